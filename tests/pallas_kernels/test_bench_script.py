"""The kernel benchmark script runs end to end in interpret mode (CPU), --parts included."""

import re

from pallas_kernels.dflash_attention import bench


def test_bench_times_the_kernel_and_each_of_its_parts(capsys):
  bench.main(["--shapes", "64x4", "--layers", "sliding", "--interpret", "--parts", "--reps", "1"])
  out = capsys.readouterr().out
  assert re.search(r"^pallas\s+w2048\s+64x4\s+[\d.]+\s+\d+\s+[\d.]+", out, re.M), out
  parts = re.search(r"kernels alone: fwd ([\d.]+) ms, dq ([\d.]+) ms, dkv ([\d.]+) ms", out)
  assert parts and all(float(v) > 0 for v in parts.groups()), out
