"""On a CUDA GPU: StaticTargetDecoder's CUDA-graph verify steps give what its eager steps and
the DynamicCache decoder give (pytest -m gpu)."""

import pytest
import torch

from bridge import spec_decode
from bridge.target import Target
from tiny_fixtures import CorruptedOracle

pytestmark = pytest.mark.gpu

VOCAB = 4096


class _Tokenizer:
  def __len__(self):
    return VOCAB


def _target(dtype):
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
  return Target(LlamaForCausalLM(cfg).to("cuda", dtype).eval(), _Tokenizer(), "tiny-cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_verify_equals_eager(dtype):
  target = _target(dtype)
  prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
  graphed = spec_decode.StaticTargetDecoder(target, (1, 3), max_len=200)
  eager = spec_decode.StaticTargetDecoder(target, (1, 3), max_len=200, cuda_graph=False)
  assert graphed.cuda_graph and not eager.cuda_graph
  # The same calls on both: replays of one captured graph per length must equal eager forwards
  # (same kernels, same inputs), features included.
  for dec in (graphed, eager):
    dec.prefill(prompt)
  for step, (block, keep) in enumerate([([5] * 16, 45), (list(range(16)), 50), ([9] * 16, 66),
                                        (list(range(20, 36)), 70)]):
    (lg, fg), (le, fe) = graphed.verify(block), eager.verify(block)
    torch.testing.assert_close(lg, le, rtol=0, atol=0)
    torch.testing.assert_close(fg, fe, rtol=0, atol=0)
    graphed.crop(keep)
    eager.crop(keep)
  assert set(graphed._graphs) == {(16, True, False)}
  # Speculative decoding, greedy: the graphed decoder takes the eager one's steps exactly (same
  # kernels) in both dtypes; in f32 both also equal the dynamic decoder's and the target's greedy
  # output (in bf16 the dynamic cache's unmasked attention may round a near-tie otherwise).
  dyn = spec_decode.TargetDecoder(target, (1, 3))
  ref = spec_decode.target_generate(dyn, prompt, max_new_tokens=64).tokens
  spec = lambda dec: spec_decode.speculative_generate(dec, CorruptedOracle(ref, 16, VOCAB), prompt,
                                                      max_new_tokens=64, block_size=16)
  got, same = spec(graphed), spec(eager)
  assert got.tokens == same.tokens and got.accepted == same.accepted
  if dtype == torch.float32:
    want = spec(dyn)
    assert got.tokens == want.tokens == ref and got.accepted == want.accepted
  assert (spec_decode.target_generate(graphed, prompt, max_new_tokens=64).tokens
          == spec_decode.target_generate(eager, prompt, max_new_tokens=64).tokens)
  assert (1, False, False) in graphed._graphs  # target-only decoding replays its own graph


def test_bucketed_graphs_decode_each_size_like_eager():
  """Caches sized per prompt, each size with its own CUDA graphs: prompts alternating between
  two sizes decode exactly as the eager static decoders of the same sizes (f32), and as the
  dynamic decoder and the target's greedy output."""
  target = _target(torch.float32)
  g = torch.Generator().manual_seed(2)
  short, long = (torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (30, 300))
  graphed = spec_decode.BucketedStaticDecoder(target, (1, 3), room=64 + 16, max_len=300 + 80)
  eager = spec_decode.BucketedStaticDecoder(target, (1, 3), room=64 + 16, max_len=300 + 80,
                                            cuda_graph=False)
  dyn = spec_decode.TargetDecoder(target, (1, 3))
  for prompt in (short, long, short, long):
    ref = spec_decode.target_generate(dyn, prompt, max_new_tokens=64).tokens
    runs = [spec_decode.speculative_generate(d, CorruptedOracle(ref, 16, VOCAB), prompt,
                                             max_new_tokens=64, block_size=16)
            for d in (graphed, eager)]
    assert runs[0].tokens == runs[1].tokens == ref and runs[0].accepted == runs[1].accepted
    assert graphed.current.max_len == (256 if prompt is short else 384)   # 380 rounded to 64s
    assert spec_decode.target_generate(graphed, prompt, max_new_tokens=64).tokens == ref
  assert sorted(graphed.decoders) == [256, 380]
  assert all((16, True, False) in d._graphs and d.cuda_graph for d in graphed.decoders.values())
