"""One timing loop for the benchmarks: median wall time of a call after warm-up."""

from __future__ import annotations

import statistics
import time


def median_seconds(call, *, sync=None, warmup: int = 2, reps: int = 7) -> float:
  """Median of `reps` timed runs of `call()` (each followed by `sync(result)`, by default
  jax.block_until_ready) after `warmup` untimed ones (compile, autotuning, caches)."""
  if sync is None:
    import jax
    sync = jax.block_until_ready
  for _ in range(warmup):
    sync(call())
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    sync(call())
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)
