"""DFlash attention on Hopper through Pallas Mosaic GPU (TMA loads, wgmma): forward, dQ (+ the
own blocks' dK/dV) and context dK/dV kernels.

Same contract, padding and index bookkeeping as the Triton kernels (triton.py: every query row's
visible context range [lo, hi), a query tile's key-tile range and a key tile's query-tile range,
the own-block tile, base-2 scores and log-sum-exp), so the forward's outputs (out, lse) also feed
the Triton backward unchanged. One warpgroup per tile of 64 rows or keys (the M of one wgmma):
  * forward and dQ: a query tile of R = 64 rows (TQ = 64 // G query tokens x the G query heads of
    one KV head, whole blocks; row g * TQ + t is token t of head g); its own blocks' keys form
    one 64-key tile, and context K/V tiles stream through `plgpu.emit_pipeline` over the tile's
    own (dynamic) key-tile range, every tile masked by the rows' ranges;
  * dK/dV: a context tile of 64 keys, keys first ([keys, rows]: the contraction over rows sums
    the G heads), query tiles (q, dO, lse, delta, lo, hi) streamed over its query-tile range.
Every kernel reads q, K, V, dO and writes out, dQ, dK, dV where the caller's arrays are
([B, tokens, heads, D]): a query tile arrives as G TMA boxes of [TQ, D], one per query head
(_tile_boxes), so no transposed copy is made (the code before 3208080 made 17).

dflash_attention_mosaic puts the forward under a custom VJP whose backward is either these dQ and
dK/dV kernels (backward="mosaic") or the Triton ones (backward="triton").

Context tiles that every real row of a tile sees entirely skip the mask (as the Triton kernels'
unmasked loop). The forward and dQ kernels run their own blocks in a scope of their own, so the
pipeline's K/V stages reuse those buffers: shared memory at head size 128 (from the lowering,
tests/pallas_kernels/test_mosaic_gpu.py) is 85 KiB for the one-warpgroup forward and 102 KiB for
dQ, so two tiles' CTAs share an SM and one's softmax overlaps the other's wgmma.

MosaicConfig(fwd_warpgroups=2) (the default) and dq_warpgroups=2 select warp-specialised forward
and dQ kernels: two compute warpgroups on query tiles 2i and 2i + 1 share the context K/V tiles
that a third (TMA) warpgroup streams over the union of their ranges, and take turns on the
tensor cores.

Status (2026-12-06, one H100, benchmarks/h100-2026-12-06-mosaic-default/): correct on the GPU
(tests/pallas_kernels' 40 GPU tests, both kernels', and the bench's checks of out and five
gradients against the Triton kernel). Fwd+bwd useful TF/s at the 27B drafter's heads, default
tiles against Triton: sliding 8k 320 against 257-261, full 64k 381 against 354-361 (with the
one-warpgroup forward: 307-311 and 345; the warp-specialised dQ was slower than the
one-warpgroup dQ on 2026-12-05); at SmolLM2's heads (9/3, head size 64), full 2048x512 73
against 47 and 8192x2048 255 against 192 (benchmarks/h100-2026-12-06b-step-profile). api.py's
default on Hopper at head sizes 64-128.
On a CPU the tests run every kernel under JAX's Mosaic GPU interpreter against
reference.py on the mask's edge cases (interpret=True: register operands and transposed views go
through SMEM buffers there, or plain dots inside a warp-specialised kernel, and layouts are left
out; the GPU path is otherwise the same code) and lower them for CUDA under both JAX versions we
meet (`bash scripts/lower_with_gpu_jax.sh [--all]`), which runs Mosaic GPU's layout inference,
TMA checks and shared-memory count. Lane semantics with explicit WGMMA layouts.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dflash_attention import triton as tri

ROWS = 64          # query rows of a tile: one warpgroup's wgmma M
KEYS = 64          # context keys of a tile


# Register layouts: the GPU lowering (Lane semantics) needs them spelled out; JAX's Mosaic GPU
# interpreter (interpret=True, on a CPU) has no layouts, and runs the same kernels without them.

def _iota(shape, dim, interpret):
  if interpret:
    return lax.broadcasted_iota(jnp.int32, shape, dim)
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


# plgpu.load's index: required by JAX 0.10, deprecated in 0.11 (index the ref instead).
_LOAD_INDEX = (() if inspect.signature(plgpu.load).parameters["idx"].default
               is inspect.Parameter.empty else None)


def _vec(ref, axis, interpret):
  """A [64] vector from SMEM laid out along `axis` of a wgmma tile (0: one value per row)."""
  if interpret:
    return ref[...]
  layout = plgpu.Layout.WGMMA.reduce(1 - axis)
  if _LOAD_INDEX is None:
    return plgpu.load(ref, layout=layout)
  return plgpu.load(ref, _LOAD_INDEX, layout=layout)


def _zeros(shape, interpret):
  z = jnp.zeros(shape, jnp.float32)
  return z if interpret else plgpu.layout_cast(z, plgpu.Layout.WGMMA)


def _mm(lhs, rhs, shape, interpret, *, lhs_array=False, rhs_t=False):
  """lhs @ rhs (rhs_t: lhs @ rhs^T) -> f32 [shape] by one wgmma. rhs is an SMEM ref, lhs an SMEM
  ref or (lhs_array) a 16-bit array in registers. The interpreter has neither register operands
  nor transposed views: there they go through SMEM buffers first."""
  def run(a, b):
    def acc_run(acc_ref):
      plgpu.wgmma(acc_ref, a, b)
      return acc_ref[...]
    return pl.run_scoped(acc_run, plgpu.ACC(shape, jnp.float32))
  if not interpret:
    return run(lhs, rhs.transpose((1, 0)) if rhs_t else rhs)     # a transposed view

  def via_smem(*bufs):
    bufs = list(bufs)
    a, b = lhs, rhs
    if lhs_array:
      a = bufs.pop(0)
      a[...] = lhs
    if rhs_t:
      b = bufs.pop(0)
      b[...] = rhs[...].T
    return run(a, b)
  scratch = [plgpu.SMEM(lhs.shape, lhs.dtype)] if lhs_array else []
  if rhs_t:
    scratch.append(plgpu.SMEM(rhs.shape[::-1], rhs.dtype))
  return pl.run_scoped(via_smem, *scratch)


class Mm(NamedTuple):
  """One product for _mms: acc + lhs @ rhs (rhs_t: lhs @ rhs^T) -> f32 [shape]; acc None = 0."""
  lhs: object
  rhs: object
  shape: tuple
  acc: jax.Array | None = None
  lhs_array: bool = False
  rhs_t: bool = False


def _mms(*ops: Mm, interpret: bool, between=None, in_warpgroup=False):
  """Independent products issued together, then between() (a turn on the tensor cores, a wait
  for the next tile) while they run, then one wait for all (each separate _mm waits for its
  wgmma before the next is issued); each accumulates in place into its acc (no separate add of a
  fresh product). Interpreted, they run one by one through _mm's SMEM staging, or, inside a
  warp-specialised kernel's warpgroup (in_warpgroup: the interpreter allocates no SMEM there),
  as plain f32-accumulated dots of the same 16-bit values."""
  if interpret:
    def dot(o):
      if not in_warpgroup:
        return _mm(o.lhs, o.rhs, o.shape, True, lhs_array=o.lhs_array, rhs_t=o.rhs_t)
      a = o.lhs if isinstance(o.lhs, jax.Array) else o.lhs[...]
      return lax.dot_general(a, o.rhs[...], (((1,), (1 if o.rhs_t else 0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    out = [r if o.acc is None else o.acc + r for o, r in zip(ops, map(dot, ops))]
    if between is not None:
      between()
    return out

  def issue(acc_refs):
    for ref, o in zip(acc_refs, ops):
      plgpu.wgmma(ref, o.lhs, o.rhs.transpose((1, 0)) if o.rhs_t else o.rhs)
    if between is not None:
      between()
  inits = tuple(plgpu.ACC.init(_zeros(o.shape, False) if o.acc is None else o.acc) for o in ops)
  return list(pl.run_state(issue)(inits))


def _mask_edge_tile(s, interior, seen):
  """Scores s of one context tile: unchanged on an interior tile (every real row sees all of its
  keys: no mask is built), else masked by seen() (elementwise: may this row see this key)."""
  return lax.cond(interior, lambda x: x, lambda x: jnp.where(seen(), x, tri._NEG), s)


def _own_block_mask(*, keys_first, tq, kp, k_real, causal, interpret):
  """[64, 64] (rows x own keys; keys x rows with keys_first): may row r (token r % tq of this
  tile, _tile_boxes' order) see key c of the 64-key own-block tile (its first tq keys are this
  tile's blocks, the rest padding). The forward's and dQ's own-block tile."""
  shape = (ROWS, ROWS)
  r_ids = _iota(shape, 1 if keys_first else 0, interpret)
  c_ids = _iota(shape, 0 if keys_first else 1, interpret)
  t = r_ids % tq
  mask = (c_ids < tq) & (t // kp == c_ids // kp) & (c_ids % kp < k_real)
  return mask & (c_ids % kp <= t % kp) if causal else mask


def _ctx_seen(kt, tk, lo, hi, interpret):
  """[64, tk]: may row r see context key kt * tk + c (lo / hi: the rows' ranges, one a row)."""
  j = kt * tk + _iota((ROWS, tk), 1, interpret)
  return (j >= lax.broadcast_in_dim(lo, j.shape, [0])) & (j < lax.broadcast_in_dim(hi, j.shape, [0]))


def _tile_boxes(x_g, tile_smem, b, h, t, tq, groups):
  """(GMEM, SMEM) pairs of query tile t of KV head h: its G query heads' tq tokens, each a [tq, D]
  box of x_g ([B, Qp, Hq, D], the caller's layout: read and written in place, no transposed
  copy) and rows g * tq .. (g + 1) * tq of the tile's [64, D] buffer (row r: token r % tq,
  head h * G + r // tq). TMA takes each box with its own row stride."""
  return [(x_g.at[b, pl.ds(t * tq, tq), h * groups + g], tile_smem.at[pl.ds(g * tq, tq)])
          for g in range(groups)]


def _copy_in(copies, bars, first=0):
  """Issues the (GMEM, SMEM) copies, copy j on barrier bars[first + j], then waits for all."""
  for j, (src, dst) in enumerate(copies):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[first + j])
  for j in range(len(copies)):
    plgpu.barrier_wait(bars.at[first + j])


def _store_tile(x_g, tile_smem, b, h, t, tq, groups):
  """Query tile t's [64, D] buffer out to x_g ([B, Qp, Hq, D]) as its G boxes (_tile_boxes)."""
  for dst, src in _tile_boxes(x_g, tile_smem, b, h, t, tq, groups):
    plgpu.copy_smem_to_gmem(src, dst)


def _query_tile_indices():
  """(i, h, b, the tile's 64 rows) of a kernel on the query-tile grid ("q", "h", "b")."""
  i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
  return i, h, b, pl.ds(i * ROWS, ROWS)


def _swizzled():
  """The transforms of a 16-bit SMEM tile read by TMA and wgmma: 8 x 64 tiles, 128-byte swizzle."""
  return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _finish_rows(acc, m, l, lo, q_smem, lse_smem, dtype):
  """The forward's last step for a 64-row tile: out = acc / l into the q tile's buffer (0 for
  rows that are not real) and the base-2 lse (the empty one for those rows) into lse_smem."""
  real = lo < tri._NO_ROW
  out = acc / lax.broadcast_in_dim(l, acc.shape, [0])
  out = jnp.where(lax.broadcast_in_dim(real, acc.shape, [0]), out, 0.0)
  q_smem[...] = out.astype(dtype)               # the q tile's buffer holds the output
  lse_smem[...] = jnp.where(real, m + jnp.log2(l), tri._LSE_EMPTY)


def _own_block_grads(mms, q_smem, do_smem, kb_smem, vb_smem, lse_c, delta_c, lse_r, delta_r,
                     block_mask, *, qk_scale, scale, dtype):
  """A query tile's share of its own blocks' keys: its dQ part, rows first, and (keys first,
  [keys, rows]: the contraction over rows sums the G query heads) the own blocks' dK, dV, which
  no other tile sees. The results go to the kb / vb buffers; returns dQ. lse / delta: _c per row
  of a rows-first tile, _r per column of a keys-first one."""
  sq, d = (ROWS, ROWS), q_smem.shape[-1]
  rows_of = lambda x: lax.broadcast_in_dim(x, sq, [0])
  cols_of = lambda x: lax.broadcast_in_dim(x, sq, [1])
  s, dp = mms(Mm(q_smem, kb_smem, sq, rhs_t=True), Mm(do_smem, vb_smem, sq, rhs_t=True))
  s = jnp.where(block_mask(False), s * qk_scale, tri._NEG)
  p = jnp.exp2(s - rows_of(lse_c))
  ds = p * (dp - rows_of(delta_c))
  sT, dpT = mms(Mm(kb_smem, q_smem, sq, rhs_t=True), Mm(vb_smem, do_smem, sq, rhs_t=True))
  sT = jnp.where(block_mask(True), sT * qk_scale, tri._NEG)
  pT = jnp.exp2(sT - cols_of(lse_r))
  dsT = pT * (dpT - cols_of(delta_r))
  dq, dvb, dkb = mms(Mm(ds.astype(dtype), kb_smem, (ROWS, d), lhs_array=True),
                     Mm(pT.astype(dtype), do_smem, (ROWS, d), lhs_array=True),
                     Mm(dsT.astype(dtype), q_smem, (ROWS, d), lhs_array=True))
  dkb = dkb * scale
  kb_smem[...] = dkb.astype(dtype)
  vb_smem[...] = dvb.astype(dtype)
  return dq


def _interpret_params(interpret):
  if not interpret:
    return None
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _forward_kernel(ranges_g, lo_g, hi_g, q_g, kc_g, vc_g, kb_g, vb_g, o_g, lse_g, *, tq, tk,
                    groups, kp, k_real, causal, qk_scale, n_kt, stages, interpret):
  i, h, b, rows = _query_tile_indices()
  d, dtype = q_g.shape[-1], q_g.dtype
  tiling, swizzle = _swizzled()
  block_mask = lambda keys_first: _own_block_mask(
      keys_first=keys_first, tq=tq, kp=kp, k_real=k_real, causal=causal,
      interpret=interpret)

  # SMEM in two nested phases, so that the own blocks' tiles (released after the first) and the
  # pipeline's K/V stages (allocated by the second) share space: 85 KiB at D = 128 with 2 stages,
  # two tiles' CTAs per SM.
  def scoped(q_smem, lo_smem, hi_smem, lse_smem, bars):
    copies = (*_tile_boxes(q_g, q_smem, b, h, i, tq, groups), (lo_g.at[b, rows], lo_smem),
              (hi_g.at[b, rows], hi_smem))
    _copy_in(copies, bars)
    lo, hi = _vec(lo_smem, 0, interpret), _vec(hi_smem, 0, interpret)

    def scores(k_ref, width):    # q k^T of a [width, D] key tile
      return _mm(q_smem, k_ref, (ROWS, width), interpret, rhs_t=True) * qk_scale

    def times_v(p, v_ref):
      return _mm(p.astype(dtype), v_ref, (ROWS, d), interpret, lhs_array=True)

    def own_blocks(kb_smem, vb_smem, own_bars):
      # The own blocks' keys as a tile of 64 (this tile's tq and the next ones', masked out; the
      # arrays are padded by 64 - tq): wgmma takes 64 keys where layout inference fails on 16.
      plgpu.copy_gmem_to_smem(kb_g.at[b, pl.ds(i * tq, ROWS), h], kb_smem, own_bars.at[0])
      plgpu.copy_gmem_to_smem(vb_g.at[b, pl.ds(i * tq, ROWS), h], vb_smem, own_bars.at[1])
      plgpu.barrier_wait(own_bars.at[0])
      plgpu.barrier_wait(own_bars.at[1])
      # First (every real row sees its block's key 0, so m is finite afterwards).
      s = jnp.where(block_mask(False), scores(kb_smem, ROWS), tri._NEG)
      m = s.max(axis=1)
      p = jnp.exp2(s - lax.broadcast_in_dim(m, s.shape, [0]))
      return times_v(p, vb_smem), m, p.sum(axis=1)

    acc, m, l = pl.run_scoped(
        own_blocks,
        plgpu.SMEM((ROWS, d), dtype, transforms=(tiling, swizzle)),   # own blocks' K
        plgpu.SMEM((ROWS, d), dtype, transforms=(tiling, swizzle)),   # own blocks' V
        plgpu.Barrier(num_barriers=2))

    # Context tiles [kt_lo, kt_hi) of this query tile, at least one (masked to nothing where
    # the tile has no context), so the pipeline's trip count is never 0.
    kt_lo = jnp.minimum(ranges_g[b, i, 0], n_kt - 1)
    n = jnp.maximum(ranges_g[b, i, 3] - kt_lo, 1)
    int_lo, int_hi = ranges_g[b, i, 1], ranges_g[b, i, 2]

    def step(idx, k_smem, v_smem, carry):
      acc, m, l = carry
      kt = kt_lo + idx[0]

      s = _mask_edge_tile(scores(k_smem, tk), (kt >= int_lo) & (kt < int_hi),
                          lambda: _ctx_seen(kt, tk, lo, hi, interpret))
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      acc, = _mms(Mm(p.astype(dtype), v_smem, acc.shape,
                     acc=acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), lhs_array=True),
                  interpret=interpret)
      return acc, m_new, l * alpha + p.sum(axis=1)

    spec = plgpu.BlockSpec(block_shape=(tk, d), index_map=lambda j: (kt_lo + j, 0),
                           transforms=(tiling, swizzle))
    acc, m, l = plgpu.emit_pipeline(step, grid=(n,), in_specs=[spec, spec],
                                    max_concurrent_steps=stages, init_carry=(acc, m, l))(
                                        kc_g.at[b, :, h], vc_g.at[b, :, h])

    _finish_rows(acc, m, l, lo, q_smem, lse_smem, dtype)
    plgpu.commit_smem()
    _store_tile(o_g, q_smem, b, h, i, tq, groups)
    plgpu.copy_smem_to_gmem(lse_smem, lse_g.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(
      scoped,
      plgpu.SMEM((ROWS, d), dtype, transforms=(tiling, swizzle)),
      plgpu.SMEM((ROWS,), jnp.int32),
      plgpu.SMEM((ROWS,), jnp.int32),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_barriers=groups + 2),
  )


