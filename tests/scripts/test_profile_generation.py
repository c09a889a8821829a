"""scripts/profile_generation.py on a CPU: the phases a CPU can time (no graphs, no memory
figures), and the profiler's ops by their own CPU time over the profiled decode steps."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import profile_generation as prof  # noqa: E402
from bench_generation import smollm2_shaped_model  # noqa: E402


def test_cpu_profile_times_the_eager_phases_and_names_the_matmuls():
  n = torch.get_num_threads()
  torch.set_num_threads(2)             # as on CI; the tests after this one keep their own count
  try:
    r = prof.profile_shape(smollm2_shaped_model("cpu"), B=2, P=16, new=16, top=5)
  finally:
    torch.set_num_threads(n)
  assert {"prefill_ms", "decode_step_full_ms", "decode_eager_ms"} <= r.keys()
  assert not {"capture_ms", "decode_graph_ms", "keep_ms", "prefill_peak_gib"} & r.keys()
  assert all(r[k] > 0 for k in ("prefill_ms", "decode_step_full_ms", "decode_eager_ms"))
  for part in ("decode_kernels", "prefill_kernels"):
    top = r[part]["top"]
    assert 0 < sum(t for t, _, _ in top) <= r[part]["total_ms"] + 1e-9
    names = [k for _, _, k in top]
    assert "aten::mm" in names
  # 30 layers x 7 projections + the head: the decode step's matmul count, per profiled step
  calls = {k: n for _, n, k in r["decode_kernels"]["top"]}
  assert calls["aten::mm"] == 211
