"""The benchmark harness: model FLOPs, and both sides of a tiny case run on CPU."""

import json

import numpy as np

from jax_drafter import presets
from jax_drafter.tools import bench


def test_model_flops_of_the_27b_case_match_the_documented_figure():
  f = bench.model_flops(presets.qwen36_27b(), 8192, 1024, 1)
  assert 250e12 < f["total"] < 262e12          # GPU.md: "about 256 TFLOP of model work"
  assert f["lm_head"] == 2 * (1024 * 15) * 5120 * 248320 * 2   # supervised rows only


def test_tiny_case_runs_both_sides(tmp_path):
  out = tmp_path / "b.json"
  # --devices runs both sides at once (on CPU the device index is ignored).
  assert bench.main(["--case", "tiny", "--steps", "1", "--ce-chunk", "32", "--torch-attention",
                     "eager", "--devices", "0,1", "--breakdown", "tiny", "--json", str(out)]) == 0
  r = json.load(open(out))["tiny"]
  assert r["jax"]["status"] == "ok" and r["torch"]["status"] == "ok", r
  assert set(r["jax"]["breakdown_ms"]) >= {"fc + hidden_norm", "norm + LM-head CE"}
  assert r["jax"]["step_ms"] > 0 and np.isfinite(r["jax"]["loss"]) and np.isfinite(r["torch"]["loss"])
  assert r["jax_over_torch"]["time"] > 0


