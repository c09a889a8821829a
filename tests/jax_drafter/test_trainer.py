"""trainer.train on a tiny random target (seconds): resume, Ctrl-C, NaN, architecture change,
regenerated data, data parallel, and the evaluation it runs."""

import json
import os
import signal
import time

import jax.numpy as jnp
import numpy as np
import pytest

from bridge import spec_decode
from jax_drafter import inputs, trainer

from tiny_fixtures import run_losses, tiny_run_config


def test_resume_reproduces_the_uninterrupted_run(tiny_target_dir, sharegpt_sample, tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, a))
  first = trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, b), stop_after=3)
  assert first["final_step"] == 3
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, b))
  la, lb = run_losses(a), run_losses(b)
  assert sorted(lb) == list(range(1, 7))
  for s in range(1, 7):
    assert lb[s] == pytest.approx(la[s], rel=1e-6, abs=1e-7), f"step {s}"


def test_ctrl_c_saves_a_checkpoint_and_resumes(tiny_target_dir, sharegpt_sample, tmp_path):
  out = str(tmp_path / "int")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out, "train.checkpoint_every=100")

  def update(step, metrics):
    if step == 2:
      os.kill(os.getpid(), signal.SIGINT)

  summary = trainer.train(cfg, progress=trainer.Progress(update=update))
  assert summary["interrupted"]
  saved = sorted(int(s) for s in os.listdir(os.path.join(out, "checkpoints")) if s.isdigit())
  assert saved and saved[-1] == summary["final_step"] < 6
  resumed = trainer.train(cfg)
  assert resumed["start_step"] == saved[-1] and resumed["final_step"] == 6


def test_nan_stops_the_run_and_keeps_the_last_good_state(tiny_target_dir, sharegpt_sample, tmp_path,
                                                         monkeypatch):
  import torch
  from bridge.target import Target
  out = str(tmp_path / "nan")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out)
  real = Target.features
  calls = {"n": 0}

  def poisoned(self, *a, **k):
    calls["n"] += 1
    f = real(self, *a, **k)
    return torch.full_like(f, float("nan")) if calls["n"] == 4 else f

  monkeypatch.setattr(Target, "features", poisoned)
  with pytest.raises(trainer.TrainingError, match="NaN/Inf at step 4"):
    trainer.train(cfg)
  from jax_drafter.checkpoint import load_params
  from jax_drafter.params import to_flat
  saved = sorted(int(s) for s in os.listdir(os.path.join(out, "checkpoints")) if s.isdigit())
  assert 2 <= saved[-1] < 6
  _, _, params, _ = load_params(out)
  assert all(np.isfinite(np.asarray(v)).all() for v in to_flat(params).values())
  monkeypatch.setattr(Target, "features", real)
  assert trainer.train(cfg)["final_step"] == 6


def test_architecture_change_on_resume_is_refused(tiny_target_dir, sharegpt_sample, tmp_path):
  out = str(tmp_path / "arch")
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, out, "train.steps=2"))
  with pytest.raises(trainer.TrainingError, match="different architecture.*num_hidden_layers"):
    trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, out, "drafter.num_hidden_layers=1",
                       "drafter.layer_types=[full_attention]"))


def test_training_on_target_regenerated_conversations(tiny_target_dir, sharegpt_sample, tmp_path):
  out = str(tmp_path / "regen")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out, "train.steps=1", "data.regenerate=true",
             "data.regenerate_max_new_tokens=8", "data.max_conversations=6", "data.held_out=1",
             f"data.cache_dir={tmp_path / 'cache'}")
  summary = trainer.train(cfg)
  assert summary["final_step"] == 1
  cached = [json.loads(l) for l in open(tmp_path / "cache" / "regenerated.jsonl")]
  # The training conversations (not the held-out one), minus prompts longer than seq_len.
  held = {c["id"] for c in summary["held_out"]}
  assert 0 < len(cached) <= 5 and not held & {r["id"] for r in cached}
  assert summary["data_stats"]["train_conversations"] == len(cached)
  assert all(r["assistant_spans"] and r["input_ids"] for r in cached)


