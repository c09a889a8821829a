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
