"""Pallas-Triton kernel for shifted softmax statistics (reference.py has the math).

Why a kernel: the cross entropy over an LM head's [C, V] f32 logits needs the row max (for the
argmax metric), the sum of exponentials and the exponentials themselves (the operand of the
gradient matmul). XLA emits the argmax and the sum as two reductions, each reading the whole
logits once; with the shift known up front (the label's logit), one pass over each tile makes all
of them. A 2-D grid of independent tiles writes partial results per tile; the few partials of a
row are combined in jnp (api.py). Deterministic: no atomics, every sum has a fixed order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.softmax_stats import config as config_lib


def _stats_kernel(x_ref, s_ref, e_ref, sum_ref, max_ref, idx_ref, *, rows: int, cols: int,
                  block_rows: int, block_cols: int, tiles: int):
  """One program: block_rows rows x `tiles` column tiles of block_cols, walked in a loop with the
  row sum, max and first argmax carried in registers (the shift is fixed, so no rescaling)."""
  r_R = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  c0 = pl.program_id(1) * (tiles * block_cols)
  row_ok_R = r_R < rows
  s_R = plgpu.load(s_ref, mask=row_ok_R, other=0.0)

  def tile(t, carry):
    sum_R, max_R, idx_R = carry
    c_K = c0 + t * block_cols + jnp.arange(block_cols)
    ok_RxK = row_ok_R[:, None] & (c_K < cols)[None, :]
    at = (slice(None), pl.ds(t * block_cols, block_cols))
    # Columns past V read -inf: exp gives 0 and they never win the max.
    x_RxK = plgpu.load(x_ref.at[at], mask=ok_RxK, other=-jnp.inf).astype(jnp.float32)
    e_RxK = jnp.exp(x_RxK - s_R[:, None])
    plgpu.store(e_ref.at[at], e_RxK.astype(e_ref.dtype), mask=ok_RxK)
    m_R = jnp.max(x_RxK, axis=1)
    first_R = jnp.min(jnp.where(x_RxK == m_R[:, None], c_K[None, :], cols), axis=1)
    better_R = m_R > max_R          # strictly: an earlier tile keeps a tie
    return (sum_R + jnp.sum(e_RxK, axis=1), jnp.where(better_R, m_R, max_R),
            jnp.where(better_R, first_R, idx_R))

  init = (jnp.zeros((block_rows,), jnp.float32), jnp.full((block_rows,), -jnp.inf, jnp.float32),
          jnp.zeros((block_rows,), jnp.int32))
  sum_R, max_R, idx_R = jax.lax.fori_loop(0, tiles, tile, init)
  plgpu.store(sum_ref, sum_R, mask=row_ok_R)
  plgpu.store(max_ref, max_R, mask=row_ok_R)
  plgpu.store(idx_ref, idx_R, mask=row_ok_R)


def tile_stats(x_CxV, shift_C, *, out_dtype, config: config_lib.StatsConfig | None = None,
               interpret: bool = False):
  """-> (e [C, V] out_dtype, and per row and program column span P = ceil(V / (tiles_per_program
  x block_cols)): partial sums, maxima and first argmax indices, each [C, P])."""
  cfg = config or config_lib.StatsConfig()
  C, V = x_CxV.shape
  br, bc = cfg.block_rows, cfg.block_cols
  # No more tiles per program than the row has (small vocabularies, tests)
  L = min(cfg.tiles_per_program, 1 << max(0, (pl.cdiv(V, bc) - 1).bit_length()))
  grid = (pl.cdiv(C, br), pl.cdiv(V, L * bc))
  tile = pl.BlockSpec((br, L * bc), lambda i, j: (i, j))
  part = pl.BlockSpec((br, None), lambda i, j: (i, j))
  kernel = functools.partial(_stats_kernel, rows=C, cols=V, block_rows=br, block_cols=bc,
                             tiles=L)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[tile, pl.BlockSpec((br,), lambda i, j: (i,))],
      out_specs=[tile, part, part, part],
      out_shape=[jax.ShapeDtypeStruct((C, V), out_dtype),
                 jax.ShapeDtypeStruct((C, grid[1]), jnp.float32),
                 jax.ShapeDtypeStruct((C, grid[1]), jnp.float32),
                 jax.ShapeDtypeStruct((C, grid[1]), jnp.int32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret,
      name="shifted_softmax_stats",
  )(x_CxV, shift_C.astype(jnp.float32))
