"""Where the GPU time of one bench case's JAX training step goes, kernel by kernel.

The JAX row of `python -m jax_drafter.tools.bench` (same plan, inputs and jitted step), timed as
the bench times it, then a JAX profiler trace of --trace-steps steps (perfetto JSON, no
TensorBoard needed). Device kernels are summed by name into classes (GEMMs, the attention kernels,
fusions, copies, collectives) and listed largest first, each with the op_name of the HLO
instruction it runs (which part of the step it is); the busy time of the device against the
step's wall time says how much is launch gaps. The optimized HLO goes to --hlo-out (gz), so a
fusion's name can be looked up.

  PYTHONPATH=. python scripts/gpu_step_profile.py --case 27b-8k [--attention triton] [--top 40]
      [--json prof.json] [--hlo-out step.hlo.txt.gz]
XLA_FLAGS in the environment apply (e.g. --xla_gpu_enable_triton_gemm=false).
"""

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

from jax_drafter import presets  # noqa: E402
from jax_drafter.tools import bench, bench_workers  # noqa: E402
from pallas_kernels.timing import timed_steps, traced_steps  # noqa: E402

CLASSES = (   # first match wins; kernel names as CUDA / XLA give them
    ("attention (Pallas)", re.compile(r"dflash|mosaic|pallas", re.I)),
    ("GEMM", re.compile(r"gemm|xmma|cutlass|cublas|sm\d+_.*(?:tensorop|wgmma)|nvjet|dot", re.I)),
    ("copy / transpose", re.compile(r"copy|transpose|memcpy|memset", re.I)),
    ("reduction fusion", re.compile(r"reduce|reduction", re.I)),
    ("other fusion", re.compile(r"fusion|loop_|input_", re.I)),
)


def kernel_class(name: str) -> str:
  for label, pat in CLASSES:
    if pat.search(name):
      return label
  return "other"


def device_events(trace: dict):
  """(name, dur_us, ts_us) of the events on device tracks of a JAX perfetto trace."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, n in names.items() if re.search(r"gpu|device", n, re.I)
         and not re.search(r"host|cpu", n, re.I)}
  out = [(e["name"], float(e["dur"]), float(e["ts"])) for e in events
         if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
  return out, ({names[p] for p in gpu} or {f"(none of: {', '.join(sorted(names.values()))})"})


def hlo_ops(hlo_text: str) -> dict[str, str]:
  """{kernel name as the trace gives it: the op_name of the HLO instruction it runs} from the
  compiled module's text. The trace names a fusion `loop_add_fusion_14` where the HLO says
  `%loop_add_fusion.14`; op_name tells where it comes from (`.../while/body/...`: the CE's chunk
  loop, `.../jit(_where)/select_n`: the optimizer, `transpose(jvp(...))`: a backward)."""
  ops = {}
  for m in re.finditer(r'^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?op_name="([^"]*)"', hlo_text, re.M):
    ops[m.group(1).replace(".", "_")] = m.group(2)
  return ops


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--case", default="27b-8k", choices=sorted(presets.RUNS))
  ap.add_argument("--attention", default=None, help="JAX attention implementation (default: api's)")
  ap.add_argument("--steps", type=int, default=6, help="timed steps (median)")
  ap.add_argument("--trace-steps", type=int, default=3)
  ap.add_argument("--top", type=int, default=40)
  ap.add_argument("--json", default=None)
  ap.add_argument("--hlo-out", default=None)
  a = ap.parse_args()

  plan = bench_workers.case_plan(a.case, on_cpu=jax.default_backend() == "cpu",
                                 attention=a.attention)
  t = plan.train
  _, fn, state, batch, frozen = bench_workers.jax_row(plan)
  t0 = time.perf_counter()
  fn = fn.lower(state, batch, frozen).compile()   # one compile, its HLO and its calls
  first = time.perf_counter() - t0
  hlo_text = fn.as_text()
  if a.hlo_out:
    with gzip.open(a.hlo_out, "wt") as f:
      f.write(hlo_text)
  ops = hlo_ops(hlo_text)
  state, times = timed_steps(fn, state, batch, frozen, steps=a.steps)
  step = statistics.median(times)
  flops = bench.model_flops(plan.cfg, plan.seq_len, t.num_anchors, plan.batch_size)["total"]
  print(f"{a.case} ({plan.describe()}), XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: "
        f"compile {first:.1f} s, step {step * 1e3:.1f} ms (median of {a.steps}: "
        f"{', '.join(f'{x * 1e3:.1f}' for x in times)}), {flops / step / 1e12:.1f} model TFLOP/s "
        f"({100 * flops / step / bench.H200_BF16_PEAK:.1f}% of 989)", flush=True)

  state, trace, wall = traced_steps(fn, state, batch, frozen, steps=a.trace_steps)
  events, tracks = device_events(trace)
  if not events:
    print("no device events in the trace (tracks: " + ", ".join(sorted(tracks)) + ")")
    return
  n = a.trace_steps
  by_name = collections.Counter()
  count = collections.Counter()
  for name, dur, _ in events:
    by_name[name] += dur
    count[name] += 1
  by_class = collections.Counter()
  for name, us in by_name.items():
    by_class[kernel_class(name)] += us
  busy = sum(by_name.values()) / n
  span = (max(ts + d for _, d, ts in events) - min(ts for _, _, ts in events)) / n
  print(f"device tracks: {', '.join(sorted(tracks))}")
  print(f"per step: kernels {busy / 1e3:.1f} ms busy (summed over streams), first to last kernel "
        f"{span / 1e3:.1f} ms, wall {wall * 1e3:.1f} ms under the profiler; "
        f"{len(events) // n} kernels a step")
  print("ms a step   share   class")
  for label, us in by_class.most_common():
    print(f"{us / n / 1e3:9.2f}   {100 * us / n / busy:5.1f}%  {label}")
  print(f"ms a step   calls   class                kernel (top {a.top}), the HLO op it runs")
  for name, us in by_name.most_common(a.top):
    op = ops.get(name, "").removeprefix("jit(train_step)/")
    print(f"{us / n / 1e3:9.2f}   {count[name] // n:5d}   {kernel_class(name):20s} {name[:60]}"
          + (f"  [{op[:70]}]" if op else ""))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"case": a.case, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                 "step_ms": step * 1e3, "steps_ms": [x * 1e3 for x in times],
                 "busy_ms": busy / 1e3, "span_ms": span / 1e3,
                 "classes_ms": {k: v / n / 1e3 for k, v in by_class.items()},
                 "kernels": [{"name": k, "ms": v / n / 1e3, "calls": count[k] // n,
                              "op": ops.get(k, "")} for k, v in by_name.most_common()]},
                f, indent=1)


if __name__ == "__main__":
  main()
