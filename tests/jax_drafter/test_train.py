"""The train CLI end to end on a tiny random target (seconds), and a shortened run of the real
default."""

import json
import os

import jax.numpy as jnp
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


def test_a_reduced_draft_vocabulary_travels_with_the_drafter(tiny_target_dir, sharegpt_sample,
                                                            tmp_path):
  """Chosen once, kept in every checkpoint, kept on resume, exported, read by evaluate."""
  from jax_drafter import draft_vocab, evaluate, export
  from jax_drafter.checkpoint import load_params
  out = str(tmp_path / "run")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out, "drafter.draft_vocab_size=40",
                        "train.eval_prompts=2", "train.eval_max_new_tokens=6")
  assert train_cli.main(_cli_args(cfg) + ["train.steps=4"]) == 0
  dcfg, _, _, meta = load_params(out)
  ids = draft_vocab.from_meta(meta, dcfg, source="test")
  assert dcfg.draft_vocab_size == 40 and len(ids) == 40
  assert train_cli.main(_cli_args(cfg)) == 0                 # resumed to step 6
  dcfg6, _, _, meta6 = load_params(out)
  assert meta6["data"] != meta["data"]
  np.testing.assert_array_equal(draft_vocab.from_meta(meta6, dcfg6, source="test"), ids)
  evals = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "eval_tau" in r]
  assert evals and all(r["lossless"] is True for r in evals)
  np.testing.assert_array_equal(draft_vocab.read(os.path.join(out, "export"), dcfg6), ids)
  zdir = str(tmp_path / "zlab")
  assert export.main(["--run-dir", out, "--out", zdir, "--dtype", "float32"]) == 0
  np.testing.assert_array_equal(draft_vocab.read(zdir, dcfg6), ids)
  for where in (["--run-dir", out], ["--run-dir", out, "--export"]):
    assert evaluate.main(where + ["--num-prompts", "2", "--max-new-tokens", "6",
                                  "--speed-prompts", "0"]) == 0
  os.remove(os.path.join(out, "export", draft_vocab.FILE))
  assert evaluate.main(["--run-dir", out, "--export", "--num-prompts", "2"]) == 2


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




def _cli_args(cfg):
  return ["--quiet", "--config", os.devnull] + [
      f"{s}.{k}={json.dumps(v) if not isinstance(v, str) else v}"
      for s, sec in cfg.to_dict().items() for k, v in sec.items()]


def test_bad_data_path_fails_before_the_target_loads(tiny_target_dir, tmp_path, monkeypatch,
                                                     capsys):
  import bridge.target

  def no(*a, **k):
    raise AssertionError("the target loaded before the data path was checked")

  monkeypatch.setattr(bridge.target, "load_target", no)
  cfg = tiny_run_config(tiny_target_dir, str(tmp_path / "missing.jsonl"), str(tmp_path / "r"))
  assert train_cli.main(_cli_args(cfg)) == 1
  assert "missing.jsonl: data file not found" in capsys.readouterr().err


def test_rerunning_a_finished_run_says_so_and_writes_nothing(tiny_target_dir, sharegpt_sample,
                                                             tmp_path, capsys):
  out = str(tmp_path / "run")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out, "train.steps=2",
                        "train.eval_prompts=1", "train.eval_max_new_tokens=4")
  assert train_cli.main(_cli_args(cfg)) == 0
  lines = open(os.path.join(out, "metrics.jsonl")).read()
  capsys.readouterr()
  assert train_cli.main(_cli_args(cfg)) == 0
  assert "this run is complete (step 2 of train.steps=2)" in capsys.readouterr().out
  assert open(os.path.join(out, "metrics.jsonl")).read() == lines    # nothing appended
  assert train_cli.main(_cli_args(cfg) + ["--re-evaluate"]) == 0
  records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]  # valid JSON
  assert [r["step"] for r in records if "eval_tau" in r] == [2, 2]
  assert all(r["train_tau_estimate"] is None or r["train_tau_estimate"] > 0
             for r in records if "eval_tau" in r)


def test_out_of_memory_while_regenerating_is_a_one_line_error(tiny_target_dir, sharegpt_sample,
                                                              tmp_path, monkeypatch, capsys):
  """train regenerates its data first: the device running out of memory there names the settings
  that size the decoding batches instead of ending in a traceback."""
  import torch

  from bridge import generation

  def oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.38 GiB.")

  monkeypatch.setattr(generation, "generate_batch", oom)
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, str(tmp_path / "r"), "data.regenerate=true",
                        "data.regenerate_max_new_tokens=4", "data.regenerate_max_turns=1")
  assert train_cli.main(_cli_args(cfg)) == 1
  err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
  assert len(err) == 1 and "ran out of memory while regenerating" in err[0]
  assert "data.regenerate_batch_tokens" in err[0] and "Tried to allocate 3.38 GiB" in err[0]


def test_evaluate_decodes_a_run_as_its_own_evaluation_did(tiny_target_dir, sharegpt_sample,
                                                          tmp_path, monkeypatch):
  """`jax_drafter.evaluate --run-dir` runs the drafter in the run's compute dtype with the head
  narrowed as training narrows it (before, a bfloat16 run's checkpoint decoded in float32 with a
  float32 head there), and reads the tau its end-of-run evaluation read."""
  from jax_drafter import evaluate
  seen = []

  class Recording(evaluate.DrafterSession):
    def __init__(self, *a, **k):
      super().__init__(*a, **k)
      seen.append((self._dtype, self.lm_head.dtype))

  monkeypatch.setattr(evaluate, "DrafterSession", Recording)
  out = str(tmp_path / "run")
  cfg = tiny_run_config(tiny_target_dir, sharegpt_sample, out, "train.compute_dtype=bfloat16",
                        "train.eval_prompts=3", "train.eval_max_new_tokens=24")
  assert train_cli.main(_cli_args(cfg)) == 0
  end = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "eval_tau" in r]
  report = str(tmp_path / "eval.json")
  assert evaluate.main(["--run-dir", out, "--num-prompts", "3", "--max-new-tokens", "24",
                        "--speed-prompts", "0", "--json", report]) == 0
  got = json.load(open(report))
  assert got["compute_dtype"] == "bfloat16"
  assert seen[-1] == (jnp.bfloat16, jnp.bfloat16)
  assert got["tau"] == end[-1]["eval_tau"]
