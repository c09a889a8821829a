"""Speculative decoding evaluation: lossless loop, oracle tau, bad input.

A tiny random Llama target (stand-in tokenizer) covers the loop; the real SmolLM2 target (loaded
once per module, ~30 s) covers tau ~ 1 for an untrained drafter and the CLI end to end.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bridge import spec_decode
from bridge.target import Target, choose_mask_token_id, load_target
from jax_drafter import evaluate
from jax_drafter.config import DrafterConfig, default_target_layer_ids
from jax_drafter.inference import DrafterSession
from jax_drafter.model import Drafter

from tiny_fixtures import (TINY_PROMPTS, VOCAB, TinyTokenizer, greedy_reference, tiny_drafter,
                           tiny_target)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
  """Tiny matmuls: OpenMP thread hand-offs cost more than the math on a busy 2-core CI machine."""
  n = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(n)


def test_decoder_choice(monkeypatch):
  """auto: the static decoder on a GPU for full-attention targets, the dynamic one otherwise
  (sliding-window or linear-attention layers, CPU); an unknown kind is an error naming them."""
  made = []
  monkeypatch.setattr(spec_decode, "BucketedStaticDecoder",
                      lambda target, layers, room, max_len: made.append(("static", room, max_len))
                      or "S")
  monkeypatch.setattr(spec_decode, "TargetDecoder",
                      lambda target, layers: made.append(("dynamic",)) or "D")
  cfg = types.SimpleNamespace(target_layer_ids=(1, 2))

  def target(device, **config):
    model = types.SimpleNamespace(config=types.SimpleNamespace(**config))
    return types.SimpleNamespace(device=torch.device(device), model=model)
  full = dict(layer_types=["full_attention"] * 2)
  choose = lambda t, kind, max_len=99: evaluate._decoder(t, cfg, kind, max_len=max_len, room=5)
  assert choose(target("cuda", **full), "auto") == "S"
  assert choose(target("cpu", **full), "auto") == "D"
  assert choose(target("cuda", layer_types=["full_attention", "linear_attention"]), "auto") == "D"
  assert choose(target("cuda", sliding_window=4096), "auto") == "D"
  assert choose(target("cpu", **full), "static", 7) == "S"
  assert choose(target("cuda", **full), "dynamic", 7) == "D"
  assert made == [("static", 5, 99), ("dynamic",), ("dynamic",), ("dynamic",), ("static", 5, 7),
                  ("dynamic",)]
  with pytest.raises(evaluate.EvaluationError, match="auto, static, dynamic"):
    choose(target("cpu", **full), "graphs", 7)


# ---- the loop ------------------------------------------------------------------------------------

def test_lossless_untrained_drafter(tiny_target):
  cfg, graphdef, params = tiny_drafter()
  report = evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, TINY_PROMPTS,
                                 max_new_tokens=16, progress=False)
  # f32 target: exactly equal, not even a near-tie.
  assert report["lossless"] == {"checked": True, "passed": True, "ties": [], "mismatches": [],
                                "arbiter": None}
  assert report["num_prompts"] == 3 and report["verify_steps"] > 0
  for p, row in zip(TINY_PROMPTS, report["per_prompt"]):
    assert row["new_tokens"] == 16 and row["target_new_tokens"] == 16
  # The static-cache decoder: the same verify steps, prompt by prompt, and lossless.
  static = evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, TINY_PROMPTS,
                                 max_new_tokens=16, progress=False, decoder="static")
  assert static["lossless"]["passed"] is True
  assert ([r["accepted"] for r in static["per_prompt"]]
          == [r["accepted"] for r in report["per_prompt"]])
  # On a CPU the default ("auto") is the dynamic cache; the report says which decoded.
  assert report["tokens_per_second"]["decoder"] == "with a dynamic KV cache, eager"
  assert static["tokens_per_second"]["decoder"].startswith("with static KV caches sized per prompt")
  # The speculative output itself, against decoding that shares no code with the loop.
  ids = evaluate.encode(tiny_target.tokenizer, TINY_PROMPTS[1])
  session = DrafterSession(cfg, graphdef, params, jnp.asarray(tiny_target.embedding.numpy()),
                           jnp.asarray(tiny_target.lm_head.numpy()))
  proposer = evaluate._JaxProposer(session, len(ids) + 40, seed=0)
  dec = spec_decode.TargetDecoder(tiny_target, cfg.target_layer_ids)
  gen = spec_decode.speculative_generate(dec, proposer, ids, max_new_tokens=12, block_size=4)
  assert gen.tokens == greedy_reference(tiny_target.model, ids, 12)
  assert sum(a + 1 for a in gen.accepted) >= 11  # every verify step added acc + 1 tokens
  # Appending a step's features in the next proposal's call (the default) drafts what appending
  # them on their own does, step by step.
  drafts = {}
  for fuse in (True, False):
    p = evaluate._JaxProposer(session, len(ids) + 40, seed=0, fuse=fuse)
    seen = drafts[fuse] = []
    p.propose = (lambda f: lambda *a: seen.append(f(*a)[0].tolist()) or (seen[-1], None))(p.propose)
    spec_decode.speculative_generate(dec, p, ids, max_new_tokens=12, block_size=4)
  assert drafts[True] == drafts[False] and len(drafts[True]) == len(gen.accepted)


def test_warm_up_fits_the_caches_of_a_short_evaluation(tiny_target):
  """The warm-up decodes 2K + 2 tokens whatever max_new_tokens is: the caches sized per prompt
  must hold that too. A 58-token prompt with 2 new tokens and blocks of 4 needs 64 positions;
  its warm-up reaches 58 + 10 + a block."""
  cfg, graphdef, params = tiny_drafter()
  prompt = [5 + i % 50 for i in range(58)]
  report = evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, [prompt], max_new_tokens=2,
                                 progress=False, decoder="static")
  assert report["lossless"]["passed"] is True and report["per_prompt"][0]["new_tokens"] == 2


def test_warm_up_compiles_every_drafter_call(tiny_target, monkeypatch, caplog):
  """Nothing compiles while a prompt is timed, whatever its length: the untimed warm-up of each
  cache size runs the prompt's chunk, the first proposal and the fused append + proposal of later
  steps, and no shape-dependent JAX op (a pad, a slice) runs per prompt."""
  from jax_drafter import inference
  inference._compiled.cache_clear()          # fresh jitted functions: earlier tests compiled none
  cfg, graphdef, params = tiny_drafter()
  sizes, compiled, real = [], [], spec_decode.speculative_generate

  def spy(decoder, proposer, *a, **kw):
    s = proposer.session
    count = lambda: [f._cache_size() for f in (s._extend, s._propose, s._extend_propose)]
    before = count()
    caplog.clear()
    out = real(decoder, proposer, *a, **kw)
    sizes.append((before, count()))
    compiled.append([r.getMessage()[:60] for r in caplog.records if "Compiling" in r.getMessage()])
    return out

  monkeypatch.setattr(spec_decode, "speculative_generate", spy)
  # The drafter's context is sized per prompt: with prefill chunks of 16 rows a 100-token prompt
  # takes a second size (256 rows, the chat prompts 64), compiled by a warm-up of its own.
  monkeypatch.setattr(evaluate, "DrafterSession",
                      functools.partial(evaluate.DrafterSession, prefill_chunk=16))
  prompts = TINY_PROMPTS + [[5 + i % 50 for i in range(n)] for n in (100, 37, 3)]
  log_compiles = jax.config.jax_log_compiles
  jax.config.update("jax_log_compiles", True)
  try:
    with caplog.at_level(logging.WARNING):
      evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, prompts, max_new_tokens=16,
                            progress=False)
  finally:
    jax.config.update("jax_log_compiles", log_compiles)
  lengths = [len(evaluate.encode(tiny_target.tokenizer, p)) for p in prompts]
  n = len({inference.bucket(t + 16 + 4 + 16) for t in lengths})   # + new tokens, block, chunk
  assert n >= 2 and len(sizes) == n + len(prompts)
  # each warm-up compiled its size's three calls, and no prompt compiled anything
  assert [after for _, after in sizes[:n]] == [[i + 1] * 3 for i in range(n)]
  assert all(before == after == [n] * 3 for before, after in sizes[n:])
  assert any(compiled[:n]) and not any(compiled[n:]), compiled[n:]


class OracleProposer:
  """Proposes the target's own greedy continuation (keyed by prompt length): accepts everything."""

  def __init__(self, continuations: dict[int, list[int]], block_size: int):
    self.cont, self.K = continuations, block_size

  def start(self, feats):
    self.prompt_len = self.n = feats.shape[0]

  def extend(self, feats, count):
    self.n += count

  def propose(self, last_token, temperature):
    done = self.n - self.prompt_len + 1  # tokens generated so far; `last_token` is the latest
    assert self.cont[self.prompt_len][done - 1] == last_token
    return self.cont[self.prompt_len][done:done + self.K - 1], None


