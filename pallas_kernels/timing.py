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


def timed_steps(step, state, *args, steps: int, warmup: int = 1):
  """A training step that threads its state (`state, out = step(state, *args)`, state donated):
  `warmup` untimed calls, then `steps` timed ones, each waited for. -> (state, [seconds])."""
  import jax
  for _ in range(warmup):
    state, out = step(state, *args)
    jax.block_until_ready(out)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, out = step(state, *args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
  return state, times


def traced_steps(step, state, *args, steps: int):
  """`steps` calls of a state-threading step under the JAX profiler, waited for once at the end.
  -> (state, the trace as a perfetto JSON dict (no TensorBoard needed), wall seconds a step)."""
  import glob
  import gzip
  import json
  import tempfile

  import jax
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp, create_perfetto_trace=True)
    t0 = time.perf_counter()
    for _ in range(steps):
      state, out = step(state, *args)
    jax.block_until_ready(out)
    wall = (time.perf_counter() - t0) / steps
    jax.profiler.stop_trace()
    path = glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
      trace = json.load(f)
  return state, trace, wall
