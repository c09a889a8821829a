"""Pallas-Triton DFlash attention: forward, dQ (+ block dK/dV) and context dK/dV kernels.

Letters as in reference.py; Kp = block size padded to a power of two, G = Hq // Hkv, and a tile's
R = TQ * G rows are its TQ query tokens x the G query heads of one KV head (row r = t * G + g), so
one K/V tile load serves the whole group and the group sum of dK/dV happens inside one matmul.

Work is bounded by indices, never by a mask matrix (docs/DESIGN.md, "Attention kernel"):
  * every query row has a visible context range [lo, hi) (window offset included); a query tile of
    consecutive blocks loops over the key tiles [kt_lo, kt_hi) that cover its rows' ranges and
    skips the element mask on the interior tiles [int_lo, int_hi) that every row sees completely;
    these per-tile ranges are computed in jnp before the call (Triton has no scalar prefetch) and
    passed as small int32 inputs;
  * the block keys of a tile's own blocks form one extra block-diagonal [R, TQ] tile;
  * the dK/dV kernel walks, for one context key tile, the contiguous range of query tiles that may
    see it (monotone envelopes of the per-query-tile ranges, so it is a superset for any indices),
    again with an unmasked interior. Block-key gradients come from the dQ kernel, which owns them.
Scores are kept in base 2 (scale * log2(e) folded into q.k) and the saved log-sum-exp is base 2.
Invalid blocks and padding rows have lo = _NO_ROW: the forward writes 0 and lse = _LSE_EMPTY, so
exp2(s - lse) is exactly 0 in the backward and they contribute nothing anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dflash_attention import config as config_lib
from pallas_kernels.dflash_attention import reference

_NEG = -1e30          # masked score (finite: exp2(_NEG - m) underflows to exactly 0, no inf - inf)
_LSE_EMPTY = 1e30     # lse of rows that see nothing: exp2(s - lse) == 0 for any finite score
_NO_ROW = 1 << 30     # row lo of an invalid block / padding row (larger than any context length)
_BIG = 1 << 30


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class _Static:
  block_size: int
  window: int | None
  scale: float
  interpret: bool
  backward: str | None
  config: config_lib.DFlashConfig


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static geometry: padded sizes and per-kernel tiles (TQ in query tokens, TK in keys)."""
  K: int; Kp: int; N: int; Np: int; S: int; Sp: int; G: int
  fwd_q: int; fwd_k: int; dq_q: int; dq_k: int; dkv_q: int; dkv_k: int