@pytest.mark.parametrize("block_size", [4, 3])
def test_oracle_drafter_reaches_max_tau(tiny_target, block_size):
  cfg, graphdef, params = tiny_drafter(block_size=4)
  prompts = [TINY_PROMPTS[2], [{"role": "user", "content": "hi"}]]
  ids = [evaluate.encode(tiny_target.tokenizer, p) for p in prompts]
  # The oracle is keyed by prompt length (evaluate_tau's warm-up decodes whole prompts too).
  assert len({len(i) for i in ids}) == len(ids)
  cont = {len(i): greedy_reference(tiny_target.model, i, 16 + block_size) for i in ids}
  report = evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, prompts, max_new_tokens=16,
                                 block_size=block_size, progress=False,
                                 proposer=OracleProposer(cont, block_size))
  assert report["tau"] == block_size
  assert report["accept_length_histogram"][str(block_size)] == report["verify_steps"] > 0
  assert report["lossless"]["passed"]


def test_lossless_report_lists_ties_and_mismatches():
  tie = dict(prompt=0, position=1, speculative=7, target=9, margin=2e-6, tolerance=1e-4,
             reason="")
  bad = dict(prompt=1, position=2, speculative=3, target=4, margin=1.5, tolerance=1e-4,
             reason="not a near-tie: |margin| 1.5 > tolerance 0.0001")
  row = lambda i, **kw: dict(prompt=i, new_tokens=3, target_new_tokens=3, accepted=[0, 1], tau=1.5,
                             speculative_seconds=1.0, target_seconds=2.0, **kw)
  rows = [row(0, ties=[tie], mismatch=None, target_cached=True),
          row(1, ties=[], mismatch=bad, target_cached=False)]
  r = evaluate.summarize(rows, block_size=4, max_new_tokens=3, temperature=0.0, target_name="t",
                         arbiter="the target in float32")
  assert r["lossless"]["passed"] is False
  assert r["lossless"]["ties"] == [tie] and r["lossless"]["mismatches"] == [bad]
  assert r["tokens_per_second"]["target_only_cached"] == 1
  text = evaluate.format_report(r)
  assert "FAILED on 1 of 2 prompts" in text and "prompt 1 new token 2" in text and "1.5" in text
  assert "1 near-ties" in text and "prompt 0 new token 1: speculative 7, target 9" in text
  assert "1 references from an earlier evaluation" in text
  # Only ties: passed.
  r = evaluate.summarize(rows[:1], block_size=4, max_new_tokens=3, temperature=0.0,
                         target_name="t", arbiter="the target in float32")
  assert r["lossless"]["passed"] is True and "passed" in evaluate.format_report(r)
  assert spec_decode.first_difference([1, 2], [1, 2, 3]) == 2
  assert spec_decode.first_difference([1, 2], [1, 2]) is None


