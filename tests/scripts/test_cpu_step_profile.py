"""scripts/cpu_step_profile.py --compare-plain-matmul: both steps built, timed in alternating
rounds, and model.matmul restored afterwards (a small config, so it runs in seconds)."""

import os
import sys

from jax_drafter import model

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_compare_plain_matmul_prints_both_steps(monkeypatch):
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import cpu_step_profile as prof
  ours = model.matmul
  monkeypatch.setattr(sys, "argv", [
      "cpu_step_profile.py", "--compare-plain-matmul", "--steps", "2", "--rounds", "2",
      "data.seq_len=64", "data.batch_size=2", "train.num_anchors=4",
      "train.compute_dtype=bfloat16", "drafter.draft_vocab_size=512"])
  lines = []
  monkeypatch.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
  prof.main()
  assert model.matmul is ours
  assert [line.split(":")[0].strip() for line in lines] == ["jnp.matmul", "model.matmul"]
  assert all("4 steps in 2 alternating rounds" in line for line in lines)


SMALL = ["data.seq_len=64", "data.batch_size=2", "train.num_anchors=4",
         "train.compute_dtype=bfloat16", "drafter.draft_vocab_size=512"]


def _run(monkeypatch, argv):
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import cpu_step_profile as prof
  monkeypatch.setattr(sys, "argv", ["cpu_step_profile.py"] + argv)
  lines = []
  monkeypatch.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
  prof.main()
  return lines


def test_compare_overrides_times_each_recipe(monkeypatch):
  lines = _run(monkeypatch, ["--compare-overrides", "train.num_anchors=8 train.dropout=0.2",
                             "--steps", "2", "--rounds", "2"] + SMALL)
  assert [line.split(":")[0].strip() for line in lines] == [
      "(the config)", "train.num_anchors=8 train.dropout=0.2"]
  assert lines[0].split("step ")[1].split(" ms")[0]        # a time, then its ratio
  assert "(1.00x;" in lines[0]
  assert all("4 steps in 2 alternating rounds" in line for line in lines)


def test_compare_overrides_refuses_what_the_arms_share(monkeypatch):
  import pytest
  for extra in ("data.batch_size=3", "train.compute_dtype=float32"):
    with pytest.raises(SystemExit, match="data.batch_size, data.seq_len"):
      _run(monkeypatch, ["--compare-overrides", extra, "--steps", "1", "--rounds", "1"] + SMALL)
