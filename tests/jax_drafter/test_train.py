"""End-to-end training on a tiny random target (seconds) and a shortened run of the real default."""

import json
import os
import signal

import jax
import numpy as np
import pytest

from jax_drafter import train as train_cli
from jax_drafter import trainer

from tiny_fixtures import run_losses, tiny_run_config


def test_cli_trains_checkpoints_and_exports(tiny_target_dir, sharegpt_sample, tmp_path, capsys):
  out = str(tmp_path / "run")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out, "train.eval_prompts=2", "train.grad_accum=2",
             "train.eval_max_new_tokens=6")
  overrides = [f"{s}.{k}={json.dumps(v) if not isinstance(v, str) else v}"
               for s, sec in cfg.to_dict().items() for k, v in sec.items()]
  rc = train_cli.main(["--quiet", "--config", os.devnull] + overrides)
  assert rc == 0
  losses = run_losses(out)
  assert sorted(losses) == list(range(1, 7))
  assert all(np.isfinite(v) for v in losses.values())
  assert sorted(os.listdir(os.path.join(out, "checkpoints")))[-1] == "6"
  export = os.path.join(out, "export")
  assert {"model.safetensors", "config.json"} <= set(os.listdir(export))
  zcfg = json.load(open(os.path.join(export, "config.json")))
  assert zcfg["dflash_config"]["target_layer_ids"] == [1, 1]   # DESIGN rule for L=4, n=2
  assert zcfg["layer_types"] == ["sliding_attention", "full_attention"]
  evals = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "eval_tau" in r]
  assert len(evals) == 1 and evals[0]["step"] == 6 and evals[0]["lossless"] is True
  assert 1.0 <= evals[0]["eval_tau"] <= 4.0


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


def test_bad_config_key_is_a_one_line_error(capsys):
  rc = train_cli.main(["--quiet", "train.stepz=3"])
  assert rc == 2
  err = capsys.readouterr().err
  assert "unknown key 'stepz'" in err and "did you mean 'steps'" in err


def test_real_default_run_shortened(tmp_path):
  """The README's main command, shortened: real SmolLM2 target, real ShareGPT data."""
  out = str(tmp_path / "default")
  rc = train_cli.main(["--quiet", "train.steps=3", "data.max_conversations=48",
                       "data.held_out=2", "data.seq_len=128", "data.cache_dir=null",
                       "train.checkpoint_every=2", f"train.output_dir={out}"])
  assert rc == 0
  losses = run_losses(out)
  assert sorted(losses) == [1, 2, 3] and all(np.isfinite(list(losses.values())))
  assert os.path.exists(os.path.join(out, "export", "model.safetensors"))


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


def test_data_parallel_over_two_devices_matches_one_device(tiny_target_dir, sharegpt_sample,
                                                           tmp_path):
  """Two host devices stand in for two drafter GPUs: rows split, state replicated, same losses."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  code = (
      "import sys\n"
      "sys.path.insert(0, 'tests')\n"
      "from tiny_fixtures import tiny_run_config\n"
      "from jax_drafter import trainer\n"
      "import jax\n"
      "out = sys.argv[1]\n"
      "s = trainer.train(tiny_run_config(sys.argv[2], sys.argv[3], out, 'train.steps=3'))\n"
      "print('DEVICES', len(jax.local_devices()), s['final_step'])\n")
  losses = {}
  for n in (1, 2):
    out = str(tmp_path / f"dp{n}")
    env = dict(os.environ, PYTHONPATH=root,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    p = subprocess.run([sys.executable, "-c", code, out, tiny_target_dir, sharegpt_sample],
                       capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert p.returncode == 0 and f"DEVICES {n} 3" in p.stdout, p.stderr[-3000:]
    losses[n] = run_losses(out)
  for s in (1, 2, 3):
    assert losses[2][s] == pytest.approx(losses[1][s], rel=1e-5), s