# ---- the lossless check: a broken verifier fails, a near-tie passes --------------------------------

def _accept_one_more(real):
  def accept(draft, logits, **kw):  # verify off by one: takes the first wrong draft token too
    acc, bonus = real(draft, logits, **kw)
    return (acc + 1, int(logits[acc + 1].argmax())) if acc < len(draft) else (acc, bonus)
  return accept


def _runner_up_bonus(real):
  def accept(draft, logits, **kw):  # the closest wrong token there is: the target's second best
    acc, _ = real(draft, logits, **kw)
    return acc, int(logits[acc].topk(2).indices[1])
  return accept


def _crop_keeps_rejected(real):
  def crop(self, length):  # rolls the cache back one position short: a rejected draft stays
    return real(self, min(length + 1, self.length))
  return crop


@pytest.mark.parametrize("broken", ["accept_one_more", "runner_up_bonus", "crop_keeps_rejected"])
def test_broken_verifier_fails_with_a_mismatch(tiny_target, monkeypatch, broken):
  if broken == "crop_keeps_rejected":
    monkeypatch.setattr(spec_decode.TargetDecoder, "crop",
                        _crop_keeps_rejected(spec_decode.TargetDecoder.crop))
  else:
    wrap = {"accept_one_more": _accept_one_more, "runner_up_bonus": _runner_up_bonus}[broken]
    monkeypatch.setattr(spec_decode, "accept", wrap(spec_decode.accept))
  cfg, graphdef, params = tiny_drafter()
  report = evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, TINY_PROMPTS[2:],
                                 max_new_tokens=12, progress=False)
  ll = report["lossless"]
  assert ll["passed"] is False and ll["ties"] == []
  m = ll["mismatches"][0]
  assert m["position"] == report["per_prompt"][0]["first_difference"]
  assert m["speculative"] != m["target"] and m["margin"] > m["tolerance"] > 0
  assert m["reason"].startswith("not a near-tie")
  assert ll["arbiter"] == "the target in float32"


