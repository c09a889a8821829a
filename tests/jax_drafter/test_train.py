"""The train CLI end to end on a tiny random target (seconds), and a shortened run of the real
default."""

import json
import os

import numpy as np

from jax_drafter import train as train_cli

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
  assert zcfg["dflash_config"]["target_layer_ids"] == [1, 1]   # docs/DESIGN.md rule for L=4, n=2
  assert zcfg["layer_types"] == ["sliding_attention", "full_attention"]
  evals = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "eval_tau" in r]
  assert len(evals) == 1 and evals[0]["step"] == 6 and evals[0]["lossless"] is True
  assert 1.0 <= evals[0]["eval_tau"] <= 4.0


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


