"""bf16 matmul throughput through jax.jit and torch on this GPU (the ceiling the drafter step's
matmuls see). XLA_FLAGS in the environment apply to the JAX side.

  python scripts/matmul_peak.py [--shapes MxKxN,...]   (default 8192^3, then the 27b-8k step's
                                                        MLP and LM-head shapes)
"""

import argparse
import os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax
import jax.numpy as jnp

from pallas_kernels.timing import median_seconds

# 8192^3; then Qwen3.6-27B's drafter at 27b-8k (16,384 block tokens, hidden 5120): gate+up, down,
# one 2048-row LM-head chunk of the 248,320-token vocabulary, and its input gradient.
BURST = 8   # calls per timed run, one sync at the end: dispatch and sync overheads amortised
DEFAULT = "8192x8192x8192,16384x5120x34816,16384x17408x5120,2048x5120x248320,2048x248320x5120"


def _burst(call):
  """BURST calls of `call`, each result dropped as the next is queued: -> the last one."""
  for _ in range(BURST):
    out = call()
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default=DEFAULT, help="comma-separated MxKxN")
  ap.add_argument("--reps", type=int, default=20)
  a = ap.parse_args()
  flags = os.environ.get("XLA_FLAGS", "")
  try:
    import torch
  except ImportError:
    torch = None
  for shape in a.shapes.split(","):
    M, K, N = (int(x) for x in shape.split("x"))
    flop = 2 * M * K * N
    x = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
    y = jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16)
    mm = jax.jit(jnp.matmul)
    t = median_seconds(lambda: _burst(lambda: mm(x, y)), warmup=3, reps=a.reps) / BURST
    line = f"{M}x{K}x{N}: jax {t * 1e3:.3f} ms {flop / t / 1e12:.0f} TFLOP/s (XLA_FLAGS={flags!r})"
    del x, y
    if torch is not None and torch.cuda.is_available():
      p = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
      q = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
      t = median_seconds(lambda: _burst(lambda: p @ q), sync=lambda _: torch.cuda.synchronize(),
                         warmup=3, reps=a.reps) / BURST
      line += f" | torch {t * 1e3:.3f} ms {flop / t / 1e12:.0f} TFLOP/s"
      del p, q
      torch.cuda.empty_cache()
    print(line, flush=True)


if __name__ == "__main__":
  main()