def test_training_run_decodes_the_reference_once(tiny_target_dir, sharegpt_sample, tmp_path,
                                                 monkeypatch):
  """trainer.train's evaluate closure keeps one reference cache for the run (eval_every)."""
  from jax_drafter import trainer
  from jax_drafter.config import load_config
  calls = []
  real = spec_decode.target_generate
  monkeypatch.setattr(spec_decode, "target_generate",
                      lambda *a, **kw: calls.append(kw["max_new_tokens"]) or real(*a, **kw))
  cfg = load_config(None, [
      f"target.path={tiny_target_dir}", f"data.path={sharegpt_sample}", "data.max_conversations=40",
      "data.held_out=2", "data.seq_len=96", "data.batch_size=2", "data.cache_dir=null",
      "drafter.num_hidden_layers=1", "drafter.block_size=4", "train.num_anchors=4",
      "train.steps=4", "train.warmup_steps=1", "train.checkpoint_every=4",
      "train.tensorboard=false", "train.eval_every=2", "train.eval_prompts=2",
      "train.eval_max_new_tokens=5", f"train.output_dir={tmp_path / 'run'}"])
  summary = trainer.train(cfg)
  assert [e["step"] for e in summary["evaluations"]] == [2, 4]
  assert all(e["lossless"] is True and e["near_ties"] == 0 for e in summary["evaluations"])
  n = summary["eval_report"]["num_prompts"]  # usable held-out prompts (short enough, a user turn)
  assert n >= 1 and calls == [2] + [5] * n  # the first evaluation's warm-up and references only
  assert summary["eval_report"]["tokens_per_second"]["target_only_cached"] == n


LAYOUTS = {
    # name: (overrides, a second target replica?)
    "dp2": (["train.devices=[cpu:0, cpu:1]"], False),             # drafter data parallel
    "split": (["train.devices=[cpu:1]", "train.prefetch=2"], False),  # drafter off the target's device
    "replicas_dp2": (["train.prefetch=0"], True),                 # two target replicas, DP drafter
    "fsdp2": (["train.shard_state=true"], False),                 # parameters + moments split
}


