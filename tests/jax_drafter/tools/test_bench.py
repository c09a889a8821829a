"""The benchmark harness: FLOP counting by hand, and both sides of a tiny case run on CPU."""

import json

import numpy as np

from jax_drafter import presets
from jax_drafter.tools import bench
from pallas_kernels.dflash_attention.reference import visible_pairs


def test_visible_keys_hand_counted():
  a = np.array([[3, 6]])
  count = lambda a, K, w: visible_pairs(a, np.zeros_like(a), block_size=K, window=w)
  # Full layer, K=2: each query sees a context keys + 2 block keys: (3+2)*2 + (6+2)*2.
  assert count(a, 2, None) == 26
  # Sliding window 2, K=2: offset o sees a - max(0, a+o-1) context keys (1, 0) + o+1 block keys.
  assert count(a, 2, 2) == (1 + 0 + 1 + 2) * 2
  # Anchor 0 with a full layer sees no context.
  assert count(np.array([[0]]), 4, None) == 16


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


def test_breakdown_times_every_part_of_the_tiny_step():
  from jax_drafter.tools import breakdown, plans
  plan = plans.build_plan("tiny-memory", [])
  graphdef, state, batch, frozen = plans.random_inputs(plan)
  parts = breakdown.step_breakdown(graphdef, state, batch, frozen, cfg=plan.cfg, t=plan.train,
                                   reps=1)
  n = plan.cfg.num_hidden_layers
  assert list(parts)[0] == "fc + hidden_norm" and len(parts) == n + 3, parts
  assert all(name.startswith(f"layer {i} (") for i, name in enumerate(list(parts)[1:n + 1]))
  assert all(v > 0 for v in parts.values())
  text = bench.format_breakdown({k: v * 1e3 for k, v in parts.items()}, 1e3 * sum(parts.values()))
  assert "rest (step - parts)" in text and "norm + LM-head CE" in text
