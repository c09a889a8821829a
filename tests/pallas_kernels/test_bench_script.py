"""The kernel benchmark script runs end to end in interpret mode (CPU), --parts and --mosaic
included."""

import re

from pallas_kernels.dflash_attention import bench


def test_bench_times_the_kernel_and_each_of_its_parts(capsys):
  bench.main(["--shapes", "64x4", "--layers", "sliding", "--interpret", "--parts", "--reps", "1"])
  out = capsys.readouterr().out
  assert re.search(r"^pallas\s+w2048\s+64x4\s+[\d.]+\s+\d+\s+[\d.]+", out, re.M), out
  parts = re.search(r"kernels alone: fwd ([\d.]+) ms, dq ([\d.]+) ms, dkv ([\d.]+) ms", out)
  assert parts and all(float(v) > 0 for v in parts.groups()), out


def test_bench_checks_then_times_the_mosaic_kernels(capsys):
  """--mosaic: both Mosaic GPU rows (its forward under the Triton backward, and all-Mosaic) are
  compared with the Triton kernel's output and gradients, then timed (interpreted here). The
  one-warpgroup forward: on this 2-core CPU the warp-specialised forward (the default tiles) and
  the interpreted Triton backward in one jitted program deadlock JAX's two interpreters (their
  threads wait on barriers for ever); the GPU runs that pair (the mosaic-fwd rows of
  benchmarks/h100-2026-12-06-mosaic-default), and tests interpret it outside jit."""
  bench.main(["--shapes", "64x4", "--layers", "sliding", "--interpret", "--mosaic", "--reps", "1",
              "--heads", "4/1", "--head-dim", "64", "--mosaic-tiles", "wg1"])
  out = capsys.readouterr().out
  for name in ("mosaic-fwd:wg1", "mosaic:wg1"):
    row = re.search(rf"^{name}\s+w2048\s+64x4\s+[\d.]+\s+\d+\s+[\d.]+.*max \|x - triton x\|:(.*)$",
                    out, re.M)
    assert row, out
  assert "dk_ctx" in row.group(1) and "WRONG" not in out, out
