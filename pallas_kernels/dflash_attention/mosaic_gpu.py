"""DFlash attention forward on Hopper through Pallas Mosaic GPU (TMA loads, wgmma): a prototype.

Same contract, padding and index bookkeeping as the Triton kernel (triton.py: every query row's
visible context range [lo, hi), a query tile's key-tile range, the own-block tile, base-2 scores
and log-sum-exp), so its outputs (out, lse) feed the Triton backward unchanged. One warpgroup per
query tile of R = 64 rows (TQ = 64 // G query tokens x the G query heads of one KV head, whole
blocks): the M of one wgmma. Context K/V tiles stream through `plgpu.emit_pipeline` over the
tile's own (dynamic) key-tile range, every tile masked by the rows' ranges.

dflash_attention_mosaic puts it under a custom VJP whose backward is the Triton dQ and dK/dV
kernels (triton._dflash_bwd), fed the forward's padded output and lse.

Status (2026-12-05): a forward only, written on a CPU machine. It lowers for CUDA (the tests
export it for 'cuda' on a CPU, which runs Mosaic GPU's layout inference and TMA checks), but it
has not run on a GPU yet, so nothing selects it: tests/pallas_kernels/test_mosaic_gpu.py's GPU
test against reference.py comes first. Lane semantics with explicit WGMMA layouts: the
Warpgroup semantics (which JAX's Mosaic GPU interpreter could run on a CPU) failed layout
inference on this kernel, and the interpreter supports neither `plgpu.load` nor layout casts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dflash_attention import triton as tri

ROWS = 64          # query rows of a tile: one warpgroup's wgmma M
KEYS = 64          # context keys of a tile


def _forward_kernel(ranges_g, lo_g, hi_g, q_g, kc_g, vc_g, kb_g, vb_g, o_g, lse_g, *, tq, tk,
                    groups, kp, k_real, causal, qk_scale, n_kt):
  i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
  d = q_g.shape[-1]
  dtype = q_g.dtype
  rows = pl.ds(i * ROWS, ROWS)
  tiling, swizzle = plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)
  wgmma_layout, row_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
  iota = lambda shape, dim: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma_layout)

  def scoped(q_smem, kb_smem, vb_smem, lo_smem, hi_smem, lse_smem, bars):
    plgpu.copy_gmem_to_smem(q_g.at[b, h, rows], q_smem, bars.at[0])
    # The own blocks' keys as a tile of 64 (this tile's tq and the next ones', masked out; the
    # arrays are padded by 64 - tq): wgmma takes 64 keys where layout inference fails on 16.
    plgpu.copy_gmem_to_smem(kb_g.at[b, h, :, pl.ds(i * tq, ROWS)], kb_smem, bars.at[1])
    plgpu.copy_gmem_to_smem(vb_g.at[b, h, pl.ds(i * tq, ROWS)], vb_smem, bars.at[2])
    plgpu.copy_gmem_to_smem(lo_g.at[b, rows], lo_smem, bars.at[3])
    plgpu.copy_gmem_to_smem(hi_g.at[b, rows], hi_smem, bars.at[4])
    for j in range(5):
      plgpu.barrier_wait(bars.at[j])
    lo = plgpu.load(lo_smem, (), layout=row_layout)
    hi = plgpu.load(hi_smem, (), layout=row_layout)

    def scores(kt_ref, width):   # kt_ref: keys transposed, [D, width]
      def run(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, kt_ref)
        return acc_ref[...]
      return pl.run_scoped(run, plgpu.ACC((ROWS, width), jnp.float32)) * qk_scale

    def times_v(p, v_ref):
      def run(acc_ref):
        plgpu.wgmma(acc_ref, p.astype(dtype), v_ref)
        return acc_ref[...]
      return pl.run_scoped(run, plgpu.ACC((ROWS, d), jnp.float32))

    # Own-block keys first (every real row sees its block's key 0, so m is finite afterwards).
    r_ids, c_ids = iota((ROWS, ROWS), 0), iota((ROWS, ROWS), 1)
    t = r_ids // groups
    mask = (c_ids < tq) & (t // kp == c_ids // kp) & (c_ids % kp < k_real)
    if causal:
      mask = mask & (c_ids % kp <= t % kp)
    s = jnp.where(mask, scores(kb_smem, ROWS), tri._NEG)
    m = s.max(axis=1)
    p = jnp.exp2(s - lax.broadcast_in_dim(m, s.shape, [0]))
    l = p.sum(axis=1)
    acc = times_v(p, vb_smem)

    # Context tiles [kt_lo, kt_hi) of this query tile, at least one (masked to nothing where
    # the tile has no context), so the pipeline's trip count is never 0.
    kt_lo = jnp.minimum(ranges_g[b, i, 0], n_kt - 1)
    n = jnp.maximum(ranges_g[b, i, 3] - kt_lo, 1)

    def step(idx, k_smem, v_smem, carry):
      acc, m, l = carry
      start = (kt_lo + idx[0]) * tk
      j = start + iota((ROWS, tk), 1)
      seen = (j >= lax.broadcast_in_dim(lo, j.shape, [0])) & (
          j < lax.broadcast_in_dim(hi, j.shape, [0]))
      s = jnp.where(seen, scores(k_smem, tk), tri._NEG)
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + times_v(p, v_smem)
      return acc, m_new, l * alpha + p.sum(axis=1)

    k_spec = plgpu.BlockSpec(block_shape=(d, tk), index_map=lambda j: (0, kt_lo + j),
                             transforms=(tiling, swizzle))
    v_spec = plgpu.BlockSpec(block_shape=(tk, d), index_map=lambda j: (kt_lo + j, 0),
                             transforms=(tiling, swizzle))
    acc, m, l = plgpu.emit_pipeline(step, grid=(n,), in_specs=[k_spec, v_spec],
                                    max_concurrent_steps=2, init_carry=(acc, m, l))(
                                        kc_g.at[b, h], vc_g.at[b, h])

    real = lo < tri._NO_ROW
    out = acc / lax.broadcast_in_dim(l, acc.shape, [0])
    out = jnp.where(lax.broadcast_in_dim(real, acc.shape, [0]), out, 0.0)
    q_smem[...] = out.astype(dtype)               # the q tile's buffer holds the output
    lse_smem[...] = jnp.where(real, m + jnp.log2(l), tri._LSE_EMPTY)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_g.at[b, h, rows])
    plgpu.copy_smem_to_gmem(lse_smem, lse_g.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(
      scoped,
      plgpu.SMEM((ROWS, d), dtype, transforms=(tiling, swizzle)),
      plgpu.SMEM((d, ROWS), dtype, transforms=(tiling, swizzle)),   # own blocks' K^T
      plgpu.SMEM((ROWS, d), dtype, transforms=(tiling, swizzle)),   # own blocks' V
      plgpu.SMEM((ROWS,), jnp.int32),
      plgpu.SMEM((ROWS,), jnp.int32),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_barriers=5),
  )


def _check(q, kc, block_size):
  _, _, Hq, D = q.shape
  Hkv = kc.shape[2]
  G = Hq // Hkv
  Kp = tri._next_pow2(block_size)
  if Hq % Hkv or ROWS % G or (ROWS // G) % Kp:
    raise NotImplementedError(f"{Hq}/{Hkv} heads with blocks of {block_size}: a tile of 64 rows "
                              "must hold whole blocks of every query head of a KV head")
  # A multiple of 64 for the 128-byte swizzle, a power of two for the Triton backward.
  if D < 64 or D & (D - 1) or q.dtype not in (jnp.bfloat16, jnp.float16):
    raise NotImplementedError(f"head size {D} ({q.dtype}): needs a power of two >= 64, bf16/f16")


def _forward(q, kc, vc, kb, vb, anchors, doc_start, valid, st):
  """-> (out, out_p padded [B, Qp, Hq, D], lse) in the layouts of triton._forward for the same
  st (its config's plan: the Triton backward pads the same way)."""
  B, _, Hq, D = q.shape
  Hkv = kc.shape[2]
  G = Hq // Hkv
  Kp = tri._next_pow2(st.block_size)
  tq, tk = ROWS // G, KEYS
  plan = tri._plan(st, q.shape, kc.shape)
  Qp = plan.Np * Kp
  if plan.Sp % tk or Qp % tq:
    raise NotImplementedError(f"{kc.shape[1]} context keys or {q.shape[1]} queries: fewer than "
                              f"one tile ({tk} keys, {tq} queries)")
  lo, hi = tri._row_bounds(anchors, doc_start, valid, plan=plan, window=st.window)
  ranges, _ = tri._q_tile_ranges(lo, hi, tq=tq, tk=tk)
  # Row layouts the tiles read as contiguous 2-D slabs: [B, Hkv, Qp * G, D] (row t * G + g) and
  # [B, Hkv, keys, D]; lo / hi per row [B, Qp * G].
  q_rows = tri._pad_blocks(q, plan).reshape(B, Qp, Hkv, G, D).transpose(0, 2, 1, 3, 4)
  q_rows = q_rows.reshape(B, Hkv, Qp * G, D)
  heads_first = lambda x: x.transpose(0, 2, 1, 3)
  # K transposed ([B, Hkv, D, keys]): the scores' right operand needs no transposed view.
  keys_last = lambda x: x.transpose(0, 2, 3, 1)
  kc_h, vc_h = keys_last(tri._pad_keys(kc, plan)), heads_first(tri._pad_keys(vc, plan))
  kb_h, vb_h = keys_last(tri._pad_blocks(kb, plan)), heads_first(tri._pad_blocks(vb, plan))
  extra = tri._round_up(Qp + ROWS - tq, ROWS) - Qp   # TMA boxes tile the key axis by 64
  kb_h = jnp.pad(kb_h, ((0, 0), (0, 0), (0, 0), (0, extra)))
  vb_h = jnp.pad(vb_h, ((0, 0), (0, 0), (0, extra), (0, 0)))
  lo_r, hi_r = (jnp.repeat(x, G, axis=1) for x in (lo, hi))
  kernel = plgpu.kernel(
      lambda *refs: _forward_kernel(
          *refs, tq=tq, tk=tk, groups=G, kp=Kp, k_real=st.block_size,
          causal=st.window is not None, qk_scale=st.scale * math.log2(math.e),
          n_kt=plan.Sp // tk),
      out_type=(jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
                jax.ShapeDtypeStruct((B, Hkv, Qp * G), jnp.float32)),
      grid=(Qp // tq, Hkv, B), grid_names=("q", "h", "b"),
      compiler_params=plgpu.CompilerParams(approx_math=True))
  o_rows, lse = kernel(ranges, lo_r, hi_r, q_rows, kc_h, vc_h, kb_h, vb_h)
  out_p = o_rows.reshape(B, Hkv, Qp, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Qp, Hq, D)
  return tri._unpad_blocks(out_p, plan), out_p, lse


def _static(q, block_size, window, scale, config):
  D = q.shape[-1]
  return tri.make_static(block_size=block_size, window=window,
                         scale=D ** -0.5 if scale is None else scale, head_dim=D, dtype=q.dtype,
                         config=config)


def dflash_forward_mosaic(q, kc, vc, kb, vb, anchors, doc_start, valid, *, block_size: int,
                          window: int | None = None, scale: float | None = None, config=None):
  """-> (out [B, N*K, Hq, D], lse base 2 [B, Hkv, Qp * G]) as the Triton forward's with the same
  config (default: the device's preset). Shapes as api.dflash_attention's; bf16 or f16,
  G = Hq // Hkv dividing 64 into whole padded blocks, head size a multiple of 64."""
  _check(q, kc, block_size)
  st = _static(q, block_size, window, scale, config)
  out, _, lse = _forward(q, kc, vc, kb, vb, anchors.astype(jnp.int32),
                         doc_start.astype(jnp.int32), valid.astype(jnp.bool_), st)
  return out, lse


# The Triton dQ and dK/dV kernels read this forward's padded output and lse as their own.
_attention = tri.with_triton_backward(_forward)


def dflash_attention_mosaic(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, *,
                            block_size: int, window: int | None = None,
                            scale: float | None = None, config=None):
  """DFlash attention (api.dflash_attention's contract) with the Mosaic GPU forward and the
  Triton backward (config: the Triton kernels' tiles, default the device's preset)."""
  _check(q, k_ctx, block_size)
  st = _static(q, block_size, window, scale, config)
  return _attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors.astype(jnp.int32),
                    doc_start.astype(jnp.int32), block_valid.astype(jnp.bool_), st)