def test_near_tie_is_reported_and_passes(tiny_target, monkeypatch):
  """A target whose two best logits at new token d are 3e-6 x max|logit| apart (inside the f32
  tolerance 1e-5, far outside f32 noise), and a verify block that rounds the other way there."""
  import copy
  prompt = TINY_PROMPTS[2]
  ref = greedy_reference(tiny_target.model, prompt, 16)
  d = next(i for i in range(2, 16) if ref[i] not in ref[:i])  # a is new at d: the prefix stands
  a = ref[d]
  b = VOCAB - 2 if a != VOCAB - 2 else VOCAB - 3
  model = copy.deepcopy(tiny_target.model)
  with torch.inference_mode():
    ctx = torch.tensor([prompt + ref[:d]])
    h = model.model(ctx).last_hidden_state[0, -1]  # what the LM head sees at new token d
    scale = float(model(ctx).logits[0, -1].abs().max())
  delta = 3e-6 * scale
  with torch.no_grad():  # logit[b] = logit[a] - delta at new token d
    model.lm_head.weight[b] = model.lm_head.weight[a] - delta * h / h.dot(h)
  tie_target = Target(model, TinyTokenizer(), "tiny-tie")

  real_verify = spec_decode.TargetDecoder.verify

  def verify(self, block_ids, *, capture=True):
    logits, feats = real_verify(self, block_ids, capture=capture)
    row = len(prompt) + d - 1 - (self.length - len(block_ids))  # the row predicting new token d
    if len(block_ids) > 1 and 0 <= row < len(block_ids):  # the speculative path's blocks only
      logits = logits.clone()
      logits[row, b] += 2.5 * delta  # rounding noise of the block forward: b now wins
    return logits, feats

  monkeypatch.setattr(spec_decode.TargetDecoder, "verify", verify)
  cfg, graphdef, params = tiny_drafter()
  report = evaluate.evaluate_tau(tie_target, cfg, graphdef, params, [prompt], max_new_tokens=16,
                                 progress=False)
  ll = report["lossless"]
  assert ll["passed"] is True and ll["mismatches"] == []
  assert report["per_prompt"][0]["first_difference"] == d
  (tie,) = ll["ties"]
  assert (tie["prompt"], tie["position"], tie["speculative"], tie["target"]) == (0, d, b, a)
  np.testing.assert_allclose(tie["margin"], delta, rtol=0.1)  # the f32 weights round it
  np.testing.assert_allclose(tie["tolerance"], 1e-5 * scale, rtol=1e-3)
  # The check went on past the tie: the rest of the speculative output is the target's greedy
  # continuation of prompt + the speculative tokens up to and including the tie.
  assert report["per_prompt"][0]["new_tokens"] == 16
  assert "1 near-ties" in evaluate.format_report(report)