def _plan(st: _Static, q_shape, kc_shape) -> _Plan:
  _, Q, Hq, _ = q_shape
  S, Hkv = kc_shape[1], kc_shape[2]
  K = st.block_size
  Kp, N, G, cfg = _next_pow2(K), Q // K, Hq // Hkv, st.config
  # A query tile holds whole blocks and at least 16 tokens (Triton dot dims are >= 16), and is
  # not larger than the (padded) problem.
  q_min = max(Kp, 16)
  q_max = max(q_min, _next_pow2(N * Kp))
  tq = lambda rows: min(max(rows // G, q_min), q_max)
  tk = lambda keys: min(keys, max(16, _next_pow2(S)))
  fwd_q, dq_q, dkv_q = tq(cfg.fwd_rows), tq(cfg.dq_rows), tq(cfg.dkv_rows)
  fwd_k, dq_k, dkv_k = tk(cfg.fwd_keys), tk(cfg.dq_keys), tk(cfg.dkv_keys)
  Np = _round_up(N, max(fwd_q, dq_q, dkv_q) // Kp)
  Sp = _round_up(max(S, 1), max(fwd_k, dq_k, dkv_k))
  return _Plan(K, Kp, N, Np, S, Sp, G, fwd_q, fwd_k, dq_q, dq_k, dkv_q, dkv_k)


# ----------------------------------------------------------------------------------------------
# Index bookkeeping in jnp (O(B * (Q + S / TK)) int32, computed before the kernels).

def _row_bounds(anchors, doc_start, valid, *, plan: _Plan, window):
  """Per query token (padded layout [B, Np*Kp]): visible context range [lo, hi), lo = _NO_ROW for
  rows that are not real queries. Clipped to [0, S]: kernels never index past the context."""
  B, N = anchors.shape
  pad = ((0, 0), (0, plan.Np - N))
  a = jnp.pad(anchors, pad)[:, :, None]
  ds = jnp.pad(doc_start, pad)[:, :, None]
  ok = jnp.pad(valid, pad)[:, :, None]
  o = jnp.arange(plan.Kp, dtype=jnp.int32)[None, None, :]
  if window is None:
    lower = ds
  else:
    w = min(window, plan.S + plan.Kp)  # any larger window is the same mask; keeps int32 in range
    lower = jnp.maximum(ds, a + o - (w - 1))
  lo = jnp.clip(lower, 0, plan.S)
  hi = jnp.clip(a, 0, plan.S)
  real = ok & (o < plan.K)
  lo = jnp.where(real, lo, _NO_ROW).astype(jnp.int32)
  hi = jnp.where(real, hi, 0).astype(jnp.int32)
  return lo.reshape(B, -1), hi.reshape(B, -1)


def _q_tile_ranges(lo, hi, *, tq: int, tk: int):
  """Per query tile: [kt_lo, int_lo, int_hi, kt_hi] in key tiles, int32 [B, nqt, 4], and whether
  the tile has any real row. [kt_lo, kt_hi) covers every row's range; [int_lo, int_hi) are tiles
  that every real row sees entirely (no element mask needed)."""
  B = lo.shape[0]
  lo, hi = lo.reshape(B, -1, tq), hi.reshape(B, -1, tq)
  real = lo < _NO_ROW
  any_row = real.any(-1)
  r_lo = jnp.min(jnp.where(real, jnp.minimum(lo, hi), _BIG), -1)
  r_hi = jnp.max(jnp.where(real, hi, 0), -1)
  kt_lo = jnp.where(any_row, r_lo // tk, 0)
  kt_hi = jnp.where(any_row, jnp.maximum(-(-r_hi // tk), kt_lo), 0)
  i_lo = jnp.max(jnp.where(real, lo, 0), -1)
  i_hi = jnp.min(jnp.where(real, hi, _BIG), -1)
  int_lo = jnp.clip(-(-i_lo // tk), kt_lo, kt_hi)
  int_hi = jnp.clip(i_hi // tk, int_lo, kt_hi)
  return jnp.stack([kt_lo, int_lo, int_hi, kt_hi], -1).astype(jnp.int32), any_row


def _k_tile_ranges(q_ranges, any_row, *, nkt: int):
  """Per context key tile: [qa, ia, ib, qb] in query tiles, int32 [B, nkt, 4]. Query tiles
  [qa, qb) include every tile whose range covers the key tile; [ia, ib) are tiles for which it is
  interior. Built from monotone envelopes so both are contiguous and correct for any indices
  (sorted anchors make the envelopes tight)."""
  kt_lo, int_lo, int_hi, kt_hi = (q_ranges[..., i] for i in range(4))
  nonempty = kt_hi > kt_lo
  env_lo = lax.cummin(jnp.where(nonempty, kt_lo, _BIG), axis=1, reverse=True)
  env_hi = lax.cummax(jnp.where(nonempty, kt_hi, -1), axis=1)
  # Envelopes of the interiors shrink them: IL >= int_lo and IH <= int_hi for every tile.
  env_ilo = lax.cummax(jnp.where(any_row, int_lo, -1), axis=1)
  env_ihi = lax.cummin(jnp.where(any_row, int_hi, _BIG), axis=1, reverse=True)
  kt = jnp.arange(nkt, dtype=jnp.int32)
  ss = jax.vmap(lambda a: jnp.searchsorted(a, kt, side="right").astype(jnp.int32))
  qa, qb = ss(env_hi), ss(env_lo)
  qb = jnp.maximum(qb, qa)
  ia = jnp.clip(ss(env_ihi), qa, qb)
  ib = jnp.clip(ss(env_ilo), ia, qb)
  return jnp.stack([qa, ia, ib, qb], -1)


# ----------------------------------------------------------------------------------------------
# Kernel helpers (traced inside the kernels).

def _dot(a, b, *, trans_a=False, trans_b=False, precision=None):
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _rows(x_T, groups: int):
  """[TQ] per-token values -> [TQ * G] per-row values (row r = t * G + g)."""
  if groups == 1:
    return x_T
  tq = x_T.shape[0]
  return jnp.broadcast_to(x_T[:, None], (tq, groups)).reshape(tq * groups)


def _load_rows(ref):
  """A whole [T, G, D] block (loaded once, outside any loop) -> rows [T * G, D]."""
  t, g, d = ref.shape
  return ref[...].reshape(t * g, d)


def _ctx_mask(lo_R, hi_R, start, block_k: int, *, keys_first: bool = False):
  """[R, TK] (or [TK, R] with keys_first): may row r see context key start + c."""
  j = start + jnp.arange(block_k, dtype=jnp.int32)
  if keys_first:
    return (j[:, None] >= lo_R[None, :]) & (j[:, None] < hi_R[None, :])
  return (j[None, :] >= lo_R[:, None]) & (j[None, :] < hi_R[:, None])


def _block_mask(rows: int, tq: int, *, groups: int, plan: _Plan, causal: bool,
                keys_first: bool = False):
  """[R, TQ] (or [TQ, R] with keys_first): row (block n, offset o) sees key (block n', offset
  o') of this tile's blocks."""
  kp = plan.Kp
  t = jnp.arange(rows, dtype=jnp.int32) // groups
  c = jnp.arange(tq, dtype=jnp.int32)
  ax_r, ax_c = (slice(None), None), (None, slice(None))
  if keys_first:
    ax_r, ax_c = ax_c, ax_r
  oc = (c % kp)[ax_c]
  mask = ((t // kp)[ax_r] == (c // kp)[ax_c]) & (oc < plan.K)
  if causal:
    mask = mask & (oc <= (t % kp)[ax_r])
  return mask


def _ctx_loops(ranges_ref, step, carry):
  """Run step(i, carry, masked=...) over [r0, r1) masked, [r1, r2) unmasked, [r2, r3) masked."""
  r0, r1, r2, r3 = (ranges_ref[i] for i in range(4))
  carry = lax.fori_loop(r0, r1, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(r1, r2, functools.partial(step, masked=False), carry)
  return lax.fori_loop(r2, r3, functools.partial(step, masked=True), carry)


# ----------------------------------------------------------------------------------------------
# Kernels.

def _dflash_fwd_kernel(ranges_ref, lo_ref, hi_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref,
                       o_ref, lse_ref, *, block_k, plan, causal, qk_scale, precision):
  # q_ref/o_ref [TQ, G, D]; kc_ref/vc_ref [Sp, D]; kb_ref/vb_ref [TQ, D]; lse_ref [R].
  tq, g, d = q_ref.shape
  r = tq * g
  q_RxD = _load_rows(q_ref)
  lo_R, hi_R = _rows(lo_ref[...], g), _rows(hi_ref[...], g)

  # Own-block keys first: every row sees its block's key 0, so m is finite from here on and
  # masked context scores underflow to exactly 0 in exp2 (no select on p needed).
  s = _dot(q_RxD, kb_ref[...], trans_b=True, precision=precision) * qk_scale  # [R, TQ]
  s = jnp.where(_block_mask(r, tq, groups=g, plan=plan, causal=causal), s, _NEG)
  m = s.max(-1)
  p = jnp.exp2(s - m[:, None])
  l = p.sum(-1)
  vb = vb_ref[...]
  acc = _dot(p.astype(vb.dtype), vb, precision=precision)  # [R, D] f32

  def step(kt, carry, masked):
    acc, m, l = carry
    start = pl.multiple_of(kt * block_k, block_k)
    k = kc_ref[pl.ds(start, block_k), :]
    s = _dot(q_RxD, k, trans_b=True, precision=precision) * qk_scale  # [R, TK]
    if masked:
      s = jnp.where(_ctx_mask(lo_R, hi_R, start, block_k), s, _NEG)
    m_new = jnp.maximum(m, s.max(-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    v = vc_ref[pl.ds(start, block_k), :]
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_new, l * alpha + p.sum(-1)

  acc, m, l = _ctx_loops(ranges_ref, step, (acc, m, l))
  real = lo_R < _NO_ROW
  o = jnp.where(real[:, None], acc / l[:, None], 0.0)
  o_ref[...] = o.reshape(tq, g, d).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(real, m + jnp.log2(l), _LSE_EMPTY)


def _dflash_dq_kernel(ranges_ref, lo_ref, hi_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref, do_ref,
                      lse_ref, delta_ref, dq_ref, dkb_ref, dvb_ref, *, block_k, plan, causal,
                      qk_scale, scale, precision):
  # As the forward; also owns the gradients of its blocks' keys (no other tile sees them).
  tq, g, d = q_ref.shape
  r = tq * g
  q_RxD, do_RxD = _load_rows(q_ref), _load_rows(do_ref)
  lse_R, delta_R = lse_ref[...], delta_ref[...]
  lo_R, hi_R = _rows(lo_ref[...], g), _rows(hi_ref[...], g)
  dt = q_RxD.dtype

  kb, vb = kb_ref[...], vb_ref[...]
  s = _dot(q_RxD, kb, trans_b=True, precision=precision) * qk_scale
  s = jnp.where(_block_mask(r, tq, groups=g, plan=plan, causal=causal), s, _NEG)
  p = jnp.exp2(s - lse_R[:, None])
  ds = p * (_dot(do_RxD, vb, trans_b=True, precision=precision) - delta_R[:, None])
  dq = _dot(ds.astype(dt), kb, precision=precision)
  # Block-key gradients from the same small tile computed keys-first ([TQ, R]), so every MMA
  # takes untransposed register operands; the contraction over rows sums the G heads.
  sT = _dot(kb, q_RxD, trans_b=True, precision=precision) * qk_scale
  sT = jnp.where(_block_mask(r, tq, groups=g, plan=plan, causal=causal, keys_first=True), sT,
                 _NEG)
  pT = jnp.exp2(sT - lse_R[None, :])
  dsT = pT * (_dot(vb, do_RxD, trans_b=True, precision=precision) - delta_R[None, :])
  dvb_ref[...] = _dot(pT.astype(dt), do_RxD, precision=precision).astype(dvb_ref.dtype)
  dkb_ref[...] = (_dot(dsT.astype(dt), q_RxD, precision=precision) * scale).astype(dkb_ref.dtype)

  def step(kt, dq, masked):
    start = pl.multiple_of(kt * block_k, block_k)
    k = kc_ref[pl.ds(start, block_k), :]
    v = vc_ref[pl.ds(start, block_k), :]
    s = _dot(q_RxD, k, trans_b=True, precision=precision) * qk_scale
    if masked:
      s = jnp.where(_ctx_mask(lo_R, hi_R, start, block_k), s, _NEG)
    p = jnp.exp2(s - lse_R[:, None])
    ds = p * (_dot(do_RxD, v, trans_b=True, precision=precision) - delta_R[:, None])
    return dq + _dot(ds.astype(dt), k, precision=precision)

  dq = _ctx_loops(ranges_ref, step, dq)
  dq_ref[...] = (dq * scale).reshape(tq, g, d).astype(dq_ref.dtype)


def _dflash_dkv_kernel(ranges_ref, lo_ref, hi_ref, q_ref, kc_ref, vc_ref, do_ref, lse_ref,
                       delta_ref, dk_ref, dv_ref, *, block_q, groups, qk_scale, scale,
                       precision):
  # kc_ref/vc_ref/dk_ref/dv_ref [TK, D]; lse/delta [Qp * G]; lo/hi [Qp]; q_ref/do_ref [Qp, G * D]
  # (token t's G heads side by side), loaded 2-D and reshaped to rows r = t * G + g.
  # Not 3-D [TQ, G, D] loads: reshaping those inside this pipelined loop gave wrong and
  # run-to-run different dK for G = 4 on the H200 (Triton 3.6). Measured on the H200 at
  # S=8192/N=1024 sliding, fwd+bwd: 6.59 ms and exactly inputs + outputs of memory, vs 7.43 ms
  # and +0.13 GiB for 2-D rows read from a transposed copy [B, Hkv, Qp * G, D].
  tk, d = kc_ref.shape
  g = groups
  r = block_q * g
  k, v = kc_ref[...], vc_ref[...]
  dt = k.dtype
  start_k = pl.program_id(0) * tk

  def step(i, carry, masked):
    dk, dv = carry
    qs = pl.multiple_of(i * block_q, block_q)
    rs = pl.multiple_of(i * r, r)
    q_RxD = q_ref[pl.ds(qs, block_q), :].reshape(r, d)
    do_RxD = do_ref[pl.ds(qs, block_q), :].reshape(r, d)
    lse_R, delta_R = lse_ref[pl.ds(rs, r)], delta_ref[pl.ds(rs, r)]
    # Keys-first scores [TK, R] (k q^T): dV += P^T dO and dK += dS^T q then need no transposed
    # register operand; the contraction over rows sums the G query heads of the KV head.
    sT = _dot(k, q_RxD, trans_b=True, precision=precision) * qk_scale
    if masked:
      lo_R = _rows(lo_ref[pl.ds(qs, block_q)], g)
      hi_R = _rows(hi_ref[pl.ds(qs, block_q)], g)
      sT = jnp.where(_ctx_mask(lo_R, hi_R, start_k, tk, keys_first=True), sT, _NEG)
    pT = jnp.exp2(sT - lse_R[None, :])
    dv = dv + _dot(pT.astype(dt), do_RxD, precision=precision)
    dsT = pT * (_dot(v, do_RxD, trans_b=True, precision=precision) - delta_R[None, :])
    return dk + _dot(dsT.astype(dt), q_RxD, precision=precision), dv

  zeros = jnp.zeros((tk, d), jnp.float32)
  dk, dv = _ctx_loops(ranges_ref, step, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_calls. Grids are (tile, kv head, batch): tiles of one (batch, head) run next to each
# other and share K/V in L2.

def _params(warps, stages):
  return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _precision(dtype):
  # f32 inputs: IEEE f32 matmuls (Triton's default for f32 is tf32); bf16/f16: native MMA.
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _query_grid_specs(tq: int, G: int, D: int, Sp: int):
  """BlockSpecs on the query-tile grid (i, h, b) of the forward and dq kernels."""
  return dict(
      ranges=pl.BlockSpec((None, None, 4), lambda i, h, b: (b, i, 0)),
      tok=pl.BlockSpec((None, tq), lambda i, h, b: (b, i)),                  # lo / hi [TQ]
      q=pl.BlockSpec((None, tq, None, G, D), lambda i, h, b: (b, i, h, 0, 0)),  # [TQ, G, D]
      ctx=pl.BlockSpec((None, Sp, None, D), lambda i, h, b: (b, 0, h, 0)),     # [Sp, D]
      blk=pl.BlockSpec((None, tq, None, D), lambda i, h, b: (b, i, h, 0)),     # [TQ, D]
      rows=pl.BlockSpec((None, None, tq * G), lambda i, h, b: (b, h, i)))      # [R]


def _fwd_call(q5, kc, vc, kb, vb, lo, hi, ranges, *, st: _Static, plan: _Plan):
  B, Qp, Hkv, G, D = q5.shape
  tq, tk = plan.fwd_q, plan.fwd_k
  cfg = st.config
  kernel = functools.partial(
      _dflash_fwd_kernel, block_k=tk, plan=plan, causal=st.window is not None,
      qk_scale=st.scale * math.log2(math.e), precision=_precision(q5.dtype))
  sp = _query_grid_specs(tq, G, D, plan.Sp)
  return pl.pallas_call(
      kernel,
      grid=(Qp // tq, Hkv, B),
      in_specs=[sp["ranges"], sp["tok"], sp["tok"], sp["q"], sp["ctx"], sp["ctx"], sp["blk"],
                sp["blk"]],
      out_specs=[sp["q"], sp["rows"]],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct((B, Hkv, Qp * G), jnp.float32)],
      compiler_params=_params(cfg.fwd_warps, cfg.fwd_stages),
      interpret=st.interpret,
      name="dflash_fwd",
  )(ranges, lo, hi, q5, kc, vc, kb, vb)


def _dq_call(q5, kc, vc, kb, vb, do5, lse, delta, lo, hi, ranges, *, st: _Static, plan: _Plan):
  B, Qp, Hkv, G, D = q5.shape
  tq, tk = plan.dq_q, plan.dq_k
  cfg = st.config
  kernel = functools.partial(
      _dflash_dq_kernel, block_k=tk, plan=plan, causal=st.window is not None,
      qk_scale=st.scale * math.log2(math.e), scale=st.scale, precision=_precision(q5.dtype))
  sp = _query_grid_specs(tq, G, D, plan.Sp)
  return pl.pallas_call(
      kernel,
      grid=(Qp // tq, Hkv, B),
      in_specs=[sp["ranges"], sp["tok"], sp["tok"], sp["q"], sp["ctx"], sp["ctx"], sp["blk"],
                sp["blk"], sp["q"], sp["rows"], sp["rows"]],
      out_specs=[sp["q"], sp["blk"], sp["blk"]],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct(kb.shape, kb.dtype),
                 jax.ShapeDtypeStruct(vb.shape, vb.dtype)],
      compiler_params=_params(cfg.dq_warps, cfg.dq_stages),
      interpret=st.interpret,
      name="dflash_bwd_dq",
  )(ranges, lo, hi, q5, kc, vc, kb, vb, do5, lse, delta)


def _dkv_call(q5, kc, vc, do5, lse, delta, lo, hi, ranges, *, st: _Static, plan: _Plan):
  B, Qp, Hkv, G, D = q5.shape
  tk = plan.dkv_k
  cfg = st.config
  kernel = functools.partial(
      _dflash_dkv_kernel, block_q=plan.dkv_q, groups=G, qk_scale=st.scale * math.log2(math.e),
      scale=st.scale, precision=_precision(q5.dtype))
  tile_k = pl.BlockSpec((None, tk, None, D), lambda j, h, b: (b, j, h, 0))
  # A free reshape: KV head h is the column block [h * G * D, (h + 1) * G * D).
  q_in, do_in = (x.reshape(B, Qp, Hkv * G * D) for x in (q5, do5))
  full_q = pl.BlockSpec((None, Qp, G * D), lambda j, h, b: (b, 0, h))
  full_rows = pl.BlockSpec((None, None, Qp * G), lambda j, h, b: (b, h, 0))
  full_tok = pl.BlockSpec((None, Qp), lambda j, h, b: (b, 0))
  return pl.pallas_call(
      kernel,
      grid=(plan.Sp // tk, Hkv, B),
      in_specs=[pl.BlockSpec((None, None, 4), lambda j, h, b: (b, j, 0)), full_tok, full_tok,
                full_q, tile_k, tile_k, full_q, full_rows, full_rows],
      out_specs=[tile_k, tile_k],
      out_shape=[jax.ShapeDtypeStruct(kc.shape, kc.dtype),
                 jax.ShapeDtypeStruct(vc.shape, vc.dtype)],
      compiler_params=_params(cfg.dkv_warps, cfg.dkv_stages),
      interpret=st.interpret,
      name="dflash_bwd_dkv",
  )(ranges, lo, hi, q_in, kc, vc, do_in, lse, delta)


# ----------------------------------------------------------------------------------------------
# Padding to the kernels' layout (no copy when block size and lengths already fit).

def _pad_blocks(x, plan: _Plan):
  """[B, N*K, H, D] -> [B, Np*Kp, H // G?, ...]: pads the anchor and block-offset axes."""
  if (plan.Np, plan.Kp) == (plan.N, plan.K):
    return x
  B, _, H, D = x.shape
  x = x.reshape(B, plan.N, plan.K, H, D)
  x = jnp.pad(x, ((0, 0), (0, plan.Np - plan.N), (0, plan.Kp - plan.K), (0, 0), (0, 0)))
  return x.reshape(B, plan.Np * plan.Kp, H, D)


def _unpad_blocks(x, plan: _Plan):
  if (plan.Np, plan.Kp) == (plan.N, plan.K):
    return x
  B, _, H, D = x.shape
  x = x.reshape(B, plan.Np, plan.Kp, H, D)[:, :plan.N, :plan.K]
  return x.reshape(B, plan.N * plan.K, H, D)


def _pad_keys(x, plan: _Plan):
  if plan.Sp == plan.S:
    return x
  return jnp.pad(x, ((0, 0), (0, plan.Sp - plan.S), (0, 0), (0, 0)))


def _as_groups(x, G):
  B, T, Hq, D = x.shape
  return x.reshape(B, T, Hq // G, G, D)


# ----------------------------------------------------------------------------------------------
# custom_vjp: the one place forward and backward are wired.

def _forward(q, kc, vc, kb, vb, anchors, doc_start, valid, st: _Static):
  plan = _plan(st, q.shape, kc.shape)
  lo, hi = _row_bounds(anchors, doc_start, valid, plan=plan, window=st.window)
  ranges, _ = _q_tile_ranges(lo, hi, tq=plan.fwd_q, tk=plan.fwd_k)
  q5 = _as_groups(_pad_blocks(q, plan), plan.G)
  out5, lse = _fwd_call(q5, _pad_keys(kc, plan), _pad_keys(vc, plan), _pad_blocks(kb, plan),
                        _pad_blocks(vb, plan), lo, hi, ranges, st=st, plan=plan)
  out_p = out5.reshape(out5.shape[0], out5.shape[1], -1, out5.shape[-1])
  return _unpad_blocks(out_p, plan), out_p, lse


class _BwdArrays(NamedTuple):
  """The backward kernels' operands in their padded layouts (see _bwd_arrays)."""
  q5: jax.Array
  kc: jax.Array
  vc: jax.Array
  kb: jax.Array
  vb: jax.Array
  do5: jax.Array
  lse: jax.Array
  delta: jax.Array
  lo: jax.Array
  hi: jax.Array
  ranges_dq: jax.Array
  ranges_dkv: jax.Array


def _bwd_arrays(st: _Static, plan: _Plan, res, dout) -> _BwdArrays:
  """The forward's residuals and the output cotangent -> the dQ and dK/dV kernels' operands."""
  q, kc, vc, kb, vb, anchors, doc_start, valid, out_p, lse = res
  G = plan.G
  lo, hi = _row_bounds(anchors, doc_start, valid, plan=plan, window=st.window)
  do_p = _pad_blocks(dout.astype(q.dtype), plan)
  # Delta pre-pass, D_r = sum_d dO * O: one fused XLA reduction reading O and dO once (a Pallas
  # kernel would do the same memory-bound work). Laid out [B, Hkv, Qp * G] like the lse rows.
  B, Qp, Hq, _ = do_p.shape
  delta = jnp.sum(do_p.astype(jnp.float32) * out_p.astype(jnp.float32), -1)
  delta = delta.reshape(B, Qp, Hq // G, G).transpose(0, 2, 1, 3).reshape(B, Hq // G, Qp * G)
  ranges_dq, _ = _q_tile_ranges(lo, hi, tq=plan.dq_q, tk=plan.dq_k)
  q_ranges, any_row = _q_tile_ranges(lo, hi, tq=plan.dkv_q, tk=plan.dkv_k)
  ranges_dkv = _k_tile_ranges(q_ranges, any_row, nkt=plan.Sp // plan.dkv_k)
  return _BwdArrays(_as_groups(_pad_blocks(q, plan), G), _pad_keys(kc, plan),
                    _pad_keys(vc, plan), _pad_blocks(kb, plan), _pad_blocks(vb, plan),
                    _as_groups(do_p, G), lse, delta, lo, hi, ranges_dq, ranges_dkv)


def _dq_kernel_call(st: _Static, plan: _Plan, a: _BwdArrays):
  """-> dQ [B, Qp, Hkv, G, D] and the own blocks' dK, dV (padded)."""
  return _dq_call(a.q5, a.kc, a.vc, a.kb, a.vb, a.do5, a.lse, a.delta, a.lo, a.hi, a.ranges_dq,
                  st=st, plan=plan)


def _dkv_kernel_call(st: _Static, plan: _Plan, a: _BwdArrays):
  """-> the context's dK, dV [B, Sp, Hkv, D]."""
  return _dkv_call(a.q5, a.kc, a.vc, a.do5, a.lse, a.delta, a.lo, a.hi, a.ranges_dkv, st=st,
                   plan=plan)


def _dflash_bwd(st, res, dout):
  q, kc, vc, kb, vb, anchors, doc_start, valid, out_p, lse = res
  if st.backward == "reference":
    fn = lambda *x: reference.dflash_attention_reference(
        *x, anchors, doc_start, valid, block_size=st.block_size, window=st.window, scale=st.scale)
    _, vjp = jax.vjp(fn, q, kc, vc, kb, vb)
    return (*vjp(dout), None, None, None)

  plan = _plan(st, q.shape, kc.shape)
  a = _bwd_arrays(st, plan, res, dout)
  dq5, dkb, dvb = _dq_kernel_call(st, plan, a)
  dkc, dvc = _dkv_kernel_call(st, plan, a)
  dq = _unpad_blocks(dq5.reshape(*dq5.shape[:2], -1, dq5.shape[-1]), plan)
  S = plan.S
  return (dq, dkc[:, :S], dvc[:, :S], _unpad_blocks(dkb, plan), _unpad_blocks(dvb, plan),
          None, None, None)


def differentiable(forward, backward):
  """forward(q, kc, vc, kb, vb, anchors, doc_start, valid, st) -> (out, out_p, lse) under a custom
  VJP whose backward(st, residuals, dout) gets (q, kc, vc, kb, vb, anchors, doc_start, valid,
  out_p, lse): the padded output and base-2 lse in this module's layouts."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
  def attention(q, kc, vc, kb, vb, anchors, doc_start, valid, st):
    return forward(q, kc, vc, kb, vb, anchors, doc_start, valid, st)[0]

  def attention_fwd(q, kc, vc, kb, vb, anchors, doc_start, valid, st):
    out, out_p, lse = forward(q, kc, vc, kb, vb, anchors, doc_start, valid, st)
    return out, (q, kc, vc, kb, vb, anchors, doc_start, valid, out_p, lse)

  attention.defvjp(attention_fwd, backward)
  return attention


def with_triton_backward(forward):
  """forward made differentiable by the Triton dQ and dK/dV kernels (_dflash_bwd), which read its
  padded output and base-2 lse. Another forward kernel (mosaic_gpu.py) shares them."""
  return differentiable(forward, _dflash_bwd)


_dflash = with_triton_backward(_forward)


def make_static(*, block_size: int, window: int | None, scale: float, head_dim: int, dtype,
                interpret: bool = False, backward: str | None = None,
                config: config_lib.DFlashConfig | None = None) -> _Static:
  """The kernels' static settings; config None: the device's preset for this (kernel) head size
  and dtype. scale is the softmax scale already resolved (D ** -0.5 of the unpadded D)."""
  if config is None:
    config = config_lib.default_config(head_dim=head_dim, dtype_bytes=jnp.dtype(dtype).itemsize,
                                       interpret=interpret)
  return _Static(block_size=block_size, window=window, scale=float(scale), interpret=interpret,
                 backward=backward, config=config)


def dflash_attention_triton(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, *,
                            block_size: int, window: int | None = None,
                            scale: float | None = None, interpret: bool = False,
                            backward: str | None = None,
                            config: config_lib.DFlashConfig | None = None):
  """The Pallas-Triton DFlash attention (see api.dflash_attention for the contract).

  backward: None or "triton" (the Pallas kernels), "reference" (jax.vjp of reference.py).
  Any group size and head size run on the kernels, which fold a power-of-two number of query
  heads into a tile's rows and need a power-of-two head size >= 16:
    * G = Hq // Hkv is split as g * r with g its largest power-of-two divisor: each KV head is
      repeated r times, so every repeat serves g query heads (SmolLM2's 9/3 heads: g 1, r 3); the
      repeat's VJP sums the r partial dK/dV, so gradients are exact;
    * a head size D that is not a power of two >= 16 is zero-padded (q.k and the output's first
      D dims are unchanged; the softmax scale stays D ** -0.5).
  Raises NotImplementedError only for mixed input dtypes (the caller may fall back).
  """
  B, Q, Hq, D = q.shape
  Hkv = k_ctx.shape[2]
  if Hq % Hkv:
    raise ValueError(f"query heads {Hq} must be a multiple of the KV heads {Hkv}")
  if len({x.dtype for x in (q, k_ctx, v_ctx, k_blk, v_blk)}) != 1:
    raise NotImplementedError("q, k_ctx, v_ctx, k_blk, v_blk must share one dtype")
  if backward not in (None, "triton", "reference"):
    raise ValueError(f"backward={backward!r} must be None, 'triton' or 'reference'")
  scale = float(D ** -0.5 if scale is None else scale)
  G = Hq // Hkv
  r = G // (G & -G)                    # G = g * r, g = G & -G the largest power-of-two divisor
  kv = (k_ctx, v_ctx, k_blk, v_blk)
  if r > 1:                            # KV head j // r serves query heads [j * g, (j + 1) * g)
    kv = tuple(jnp.repeat(x, r, axis=2) for x in kv)
  Dp = max(16, _next_pow2(D))
  if Dp != D:
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, Dp - D)))
    q, kv = pad(q), tuple(pad(x) for x in kv)
  st = make_static(block_size=block_size, window=window, scale=scale, head_dim=Dp,
                   dtype=q.dtype, interpret=interpret, backward=backward, config=config)
  out = _dflash(q, *kv, anchors.astype(jnp.int32), doc_start.astype(jnp.int32),
                block_valid.astype(jnp.bool_), st)
  return out[..., :D] if Dp != D else out
