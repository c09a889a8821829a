"""The GPU's clock, power and energy during each step of a bench case's JAX training step.

The JAX row of `python -m jax_drafter.tools.bench` (same plan, inputs and jitted step), run for
--steps steps, each waited for (state and metrics) and timed, while a thread reads NVML every
--interval-ms: the SM clock, the power draw, the energy counter and the clock-event reasons (why the
clock is below its maximum: the software power cap, thermal slowdown, ...). Each step gets the
mean and minimum SM clock over its time, its energy in joules and the reasons seen; the table says
whether step times follow the clock (the bench's 27b-8k steps alternate by ~5%: is it the GPU's
power management?). A steady 8192^3 bf16 matmul loop is read the same way first, as a control.

  PYTHONPATH=. python scripts/gpu_step_clocks.py --case 27b-8k --steps 16 [--json clocks.json]

NVML is read through ctypes (libnvidia-ml.so.1, which every NVIDIA driver installs): no Python
package needed. Nothing is set on the GPU; it is only read.
"""

import argparse
import ctypes
import json
import os
import statistics
import threading
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# nvmlClocksEventReasons bits (nvml.h)
REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "sw power cap", 0x8: "hw slowdown",
           0x10: "sync boost", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake",
           0x100: "display clocks"}


class Nvml:
  """The few NVML reads this needs, through ctypes."""

  def __init__(self, index: int = 0, library: str = "libnvidia-ml.so.1"):
    try:
      self.lib = ctypes.CDLL(library)
    except OSError as e:
      raise SystemExit(f"gpu_step_clocks: cannot load NVML ({library}: {e}); it comes with the "
                       "NVIDIA driver: run this on the GPU machine") from None
    self._check(self.lib.nvmlInit_v2())
    self.h = ctypes.c_void_p()
    self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.h)))

  @staticmethod
  def _check(rc):
    if rc != 0:
      raise RuntimeError(f"NVML call failed with status {rc}")

  def _uint(self, fn, *args):
    v = ctypes.c_uint()
    self._check(fn(self.h, *args, ctypes.byref(v)))
    return v.value

  def sm_clock(self) -> int:        # MHz
    return self._uint(self.lib.nvmlDeviceGetClockInfo, 1)      # NVML_CLOCK_SM

  def max_sm_clock(self) -> int:
    return self._uint(self.lib.nvmlDeviceGetMaxClockInfo, 1)

  def power_w(self) -> float:
    return self._uint(self.lib.nvmlDeviceGetPowerUsage) / 1e3

  def power_limit_w(self) -> float:
    return self._uint(self.lib.nvmlDeviceGetEnforcedPowerLimit) / 1e3

  def energy_j(self) -> float:
    v = ctypes.c_ulonglong()
    self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.h, ctypes.byref(v)))
    return v.value / 1e3

  def reasons(self) -> int:
    v = ctypes.c_ulonglong()
    fn = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        self.lib.nvmlDeviceGetCurrentClocksThrottleReasons
    self._check(fn(self.h, ctypes.byref(v)))
    return v.value


class Sampler(threading.Thread):
  """(time, SM clock, power, energy, reasons) every interval seconds until stopped."""

  def __init__(self, nvml: Nvml, interval: float):
    super().__init__(daemon=True)
    self.nvml, self.interval, self.rows, self.stop = nvml, interval, [], threading.Event()

  def run(self):
    n = self.nvml
    while not self.stop.is_set():
      self.rows.append((time.perf_counter(), n.sm_clock(), n.power_w(), n.energy_j(), n.reasons()))
      time.sleep(self.interval)

  def window(self, t0: float, t1: float) -> dict:
    rows = [r for r in self.rows if t0 <= r[0] <= t1]
    if not rows:
      return {"samples": 0}
    clocks = [r[1] for r in rows]
    bits = 0
    for r in rows:
      bits |= r[4]
    return {"samples": len(rows), "clock_mean_mhz": statistics.fmean(clocks),
            "clock_min_mhz": min(clocks), "power_mean_w": statistics.fmean(r[2] for r in rows),
            "energy_j": rows[-1][3] - rows[0][3],
            "reasons": [name for bit, name in REASONS.items() if bits & bit]}


