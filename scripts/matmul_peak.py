"""bf16 8192^3 matmul throughput through jax.jit and torch on this GPU (the ceiling the drafter
step's matmuls see). XLA_FLAGS in the environment apply to the JAX side."""

import os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax
import jax.numpy as jnp

from pallas_kernels.timing import median_seconds

N, REPS = 8192, 20
FLOP = 2 * N ** 3

a = jax.random.normal(jax.random.key(0), (N, N), jnp.bfloat16)
b = jax.random.normal(jax.random.key(1), (N, N), jnp.bfloat16)
mm = jax.jit(jnp.matmul)
t = median_seconds(lambda: mm(a, b), warmup=3, reps=REPS)
print(f"jax   bf16 {N}^3 matmul: {t * 1e3:.3f} ms, {FLOP / t / 1e12:.0f} TFLOP/s "
      f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
try:
  import torch
  x = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
  y = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
  t = median_seconds(lambda: x @ y, sync=lambda _: torch.cuda.synchronize(), warmup=3, reps=REPS)
  print(f"torch bf16 {N}^3 matmul: {t * 1e3:.3f} ms, {FLOP / t / 1e12:.0f} TFLOP/s")
except Exception as e:  # noqa: BLE001
  print(f"torch matmul skipped: {e}")