def test_reference_cache_decodes_the_target_once(tiny_target, monkeypatch):
  calls = []
  real = spec_decode.target_generate

  def counting(*a, **kw):
    calls.append(kw["max_new_tokens"])
    return real(*a, **kw)

  monkeypatch.setattr(spec_decode, "target_generate", counting)
  cfg, graphdef, params = tiny_drafter()
  cache = {}
  run = lambda n: evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, TINY_PROMPTS[:2],
                                        max_new_tokens=n, progress=False, reference_cache=cache)
  first = run(8)
  assert calls == [2, 8, 8] and len(cache) == 2  # warm-up, then one decode per prompt
  assert first["tokens_per_second"]["target_only_cached"] == 0
  second = run(8)
  assert calls == [2, 8, 8]  # nothing decoded by the target alone, not even the warm-up
  assert second["tokens_per_second"]["target_only"] == first["tokens_per_second"]["target_only"]
  assert second["tokens_per_second"]["target_only_cached"] == 2
  assert [r["target_cached"] for r in second["per_prompt"]] == [True, True]
  assert "2 references from an earlier evaluation" in evaluate.format_report(second)
  assert second["lossless"]["passed"] is True
  run(6)  # another length is another reference
  assert calls[3:] == [2, 6, 6] and len(cache) == 4


# ---- temperature sampling ------------------------------------------------------------------------

def test_temperature_sampling_end_to_end(tiny_target):
  cfg, graphdef, params = tiny_drafter()
  report = evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, TINY_PROMPTS[:1],
                                 max_new_tokens=8, temperature=0.7, progress=False)
  assert report["lossless"] == {"checked": False, "passed": None, "ties": [], "mismatches": [],
                                "arbiter": None}
  assert 1.0 <= report["tau"] <= 4 and report["per_prompt"][0]["new_tokens"] == 8


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    (dict(hidden_size=32), "hidden_size=32"),
    (dict(vocab_size=VOCAB + 1, mask_token_id=VOCAB), "vocab_size"),
    (dict(num_target_layers=6), "6 layers"),
    (dict(mask_token_id=5), "mask token"),
])
def test_checkpoint_target_mismatch(tiny_target, change, match):
  cfg = dataclasses.replace(tiny_drafter()[0], **change)
  with pytest.raises(evaluate.EvaluationError, match=match):
    evaluate.check_compatible(cfg, tiny_target)


def test_bad_options(tiny_target, tmp_path):
  cfg, graphdef, params = tiny_drafter()
  run = lambda prompts, **kw: evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, prompts,
                                                     progress=False, **{"max_new_tokens": 4, **kw})
  with pytest.raises(evaluate.EvaluationError, match="trained with block_size=4"):
    run(TINY_PROMPTS, block_size=8)
  with pytest.raises(evaluate.EvaluationError, match="context of 128"):
    run([list(range(1, 100))], max_new_tokens=40)
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(evaluate.EvaluationError, match="empty file"):
    evaluate.load_prompts(str(empty))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "ok"}\n{"messages": [{"role": "assistant", "content": "x"}]}\n')
  with pytest.raises(evaluate.EvaluationError, match="line 2"):
    evaluate.load_prompts(str(bad))
  good = tmp_path / "good.jsonl"
  good.write_text('{"prompt": "hi"}\n{"conversations": [{"from": "human", "value": "a"}, '
                  '{"from": "gpt", "value": "b"}]}\n')
  assert evaluate.load_prompts(str(good)) == [[{"role": "user", "content": "hi"}],
                                              [{"role": "user", "content": "a"}]]


