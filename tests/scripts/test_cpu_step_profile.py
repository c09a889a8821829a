"""scripts/cpu_step_profile.py's comparison modes: every step built, timed in alternating rounds,
one line each (a small config, so it runs in seconds); model.matmul restored afterwards; sets of
overrides that would not fit the shared batch and frozen weights refused."""

import os
import re
import sys

import pytest

from jax_drafter import model

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
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


def _rows(lines):
  """name -> (median ms, ratio to the first row) of each printed line."""
  out = {}
  for line in lines:
    m = re.fullmatch(r"\s*(.+): step ([\d.]+) ms \(([\d.]+)x; quartiles .*\)", line)
    assert m, line
    out[m.group(1)] = (float(m.group(2)), float(m.group(3)))
  return out


def test_compare_plain_matmul_prints_both_steps(monkeypatch):
  ours = model.matmul
  lines = _run(monkeypatch, ["--compare-plain-matmul", "--steps", "2", "--rounds", "2"] + SMALL)
  assert model.matmul is ours
  rows = _rows(lines)
  assert list(rows) == ["jnp.matmul", "model.matmul"]
  assert all(ms > 0 for ms, _ in rows.values()) and rows["jnp.matmul"][1] == 1.0
  assert all("4 steps in 2 alternating rounds" in line for line in lines)


def test_compare_overrides_times_each_recipe(monkeypatch):
  lines = _run(monkeypatch, ["--compare-overrides", "train.num_anchors=8 train.dropout=0.2",
                             "--steps", "2", "--rounds", "2"] + SMALL)
  rows = _rows(lines)
  assert list(rows) == ["(the config)", "train.num_anchors=8 train.dropout=0.2"]
  (base, one), (other, ratio) = rows.values()
  assert base > 0 and other > 0 and one == 1.0
  assert ratio == pytest.approx(other / base, abs=0.01)
  assert all("4 steps in 2 alternating rounds" in line for line in lines)


@pytest.mark.parametrize("extra", ["data.batch_size=3", "train.compute_dtype=float32",
                                   "drafter.num_target_features=2"])
def test_compare_overrides_refuses_what_the_arms_share(monkeypatch, extra):
  with pytest.raises(SystemExit, match="data.batch_size, data.seq_len"):
    _run(monkeypatch, ["--compare-overrides", extra, "--steps", "1", "--rounds", "1"] + SMALL)
