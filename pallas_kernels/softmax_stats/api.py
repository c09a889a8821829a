"""shifted_softmax_stats: exp(x - shift), its row sums, the row max and argmax of [C, V] logits
(reference.py has the math). implementation: None = the Triton kernel on a GPU, the jnp
reference elsewhere; "triton", "reference", or "interpret" (the kernel in interpret mode, for
tests on a CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.softmax_stats import config as config_lib
from pallas_kernels.softmax_stats import reference
from pallas_kernels.softmax_stats import triton

IMPLEMENTATIONS = ("triton", "reference", "interpret")


def shifted_softmax_stats(x_CxV, shift_C, *, out_dtype=jnp.float32, implementation=None,
                          config: config_lib.StatsConfig | None = None):
  """-> (e [C, V] out_dtype, sum_e [C] f32, max [C] f32, argmax [C] int32); see reference.py."""
  if x_CxV.ndim != 2 or shift_C.shape != x_CxV.shape[:1]:
    raise ValueError(f"logits {x_CxV.shape} must be [C, V] and shift {shift_C.shape} [C]")
  if implementation is None:
    implementation = "triton" if jax.default_backend() == "gpu" else "reference"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS} or None")
  if implementation == "reference":
    return reference.shifted_softmax_stats(x_CxV, shift_C, out_dtype=out_dtype)
  e, psum_CxT, pmax_CxT, pidx_CxT = triton.tile_stats(
      x_CxV, shift_C, out_dtype=out_dtype, config=config,
      interpret=implementation == "interpret")
  # The first tile holding the row max holds its first index (jnp.argmax's tie rule).
  t_C = jnp.argmax(pmax_CxT, axis=1)
  argmax = jnp.take_along_axis(pidx_CxT, t_C[:, None], axis=1)[:, 0]
  return e, jnp.sum(psum_CxT, axis=1), jnp.max(pmax_CxT, axis=1), argmax