class _KvStream(NamedTuple):
  """The context K/V stream of a warp-specialised kernel: `stages` SMEM slots of [tk, D] K and V
  tiles, their TMA barriers (landed), their release barriers (free: both compute warpgroups
  arrive) and the barrier by which the compute warpgroups take turns on the tensor cores."""
  k: object
  v: object
  k_landed: object
  v_landed: object
  k_free: object
  v_free: object
  turn: object

  @staticmethod
  def scratch(stages, tk, d, dtype):
    kv = plgpu.SMEM((stages, tk, d), dtype, transforms=_swizzled())
    return (kv, kv, plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier(num_arrivals=2))

  def take_turn(self):
    plgpu.barrier_arrive(self.turn)
    plgpu.barrier_wait(self.turn)

  def produce(self, k_g, v_g, kt_lo, n, tk, stages, interpret):
    """The TMA warpgroup: context K/V tiles kt_lo .. kt_lo + n - 1 ([tk, D] of k_g / v_g) into
    the slots, each slot reloaded once both compute warpgroups released it."""
    if not interpret:
      plgpu.set_max_registers(40, action="decrease")

    def load(src, dst, bars, j, slot):
      plgpu.copy_gmem_to_smem(src.at[pl.ds((kt_lo + j) * tk, tk)], dst.at[slot], bars.at[slot])

    for j in range(stages):
      @pl.when(j < n)
      def _():
        load(k_g, self.k, self.k_landed, j, j)
        load(v_g, self.v, self.v_landed, j, j)

    @pl.loop(0, jnp.maximum(n - stages, 0))
    def _(j):
      slot = lax.rem(j, stages)
      plgpu.barrier_wait(self.k_free.at[slot])
      load(k_g, self.k, self.k_landed, j + stages, slot)
      plgpu.barrier_wait(self.v_free.at[slot])
      load(v_g, self.v, self.v_landed, j + stages, slot)

    @pl.loop(jnp.maximum(n - stages, 0), n)     # the last steps' releases: every phase of a
    def _(j):                                    # barrier is observed before the CTA ends
      slot = lax.rem(j, stages)
      plgpu.barrier_wait(self.k_free.at[slot])
      plgpu.barrier_wait(self.v_free.at[slot])


