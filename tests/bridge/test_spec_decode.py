"""The lossless check's pieces (the float32 tie arbiter, the bounds of check_lossless), target-only
decoding and the acceptance rule.

The end-to-end cases (a broken verifier fails, a constructed near-tie passes, the reference cache)
are in tests/jax_drafter/test_evaluate.py, through evaluate_tau.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from bridge import spec_decode
from bridge.target import Target
from jax_drafter import evaluate

from tiny_fixtures import TINY_PROMPTS, CorruptedOracle, greedy_reference, tiny_target

VOCAB = 64


class _Tokenizer:
  """Target only asks a tokenizer for its length; the check works on token ids."""

  def __len__(self):
    return VOCAB


@pytest.fixture(scope="module")
def tiny_llama():
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(1)
  conf = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
  return LlamaForCausalLM(conf).float().eval()


PROMPT = [3, 14, 15, 9, 26, 5]


def test_arbiter_recomputes_a_bf16_target_in_float32(tiny_llama):
  # The bf16 target's weights (and float buffers: RoPE's inv_freq is cast with the model), held
  # exactly in float32: what the arbiter must compute with.
  want_model = copy.deepcopy(tiny_llama)
  with torch.no_grad():
    for p in [*want_model.parameters(), *want_model.buffers()]:
      if p.is_floating_point():
        p.copy_(p.to(torch.bfloat16).float())
  target = Target(copy.deepcopy(want_model).to(torch.bfloat16), _Tokenizer(), "tiny-bf16")
  with torch.inference_mode():
    want = want_model(torch.tensor([PROMPT])).logits[0, -1]
    got16 = target.model(torch.tensor([PROMPT])).logits[0, -1].float()
  s, t = want.topk(2).indices.tolist()
  arbiter = spec_decode.TieArbiter(target)
  margin, tol = arbiter.judge(PROMPT, s, t)
  np.testing.assert_allclose(margin, float(want[t] - want[s]), atol=1e-6)
  np.testing.assert_allclose(tol, 5e-2 * float(want.abs().max()), rtol=1e-6)
  assert arbiter.kind == "a float32 copy of the target"
  # Not the bf16 forward's numbers, and the target itself stays bf16 (it was copied, not cast).
  assert abs(float(got16[t] - got16[s]) - margin) > 1e-4
  assert {p.dtype for p in target.model.parameters()} == {torch.bfloat16}


def _greedy(model, ids, n):
  seq = list(ids)
  with torch.inference_mode():
    for _ in range(n):
      seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
  return seq[len(ids):]


class _AlwaysTie:
  """A stand-in arbiter that calls every difference a near-tie: only the bound can stop it."""
  kind = "stand-in"

  def judge(self, ids, speculative, target_token):
    return 0.0, 1.0


def test_check_lossless_bounds_ties_and_catches_truncation(tiny_llama):
  target = Target(tiny_llama, _Tokenizer(), "tiny")
  decoder = spec_decode.TargetDecoder(target)
  ref = _greedy(tiny_llama, PROMPT, 16)
  check = lambda spec, arbiter: spec_decode.check_lossless(
      decoder, arbiter, PROMPT, spec, ref, max_new_tokens=16)
  real = spec_decode.TieArbiter(target)
  assert check(ref, real) == spec_decode.LosslessCheck([], None)
  # An output cut short is a mismatch, never a tie (there is no token to compare).
  m = check(ref[:-1], real).mismatch
  assert (m.position, m.speculative, m.target, m.margin) == (15, None, ref[15], None)
  # Every token wrong, every difference "a tie": after 1 + 16 // 8 ties the check fails. Each tie
  # forces the reference through the speculative token, so the next difference is the next one.
  wrong = [(t + 1) % VOCAB for t in ref]
  result = check(wrong, _AlwaysTie())
  assert [t.position for t in result.ties] == [0, 1, 2]
  assert result.mismatch.position == 3 and "more than 3 near-ties" in result.mismatch.reason
  # With the real arbiter the same output fails at once, on a margin far outside f32 noise.
  result = check(wrong, real)
  assert result.ties == [] and result.mismatch.position == 0
  assert result.mismatch.margin > 1e3 * result.mismatch.tolerance


def test_target_generate_stops_at_the_first_difference(tiny_llama):
  decoder = spec_decode.TargetDecoder(Target(tiny_llama, _Tokenizer(), "tiny"))
  ref = _greedy(tiny_llama, PROMPT, 12)
  expected = ref[:5] + [(ref[5] + 1) % VOCAB] + ref[6:]
  got = spec_decode.target_generate(decoder, PROMPT, max_new_tokens=12, until_differs=expected)
  assert got.tokens == ref[:6]
  assert spec_decode.target_generate(decoder, PROMPT, max_new_tokens=12,
                                     until_differs=ref).tokens == ref


def test_arbiter_copies_a_gguf_target_to_float32():
  """transformers flags GGUF-loaded models as quantized and refuses `.float()` on them (seen on
  the H200 with the bf16 default target): the arbiter's copy must still be made."""
  from bridge.target import load_target
  target = load_target(None, dtype="bfloat16", device="cpu")
  arbiter = spec_decode.TieArbiter(target)
  ids = target.tokenizer("Hello there", add_special_tokens=False)["input_ids"]
  margin, tol = arbiter.judge(ids, 5, 7)
  assert arbiter.kind == "a float32 copy of the target"
  assert next(arbiter.model.parameters()).dtype == torch.float32
  assert next(target.model.parameters()).dtype == torch.bfloat16  # the target itself untouched
  assert tol > 0 and margin == margin


