"""The benchmark harness: model FLOPs, every row of a tiny case on the CPU, the loss check."""

import json

import numpy as np
import pytest

from jax_drafter import presets
from jax_drafter.tools import bench


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
  # The workers are subprocesses sharing a small CPU: one intra-op thread each, no oversubscription.
  monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_model_flops_of_the_27b_case_match_the_documented_figure():
  f = bench.model_flops(presets.qwen36_27b(), 8192, 1024, 1)
  assert 250e12 < f["total"] < 262e12          # GPU.md: "about 256 TFLOP of model work"
  assert f["lm_head"] == 2 * (1024 * 15) * 5120 * 248320 * 2   # supervised rows only


def test_tiny_case_runs_every_row_on_one_batch(tmp_path, capsys):
  out = tmp_path / "b.json"
  # --devices runs the rows at once (on CPU the device index is ignored).
  assert bench.main(["--case", "tiny", "--steps", "2", "--ce-chunk", "32", "--devices", "0,1,2",
                     "--breakdown", "tiny", "--json", str(out)]) == 0, capsys.readouterr().out
  r = json.load(open(out))["tiny"]
  for row in bench.ROWS:
    assert r[row]["status"] == "ok", r[row]
    assert r[row]["step_ms"] > 0 and len(r[row]["losses"]) == 3
  assert r["pytorch-trainers"]["attention"] == r["pytorch-best"]["attention"] == "eager"
  assert set(r["jax"]["breakdown_ms"]) >= {"fc + hidden_norm", "norm + LM-head CE"}
  # Same batch, weights, anchors and objective: the first-step losses agree to f32 rounding, and
  # with the JAX optimizer on both sides the next steps' losses still do.
  for row in ("pytorch-trainers", "pytorch-best"):
    c = r["loss_check"][row]
    assert c["ok"] and c["dtype"] == "float32" and c["rel"] < 1e-5, c
    assert c["later_steps_max_rel"] < 1e-5, c
  # The best row computes the LM head on supervised rows only: fewer than the B*N*(K-1) of JAX.
  run, K = presets.RUNS["tiny"], presets.get("tiny").block_size
  assert 0 < r["pytorch-best"]["lm_head_rows"] <= run.batch * run.anchors * (K - 1)
  # Ratios are against the fastest PyTorch row, for every other row.
  base = r["ratios"]["against"]
  others = [s for s in bench.ROWS if s != base]
  assert base in ("pytorch-trainers", "pytorch-best") and set(r["ratios"]) == {"against", *others}
  for s in others:
    assert np.isclose(r["ratios"][s]["time"], r[s]["step_ms"] / r[base]["step_ms"])
  assert "bench: PASS (2 first-step loss check(s)" in capsys.readouterr().out


def test_shifted_anchors_fail_the_loss_check(capsys):
  """--perturb-anchors: the PyTorch row trains on the JAX anchors moved by one token."""
  assert bench.main(["--case", "tiny", "--steps", "0", "--ce-chunk", "32", "--side", "jax",
                     "--side", "pytorch-best", "--perturb-anchors"]) == 1
  out = capsys.readouterr().out
  assert "FAIL: not the same batch" in out and "tiny pytorch-best: first-step loss differs" in out


def _ok(loss, ms, dtype="bfloat16", peak=10.0, fixed=4.0):
  return {"status": "ok", "first_loss": loss, "losses": [loss], "step_ms": ms, "compile_s": 1.0,
          "compute_dtype": dtype, "peak_gib": peak, "peak_minus_fixed_gib": peak - fixed}


def test_compare_ratios_against_the_fastest_pytorch_row_and_tolerances():
  res = {"jax": _ok(12.9, 400.0, peak=45.0), "pytorch-trainers": _ok(12.9005, 700.0, peak=60.0),
         "pytorch-best": _ok(12.90001, 500.0, peak=35.0)}
  ratios, checks = bench.compare(res)
  assert ratios["against"] == "pytorch-best"
  assert ratios["jax"]["time"] == pytest.approx(0.8) and ratios["jax"]["peak"] == pytest.approx(45 / 35)
  assert ratios["jax"]["peak_minus_fixed"] == pytest.approx(41 / 31)
  # bf16: 1e-4 relative. 0.0005 / 12.9 = 3.9e-5 passes, ...
  assert checks["pytorch-trainers"]["ok"] and checks["pytorch-best"]["ok"]
  # ... and in f32 (both rows on the CPU) the same difference is far too large.
  res = {k: {**v, "compute_dtype": "float32"} for k, v in res.items()}
  assert not bench.compare(res)[1]["pytorch-trainers"]["ok"]
  res["pytorch-best"]["first_loss"] = float("nan")
  assert not bench.compare(res)[1]["pytorch-best"]["ok"]


def test_an_errored_row_fails_the_bench_and_an_oom_does_not():
  res = {"jax": _ok(12.9, 400.0), "pytorch-trainers": {"status": "out of memory"},
         "pytorch-best": _ok(12.9, 500.0)}
  rec, lines = bench.report_case("tiny", res)
  assert bench.failures({"tiny": rec}) == []
  assert any("ratios against pytorch-best" in line for line in lines)
  res["pytorch-best"] = {"status": "error: RuntimeError: boom"}
  rec, _ = bench.report_case("tiny", res)
  assert bench.failures({"tiny": rec}) == ["tiny pytorch-best: error: RuntimeError: boom"]


def test_rows_of_two_calls_merge_into_one_report(tmp_path, capsys):
  """A row run in an earlier call (its --json) joins this call's rows: ratios and the first-step
  loss check span both, and the merged row says where it came from."""
  first, second = tmp_path / "a.json", tmp_path / "b.json"
  assert bench.main(["--case", "tiny", "--steps", "0", "--ce-chunk", "32", "--side", "jax",
                     "--json", str(first)]) == 0
  assert set(json.load(open(first))["tiny"]) >= {"jax"}
  capsys.readouterr()
  assert bench.main(["--case", "tiny", "--steps", "0", "--ce-chunk", "32", "--side", "pytorch-best",
                     "--merge", str(first), "--json", str(second)]) == 0
  out = capsys.readouterr().out
  r = json.load(open(second))["tiny"]
  assert r["jax"]["merged_from"] == str(first) and "merged_from" not in r["pytorch-best"]
  assert r["jax"]["first_loss"] == json.load(open(first))["tiny"]["jax"]["first_loss"]
  assert r["loss_check"]["pytorch-best"]["ok"] and r["ratios"]["against"] == "pytorch-best"
  assert f"(from {first})" in out and "bench: PASS (1 first-step loss check(s)" in out


def test_a_merge_file_without_the_case_or_not_json_is_refused(tmp_path, capsys):
  other = tmp_path / "other.json"
  other.write_text(json.dumps({"27b-8k": {"jax": {"status": "ok"}}}))
  assert bench.main(["--case", "tiny", "--side", "jax", "--merge", str(other)]) == 2
  assert "has none of the cases tiny (it has 27b-8k)" in capsys.readouterr().err
  bad = tmp_path / "bad.json"
  bad.write_text("{ not json")
  assert bench.main(["--case", "tiny", "--side", "jax", "--merge", str(bad)]) == 2
  assert "cannot read it as JSON" in capsys.readouterr().err