class _Pair(NamedTuple):
  """A compute warpgroup's place in a warp-specialised kernel: grid indices (i: the query-tile
  pair), its warpgroup wg (0 or 1), its query tile t, and the pair's context key tiles kt_lo ..
  kt_lo + n - 1 (at least one; the same n for both warpgroups)."""
  i: jax.Array
  h: jax.Array
  b: jax.Array
  wg: jax.Array
  t: jax.Array
  kt_lo: jax.Array
  n: jax.Array


def _warp_specialised(compute, scratch, pair_ranges_g, k_g, v_g, *, n_kt, n_tiles, tk, stages,
                      interpret):
  """The frame of a warp-specialised kernel on the grid ("q", "h", "b") x "wg" (3 warpgroups):
  warpgroups 0 and 1 run compute(pair, kv, mms, *scratch refs) on query tiles 2i and 2i + 1 (an
  odd last tile repeated, its `t` clamped), warpgroup 2 streams the pair's context K/V tiles of
  k_g / v_g ([B, keys, Hkv, D]) through a _KvStream. mms: _mms inside a warpgroup."""
  i, h, b = lax.axis_index("q"), lax.axis_index("h"), lax.axis_index("b")
  kt_lo = jnp.minimum(pair_ranges_g[b, i, 0], n_kt - 1)
  wg = lax.axis_index("wg")
  n = jnp.maximum(pair_ranges_g[b, i, 3] - kt_lo, 1)
  d, dtype = k_g.shape[-1], k_g.dtype

  def kernel(*refs):
    bufs, kv = refs[:len(scratch)], _KvStream(*refs[len(scratch):])
    mms = lambda *ops, between=None: _mms(*ops, interpret=interpret, between=between,
                                          in_warpgroup=True)

    @pl.when(wg < 2)
    def _compute():
      if not interpret:
        plgpu.set_max_registers(232, action="increase")
      t = jnp.minimum(2 * i + wg, n_tiles - 1)
      compute(_Pair(i, h, b, wg, t, kt_lo, n), kv, mms, *bufs)

    pl.when(wg == 2)(lambda: kv.produce(k_g.at[b, :, h], v_g.at[b, :, h], kt_lo, n, tk, stages,
                                        interpret))

  pl.run_scoped(kernel, *scratch, *_KvStream.scratch(stages, tk, d, dtype),
                collective_axes="wg")