# ---- decoding and the acceptance rule ----

def test_target_generate_equals_uncached_greedy(tiny_target):
  ids = evaluate.encode(tiny_target.tokenizer, TINY_PROMPTS[0])
  dec = spec_decode.TargetDecoder(tiny_target)
  got = spec_decode.target_generate(dec, ids, max_new_tokens=12).tokens
  assert got == greedy_reference(tiny_target.model, ids, 12)


def test_sampling_acceptance_rule():
  """Deterministic draft: accept d with probability p(d); on rejection never emit d."""
  logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
  g = torch.Generator().manual_seed(0)
  outcomes = [spec_decode.accept([0], logits, temperature=1.0, generator=g) for _ in range(2000)]
  rate = np.mean([acc for acc, _ in outcomes])
  assert abs(rate - 0.7) < 0.05
  assert all(bonus != 0 for acc, bonus in outcomes if acc == 0)
  # A sampled draft (q != p): the first emitted token is distributed as p (the rule's guarantee).
  p = torch.tensor([0.5, 0.3, 0.2])
  q = torch.tensor([[0.2, 0.6, 0.2]])
  logits = torch.stack([p.log(), p.log()])
  counts = np.zeros(3)
  for _ in range(4000):
    d = int(torch.multinomial(q[0], 1, generator=g))
    acc, bonus = spec_decode.accept([d], logits, temperature=1.0, draft_probs=q, generator=g)
    counts[d if acc else bonus] += 1
  np.testing.assert_allclose(counts / counts.sum(), p.numpy(), atol=0.03)
  assert spec_decode.accept([0, 1], torch.log(torch.tensor([[.1, .8, .1], [.1, .1, .8]])),
                            temperature=0) == (0, 1)


def test_finish_cuts_at_eos_and_max():
  assert spec_decode._finish([4, 5, 2, 7], 10, {2}) == ([4, 5, 2], True)
  assert spec_decode._finish([4, 5, 6, 7], 3, {2}) == ([4, 5, 6], True)
  assert spec_decode._finish([4, 5], 3, {2}) == ([4, 5], False)


# ---- the static-cache decoder ----

class _ReplayGraph:
  """A CPU stand-in for a CUDA graph: replay() runs the recorded forward again and writes its
  results into the outputs the capture returned, as a replay rewrites a graph's outputs."""

  def __init__(self, fn, out):
    self.fn, self.out, self.replays = fn, out, 0

  def replay(self):
    logits, captured = self.fn()
    self.out[0].copy_(logits)
    for i, t in captured.items():
      self.out[1][i].copy_(t)
    self.replays += 1


def _capture_on_cpu(fn, device, streams=None):
  """bridge.generation.capture_graph without CUDA: the eager run, and a graph that runs nothing
  until replayed (outputs: placeholders of the eager run's shapes)."""
  eager = fn()
  out = (torch.full_like(eager[0], float("nan")),
         {i: torch.full_like(t, float("nan")) for i, t in eager[1].items()})
  return eager, _ReplayGraph(fn, out), out


@pytest.mark.parametrize("graphed", [False, True])
def test_static_decoder_equals_the_dynamic_one(tiny_llama, graphed, monkeypatch):
  """Same logits and captured features as TargetDecoder through prefill, verify and crop (f32),
  and the same speculative decoding, token for token and step for step. graphed: the CUDA-graph
  path's bookkeeping (one graph per verify length, static inputs refilled, outputs rewritten in
  place) on the CPU, with a stand-in graph that replays the eager forward."""
  from bridge import generation
  target = Target(tiny_llama, _Tokenizer(), "tiny")
  dyn = spec_decode.TargetDecoder(target, (0, 1))
  sta = spec_decode.StaticTargetDecoder(target, (0, 1), max_len=40)
  assert sta.max_len == 64 and not sta.cuda_graph          # no CUDA here
  assert dyn.kind == "with a dynamic KV cache, eager" and sta.kind == "with a static KV cache, eager"
  if graphed:
    monkeypatch.setattr(generation, "capture_graph", _capture_on_cpu)
    sta.cuda_graph = True
    assert sta.kind == "with a static KV cache, CUDA graphs"
  for a, b in zip(dyn.prefill(PROMPT), sta.prefill(PROMPT)):
    torch.testing.assert_close(b, a)
  for block, keep in (([7, 8, 9, 10], 8), ([11, 12, 13, 14], 12), ([1, 2, 3, 4], 9)):
    for a, b in zip(dyn.verify(block), sta.verify(block)):
      torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    dyn.crop(keep)
    sta.crop(keep)
    assert sta.length == dyn.length == keep
  # A second prompt on the same static cache: the first one's positions are never seen.
  for a, b in zip(dyn.prefill(PROMPT[:3]), sta.prefill(PROMPT[:3])):
    torch.testing.assert_close(b, a)
  ref = _greedy(tiny_llama, PROMPT, 24)
  runs = []
  for dec in (dyn, sta):
    runs.append(spec_decode.speculative_generate(dec, CorruptedOracle(ref, 4, VOCAB), PROMPT,
                                                 max_new_tokens=24, block_size=4))
  assert runs[0].tokens == runs[1].tokens == ref
  assert runs[0].accepted == runs[1].accepted and {1, 3} <= set(runs[1].accepted)
  assert spec_decode.target_generate(sta, PROMPT, max_new_tokens=24).tokens == ref
  if graphed:   # one graph per (length, capture, last_only), each replayed after its capture
    assert set(sta._graphs) == {(4, True, False), (1, False, False)}
    assert all(g["graph"].replays > 0 for g in sta._graphs.values())


