"""bf16 8192^3 matmul throughput through jax.jit and torch on this GPU (the ceiling the drafter
step's matmuls see). XLA_FLAGS in the environment apply to the JAX side."""

import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax
import jax.numpy as jnp

N, REPS = 8192, 20
FLOP = 2 * N ** 3


def median_s(fn, sync):
  for _ in range(3):
    sync(fn())
  ts = []
  for _ in range(REPS):
    t0 = time.perf_counter()
    sync(fn())
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


a = jax.random.normal(jax.random.key(0), (N, N), jnp.bfloat16)
b = jax.random.normal(jax.random.key(1), (N, N), jnp.bfloat16)
mm = jax.jit(jnp.matmul)
t = median_s(lambda: mm(a, b), jax.block_until_ready)
print(f"jax   bf16 {N}^3 matmul: {t * 1e3:.3f} ms, {FLOP / t / 1e12:.0f} TFLOP/s "
      f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
try:
  import torch
  x = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
  y = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
  t = median_s(lambda: x @ y, lambda _: torch.cuda.synchronize())
  print(f"torch bf16 {N}^3 matmul: {t * 1e3:.3f} ms, {FLOP / t / 1e12:.0f} TFLOP/s")
except Exception as e:  # noqa: BLE001
  print(f"torch matmul skipped: {e}")