# ---- the real SmolLM2 target ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
  return load_target(device="cpu")


def smol_drafter(target, block_size=4):
  info = target.info
  cfg = DrafterConfig(hidden_size=info.hidden_size, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=info.num_attention_heads,
                      num_key_value_heads=info.num_key_value_heads, head_dim=info.head_dim,
                      vocab_size=info.vocab_size, num_target_layers=info.num_layers,
                      target_layer_ids=default_target_layer_ids(info.num_layers, 2),
                      mask_token_id=choose_mask_token_id(target), block_size=block_size,
                      rope_theta=info.rope_theta)
  graphdef, params = nnx.split(Drafter(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  return cfg, graphdef, params


SMOL_PROMPTS = [[{"role": "user", "content": "What is the capital of France?"}],
                [{"role": "user", "content": "Write a haiku about the sea."}]]


def test_untrained_drafter_tau_close_to_one_on_smollm2(smollm2):
  cfg, graphdef, params = smol_drafter(smollm2)
  report = evaluate.evaluate_tau(smollm2, cfg, graphdef, params, SMOL_PROMPTS,
                                 max_new_tokens=8, progress=False)
  assert report["lossless"]["passed"] is True
  assert 1.0 <= report["tau"] < 1.3, report["accept_length_histogram"]
  assert report["tokens_per_second"]["speculative"] > 0
  assert report["tokens_per_second"]["target_only"] > 0
  # The real GGUF target over a static KV cache: the same verify steps.
  static = evaluate.evaluate_tau(smollm2, cfg, graphdef, params, SMOL_PROMPTS,
                                 max_new_tokens=8, progress=False, decoder="static")
  assert static["lossless"]["passed"] is True
  assert ([r["accepted"] for r in static["per_prompt"]]
          == [r["accepted"] for r in report["per_prompt"]])


def test_cli_end_to_end(smollm2, tmp_path, monkeypatch):
  from jax_drafter.export import write_zlab
  cfg, graphdef, params = smol_drafter(smollm2)  # the same architecture: compiled code is reused
  zdir = write_zlab(str(tmp_path / "zlab"), cfg, params, dtype="float32")
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "Say hi."}\n')
  monkeypatch.setattr(evaluate, "load_target", lambda *a, **k: smollm2)
  out = tmp_path / "report.json"
  rc = evaluate.main(["--drafter-dir", zdir, "--prompts", str(prompts), "--max-new-tokens", "6",
                      "--json", str(out)])
  assert rc == 0
  # The report is not buried under absl/orbax INFO lines (orbax logs through absl when a run's
  # checkpoint is read): the CLI raises those loggers to WARNING.
  import logging
  assert all(logging.getLogger(n).getEffectiveLevel() >= logging.WARNING for n in ("absl", "orbax"))
  report = json.loads(out.read_text())
  assert report["block_size"] == 4 and report["lossless"]["passed"] is True
  assert report["num_prompts"] == 1 and report["per_prompt"][0]["new_tokens"] <= 6
  # An exported drafter carries no data split: default prompts are refused with a clear message.
  assert evaluate.main(["--drafter-dir", zdir]) == 2
  assert evaluate.main(["--drafter-dir", zdir, "--prompts", str(prompts), "--block-size", "5"]) == 2


def _run_dir_with_settings(tmp_path, dtype: str):
  """tmp_path/run holding only config.json: a CPU SmolLM2 target in `dtype` and a held-out split
  of 2 of 6 one-turn conversations (tmp_path/convs.jsonl)."""
  run = tmp_path / "run"
  run.mkdir()
  convs = tmp_path / "convs.jsonl"
  convs.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
      {"from": "human", "value": f"Name a colour, number {i}."}, {"from": "gpt", "value": "Red."}]})
      + "\n" for i in range(6)))
  run_config = {"target": {"path": None, "gguf_file": None, "dtype": dtype, "device": "cpu"},
                "data": {"path": str(convs), "held_out": 2, "seed": 0, "max_conversations": None}}
  (run / "config.json").write_text(json.dumps({"run_config": run_config}))
  return run


