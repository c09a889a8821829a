"""On a CUDA GPU: the CUDA-graph decode step gives the same tokens as eager decoding, and greedy
f32 decoding equals transformers' generate (pytest -m gpu)."""

import pytest
import torch

from bridge import generation as G

pytestmark = pytest.mark.gpu


def _model(dtype):
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                    bos_token_id=1, eos_token_id=2)
  return LlamaForCausalLM(cfg).to("cuda", dtype).eval()


def _prompts(n, seed=0):
  g = torch.Generator().manual_seed(seed)
  lens = torch.randint(1, 60, (n,), generator=g).tolist()
  return [torch.randint(3, 4096, (k,), generator=g).tolist() for k in lens]


def test_cuda_graph_equals_eager_bf16():
  model, prompts = _model(torch.bfloat16), _prompts(40)
  stats = G.GenerationStats()
  stop = {7, 11}
  kw = dict(max_new_tokens=48, stop_ids=stop, pad_id=0, max_rows=16)
  graph = dict(G.generate_many(model, prompts, cuda_graph=True, stats=stats, **kw))
  eager = dict(G.generate_many(model, prompts, cuda_graph=False, **kw))
  assert stats.cuda_graph, "the decode step was not captured"
  assert graph == eager


@pytest.mark.parametrize("prefill_tokens", [None, 16])   # 16: the prompts' prefill in chunks
def test_greedy_equals_hf_generate_f32_on_cuda(prefill_tokens, monkeypatch):
  if prefill_tokens:
    monkeypatch.setattr(G, "PREFILL_TOKENS", prefill_tokens)
  model, prompts = _model(torch.float32), _prompts(12, seed=1)
  got = dict(G.generate_many(model, prompts, max_new_tokens=24, stop_ids={7}, pad_id=0, max_rows=5))
  for i, p in enumerate(prompts):
    ids = torch.tensor([p], device="cuda")
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                         do_sample=False, eos_token_id=[7], pad_token_id=0)[0, len(p):].tolist()
    ref = ref[:next((n + 1 for n, t in enumerate(ref) if t == 7), len(ref))]
    assert got[i] == ref, i


def test_concurrent_batches_on_their_own_streams_equal_eager_bf16():
  """Two workers decoding batches at once on their own CUDA streams, each capturing its graphs
  (in turn) while the other replays: the tokens of one eager worker, in bf16."""
  model, prompts = _model(torch.bfloat16), _prompts(64, seed=2)
  stats = G.GenerationStats()
  kw = dict(max_new_tokens=48, stop_ids={7, 11}, pad_id=0, max_rows=12)
  both = dict(G.generate_many(model, prompts, cuda_graph=True, stats=stats, concurrent=2, **kw))
  eager = dict(G.generate_many(model, prompts, cuda_graph=False, **kw))
  assert stats.cuda_graph and stats.batches == 6
  assert both == eager


def test_compiled_target_with_cuda_graphs_equals_compiled_eager_bf16():
  """compiled=True on CUDA: the decode step is captured around inductor's kernels; replaying the
  graph gives the tokens of running the same compiled forward eagerly (same kernels, bf16), and
  in f32 the tokens of the eager target."""
  model, prompts = _model(torch.bfloat16), _prompts(40, seed=3)
  stats = G.GenerationStats()
  kw = dict(max_new_tokens=48, stop_ids={7, 11}, pad_id=0, max_rows=16, compiled=True)
  graph = dict(G.generate_many(model, prompts, cuda_graph=True, stats=stats, **kw))
  eager = dict(G.generate_many(model, prompts, cuda_graph=False, **kw))
  assert stats.cuda_graph, "the compiled decode step was not captured"
  assert graph == eager
  f32 = _model(torch.float32)
  kw.pop("compiled")
  assert dict(G.generate_many(f32, prompts, compiled=True, **kw)) == dict(
      G.generate_many(f32, prompts, **kw))


def test_a_batch_larger_than_the_device_is_decoded_in_halves(caplog):
  """The caching allocator capped at ~160 MiB above the model: one planned batch of 256 prompts
  (110 MiB of f32 K/V cache plus its prefill temporaries) runs out of memory and is decoded in
  halves (with CUDA graphs), giving the tokens of batches of 16 that fit."""
  model, prompts = _model(torch.float32), _prompts(256, seed=4)
  prompts = [(p * 8)[:200] for p in prompts]             # 200 tokens each
  kw = dict(max_new_tokens=16, stop_ids={7}, pad_id=0)
  fits = dict(G.generate_many(model, prompts, max_rows=16, **kw))
  torch.cuda.empty_cache()
  total = torch.cuda.get_device_properties(0).total_memory
  torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (160 << 20)) / total)
  try:
    stats = G.GenerationStats()
    with caplog.at_level("WARNING", logger=G.__name__):
      got = dict(G.generate_many(model, prompts, max_rows=256, stats=stats, **kw))
  finally:
    torch.cuda.set_per_process_memory_fraction(1.0)
  assert "ran out of device memory" in caplog.text and stats.batches > 1
  assert got == fits