def correlation(xs, ys) -> float | None:
  """Pearson correlation of two equal-length sequences; None when either is constant."""
  if len(xs) < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
    return None
  mx, my = statistics.fmean(xs), statistics.fmean(ys)
  cov = statistics.fmean((x - mx) * (y - my) for x, y in zip(xs, ys))
  return cov / (statistics.pstdev(xs) * statistics.pstdev(ys))


def timed(fn, steps: int, sampler: Sampler) -> list[dict]:
  out = []
  for _ in range(steps):
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    out.append({"ms": (t1 - t0) * 1e3, **sampler.window(t0, t1)})
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--case", default="27b-8k")
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--interval-ms", type=float, default=5.0)
  ap.add_argument("--matmul-steps", type=int, default=12, help="0: no matmul control")
  ap.add_argument("--json")
  a = ap.parse_args()

  import jax
  import jax.numpy as jnp
  from jax_drafter.tools import bench_workers

  nvml = Nvml(0)
  sampler = Sampler(nvml, a.interval_ms / 1e3)
  sampler.start()
  report = {"max_sm_clock_mhz": nvml.max_sm_clock(), "power_limit_w": nvml.power_limit_w(),
            "device": str(jax.devices()[0]), "case": a.case}
  print(f"{report['device']}: max SM clock {report['max_sm_clock_mhz']} MHz, "
        f"power limit {report['power_limit_w']:.0f} W", flush=True)

  if a.matmul_steps:
    n = 8192
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    jax.block_until_ready(mm(x))
    reps = 20   # one "step" = 20 matmuls, ~22 TFLOP: a few tens of ms

    def burst():
      y = x
      for _ in range(reps):
        y = mm(x)
      jax.block_until_ready(y)
    burst()
    rows = timed(burst, a.matmul_steps, sampler)
    for r in rows:
      r["tflops"] = reps * 2 * n ** 3 / (r["ms"] / 1e3) / 1e12
    report["matmul"] = rows

  _, fn, state, batch, frozen = bench_workers.jax_row(bench_workers.case_plan(a.case, on_cpu=False))
  holder = {"state": state}

  def one():
    holder["state"], m = fn(holder["state"], batch, frozen)
    jax.block_until_ready((holder["state"], m))
  one()
  one()
  report["steps"] = timed(one, a.steps, sampler)
  sampler.stop.set()

  def table(title, rows, extra=None):
    print(f"\n{title}")
    print(f"{'#':>3} {'ms':>8} {'clock mean':>10} {'min':>6} {'power W':>8} {'J':>7}"
          f"{'  ' + extra if extra else ''}  reasons")
    for i, r in enumerate(rows):
      print(f"{i:>3} {r['ms']:>8.1f} {r.get('clock_mean_mhz', 0):>10.0f} "
            f"{r.get('clock_min_mhz', 0):>6} {r.get('power_mean_w', 0):>8.0f} "
            f"{r.get('energy_j', 0):>7.1f}" + (f"  {r[extra]:>6.0f}" if extra else "")
            + f"  {','.join(r.get('reasons', []))}")
  if "matmul" in report:
    table("8192^3 bf16 matmuls, 20 a step", report["matmul"], "tflops")
  table(f"{a.case}: the bench's JAX step", report["steps"])
  st = report["steps"]
  ms = [r["ms"] for r in st]
  clk = [r.get("clock_mean_mhz", 0) for r in st]
  corr = report["clock_time_correlation"] = correlation(clk, ms)
  print(f"\nstep median {statistics.median(ms):.1f} ms (min {min(ms):.1f}, max {max(ms):.1f}); "
        f"mean SM clock {statistics.fmean(clk):.0f} MHz of {report['max_sm_clock_mhz']}; "
        "correlation of step time with mean clock "
        + ("n/a (constant)" if corr is None else f"{corr:+.2f}"))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