def test_every_layout_trains_like_one_device(tiny_target_dir, sharegpt_sample, tmp_path):
  """Two host devices stand in for GPUs: data parallel, a split drafter, two target replicas (and
  the producer thread ahead or not) give the losses and the validation (val_tau included) of one
  device without overlap."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  one = str(tmp_path / "one")
  val = ("data.validation=6", "train.val_every=3")
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, one, "train.steps=3",
                                "train.prefetch=0", *val))
  code = (
      "import copy, json, sys\n"
      "sys.path.insert(0, 'tests')\n"
      "from tiny_fixtures import tiny_run_config\n"
      "from bridge.target import Target\n"
      "from jax_drafter import inputs, trainer\n"
      "import jax\n"
      "assert len(jax.local_devices()) == 2\n"
      "for name, (extra, replica) in json.loads(sys.argv[3]).items():\n"
      "  if replica:\n"
      "    inputs.load_replicas = lambda cfg: [Target(copy.deepcopy(t.model), t.tokenizer, t.name)"
      " for t in [inputs.setup(cfg)[0]]]\n"
      "  trainer.pipeline.MIN_SHARDED_SIZE = 1  # the tiny drafter's arrays are all small\n"
      "  s = trainer.train(tiny_run_config(sys.argv[1], sys.argv[2], sys.argv[4] + '/' + name,"
      " 'train.steps=3', 'data.validation=6', 'train.val_every=3', *extra))\n"
      "  split = sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(s['params']))\n"
      "  print('DONE', name, s['final_step'], 'sharded', split)\n")
  env = dict(os.environ, PYTHONPATH=root, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  p = subprocess.run([sys.executable, "-c", code, tiny_target_dir, sharegpt_sample,
                      json.dumps(LAYOUTS), str(tmp_path)],
                     capture_output=True, text=True, env=env, timeout=900, cwd=root)
  assert p.returncode == 0, p.stderr[-3000:]
  base = run_losses(one)

  def validation(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
      return [r for r in map(json.loads, f) if "val_loss" in r]
  base_val = validation(one)
  assert len(base_val) == 1 and base_val[0]["val_responses"] > 0
  for name in LAYOUTS:
    done = [line.split() for line in p.stdout.splitlines() if line.startswith(f"DONE {name} ")]
    assert done and done[0][2] == "3", p.stdout
    assert (int(done[0][4]) > 0) == (name == "fsdp2"), done  # only fsdp2 splits parameters
    got = run_losses(str(tmp_path / name))
    for s in (1, 2, 3):
      assert got[s] == pytest.approx(base[s], rel=1e-5), (name, s)
    v = validation(str(tmp_path / name))
    assert len(v) == 1 and v[0]["val_responses"] == base_val[0]["val_responses"], name
    assert v[0]["val_loss"] == pytest.approx(base_val[0]["val_loss"], rel=1e-5), name
    assert v[0]["val_tau"] == pytest.approx(base_val[0]["val_tau"], abs=1e-6), name


def test_metrics_name_both_sides_throughput_and_the_bound(tiny_target_dir, sharegpt_sample,
                                                          tmp_path):
  out = str(tmp_path / "tp")
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, out, "train.steps=3"))
  with open(os.path.join(out, "metrics.jsonl")) as f:
    recs = [r for r in map(json.loads, f) if "loss" in r]
  for r in recs:
    assert r["target_tokens_per_s"] > 0 and r["drafter_tokens_per_s"] > 0
    # a step's wall time holds its drafter time: the whole is never faster than the drafter
    assert r["tokens_per_s"] <= r["drafter_tokens_per_s"] * (1 + 1e-9)
    assert trainer.bound(r) in ("target", "drafter")


def test_time_budget_stops_with_a_checkpoint_and_the_same_command_continues(
    tiny_target_dir, sharegpt_sample, tmp_path):
  out = str(tmp_path / "budget")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out)
  first = trainer.train(cfg, stop_after=2)
  assert first["final_step"] == 2
  stopped = trainer.train(cfg, time_budget_s=0.0)     # out of time before its first step
  assert stopped["out_of_time"] and stopped["final_step"] == 2
  # the budget counts from budget_from (train's --max-minutes: the command's start), so a
  # start-up that used it up leaves no step
  late = trainer.train(cfg, time_budget_s=3600.0, budget_from=time.time() - 3601.0)
  assert late["out_of_time"] and late["final_step"] == 2
  done = trainer.train(cfg, time_budget_s=3600.0, budget_from=time.time())  # time left: to the end
  assert done["final_step"] == 6 and not done["out_of_time"]
  assert sorted(run_losses(out)) == list(range(1, 7))


def test_feature_cache_trains_like_the_live_target(tiny_target_dir, sharegpt_sample, tmp_path):
  """Steps over cached target features give the losses of steps over fresh target forwards."""
  live = str(tmp_path / "live")
  cached = str(tmp_path / "cached")
  few = ("train.steps=4", "data.max_conversations=6")  # few rows: steps 3-4 revisit them
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, live, *few))
  summary = trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, cached, *few,
                                          "target.feature_cache_gib=0.5"))
  assert summary["data_stats"]["rows"] < 4 * 2
  # The host tier alone (no device tier): the same steps again.
  host = str(tmp_path / "host")
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, host, *few,
                                "target.feature_cache_host_gib=0.5"))
  a, b, c = run_losses(live), run_losses(cached), run_losses(host)
  assert sorted(a) == sorted(b) == sorted(c) == [1, 2, 3, 4]
  for s in a:
    assert b[s] == pytest.approx(a[s], rel=1e-5), s
    assert c[s] == pytest.approx(a[s], rel=1e-5), s


def test_validation_reports_where_the_feature_cache_keeps_the_rows(tiny_target_dir, sharegpt_sample,
                                                                   tmp_path, caplog):
  """Each validation logs the feature cache's tiers and what served the rows (here the host
  tier alone: every row in host memory, none on the device)."""
  import logging
  caplog.set_level(logging.INFO, logger="jax_drafter.trainer")
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, str(tmp_path / "h"),
                                "data.validation=6", "train.val_every=2", "train.steps=2",
                                "data.max_conversations=12", "target.feature_cache_host_gib=0.5"))
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("feature cache")]
  assert len(lines) == 1, lines
  import re
  m = re.fullmatch(r"feature cache: 0 rows on the device \(0\.00 GiB\), (\d+) in host memory "
                   r"\([\d.]+ GiB\); rows served so far: 0 from the device, (\d+) from host "
                   r"memory, (\d+) by the target", lines[0])
  assert m, lines[0]
  kept, host_hits, computed = map(int, m.groups())
  assert kept > 0 and computed == kept   # each row computed once, then kept in the host tier


def test_validation_rows_are_never_trained_on_and_give_the_same_curve_on_resume(
    tiny_target_dir, sharegpt_sample, tmp_path):
  extra = ("data.validation=6", "train.val_every=2", "train.steps=4")
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  whole = trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, a, *extra))
  assert [v["step"] for v in whole["validations"]] == [2, 4]
  assert all(np.isfinite(v["val_loss"]) and v["val_loss"] > 0 for v in whole["validations"])
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, b, *extra), stop_after=3)
  resumed = trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, b, *extra))
  assert resumed["validations"][-1]["val_loss"] == pytest.approx(
      whole["validations"][-1]["val_loss"], rel=1e-6)
  with open(os.path.join(a, "metrics.jsonl")) as f:
    assert [r["step"] for r in map(json.loads, f) if "val_loss" in r] == [2, 4]
  # the validation conversations are not among the training rows
  _, _, ds = inputs.setup(tiny_run_config(tiny_target_dir, sharegpt_sample, a, *extra))
  train_rows = {r.tobytes() for r in ds.rows["input_ids"]}
  assert ds.val_rows is not None and not any(r.tobytes() in train_rows
                                             for r in ds.val_rows["input_ids"])
  _, _, plain = inputs.setup(tiny_run_config(tiny_target_dir, sharegpt_sample, a))
  assert len(plain.rows["input_ids"]) > len(ds.rows["input_ids"])


def test_val_every_without_validation_conversations_is_refused(tiny_target_dir, sharegpt_sample,
                                                               tmp_path):
  from jax_drafter.config import ConfigError
  with pytest.raises(ConfigError, match="set data.validation"):
    trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, str(tmp_path / "x"),
                                  "train.val_every=2"))


def test_the_best_validation_drafter_is_exported_and_survives_a_resume(tiny_target_dir,
                                                                       sharegpt_sample, tmp_path):
  from jax_drafter.export import read_zlab
  out = str(tmp_path / "best")
  extra = ("data.validation=6", "train.val_every=1", "train.steps=4")
  first = trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, out, *extra), stop_after=2)
  vals = first["validations"]
  best = max(vals, key=lambda v: v["val_tau"])
  with open(os.path.join(out, "best", "validation.json")) as f:
    kept = json.load(f)
  assert kept["val_tau"] == best["val_tau"]
  assert kept["step"] == min(v["step"] for v in vals if v["val_tau"] == best["val_tau"])
  cfg, _, params = read_zlab(os.path.join(out, "best"))
  assert cfg.block_size == 4 and params is not None
  done = trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, out, *extra))
  allv = vals + done["validations"]
  with open(os.path.join(out, "best", "validation.json")) as f:
    kept = json.load(f)
  assert kept["val_tau"] == max(v["val_tau"] for v in allv)


@pytest.mark.parametrize("draft_vocab_size", [None, 48])
def test_validation_tau_is_what_speculative_decoding_of_the_validation_answers_measures(
    tiny_target_dir, sharegpt_sample, tmp_path, draft_vocab_size):
  """val_tau walks the accepted lengths of anchors at every answer position (teacher forcing);
  real greedy DFlash decoding of the same prompts, with the same drafter, must give the same tau
  (same verify steps, same accepted lengths). Also with a reduced draft vocabulary: the run's,
  read back from its checkpoint."""
  from jax_drafter import evaluate, objective
  M = 10
  out = str(tmp_path / "run")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out, "data.regenerate=true",
                        "data.regenerate_max_new_tokens=24", "data.validation=14",
                        "data.max_conversations=40", f"data.cache_dir={tmp_path / 'cache'}",
                        "train.steps=2", "train.val_every=2", "train.num_anchors=16",
                        f"train.eval_max_new_tokens={M}",
                        # a 48-row head learns the newline faster: a smaller step keeps misses
                        f"train.learning_rate={1e-2 if draft_vocab_size is None else 1e-3}",
                        f"drafter.draft_vocab_size={json.dumps(draft_vocab_size)}")
  summary = trainer.train(cfg)
  val = summary["validations"][-1]
  run = trainer._Run(cfg, trainer.Progress())     # resumes the final state
  rows = run.ds.val_rows
  ra = objective.response_anchors(rows["loss_mask"], rows["doc_id"], M)
  starts = np.asarray(objective.document_starts(jnp.asarray(rows["doc_id"])))
  B, R = cfg.data.batch_size, len(rows["input_ids"])
  prompts = []
  for r in range(R if R < B else R // B * B):      # the rows validation evaluates
    for i in np.nonzero(ra.valid[r] & (ra.offset[r] == 0))[0]:
      a = ra.anchors[r, i]                         # the answer's first token: the prompt ends before
      prompts.append([int(t) for t in rows["input_ids"][r, starts[r, a]:a]])
  assert val["val_responses"] == len(prompts) >= 3
  if draft_vocab_size:
    assert run.vocab is not None and len(run.vocab) == draft_vocab_size
    # The tiny target answers mostly in its newline (198), another row of the draft head: drafted
    # rows must be mapped back to ids on both sides for the taus to agree.
    row = int(np.searchsorted(run.vocab, 198))
    assert run.vocab[row] == 198 and row != 198
  report = evaluate.evaluate_tau(run.target, run.dcfg, run.graphdef, run.state.params, prompts,
                                 max_new_tokens=M, progress=False, draft_vocab=run.vocab)
  assert report["lossless"]["passed"]
  # Neither all-rejected nor all-accepted: verify steps of different lengths on both sides.
  assert 1.05 < val["val_tau"] < cfg.drafter.block_size
  assert sum(1 for n in report["accept_length_histogram"].values() if n) >= 2
  assert val["val_tau"] == pytest.approx(report["tau"], abs=1e-9)