def test_cli_best_takes_the_runs_settings(smollm2, tmp_path, monkeypatch):
  """--best: RUN/best's weights, with the target dtype and held-out split RUN/config.json records
  (an exported directory alone records neither); --target-dtype overrides the dtype."""
  from jax_drafter.export import write_zlab
  cfg, graphdef, params = smol_drafter(smollm2)
  run = _run_dir_with_settings(tmp_path, "bfloat16")
  write_zlab(str(run / "best"), cfg, params, dtype="float32")
  asked = []
  monkeypatch.setattr(evaluate, "load_target", lambda *a, **k: asked.append(k["dtype"]) or smollm2)
  out = tmp_path / "report.json"
  assert evaluate.main(["--run-dir", str(run), "--best", "--num-prompts", "4",
                        "--max-new-tokens", "4", "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert report["num_prompts"] == 2                       # the run's two held-out conversations
  assert asked == ["bfloat16"]                            # the run's target dtype
  assert evaluate.main(["--run-dir", str(run), "--best", "--target-dtype", "float32",
                        "--num-prompts", "1", "--max-new-tokens", "2"]) == 0
  assert asked[-1] == "float32"
  # No best/ yet: a clear error, not a traceback; --best with --step or without --run-dir: usage.
  assert evaluate.main(["--run-dir", str(tmp_path / "empty"), "--best"]) == 2
  for bad in (["--run-dir", str(run), "--best", "--step", "5"], ["--drafter-dir", "x", "--best"],
              ["--run-dir", str(run), "--best", "--export"], ["--drafter-dir", "x", "--export"]):
    with pytest.raises(SystemExit):
      evaluate.main(bad)


def test_cli_export_reads_the_end_of_training_drafter(smollm2, tmp_path, monkeypatch, capsys):
  """--export: RUN/export (what train writes at its end) with the run's settings, in a run directory
  that has nothing else (no checkpoints, no best/: what a lost GPU machine sends back); the drafter
  read is that one, not best/."""
  from jax_drafter.export import write_zlab
  cfg, graphdef, params = smol_drafter(smollm2)
  run = _run_dir_with_settings(tmp_path, "float32")
  monkeypatch.setattr(evaluate, "load_target", lambda *a, **k: smollm2)
  assert evaluate.main(["--run-dir", str(run), "--export", "--num-prompts", "1"]) == 2
  assert "has no export/ drafter" in capsys.readouterr().err
  write_zlab(str(run / "export"), cfg, params, dtype="float32")
  read = []
  real = evaluate.evaluate_tau
  monkeypatch.setattr(evaluate, "evaluate_tau",
                      lambda target, c, g, p, prompts, **kw: read.append(p) or real(target, c, g, p,
                                                                                  prompts, **kw))
  out = tmp_path / "report.json"
  assert evaluate.main(["--run-dir", str(run), "--export", "--num-prompts", "4",
                        "--max-new-tokens", "4", "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert report["num_prompts"] == 2                       # the run's two held-out conversations
  keys = [r["prompt_key"] for r in report["per_prompt"]]  # what tools.compare pairs rows by
  assert len(set(keys)) == 2 and all(len(k) == 16 for k in keys)
  got = jax.tree_util.tree_leaves(read[0])
  want = jax.tree_util.tree_leaves(params)
  assert len(got) == len(want) and all(np.array_equal(np.asarray(a), np.asarray(b))
                                       for a, b in zip(got, want))


def test_batched_references_equal_decoded_ones(tiny_target, monkeypatch):
  """reference="batched": prompts past speed_prompts come from one batched greedy decode, equal to
  the one-token decode (f32), untimed, and not counted as from an earlier evaluation."""
  cfg, graphdef, params = tiny_drafter()
  decoded, batched = {}, {}
  kw = dict(max_new_tokens=8, progress=False)
  evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, TINY_PROMPTS, reference="decode",
                        reference_cache=decoded, **kw)
  report = evaluate.evaluate_tau(tiny_target, cfg, graphdef, params, TINY_PROMPTS,
                                 reference="batched", speed_prompts=1, reference_cache=batched, **kw)
  assert len(TINY_PROMPTS) > 2 and batched.keys() == decoded.keys()
  for k in decoded:
    assert batched[k].tokens == decoded[k].tokens
  assert [batched[k].seconds is None for k in decoded] == [False] + [True] * (len(decoded) - 1)
  tps = report["tokens_per_second"]
  assert tps["target_only_timed_prompts"] == 1 and tps["target_only_cached"] == 0
  assert report["lossless"]["passed"] is True


def test_tau_is_the_mean_over_responses_with_its_standard_error():
  row = lambda i, acc: dict(prompt=i, new_tokens=len(acc) + sum(acc), target_new_tokens=1,
                            accepted=acc, tau=float(np.mean(acc) + 1), speculative_seconds=1.0,
                            target_seconds=None, ties=[], mismatch=None)
  rows = [row(0, [0, 0]), row(1, [3]), row(2, [1, 1, 1, 1])]   # taus 1, 4, 2
  r = evaluate.summarize(rows, block_size=4, max_new_tokens=4, temperature=0.0, target_name="t")
  assert r["tau"] == pytest.approx(7 / 3)
  assert r["tau_stderr"] == pytest.approx(np.std([1, 4, 2], ddof=1) / np.sqrt(3))
  assert f"tau = 2.333 ± {r['tau_stderr']:.3f} (standard error over prompts)" in evaluate.format_report(r)
  assert r["tau_pooled"] == pytest.approx((2 + 4 + 8) / 7)   # 14 tokens in 7 verify steps
  assert "2.000 over all verify steps pooled" in evaluate.format_report(r)
  assert evaluate.summarize(rows[:1], block_size=4, max_new_tokens=4, temperature=0.0,
                            target_name="t")["tau_stderr"] is None


def test_speedup_compares_the_prompts_the_target_was_timed_on():
  """The target alone is timed on the first speed_prompts prompts only: the speed-up divides
  speculative decoding's tokens/s on those same prompts by the target's, not the tokens/s over
  every prompt (other prompts, other lengths)."""
  row = lambda i, spec_s, target_s: dict(prompt=i, new_tokens=10, target_new_tokens=10,
                                         accepted=[1], tau=2.0, speculative_seconds=spec_s,
                                         target_seconds=target_s, ties=[], mismatch=None)
  rows = [row(0, 1.0, 2.0), row(1, 4.0, None), row(2, 4.0, None)]  # 10 tokens/s vs 5 on prompt 0
  r = evaluate.summarize(rows, block_size=4, max_new_tokens=10, temperature=0.0, target_name="t")
  tps = r["tokens_per_second"]
  assert tps["speculative"] == pytest.approx(30 / 9)
  assert tps["speculative_on_timed_prompts"] == pytest.approx(10.0)
  assert tps["target_only"] == pytest.approx(5.0) and tps["speedup"] == pytest.approx(2.0)
  assert ("speculative 3.3 (10.0 on the 1 prompts the target alone was timed on, which the "
          "speed-up compares), target only 5.0, speedup 2.00x") in evaluate.format_report(r)
