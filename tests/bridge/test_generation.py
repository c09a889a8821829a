"""Batched static-cache decoding equals transformers' greedy `generate`, token for token (f32)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from bridge import generation as G


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=48, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                    max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
  return LlamaForCausalLM(cfg).eval()


def _hf_greedy(model, prompt, max_new, stop):
  ids = torch.tensor([prompt])
  out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                       do_sample=False, eos_token_id=sorted(stop), pad_token_id=0)
  row = out[0, len(prompt):].tolist()
  return row[:next((n + 1 for n, t in enumerate(row) if t in stop), len(row))]


def _prompts(lengths, seed=0):
  g = torch.Generator().manual_seed(seed)
  return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]


def test_plan_batches_sorts_by_length_and_respects_budget():
  lengths = [5, 50, 7, 30, 30, 1]
  batches = G.plan_batches(lengths, max_new_tokens=10, max_rows=2, max_tokens=10_000)
  assert batches == [[1, 3], [4, 2], [0, 5]]
  batches = G.plan_batches(lengths, max_new_tokens=10, max_rows=8, max_tokens=100)
  for b in batches:
    assert len(b) * (max(lengths[i] for i in b) + 10) <= 100 or len(b) == 1
  assert sorted(i for b in batches for i in b) == list(range(6))


# check_every 2: finished rows are dropped mid-decode. prefill_tokens: the prompts' prefill in
# chunks of one column (6 rows x 1) or two (13 // 6), not in one forward.
@pytest.mark.parametrize("check_every,prefill_tokens", [(16, None), (2, None), (16, 6), (16, 13)])
def test_greedy_equals_hf_generate_on_a_random_target(tiny, check_every, prefill_tokens,
                                                      monkeypatch):
  if prefill_tokens:
    monkeypatch.setattr(G, "PREFILL_TOKENS", prefill_tokens)
  # Stop on a token the random model emits early for some prompts, so rows finish at different
  # steps (exercises the finished-row mask and, with check_every=2, the compaction).
  prompts = _prompts([3, 17, 9, 30, 1, 12])
  refs = [_hf_greedy(tiny, p, 12, {99999}) for p in prompts]
  stop = {refs[0][2], refs[3][5]}
  refs = [_hf_greedy(tiny, p, 12, stop) for p in prompts]
  assert len({len(r) for r in refs}) > 1
  got = G.generate_batch(tiny, prompts, max_new_tokens=12, stop_ids=stop, pad_id=0,
                         check_every=check_every)
  assert got == refs
  # The folded GQA attention (what generate_many switches on) gives the same tokens, and is
  # switched off again afterwards.
  many = dict(G.generate_many(tiny, prompts, max_new_tokens=12, stop_ids=stop, pad_id=0,
                              max_rows=4))
  assert [many[i] for i in range(len(prompts))] == refs
  assert tiny.config._attn_implementation == "sdpa"


def test_the_lm_head_gets_contiguous_rows_during_generation(tiny):
  # transformers hands the head a strided [B, 1, D] slice of the prefill's hidden states, which
  # torch multiplies by a per-row copy of the whole head; generate_many makes it contiguous (same
  # tokens) and takes its hook off afterwards.
  prompts = _prompts([3, 17, 9])
  seen = []
  handle = tiny.lm_head.register_forward_hook(
      lambda module, args, out: seen.append(args[0].is_contiguous()))
  try:
    many = dict(G.generate_many(tiny, prompts, max_new_tokens=4, stop_ids={99999}, pad_id=0))
  finally:
    handle.remove()
  assert [many[i] for i in range(3)] == [_hf_greedy(tiny, p, 4, {99999}) for p in prompts]
  assert len(seen) == 4 and all(seen)      # the prefill and 3 decode steps
  assert not tiny.lm_head._forward_pre_hooks


def test_folded_gqa_attention_equals_sdpa():
  torch.manual_seed(1)
  B, Hq, Hkv, q, M, D = 3, 6, 2, 1, 40, 16
  query, key, value = torch.randn(B, Hq, q, D), torch.randn(B, Hkv, M, D), torch.randn(B, Hkv, M, D)
  mask = torch.rand(B, 1, q, M) > 0.3
  mask[..., 0] = True

  class Mod:
    num_key_value_groups = Hq // Hkv
    is_causal = True

  got, _ = G._fold_gqa_attention(Mod(), query, key, value, mask, scaling=D ** -0.5)
  from transformers.integrations.sdpa_attention import sdpa_attention_forward
  ref, _ = sdpa_attention_forward(Mod(), query, key, value, mask, scaling=D ** -0.5)
  torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


def test_greedy_selection_of_bfloat16_logits_is_their_argmax_ties_included():
  torch.manual_seed(2)
  logits = torch.randn(16, 3000).to(torch.bfloat16)
  logits[3, [7, 1500, 2999]] = 40.0          # a three-way tie: the first index wins
  logits[5] = 1.0                            # every entry tied
  logits[9, 2999] = 50.0                     # the last index
  got = G._select(logits, 0.0, None)
  assert got.tolist() == torch.argmax(logits, dim=-1).tolist()
  assert got[3] == 7 and got[5] == 0 and got[9] == 2999


def test_sampling_is_reproducible_and_differs_from_greedy(tiny):
  prompts = _prompts([4, 6])
  run = lambda seed: G.generate_batch(tiny, prompts, max_new_tokens=8, stop_ids={99999}, pad_id=0,
                                      temperature=1.0,
                                      generator=torch.Generator().manual_seed(seed))
  assert run(3) == run(3)
  assert run(3) != G.generate_batch(tiny, prompts, max_new_tokens=8, stop_ids={99999}, pad_id=0)


@pytest.mark.parametrize("concurrent", [2, 3])
def test_concurrent_batches_give_the_sequential_results(tiny, concurrent):
  """Worker threads decoding batches at once: the same tokens for every prompt, the same counts,
  each batch reported once; sampled batches do not depend on how many workers ran them."""
  prompts = _prompts([3, 17, 9, 30, 1, 12, 25, 6, 14])
  refs = [_hf_greedy(tiny, p, 10, {99999}) for p in prompts]
  stop = {refs[0][2], refs[3][5]}
  kw = dict(max_new_tokens=10, stop_ids=stop, pad_id=0, max_rows=2)
  seq_stats, stats, reported = G.GenerationStats(), G.GenerationStats(), []
  seq = dict(G.generate_many(tiny, prompts, stats=seq_stats, **kw))
  got = dict(G.generate_many(tiny, prompts, stats=stats, concurrent=concurrent,
                             on_batch=lambda rows, toks: reported.append((rows, toks)), **kw))
  assert got == seq and [seq[i] for i in range(len(prompts))] == \
      [_hf_greedy(tiny, p, 10, stop) for p in prompts]
  assert stats == seq_stats and stats.batches == 5
  assert sorted(reported) == sorted((len(b), sum(len(got[i]) for i in b))
                                    for b in G.plan_batches([len(p) for p in prompts],
                                                            max_new_tokens=10, max_rows=2,
                                                            max_tokens=1 << 19))
  sample = lambda n, seed: dict(G.generate_many(
      tiny, prompts, concurrent=n, temperature=1.0, generator=torch.Generator().manual_seed(seed),
      **dict(kw, stop_ids={99999})))
  assert sample(concurrent, 5) == sample(2, 5) != sample(concurrent, 6)
  assert tiny.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("concurrent", [1, 2])
def test_a_failing_worker_stops_the_others_and_raises_in_the_caller(tiny, monkeypatch, concurrent):
  import threading
  real, calls = G.generate_batch, []

  def flaky(model, prompts, **kw):
    calls.append(len(prompts))
    if len(calls) == 2:
      raise RuntimeError("CUDA error: out of memory")
    return real(model, prompts, **kw)

  monkeypatch.setattr(G, "generate_batch", flaky)
  with pytest.raises(RuntimeError, match="out of memory"):
    list(G.generate_many(tiny, _prompts([5] * 12), max_new_tokens=3, stop_ids={99999}, pad_id=0,
                         max_rows=1, concurrent=concurrent))
  assert len(calls) < 12                        # the rest of the batches never started
  assert not any(t.name.startswith("decode-") for t in threading.enumerate())


@pytest.mark.parametrize("concurrent", [1, 2])
def test_a_batch_out_of_device_memory_is_decoded_in_halves(tiny, monkeypatch, caplog, concurrent):
  """A batch that runs out of device memory is decoded again as two halves, and later batches
  are split before they start (at most one failure per worker): the same tokens as batches that
  fit, every prompt reported once. A single prompt that does not fit still raises."""
  real, calls = G.generate_batch, []

  def small_device(model, prompts, **kw):
    calls.append(len(prompts))
    if len(prompts) > 2:
      raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.19 GiB")
    return real(model, prompts, **kw)

  prompts = _prompts([5] * 12, seed=3)
  kw = dict(max_new_tokens=4, stop_ids={99999}, pad_id=0, max_rows=4)
  fits = dict(G.generate_many(tiny, prompts, **dict(kw, max_rows=2)))
  monkeypatch.setattr(G, "generate_batch", small_device)
  stats, reported = G.GenerationStats(), []
  with caplog.at_level("WARNING", logger=G.__name__):
    got = list(G.generate_many(tiny, prompts, stats=stats, concurrent=concurrent,
                               on_batch=lambda rows, toks: reported.append(rows), **kw))
  assert dict(got) == fits and sorted(i for i, _ in got) == list(range(12))
  assert 1 <= calls.count(4) <= concurrent and set(calls) == {4, 2}
  assert sorted(reported) == [2] * 6 and stats.batches == 6 and stats.prompts == 12
  assert "ran out of device memory" in caplog.text and "halves" in caplog.text

  monkeypatch.setattr(G, "generate_batch", lambda *a, **k: (_ for _ in ()).throw(
      torch.OutOfMemoryError("CUDA out of memory")))
  with pytest.raises(torch.OutOfMemoryError):
    list(G.generate_many(tiny, prompts[:2], **dict(kw, max_rows=1)))


def test_decoding_runs_beside_the_caller_and_stops_with_it(tiny, monkeypatch):
  """Batches are decoded in a worker thread (in plan order for one worker) while the caller
  consumes; a caller that stops early stops the worker after its current batch, and the model's
  attention, the threads and the interpreter's switch interval are as before."""
  import sys
  import threading
  import time
  interval = sys.getswitchinterval()
  real, ran_in = G.generate_batch, []

  def slow(model, prompts, **kw):
    ran_in.append(threading.current_thread().name)
    time.sleep(0.05)
    return real(model, prompts, **kw)

  monkeypatch.setattr(G, "generate_batch", slow)
  prompts = _prompts([12, 11, 10, 9, 8, 7, 6, 5])
  kw = dict(max_new_tokens=3, stop_ids={99999}, pad_id=0, max_rows=1)
  order = [i for i, _ in G.generate_many(tiny, prompts, **kw)]
  assert order == list(range(8)) and ran_in == ["decode-0"] * 8   # longest first = index order
  ran_in.clear()
  for i, _ in G.generate_many(tiny, prompts, **kw):
    break                                                # the caller stops after one result
  assert 1 <= len(ran_in) <= 3                           # the worker did not run on to the end
  assert not any(t.name.startswith("decode-") for t in threading.enumerate())
  assert tiny.config._attn_implementation == "sdpa"
  assert sys.getswitchinterval() == interval