def test_bucketed_decoder_sizes_each_prompt_and_decodes_like_one_cache(tiny_llama):
  """Each prefill picks the smallest power-of-two cache (from `minimum`, capped at max_len) that
  holds the prompt + room; prompts alternating between sizes decode exactly as the dynamic
  decoder does (each size keeps its own cache: no positions leak between them)."""
  target = Target(tiny_llama, _Tokenizer(), "tiny")
  dec = spec_decode.BucketedStaticDecoder(target, (0, 1), room=20, max_len=60, minimum=16)
  assert [dec.size_for(n) for n in (1, 12, 13, 40)] == [32, 32, 60, 60]
  assert dec.kind == "with static KV caches sized per prompt (at most 60 positions), eager"
  dyn = spec_decode.TargetDecoder(target, (0, 1))
  short, long = PROMPT, PROMPT * 5 + [1, 2]    # 6 and 32 tokens
  for prompt in (short, long, short, long):
    ref = _greedy(tiny_llama, prompt, 16)
    runs = [spec_decode.speculative_generate(d, CorruptedOracle(ref, 4, VOCAB), prompt,
                                             max_new_tokens=16, block_size=4) for d in (dyn, dec)]
    assert runs[0].tokens == runs[1].tokens == ref and runs[0].accepted == runs[1].accepted
    assert dec.current is dec.decoders[32 if prompt is short else 60]
    assert dec.length == dyn.length
    assert spec_decode.target_generate(dec, prompt, max_new_tokens=16).tokens == ref
  assert sorted(dec.decoders) == [32, 60]
  with pytest.raises(ValueError, match="room"):
    spec_decode.BucketedStaticDecoder(target, room=0, max_len=60)


@pytest.mark.parametrize("layer_crop", [True, False])
def test_static_decoder_crop_on_gpu_made_counters(tiny_llama, layer_crop, monkeypatch):
  """crop() where the cache's length counters were made in inference mode, as its first forward
  makes them when it moves them to a GPU (an in-place update outside inference mode then fails),
  with the static layer's own crop (transformers >= 5.18) and without it (5.17 on the GPU
  machine: the decoder moves each layer's counter itself). Decoding after the crop must still
  equal the dynamic decoder's."""
  from transformers.cache_utils import StaticLayer
  if not layer_crop:
    monkeypatch.delattr(StaticLayer, "crop")
  target = Target(tiny_llama, _Tokenizer(), "tiny")
  dyn = spec_decode.TargetDecoder(target, (0, 1))
  sta = spec_decode.StaticTargetDecoder(target, (0, 1), max_len=40)
  dyn.prefill(PROMPT)
  sta.prefill(PROMPT)
  with torch.inference_mode():   # what lazy initialisation's .to(cuda) leaves behind
    for layer in sta.cache.layers:
      layer.cumulative_length = layer.cumulative_length.clone()
  assert all(layer.cumulative_length.is_inference() for layer in sta.cache.layers)
  for block, keep in (([7, 8, 9, 10], 8), ([11, 12, 13, 14], 6)):
    for a, b in zip(dyn.verify(block), sta.verify(block)):
      torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    dyn.crop(keep)
    sta.crop(keep)
    assert [int(layer.cumulative_length) for layer in sta.cache.layers] == [keep] * len(sta.cache.layers)
  for a, b in zip(dyn.verify([3, 4]), sta.verify([3, 4])):
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_static_decoder_bounds(tiny_llama):
  target = Target(tiny_llama, _Tokenizer(), "tiny")
  sta = spec_decode.StaticTargetDecoder(target, max_len=10)   # rounded up to 64 positions
  sta.prefill(list(range(1, 60)))
  sta.verify([1, 2, 3, 4, 5])
  with pytest.raises(ValueError, match="holds 64 positions: 64 cached \\+ 1 new"):
    sta.verify([6])
  with pytest.raises(ValueError, match="cannot crop"):
    sta.crop(65)