def _forward_ws_kernel(pair_ranges_g, ranges_g, lo_g, hi_g, q_g, kc_g, vc_g, kb_g, vb_g, o_g,
                       lse_g, *, tq, tk, groups, kp, k_real, causal, qk_scale, n_kt, n_tiles,
                       stages, interpret):
  """The forward, warp-specialised: a CTA runs two 64-row query tiles (2i, 2i + 1), one on each
  of two compute warpgroups, and a third warpgroup streams the context K/V tiles of both (the
  union of their key-tile ranges) through `stages` SMEM slots with TMA. Each K/V tile read
  serves 128 rows (half the L2 / HBM traffic of one tile a CTA), and the two compute warpgroups
  take turns on the tensor cores (a schedule barrier: one's softmax overlaps the other's wgmma),
  as in JAX's attention_mgpu. Where the tile count is odd the last CTA's second warpgroup
  repeats the last tile and does not store it."""
  d, dtype = q_g.shape[-1], q_g.dtype
  n_in = groups + 4                                      # input copies of a compute warpgroup

  def compute(pair, kv, mms, q_smem2, kb_smem2, vb_smem2, lo_smem2, hi_smem2, lse_smem2,
              in_bars):
    i, h, b, wg, t, kt_lo, n = pair
    k_smem, v_smem, k_bars, v_bars, k_free, v_free, turn = kv
    take_turn = kv.take_turn
    rows = pl.ds(t * ROWS, ROWS)
    q_smem, kb_smem, vb_smem = q_smem2.at[wg], kb_smem2.at[wg], vb_smem2.at[wg]
    lo_smem, hi_smem, lse_smem = lo_smem2.at[wg], hi_smem2.at[wg], lse_smem2.at[wg]
    copies = (*_tile_boxes(q_g, q_smem, b, h, t, tq, groups), (lo_g.at[b, rows], lo_smem),
              (hi_g.at[b, rows], hi_smem), (kb_g.at[b, pl.ds(t * tq, ROWS), h], kb_smem),
              (vb_g.at[b, pl.ds(t * tq, ROWS), h], vb_smem))
    _copy_in(copies, in_bars, wg * n_in)
    lo, hi = _vec(lo_smem, 0, interpret), _vec(hi_smem, 0, interpret)

    # The own blocks first (every real row sees its block's key 0: m is finite afterwards).
    s, = mms(Mm(q_smem, kb_smem, (ROWS, ROWS), rhs_t=True))
    block_mask = _own_block_mask(keys_first=False, tq=tq, kp=kp,
                                 k_real=k_real, causal=causal, interpret=interpret)
    s = jnp.where(block_mask, s * qk_scale, tri._NEG)
    m = s.max(axis=1)
    p = jnp.exp2(s - lax.broadcast_in_dim(m, s.shape, [0]))
    l = p.sum(axis=1)
    acc, = mms(Mm(p.astype(dtype), vb_smem, (ROWS, d)))

    int_lo, int_hi = ranges_g[b, t, 1], ranges_g[b, t, 2]
    plgpu.barrier_wait(k_bars.at[0])
    pl.when(wg == 1)(take_turn)

    def step(j, carry):
      acc, m, l = carry
      slot = lax.rem(j, stages)
      kt = kt_lo + j
      k_t, v_t = k_smem.at[slot], v_smem.at[slot]
      s, = mms(Mm(q_smem, k_t, (ROWS, tk), rhs_t=True), between=take_turn)
      plgpu.barrier_arrive(k_free.at[slot])
      s = _mask_edge_tile(s * qk_scale, (kt >= int_lo) & (kt < int_hi),
                          lambda: _ctx_seen(kt, tk, lo, hi, interpret))
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l = l * alpha + p.sum(axis=1)
      p16 = p.astype(dtype)
      acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
      plgpu.barrier_arrive(turn)                 # done with the softmax
      plgpu.barrier_wait(v_bars.at[slot])
      plgpu.barrier_wait(turn)                   # the tensor cores are free

      def wait_next_k():
        @pl.when(j + 1 < n)
        def _():
          plgpu.barrier_wait(k_bars.at[lax.rem(j + 1, stages)])
      acc, = mms(Mm(p16, v_t, (ROWS, d), acc=acc), between=wait_next_k)
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    acc, m, l = lax.fori_loop(0, n, step, (acc, m, l))
    pl.when(wg == 0)(take_turn)

    _finish_rows(acc, m, l, lo, q_smem, lse_smem, dtype)
    plgpu.commit_smem()

    @pl.when(2 * i + wg < n_tiles)
    def _store():
      _store_tile(o_g, q_smem, b, h, t, tq, groups)
      plgpu.copy_smem_to_gmem(lse_smem, lse_g.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  tile = plgpu.SMEM((2, ROWS, d), dtype, transforms=_swizzled())
  scratch = (tile, tile, tile, plgpu.SMEM((2, ROWS), jnp.int32),
             plgpu.SMEM((2, ROWS), jnp.int32), plgpu.SMEM((2, ROWS), jnp.float32),
             plgpu.Barrier(num_barriers=2 * n_in))    # q (G boxes), lo, hi, own K, V
  _warp_specialised(compute, scratch, pair_ranges_g, kc_g, vc_g, n_kt=n_kt, n_tiles=n_tiles,
                    tk=tk, stages=stages, interpret=interpret)


def _dq_kernel(ranges_g, lo_g, hi_g, q_g, do_g, lse_g, delta_g, kc_g, vc_g, kb_g, vb_g,
               dq_g, dkb_g, dvb_g, *, tq, tk, groups, kp, k_real, causal, qk_scale, scale, n_kt,
               stages, interpret):
  """dQ of one 64-row query tile, and the gradients of its own blocks' keys (no other tile sees
  them): the Triton dQ kernel's work, one warpgroup per tile, context K/V tiles pipelined."""
  i, h, b, rows = _query_tile_indices()
  d, dtype = q_g.shape[-1], q_g.dtype
  tiling, swizzle = _swizzled()
  block_mask = lambda keys_first: _own_block_mask(
      keys_first=keys_first, tq=tq, kp=kp, k_real=k_real, causal=causal,
      interpret=interpret)
  rows_of = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])   # per query row, rows-first

  mms = lambda *ops: _mms(*ops, interpret=interpret)

  # SMEM in two nested phases as in the forward: the own blocks' K, V (their dK, dV staged in
  # the same buffers) are released before the pipeline allocates its K/V stages (102 KiB at
  # D = 128 with 2 stages).
  def scoped(q_smem, do_smem, lse_smem, delta_smem, lse_t_smem, delta_t_smem, lo_smem, hi_smem,
             bars):
    # lse and delta twice: one copy read per row of a rows-first tile, one per column of a
    # keys-first tile (a buffer loaded in two register layouts failed JAX 0.11's layout inference)
    copies = (*_tile_boxes(q_g, q_smem, b, h, i, tq, groups),
              *_tile_boxes(do_g, do_smem, b, h, i, tq, groups),
              (lse_g.at[b, h, rows], lse_smem), (delta_g.at[b, h, rows], delta_smem),
              (lse_g.at[b, h, rows], lse_t_smem), (delta_g.at[b, h, rows], delta_t_smem),
              (lo_g.at[b, rows], lo_smem), (hi_g.at[b, rows], hi_smem))
    _copy_in(copies, bars)
    # per row of a rows-first [R, X] tile (_c) and per column of a keys-first [X, R] one (_r)
    lse_c, delta_c, lo, hi = (_vec(r, 0, interpret)
                              for r in (lse_smem, delta_smem, lo_smem, hi_smem))
    lse_r, delta_r = (_vec(r, 1, interpret) for r in (lse_t_smem, delta_t_smem))

    def own_blocks(kb_smem, vb_smem, own_bars):
      # The own blocks' keys as a tile of 64 (this tile's tq and the next ones', masked out;
      # padded by 64 - tq): wgmma takes 64 keys.
      plgpu.copy_gmem_to_smem(kb_g.at[b, pl.ds(i * tq, ROWS), h], kb_smem, own_bars.at[0])
      plgpu.copy_gmem_to_smem(vb_g.at[b, pl.ds(i * tq, ROWS), h], vb_smem, own_bars.at[1])
      plgpu.barrier_wait(own_bars.at[0])
      plgpu.barrier_wait(own_bars.at[1])
      dq = _own_block_grads(mms, q_smem, do_smem, kb_smem, vb_smem, lse_c, delta_c, lse_r,
                            delta_r, block_mask, qk_scale=qk_scale, scale=scale, dtype=dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(kb_smem.at[pl.ds(0, tq)], dkb_g.at[b, pl.ds(i * tq, tq), h])
      plgpu.copy_smem_to_gmem(vb_smem.at[pl.ds(0, tq)], dvb_g.at[b, pl.ds(i * tq, tq), h])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the buffers are released on return
      return dq

    tile = lambda: plgpu.SMEM((ROWS, d), dtype, transforms=(tiling, swizzle))
    dq = pl.run_scoped(own_blocks, tile(), tile(), plgpu.Barrier(num_barriers=2))

    # Context tiles [kt_lo, kt_hi), at least one (masked to nothing where the tile has none).
    kt_lo = jnp.minimum(ranges_g[b, i, 0], n_kt - 1)
    n = jnp.maximum(ranges_g[b, i, 3] - kt_lo, 1)
    int_lo, int_hi = ranges_g[b, i, 1], ranges_g[b, i, 2]
    st = (ROWS, tk)

    def step(idx, k_smem, v_smem, dq):
      kt = kt_lo + idx[0]

      s, dp = mms(Mm(q_smem, k_smem, st, rhs_t=True), Mm(do_smem, v_smem, st, rhs_t=True))
      s = _mask_edge_tile(s * qk_scale, (kt >= int_lo) & (kt < int_hi),
                          lambda: _ctx_seen(kt, tk, lo, hi, interpret))
      p = jnp.exp2(s - rows_of(lse_c, st))
      ds = p * (dp - rows_of(delta_c, st))
      dq, = mms(Mm(ds.astype(dtype), k_smem, (ROWS, d), acc=dq, lhs_array=True))
      return dq

    spec = plgpu.BlockSpec(block_shape=(tk, d), index_map=lambda j: (kt_lo + j, 0),
                           transforms=(tiling, swizzle))
    dq = plgpu.emit_pipeline(step, grid=(n,), in_specs=[spec, spec],
                             max_concurrent_steps=stages, init_carry=dq)(
                                 kc_g.at[b, :, h], vc_g.at[b, :, h])
    q_smem[...] = (dq * scale).astype(dtype)      # the q tile's buffer holds dQ
    plgpu.commit_smem()
    _store_tile(dq_g, q_smem, b, h, i, tq, groups)
    plgpu.wait_smem_to_gmem(0)

  tile = lambda: plgpu.SMEM((ROWS, d), dtype, transforms=(tiling, swizzle))
  vec = lambda dt: plgpu.SMEM((ROWS,), dt)
  pl.run_scoped(scoped, tile(), tile(), *(vec(jnp.float32) for _ in range(4)), vec(jnp.int32),
                vec(jnp.int32), plgpu.Barrier(num_barriers=2 * groups + 6))


def _dq_ws_kernel(pair_ranges_g, ranges_g, lo_g, hi_g, q_g, do_g, lse_g, delta_g, kc_g, vc_g,
                  kb_g, vb_g, dq_g, dkb_g, dvb_g, *, tq, tk, groups, kp, k_real, causal, qk_scale,
                  scale, n_kt, n_tiles, stages, interpret):
  """dQ (+ the own blocks' dK/dV), warp-specialised as _forward_ws_kernel: query tiles 2i and
  2i + 1 on two compute warpgroups taking turns on the tensor cores, the context K/V tiles of both
  streamed by a TMA warpgroup."""
  d, dtype = q_g.shape[-1], q_g.dtype
  n_in = 2 * groups + 8                                  # input copies of a compute warpgroup
  rows_of = lambda x, shape: lax.broadcast_in_dim(x, shape, [0])   # per query row, rows-first

  def compute(pair, kv, mms, q_smem2, do_smem2, kb_smem2, vb_smem2, vec_f2, vec_i2, in_bars):
    i, h, b, wg, t, kt_lo, n = pair
    k_smem, v_smem, k_bars, v_bars, k_free, v_free, turn = kv
    take_turn = kv.take_turn
    store = 2 * i + wg < n_tiles
    rows = pl.ds(t * ROWS, ROWS)
    own = pl.ds(t * tq, ROWS)
    q_smem, do_smem, kb_smem, vb_smem = (x.at[wg] for x in (q_smem2, do_smem2, kb_smem2,
                                                             vb_smem2))
    # lse and delta twice: one copy read per row of a rows-first tile, one per column of a
    # keys-first one (one buffer in two register layouts fails JAX 0.11's layout inference)
    lse_s, delta_s, lse_t, delta_t = (vec_f2.at[wg, j] for j in range(4))
    lo_s, hi_s = vec_i2.at[wg, 0], vec_i2.at[wg, 1]
    copies = (*_tile_boxes(q_g, q_smem, b, h, t, tq, groups),
              *_tile_boxes(do_g, do_smem, b, h, t, tq, groups),
              (lse_g.at[b, h, rows], lse_s), (delta_g.at[b, h, rows], delta_s),
              (lse_g.at[b, h, rows], lse_t), (delta_g.at[b, h, rows], delta_t),
              (lo_g.at[b, rows], lo_s), (hi_g.at[b, rows], hi_s),
              (kb_g.at[b, own, h], kb_smem), (vb_g.at[b, own, h], vb_smem))
    _copy_in(copies, in_bars, wg * n_in)
    lse_c, delta_c, lo, hi = (_vec(r, 0, interpret) for r in (lse_s, delta_s, lo_s, hi_s))
    lse_r, delta_r = (_vec(r, 1, interpret) for r in (lse_t, delta_t))
    block_mask = lambda keys_first: _own_block_mask(
        keys_first=keys_first, tq=tq, kp=kp, k_real=k_real, causal=causal,
        interpret=interpret)

    # The own blocks: dQ's share, and their dK and dV.
    dq = _own_block_grads(mms, q_smem, do_smem, kb_smem, vb_smem, lse_c, delta_c, lse_r,
                          delta_r, block_mask, qk_scale=qk_scale, scale=scale, dtype=dtype)
    plgpu.commit_smem()

    @pl.when(store)
    def _():
      plgpu.copy_smem_to_gmem(kb_smem.at[pl.ds(0, tq)], dkb_g.at[b, pl.ds(t * tq, tq), h])
      plgpu.copy_smem_to_gmem(vb_smem.at[pl.ds(0, tq)], dvb_g.at[b, pl.ds(t * tq, tq), h])

    int_lo, int_hi = ranges_g[b, t, 1], ranges_g[b, t, 2]
    st = (ROWS, tk)
    pl.when(wg == 1)(take_turn)

    def step(j, dq):
      slot = lax.rem(j, stages)
      kt = kt_lo + j
      k_t, v_t = k_smem.at[slot], v_smem.at[slot]
      plgpu.barrier_wait(k_bars.at[slot])
      plgpu.barrier_wait(v_bars.at[slot])
      s, dp = mms(Mm(q_smem, k_t, st, rhs_t=True), Mm(do_smem, v_t, st, rhs_t=True),
                  between=take_turn)
      plgpu.barrier_arrive(v_free.at[slot])
      s = _mask_edge_tile(s * qk_scale, (kt >= int_lo) & (kt < int_hi),
                          lambda: _ctx_seen(kt, tk, lo, hi, interpret))
      ds = (jnp.exp2(s - rows_of(lse_c, st)) * (dp - rows_of(delta_c, st))).astype(dtype)
      dq, ds = lax.optimization_barrier((dq, ds))
      plgpu.barrier_arrive(turn)                 # done with the elementwise part
      plgpu.barrier_wait(turn)                   # the tensor cores are free
      dq, = mms(Mm(ds, k_t, (ROWS, d), acc=dq))
      plgpu.barrier_arrive(k_free.at[slot])
      return dq

    dq = lax.fori_loop(0, n, step, dq)
    pl.when(wg == 0)(take_turn)
    q_smem[...] = (dq * scale).astype(dtype)          # the q tile's buffer holds dQ
    plgpu.commit_smem()

    @pl.when(store)
    def _():
      _store_tile(dq_g, q_smem, b, h, t, tq, groups)
    plgpu.wait_smem_to_gmem(0)

  tile = plgpu.SMEM((2, ROWS, d), dtype, transforms=_swizzled())
  scratch = (tile, tile, tile, tile, plgpu.SMEM((2, 4, ROWS), jnp.float32),
             plgpu.SMEM((2, 2, ROWS), jnp.int32), plgpu.Barrier(num_barriers=2 * n_in))
  _warp_specialised(compute, scratch, pair_ranges_g, kc_g, vc_g, n_kt=n_kt, n_tiles=n_tiles,
                    tk=tk, stages=stages, interpret=interpret)


def _dkv_kernel(ranges_g, lo_g, hi_g, q_g, do_g, lse_g, delta_g, kc_g, vc_g, dk_g, dv_g, *,
                tk, tq, groups, qk_scale, scale, n_qt, stages, interpret):
  """dK, dV of one context key tile over the query tiles that may see it (keys first, [TK, R]:
  the contraction over rows sums the G query heads), query tiles streamed through `stages` SMEM
  slots: each tile's q and dO arrive as G boxes each (_tile_boxes) with its lse, delta, lo and hi
  on one barrier, and a slot is reloaded as soon as its step's products are done."""
  j, h, b = lax.axis_index("k"), lax.axis_index("h"), lax.axis_index("b")
  d = q_g.shape[-1]
  dtype = q_g.dtype
  keys = pl.ds(j * tk, tk)
  st = (tk, ROWS)
  cols_of = lambda x: lax.broadcast_in_dim(x, st, [1])

  mms = lambda *ops: _mms(*ops, interpret=interpret)

  def scoped(k_smem, v_smem, q_s, do_s, lse_s, delta_s, lo_s, hi_s, kv_bars, landed):
    plgpu.copy_gmem_to_smem(kc_g.at[b, keys, h], k_smem, kv_bars.at[0])
    plgpu.copy_gmem_to_smem(vc_g.at[b, keys, h], v_smem, kv_bars.at[1])
    qa = jnp.minimum(ranges_g[b, j, 0], n_qt - 1)
    n = jnp.maximum(ranges_g[b, j, 3] - qa, 1)
    ia, ib = ranges_g[b, j, 1], ranges_g[b, j, 2]
    key_ids = j * tk + _iota(st, 0, interpret)

    def load(idx, slot):             # query tile qa + idx into a slot, on its barrier
      t = qa + idx
      rows = pl.ds(t * ROWS, ROWS)
      copies = (*_tile_boxes(q_g, q_s.at[slot], b, h, t, tq, groups),
                *_tile_boxes(do_g, do_s.at[slot], b, h, t, tq, groups),
                (lse_g.at[b, h, rows], lse_s.at[slot]), (delta_g.at[b, h, rows], delta_s.at[slot]),
                (lo_g.at[b, rows], lo_s.at[slot]), (hi_g.at[b, rows], hi_s.at[slot]))
      for src, dst in copies:
        plgpu.copy_gmem_to_smem(src, dst, landed.at[slot])

    for idx in range(stages):
      pl.when(idx < n)(lambda idx=idx: load(idx, idx))
    plgpu.barrier_wait(kv_bars.at[0])
    plgpu.barrier_wait(kv_bars.at[1])

    def step(idx, carry):
      dk, dv = carry
      slot = lax.rem(idx, stages)
      t = qa + idx
      q_smem, do_smem = q_s.at[slot], do_s.at[slot]
      plgpu.barrier_wait(landed.at[slot])
      # per column of the keys-first [TK, R] tile (query rows)
      lse, delta = (_vec(r.at[slot], 1, interpret) for r in (lse_s, delta_s))

      def seen():
        lo, hi = (_vec(r.at[slot], 1, interpret) for r in (lo_s, hi_s))
        return (key_ids >= cols_of(lo)) & (key_ids < cols_of(hi))
      sT, dpT = mms(Mm(k_smem, q_smem, st, rhs_t=True), Mm(v_smem, do_smem, st, rhs_t=True))
      sT = _mask_edge_tile(sT * qk_scale, (t >= ia) & (t < ib), seen)
      pT = jnp.exp2(sT - cols_of(lse))
      dsT = pT * (dpT - cols_of(delta))
      dk, dv = mms(Mm(dsT.astype(dtype), q_smem, (tk, d), acc=dk, lhs_array=True),
                   Mm(pT.astype(dtype), do_smem, (tk, d), acc=dv, lhs_array=True))
      # The slot's products are done (_mms waited for them): it takes tile idx + stages.
      pl.when(idx + stages < n)(lambda: load(idx + stages, slot))
      return dk, dv

    zeros = _zeros((tk, d), interpret)
    dk, dv = lax.fori_loop(0, n, step, (zeros, zeros))
    k_smem[...] = (dk * scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_g.at[b, keys, h])
    plgpu.copy_smem_to_gmem(v_smem, dv_g.at[b, keys, h])
    plgpu.wait_smem_to_gmem(0)

  tile = lambda *shape: plgpu.SMEM((*shape, d), dtype, transforms=_swizzled())
  vec = lambda dt: plgpu.SMEM((stages, ROWS), dt)
  pl.run_scoped(scoped, tile(tk), tile(tk), tile(stages, ROWS), tile(stages, ROWS),
                vec(jnp.float32), vec(jnp.float32), vec(jnp.int32), vec(jnp.int32),
                plgpu.Barrier(num_barriers=2),
                plgpu.Barrier(num_arrivals=2 * groups + 4, num_barriers=stages))


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


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles of the Mosaic GPU kernels: context keys per pipeline step of the forward and dQ kernels
  (64 or 128; a query tile is always one warpgroup's 64 rows, a dK/dV tile 64 keys) and each
  kernel's pipeline depth (steps in flight, 2-4; SMEM per stage at head size 128: 32 KB for the
  forward's and dQ's 64-key K/V tiles, 64 KB for 128 keys, 32 KB for dK/dV's q/dO tiles)."""
  fwd_keys: int = 64
  fwd_stages: int = 2
  dq_keys: int = 64
  dq_stages: int = 2
  dkv_stages: int = 2
  # 2: the warp-specialised forward (two 64-row tiles a CTA, a TMA warpgroup streaming K/V to
  # both). One H100, 2026-12-06, fwd+bwd useful TF/s with 1 / 2: sliding 8k 307-311 / 320, full
  # 64k 345 / 381 (Triton 257-261, 354-361): benchmarks/h100-2026-12-06-mosaic-default
  fwd_warpgroups: int = 2
  dq_warpgroups: int = 1      # 2: the warp-specialised dQ kernel

  def __post_init__(self):
    for name in ("fwd_warpgroups", "dq_warpgroups"):
      if getattr(self, name) not in (1, 2):
        raise ValueError(f"{name}={getattr(self, name)} must be 1 or 2")
    for name in ("fwd_keys", "dq_keys"):
      if getattr(self, name) not in (64, 128):
        raise ValueError(f"{name}={getattr(self, name)} must be 64 or 128")
    for name in ("fwd_stages", "dq_stages", "dkv_stages"):
      if getattr(self, name) not in (2, 3, 4):
        raise ValueError(f"{name}={getattr(self, name)} must be 2, 3 or 4")


@dataclasses.dataclass(frozen=True)
class _Static(tri._Static):
  """The Triton kernels' static settings (their backward may take this forward's outputs) and the
  Mosaic GPU kernels' tiles."""
  tiles: MosaicConfig = MosaicConfig()


def _keys_per_step(plan, keys: int) -> int:
  """A kernel's context keys per step: its configured tile where the padded context is a
  multiple of it (the plan pads to the Triton tiles' multiple), else 64."""
  return keys if plan.Sp % keys == 0 else KEYS


class _Geometry(NamedTuple):
  plan: tri._Plan
  tq: int                 # query tokens of a 64-row tile
  lo: jax.Array           # per query token [B, Qp]: visible context [lo, hi)
  hi: jax.Array
  lo_r: jax.Array         # per row [B, Qp * G] (_tile_rows' order)
  hi_r: jax.Array
  ranges: jax.Array       # per query tile [B, Qp // tq, 4]: its tk-key tiles (triton._q_tile_ranges)
  any_row: jax.Array


def _geometry(st, q_shape, kc_shape, anchors, doc_start, valid, tk=KEYS) -> _Geometry:
  """Row bounds and each 64-row query tile's range of tk-key context tiles."""
  G = q_shape[2] // kc_shape[2]
  tq = ROWS // G
  plan = tri._plan(st, q_shape, kc_shape)
  if plan.Sp % KEYS or (plan.Np * plan.Kp) % tq:
    raise NotImplementedError(f"{kc_shape[1]} context keys or {q_shape[1]} queries: fewer than "
                              f"one tile ({KEYS} keys, {tq} queries)")
  lo, hi = tri._row_bounds(anchors, doc_start, valid, plan=plan, window=st.window)
  ranges, any_row = tri._q_tile_ranges(lo, hi, tq=tq, tk=tk)
  lo_r, hi_r = (_tile_rows(jnp.repeat(x[:, :, None], G, axis=2), tq, G)[:, 0] for x in (lo, hi))
  return _Geometry(plan, tq, lo, hi, lo_r, hi_r, ranges, any_row)


def _pair_ranges(geo, n_tiles, tk):
  """Key-tile ranges [B, ceil(n_tiles / 2), 4] of the query-tile pairs (2i, 2i + 1) of a
  warp-specialised kernel (the union of the two tiles' ranges); an odd last tile is paired with
  padding rows."""
  pad = (n_tiles % 2) * geo.tq
  lo2, hi2 = (jnp.pad(x, ((0, 0), (0, pad)), constant_values=c)
              for x, c in ((geo.lo, tri._NO_ROW), (geo.hi, 0)))
  return tri._q_tile_ranges(lo2, hi2, tq=2 * geo.tq, tk=tk)[0]


def _tile_rows(x, tq, G):
  """One value per query token and head [B, Qp, Hq] -> per row [B, Hkv, Qp * G] in this module's
  row order: 64-row tiles of tq tokens, a tile's row g * tq + t for its token t and head g of the
  KV head (_tile_boxes)."""
  B, Qp, Hq = x.shape
  x = x.reshape(B, Qp // tq, tq, Hq // G, G).transpose(0, 3, 1, 4, 2)
  return x.reshape(B, Hq // G, Qp * G)


def _triton_rows(x, tq, G, *, inverse=False):
  """[B, Hkv, Qp * G] per row: this module's row order -> the Triton kernels' (row t * G + g of
  token t; inverse: the other way). The lse crosses between the two backwards this way."""
  B, Hkv, R = x.shape
  inner = (tq, G) if inverse else (G, tq)
  return x.reshape(B, Hkv, R // (tq * G), *inner).swapaxes(3, 4).reshape(B, Hkv, R)


def _pad_own_keys(x, plan, tq):
  """[B, Qp, Hkv, D] -> padded by 64 - tq (rounded to 64) on the token axis: a tile reads its own
  blocks' keys as one 64-key box, the TMA tiling the key axis by 64."""
  Qp = plan.Np * plan.Kp
  extra = tri._round_up(Qp + ROWS - tq, ROWS) - Qp
  return jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))


def _params(st, name):
  """plgpu.kernel's arguments; the kernels take the Triton kernels' names (dflash_fwd, ...), which
  the memory report looks for in the compiled step."""
  return dict(compiler_params=plgpu.CompilerParams(approx_math=True),
              interpret=_interpret_params(st.interpret), kernel_name=name)


def _forward(q, kc, vc, kb, vb, anchors, doc_start, valid, st):
  """-> (out, out_p padded [B, Qp, Hq, D], lse base 2 [B, Hkv, Qp * G]) in the layouts of
  triton._forward (its backward reads them). The kernels read q, K and V and write out where the
  caller's arrays are ([B, tokens, heads, D]): no transposed copies (the Triton kernels' way)."""
  B, _, Hq, D = q.shape
  Hkv = kc.shape[2]
  G = Hq // Hkv
  tk = _keys_per_step(tri._plan(st, q.shape, kc.shape), st.tiles.fwd_keys)
  geo = _geometry(st, q.shape, kc.shape, anchors, doc_start, valid, tk)
  plan, tq = geo.plan, geo.tq
  q_p = tri._pad_blocks(q, plan)
  kc_p, vc_p = (tri._pad_keys(x, plan) for x in (kc, vc))
  kb_p, vb_p = (_pad_own_keys(tri._pad_blocks(x, plan), plan, tq) for x in (kb, vb))
  Qp = q_p.shape[1]
  n_tiles = Qp // tq
  out_type = (jax.ShapeDtypeStruct(q_p.shape, q.dtype),
              jax.ShapeDtypeStruct((B, Hkv, Qp * G), jnp.float32))
  kw = dict(tq=tq, tk=tk, groups=G, kp=plan.Kp, k_real=st.block_size,
            causal=st.window is not None, qk_scale=st.scale * math.log2(math.e),
            n_kt=plan.Sp // tk, stages=st.tiles.fwd_stages, interpret=st.interpret)
  args = (geo.ranges, geo.lo_r, geo.hi_r, q_p, kc_p, vc_p, kb_p, vb_p)
  if st.tiles.fwd_warpgroups == 2:
    out_p, lse = plgpu.kernel(
        lambda *refs: _forward_ws_kernel(*refs, n_tiles=n_tiles, **kw), out_type=out_type,
        grid=(-(-n_tiles // 2), Hkv, B), grid_names=("q", "h", "b"), num_threads=3,
        thread_name="wg", **_params(st, "dflash_fwd"))(_pair_ranges(geo, n_tiles, tk), *args)
  else:
    out_p, lse = plgpu.kernel(
        lambda *refs: _forward_kernel(*refs, **kw), out_type=out_type,
        grid=(n_tiles, Hkv, B), grid_names=("q", "h", "b"), **_params(st, "dflash_fwd"))(*args)
  return tri._unpad_blocks(out_p, plan), out_p, _triton_rows(lse, tq, G)


def _backward(st, res, dout):
  """The Mosaic GPU dQ (+ own-block dK/dV) and context dK/dV kernels: triton._dflash_bwd's
  contract, from the forward's padded output and base-2 lse. As the forward, the kernels read
  and write the caller's layouts."""
  q, kc, vc, kb, vb, anchors, doc_start, valid, out_p, lse = res
  B, _, Hq, D = q.shape
  Hkv = kc.shape[2]
  G = Hq // Hkv
  geo = _geometry(st, q.shape, kc.shape, anchors, doc_start, valid)     # 64-key tiles (dK/dV)
  plan, tq = geo.plan, geo.tq
  tk_dq = _keys_per_step(plan, st.tiles.dq_keys)
  ranges_dq = _geometry(st, q.shape, kc.shape, anchors, doc_start, valid, tk_dq).ranges
  q_p, do_p = (tri._pad_blocks(x.astype(q.dtype), plan) for x in (q, dout))
  # D_r = sum_d dO * O per row, one fused XLA reduction, in the kernels' row order.
  delta = _tile_rows(jnp.sum(do_p.astype(jnp.float32) * out_p.astype(jnp.float32), -1), tq, G)
  lse = _triton_rows(lse, tq, G, inverse=True)
  kc_p, vc_p = (tri._pad_keys(x, plan) for x in (kc, vc))
  kb_p, vb_p = (_pad_own_keys(tri._pad_blocks(x, plan), plan, tq) for x in (kb, vb))
  Qp, n_kt = q_p.shape[1], plan.Sp // KEYS
  n_tiles = Qp // tq
  qk_scale = st.scale * math.log2(math.e)
  blk = jax.ShapeDtypeStruct((B, Qp, Hkv, D), q.dtype)
  kw = dict(tq=tq, tk=tk_dq, groups=G, kp=plan.Kp, k_real=st.block_size,
            causal=st.window is not None, qk_scale=qk_scale, scale=st.scale,
            n_kt=plan.Sp // tk_dq, stages=st.tiles.dq_stages, interpret=st.interpret)
  out_type = (jax.ShapeDtypeStruct(q_p.shape, q.dtype), blk, blk)
  args = (ranges_dq, geo.lo_r, geo.hi_r, q_p, do_p, lse, delta, kc_p, vc_p, kb_p, vb_p)
  if st.tiles.dq_warpgroups == 2:
    dq, dkb, dvb = plgpu.kernel(
        lambda *refs: _dq_ws_kernel(*refs, n_tiles=n_tiles, **kw), out_type=out_type,
        grid=(-(-n_tiles // 2), Hkv, B), grid_names=("q", "h", "b"), num_threads=3,
        thread_name="wg", **_params(st, "dflash_bwd_dq"))(_pair_ranges(geo, n_tiles, tk_dq), *args)
  else:
    dq, dkb, dvb = plgpu.kernel(
        lambda *refs: _dq_kernel(*refs, **kw), out_type=out_type,
        grid=(n_tiles, Hkv, B), grid_names=("q", "h", "b"),
        **_params(st, "dflash_bwd_dq"))(*args)
  k_ranges = tri._k_tile_ranges(geo.ranges, geo.any_row, nkt=n_kt)
  ctx = jax.ShapeDtypeStruct(kc_p.shape, q.dtype)
  dkc, dvc = plgpu.kernel(
      lambda *refs: _dkv_kernel(*refs, tk=KEYS, tq=tq, groups=G, qk_scale=qk_scale,
                                scale=st.scale, n_qt=n_tiles, stages=st.tiles.dkv_stages,
                                interpret=st.interpret),
      out_type=(ctx, ctx), grid=(n_kt, Hkv, B), grid_names=("k", "h", "b"),
      **_params(st, "dflash_bwd_dkv"))(k_ranges, geo.lo_r, geo.hi_r, q_p, do_p, lse, delta, kc_p,
                                       vc_p)
  S = plan.S
  blocks = lambda x: tri._unpad_blocks(x, plan)
  return (blocks(dq), dkc[:, :S], dvc[:, :S], blocks(dkb), blocks(dvb), None, None, None)


# Interpreted (CPU), the Triton kernels' tiles are those of the Mosaic GPU ones, so that the plan's
# padding (triton._plan) fits both: keys a multiple of 64, queries of a 64-row tile.
_INTERPRET = tri.config_lib.DFlashConfig(fwd_rows=ROWS, fwd_keys=KEYS, dq_rows=ROWS,
                                         dq_keys=KEYS, dkv_rows=ROWS, dkv_keys=KEYS)


def _static(q, block_size, window, scale, config, interpret, tiles=None) -> _Static:
  D = q.shape[-1]
  if interpret and config is None:
    config = _INTERPRET
  base = tri.make_static(block_size=block_size, window=window,
                         scale=D ** -0.5 if scale is None else scale, head_dim=D, dtype=q.dtype,
                         config=config, interpret=interpret)
  return _Static(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                 tiles=tiles or MosaicConfig())


def dflash_forward_mosaic(q, kc, vc, kb, vb, anchors, doc_start, valid, *, block_size: int,
                          window: int | None = None, scale: float | None = None, config=None,
                          interpret: bool = False, tiles: MosaicConfig | None = None):
  """-> (out [B, N*K, Hq, D], lse base 2 [B, Hkv, Qp * G]) as the Triton forward's with the same
  config (default: the device's preset). Shapes as api.dflash_attention's; bf16 or f16,
  G = Hq // Hkv dividing 64 into whole padded blocks, head size a power of two >= 64. interpret:
  JAX's Mosaic GPU interpreter on a CPU (slow; for tests)."""
  _check(q, kc, block_size)
  st = _static(q, block_size, window, scale, config, interpret, tiles)
  out, _, lse = _forward(q, kc, vc, kb, vb, anchors.astype(jnp.int32),
                         doc_start.astype(jnp.int32), valid.astype(jnp.bool_), st)
  return out, lse


# The Triton dQ and dK/dV kernels read this forward's padded output and lse as their own.
_attention = tri.with_triton_backward(_forward)


_attention_mgpu = tri.differentiable(_forward, _backward)


def _fit_groups(Hq: int, Hkv: int, block_size: int) -> int:
  """-> r: each KV head repeated r times so that a 64-row tile holds whole blocks of the
  G // r query heads each repeat serves (G = 3, SmolLM2's 9 / 3 heads: r = 3; G = 8 with blocks
  of 16: r = 2). Raises NotImplementedError where no repeat fits (a block longer than 64)."""
  if Hkv == 0 or Hq % Hkv:
    raise ValueError(f"query heads {Hq} must be a multiple of the KV heads {Hkv}")
  G, Kp = Hq // Hkv, tri._next_pow2(block_size)
  for g in range(G, 0, -1):
    if G % g == 0 and ROWS % g == 0 and (ROWS // g) % Kp == 0:
      return G // g
  raise NotImplementedError(f"blocks of {block_size}: a tile of {ROWS} rows cannot hold one")


def dflash_attention_mosaic(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, *,
                            block_size: int, window: int | None = None,
                            scale: float | None = None, config=None, backward: str = "triton",
                            interpret: bool = False, tiles: MosaicConfig | None = None):
  """DFlash attention (api.dflash_attention's contract) with the Mosaic GPU forward.

  backward: "triton" (the Triton dQ and dK/dV kernels; config: their tiles, default the
  device's preset) or "mosaic" (this module's dQ and dK/dV kernels). interpret: every kernel
  interpreted on a CPU (JAX's Mosaic GPU and Pallas-Triton interpreters; slow, for tests).
  tiles: the Mosaic GPU kernels' MosaicConfig (default: 64-key steps, 2 stages). As the Triton kernel's entry point: KV heads are repeated where a tile could not hold whole
  blocks of a KV head's query heads (the repeat's VJP sums the partial dK/dV, so gradients are
  exact), and head sizes below 64 or not a power of two are zero-padded (the softmax scale stays
  that of the real size). bf16 / f16 inputs, head sizes up to 128, blocks up to 64.
  Raises NotImplementedError for what it does not take (the caller may fall back)."""
  if backward not in ("triton", "mosaic"):
    raise ValueError(f"backward={backward!r} must be 'triton' or 'mosaic'")
  B, Q, Hq, D = q.shape
  if len({x.dtype for x in (q, k_ctx, v_ctx, k_blk, v_blk)}) != 1:
    raise NotImplementedError("q, k_ctx, v_ctx, k_blk, v_blk must share one dtype")
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise NotImplementedError(f"{q.dtype} inputs: the Mosaic GPU kernels take bf16 or f16")
  Dp = max(KEYS, tri._next_pow2(D))
  if Dp > 128:
    raise NotImplementedError(f"head size {D}: the Mosaic GPU kernels take up to 128")
  r = _fit_groups(Hq, k_ctx.shape[2], block_size)
  kv = (k_ctx, v_ctx, k_blk, v_blk)
  if r > 1:                            # KV head j // r serves query heads [j * g, (j + 1) * g)
    kv = tuple(jnp.repeat(x, r, axis=2) for x in kv)
  if Dp != D:
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, Dp - D)))
    q, kv = pad(q), tuple(pad(x) for x in kv)
  _check(q, kv[0], block_size)
  st = _static(q, block_size, window, D ** -0.5 if scale is None else scale, config, interpret,
               tiles)
  fn = _attention if backward == "triton" else _attention_mgpu
  out = fn(q, *kv, anchors.astype(jnp.int32), doc_start.astype(jnp.int32),
           block_valid.astype(jnp.bool_), st)
  return out[..., :D] if Dp != D else out