def test_greedy_equals_hf_generate_on_smollm2(smollm2_target):
  """The real default target in float32 on real chat prompts."""
  tok, model = smollm2_target.tokenizer, smollm2_target.model
  texts = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers and explain why they are prime."]
  prompts = [tok(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                         add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"] for t in texts]
  stop = {tok.eos_token_id}
  got = dict(G.generate_many(model, prompts, max_new_tokens=20, stop_ids=stop, pad_id=2))
  for i, p in enumerate(prompts):
    assert got[i] == _hf_greedy(model, p, 20, stop), i


def test_compiled_target_gives_the_eager_tokens(tiny):
  """compiled=True: the target's forward through torch.compile (dynamic shapes, compiled once per
  model) decodes the same tokens as eager in f32, over batches of different rows and prompt
  lengths, finished rows dropped mid-decode (new shapes), greedy and sampled."""
  prompts = _prompts([3, 17, 9, 30, 1, 12, 25, 5])
  # Stop tokens that end some rows early, so check_every=2 drops them mid-decode.
  first = G.generate_batch(tiny, prompts, max_new_tokens=14, stop_ids={99999}, pad_id=0)
  stop = {first[0][2], first[3][5]}
  kw = dict(max_new_tokens=14, stop_ids=stop, pad_id=0)
  eager = G.generate_batch(tiny, prompts, check_every=2, **kw)
  assert len({len(r) for r in eager}) > 1
  from torch._dynamo.utils import counters
  before = sum(counters["frames"].values())
  assert G.generate_batch(tiny, prompts, check_every=2, compiled=True, **kw) == eager
  assert sum(counters["frames"].values()) > before        # the forward went through Dynamo
  kw["max_rows"] = 3
  eager = dict(G.generate_many(tiny, prompts, **kw))
  assert dict(G.generate_many(tiny, prompts, compiled=True, **kw)) == eager
  assert G._compiled_model(tiny) is G._compiled_model(tiny)           # one compiled model
  g1, g2 = (torch.Generator().manual_seed(5) for _ in range(2))
  sampled = dict(G.generate_many(tiny, prompts, temperature=0.9, generator=g1, **kw))
  assert dict(G.generate_many(tiny, prompts, temperature=0.9, generator=g2, compiled=True,
                              **kw)) == sampled
