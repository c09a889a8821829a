"""The Mosaic GPU kernels (pallas_kernels/dflash_attention/mosaic_gpu.py).

On a CPU: under JAX's Mosaic GPU interpreter, the forward, the dQ and the dK/dV kernels equal the
reference on the mask's edge cases (anchor 0, equal and overlapping anchors, the row's end, window
1, document boundaries, a row without a valid block) for each group size a tile takes (G = 1, 2,
4); they lower for CUDA (Mosaic GPU's layout inference and TMA shape checks run there), also under
the custom VJP with the Triton backward, and refuse the shapes they do not take. On a GPU
(pytest -m gpu): its out and base-2 lse equal the Triton forward's and the reference's on the
suite's cases that fit it (blocks of 16, bf16), and so do the gradients through the Triton
backward and through the Mosaic GPU dQ and dK/dV kernels."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dflash_attention import mosaic_gpu as mg
from pallas_kernels.dflash_attention import reference
from pallas_kernels.dflash_attention import triton as dflash_triton
from tests.pallas_kernels.test_dflash_attention import (TOLERANCES, Case, _assert_close, _has_gpu,
                                                        make_inputs)


def _args(block_size, head_dim, Hq, Hkv, N=8, S=300, dtype=jnp.bfloat16):
  sd = jax.ShapeDtypeStruct
  Q = N * block_size
  return (sd((1, Q, Hq, head_dim), dtype), sd((1, S, Hkv, head_dim), dtype),
          sd((1, S, Hkv, head_dim), dtype), sd((1, Q, Hkv, head_dim), dtype),
          sd((1, Q, Hkv, head_dim), dtype), sd((1, N), jnp.int32), sd((1, N), jnp.int32),
          sd((1, N), jnp.bool_))


@pytest.mark.parametrize("head_dim,window,Hq,Hkv", [
    (128, 2048, 32, 8), (64, None, 8, 2), (128, None, 4, 2), (64, 1, 4, 4)])
@pytest.mark.parametrize("warpgroups", [1, 2])
def test_forward_lowers_for_cuda(head_dim, window, Hq, Hkv, warpgroups):
  tiles = mg.MosaicConfig(fwd_warpgroups=warpgroups)
  fwd = lambda *x: mg.dflash_forward_mosaic(*x, block_size=16, window=window, tiles=tiles)
  text = jax.jit(fwd).trace(*_args(16, head_dim, Hq, Hkv)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text, "no Mosaic GPU kernel in the lowered program"


@pytest.mark.parametrize("head_dim,window,Hq,Hkv", [
    (128, 2048, 32, 8), (64, None, 8, 2), (128, None, 4, 2), (64, 1, 4, 4),
    (64, None, 9, 3)])      # the GPU recipe's drafter (SmolLM2's heads): KV heads repeated
def test_mosaic_backward_lowers_for_cuda(head_dim, window, Hq, Hkv):
  """backward="mosaic": the forward, dQ and dK/dV are all Mosaic GPU kernels; no Triton one."""
  def loss(*x):
    out = mg.dflash_attention_mosaic(*x, block_size=16, window=window, backward="mosaic")
    return jnp.sum(out.astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(
      *_args(16, head_dim, Hq, Hkv)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3, "fewer than three Mosaic GPU kernels"
  assert "__gpu$xla.gpu.triton" not in text, "a Triton kernel ran"


@pytest.mark.parametrize("head_dim,window,Hq,Hkv,N", [
    (128, 2048, 32, 8, 8), (64, None, 8, 2, 8), (64, 1, 4, 4, 12), (128, None, 4, 2, 8),
    (64, None, 9, 3, 8)])
@pytest.mark.parametrize("stages", [2, 3])
def test_warp_specialised_kernels_lower_for_cuda(head_dim, window, Hq, Hkv, N, stages):
  """fwd_warpgroups=2, dq_warpgroups=2: two compute warpgroups and a TMA warpgroup in the
  forward and dQ kernels (N = 12 with G = 1: an odd number of 64-row tiles, the last CTA's
  second warpgroup repeating the last tile), within an SM's shared memory (dQ's 3 stages at
  head size 128 exceed it by 264 bytes: 2 there)."""
  tiles = mg.MosaicConfig(fwd_warpgroups=2, dq_warpgroups=2, fwd_stages=stages,
                          dq_stages=stages if head_dim < 128 else 2)
  def loss(*x):
    out = mg.dflash_attention_mosaic(*x, block_size=16, window=window, backward="mosaic",
                                     tiles=tiles)
    return jnp.sum(out.astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(
      *_args(16, head_dim, Hq, Hkv, N=N)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3, "fewer than three Mosaic GPU kernels"


@pytest.mark.parametrize("tiles", [
    dict(fwd_keys=128, dq_keys=128, dkv_stages=3, fwd_warpgroups=1),
    dict(fwd_stages=4, dq_stages=4, dkv_stages=4, fwd_warpgroups=1)], ids=str)
def test_tile_variants_lower_for_cuda(tiles):
  def loss(*x):
    out = mg.dflash_attention_mosaic(*x, block_size=16, window=2048, backward="mosaic",
                                     tiles=mg.MosaicConfig(**tiles))
    return jnp.sum(out.astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(
      *_args(16, 128, 32, 8, S=1024)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3


def test_one_warpgroup_tiles_fit_two_ctas_per_sm(monkeypatch):
  """At head size 128 every one-warpgroup kernel's shared memory (counted by Mosaic GPU's
  lowering) leaves room for a second tile's CTA on the SM (228 KB, 1 KB reserved per CTA): a
  warpgroup waiting on its wgmma or softmax then overlaps with another. 128-key steps or 3 stages
  do not fit twice. (The default's warp-specialised forward runs two tiles in one CTA.)"""
  import jax.experimental.mosaic.gpu.core as mgpu_core
  if not hasattr(mgpu_core, "_SMEM_SIZE_BOUND"):
    pytest.skip("this JAX's Mosaic GPU has no shared-memory bound to set")
  monkeypatch.setattr(mgpu_core, "_SMEM_SIZE_BOUND", 113 * 1024)

  def loss(tiles, *x):
    out = mg.dflash_attention_mosaic(*x, block_size=16, window=2048, backward="mosaic",
                                     tiles=tiles)
    return jnp.sum(out.astype(jnp.float32))
  lower = lambda tiles: jax.jit(jax.grad(lambda *x: loss(tiles, *x), argnums=(0, 1, 2, 3, 4))).trace(
      *_args(16, 128, 32, 8, S=1024)).lower(lowering_platforms=("cuda",))
  lower(mg.MosaicConfig(fwd_warpgroups=1))
  with pytest.raises(Exception, match="exceeds available shared memory"):
    lower(mg.MosaicConfig(fwd_stages=3, dq_stages=3, fwd_warpgroups=1))


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_the_kernels_make_no_transposed_copy_of_the_tensors(warpgroups):
  """The forward, dQ and dK/dV kernels read q, K, V, dO and write out, dQ, dK, dV in the caller's
  [B, tokens, heads, D] layout (a query tile as G TMA boxes): the lowered forward + backward at
  the 27B's heads moves no 16-bit tensor, only per-row bounds and softmax statistics (1 / D of
  q's size). Before 3208080 the forward + backward made 17 transposed copies (heads first, and
  back), ~1.9 GB of traffic at the bench's sliding 8k: ~0.6 ms of its 6 by their bytes alone."""
  tiles = mg.MosaicConfig(fwd_warpgroups=warpgroups, dq_warpgroups=warpgroups)

  def loss(*x):
    out = mg.dflash_attention_mosaic(*x, block_size=16, window=2048, backward="mosaic",
                                     tiles=tiles)
    return jnp.sum(out.astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(
      *_args(16, 128, 32, 8, N=64, S=1024)).lower(lowering_platforms=("cuda",)).as_text()
  moved = re.findall(r"stablehlo\.transpose .*-> tensor<([0-9x]+)x(\w+)>", text)
  assert moved, "the per-row bookkeeping's reorders are gone: is this still the lowered program?"
  copies = [f"{shape}x{dt}" for shape, dt in moved if dt in ("bf16", "f16")]
  assert not copies, f"transposed copies of 16-bit tensors: {copies}"


def test_forward_and_triton_backward_lower_for_cuda():
  """dflash_attention_mosaic: the Mosaic GPU forward under a custom VJP whose backward is the
  Triton dQ and dK/dV kernels, fed the forward's padded output and lse."""
  def loss(*x):
    out = mg.dflash_attention_mosaic(*x, block_size=16, window=2048)
    return jnp.sum(out.astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*_args(16, 128, 32, 8)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text, "no Mosaic GPU kernel in the lowered program"
  # the Triton calls' names (the Mosaic GPU kernels have the same names, elsewhere in the text)
  triton_calls = re.findall(r'name = "(dflash\w*)"', text)
  assert sorted(triton_calls) == ["dflash_bwd_dkv", "dflash_bwd_dq"], triton_calls


@pytest.mark.parametrize("block_size,head_dim,Hq,Hkv,dtype", [
    (16, 128, 16, 2, jnp.bfloat16),    # G = 8: a 64-row tile would hold half a block
    (16, 80, 4, 2, jnp.bfloat16),      # head size not a multiple of 64
    (16, 192, 4, 2, jnp.bfloat16),     # not a power of two: the Triton backward's head sizes
    (16, 64, 4, 2, jnp.float32)])
def test_shapes_it_does_not_take_are_refused(block_size, head_dim, Hq, Hkv, dtype):
  x = [jnp.zeros(a.shape, a.dtype) for a in _args(block_size, head_dim, Hq, Hkv, dtype=dtype)]
  with pytest.raises(NotImplementedError):
    mg.dflash_forward_mosaic(*x, block_size=block_size)


# Small: the interpreter simulates every warpgroup, barrier and copy on the CPU (10-25 s a case).
INTERPRET_CASES = [
    Case(window=24, hq=4, hkv=4, head_dim=64, dtype="bfloat16", blocks=12, seq_len=200,
         anchors="edges", docs=4),                                   # G = 1
    Case(window=1, hq=4, hkv=2, head_dim=64, dtype="bfloat16", blocks=8, seq_len=150,
         anchors="edges", docs=1),                                   # G = 2, window 1
    Case(window=256, hq=8, hkv=2, head_dim=64, dtype="bfloat16", batch=2, blocks=16,
         seq_len=300, docs=3, invalid_row=True),                     # G = 4
    Case(hq=8, hkv=2, head_dim=128, dtype="bfloat16", blocks=8, seq_len=200, docs=2),  # full
]


@pytest.mark.parametrize("case,warpgroups", [
    *((c, 1) for c in INTERPRET_CASES),
    # the warp-specialised forward and dQ: the first case has 3 tiles (the last CTA's second
    # warpgroup repeats tile 2 and stores nothing)
    (INTERPRET_CASES[0], 2), (INTERPRET_CASES[2], 2)], ids=str)
def test_interpreted_kernels_match_the_reference(case, warpgroups):
  """Forward (out and base-2 lse) and all five gradients through the Mosaic GPU dQ and dK/dV
  kernels, interpreted on the CPU, against reference.py in f32; the lse also against the
  Triton forward's (the Triton backward reads it). warpgroups=2: the warp-specialised forward
  and dQ kernels (two compute warpgroups on tiles 2i, 2i + 1 and a TMA warpgroup; the
  interpreter runs the three as threads and checks that every barrier phase is observed)."""
  (q, kc, vc, kb, vb), idx = make_inputs(case, seed=7)
  kw = dict(block_size=case.block_size, window=case.window)
  tiles = mg.MosaicConfig(fwd_warpgroups=warpgroups, dq_warpgroups=warpgroups)
  ct = jax.random.normal(jax.random.PRNGKey(3), q.shape, jnp.float32)

  def fwd_bwd(fn, *x):
    out, vjp = jax.vjp(fn, *x)
    return out, vjp(ct.astype(out.dtype))
  out, grads = fwd_bwd(lambda *y: mg.dflash_attention_mosaic(
      *y, *idx, **kw, backward="mosaic", interpret=True, tiles=tiles), q, kc, vc, kb, vb)
  f32 = [x.astype(jnp.float32) for x in (q, kc, vc, kb, vb)]
  ref_out, ref = fwd_bwd(lambda *y: reference.dflash_attention_reference(*y, *idx, **kw), *f32)
  _assert_close(out, ref_out, what="out", **TOLERANCES["bfloat16"])
  for name, a, b in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), grads, ref):
    _assert_close(a, b, what=name, **TOLERANCES["bfloat16"])
  _, lse = mg.dflash_forward_mosaic(q, kc, vc, kb, vb, *idx, **kw, interpret=True, tiles=tiles)
  st = mg._static(q, case.block_size, case.window, None, None, True)
  _, _, tri_lse = dflash_triton._forward(q, kc, vc, kb, vb, *idx, st)
  real = np.asarray(tri_lse) < 1e29
  np.testing.assert_allclose(np.asarray(lse)[real], np.asarray(tri_lse)[real], atol=2e-2, rtol=1e-3)
  assert np.all(np.asarray(lse)[~real] > 1e29), "rows that see nothing must keep the empty lse"
  if warpgroups == 2:   # the same softmax statistics as the one-warpgroup forward's
    _, lse1 = mg.dflash_forward_mosaic(q, kc, vc, kb, vb, *idx, **kw, interpret=True)
    np.testing.assert_allclose(np.asarray(lse)[real], np.asarray(lse1)[real], atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("case", [
    # G = 6 = 2 x 3: each KV head repeated 3 times, a tile holds 2 heads x 2 blocks; head size
    # 80 zero-padded to 128
    Case(window=40, hq=6, hkv=1, head_dim=80, dtype="bfloat16", blocks=6, seq_len=120,
         anchors="edges", docs=2),
], ids=str)
def test_interpreted_entry_point_repeats_kv_heads_and_pads_head_size(case):
  (q, kc, vc, kb, vb), idx = make_inputs(case, seed=9)
  kw = dict(block_size=case.block_size, window=case.window)
  ct = jax.random.normal(jax.random.PRNGKey(5), q.shape, jnp.float32)
  fn = lambda *y: mg.dflash_attention_mosaic(*y, *idx, **kw, backward="mosaic", interpret=True)
  out, vjp = jax.vjp(fn, q, kc, vc, kb, vb)
  f32 = [x.astype(jnp.float32) for x in (q, kc, vc, kb, vb)]
  ref_out, ref_vjp = jax.vjp(lambda *y: reference.dflash_attention_reference(*y, *idx, **kw), *f32)
  assert out.shape == q.shape
  _assert_close(out, ref_out, what="out", **TOLERANCES["bfloat16"])
  for name, a, b in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), vjp(ct.astype(q.dtype)),
                        ref_vjp(ct)):
    _assert_close(a, b, what=name, **TOLERANCES["bfloat16"])


@pytest.mark.parametrize("block_size,head_dim,dtype", [
    (128, 64, jnp.bfloat16),      # a block longer than a 64-row tile
    (16, 256, jnp.bfloat16),      # head size above 128 (shared memory)
    (16, 64, jnp.float32)])
def test_entry_point_refuses_what_it_does_not_take(block_size, head_dim, dtype):
  x = [jnp.zeros(a.shape, a.dtype) for a in _args(block_size, head_dim, 4, 2, N=2, dtype=dtype)]
  with pytest.raises(NotImplementedError):
    mg.dflash_attention_mosaic(*x, block_size=block_size)


def test_interpreted_kernels_with_128_key_steps_and_deeper_pipelines():
  """MosaicConfig: 128 context keys a step in the forward and dQ, 3-4 stages in flight; the
  context padded to a multiple of 128 (the Triton tiles' plan), the same gradients."""
  import dataclasses
  case = INTERPRET_CASES[2]
  (q, kc, vc, kb, vb), idx = make_inputs(case, seed=11)
  kw = dict(block_size=case.block_size, window=case.window)
  tiles = mg.MosaicConfig(fwd_keys=128, fwd_stages=3, dq_keys=128, dq_stages=4, dkv_stages=3,
                          fwd_warpgroups=1)
  config = dataclasses.replace(mg._INTERPRET, dkv_keys=128)
  ct = jax.random.normal(jax.random.PRNGKey(6), q.shape, jnp.float32)
  fn = lambda *y: mg.dflash_attention_mosaic(*y, *idx, **kw, backward="mosaic", interpret=True,
                                             tiles=tiles, config=config)
  out, vjp = jax.vjp(fn, q, kc, vc, kb, vb)
  f32 = [x.astype(jnp.float32) for x in (q, kc, vc, kb, vb)]
  ref_out, ref_vjp = jax.vjp(lambda *y: reference.dflash_attention_reference(*y, *idx, **kw), *f32)
  _assert_close(out, ref_out, what="out", **TOLERANCES["bfloat16"])
  for name, a, b in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), vjp(ct.astype(q.dtype)),
                        ref_vjp(ct)):
    _assert_close(a, b, what=name, **TOLERANCES["bfloat16"])
  with pytest.raises(ValueError, match="fwd_keys"):
    mg.MosaicConfig(fwd_keys=32)


def test_api_runs_the_mosaic_implementation_by_name():
  """api.dflash_attention(implementation="mosaic", interpret=True) is these kernels: the same
  output as the xla implementation; a Triton backward cannot be asked of it."""
  from pallas_kernels.dflash_attention import api
  case = INTERPRET_CASES[1]
  (q, kc, vc, kb, vb), idx = make_inputs(case, seed=10)
  kw = dict(block_size=case.block_size, window=case.window)
  got = api.dflash_attention(q, kc, vc, kb, vb, *idx, **kw, implementation="mosaic",
                             interpret=True)
  want = api.dflash_attention(q, kc, vc, kb, vb, *idx, **kw, implementation="xla")
  _assert_close(got, want, what="out", **TOLERANCES["bfloat16"])
  with pytest.raises(ValueError, match="own backward"):
    api.dflash_attention(q, kc, vc, kb, vb, *idx, **kw, implementation="mosaic",
                         backward="triton", interpret=True)
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="Hopper GPU"):
      api.dflash_attention(q, kc, vc, kb, vb, *idx, **kw, implementation="mosaic")


def test_the_default_is_mosaic_on_hopper_triton_on_other_gpus(monkeypatch):
  """Unset, the implementation is the Mosaic GPU kernels on an sm_90 GPU at head sizes 64 and up
  (where they were timed), the Triton kernel there at smaller ones and on other GPUs, xla on a
  CPU."""
  from pallas_kernels.dflash_attention import api
  for gpu, hopper, want in ((True, True, ("mosaic", "mosaic", "mosaic", "triton")),
                            (True, False, ("triton",) * 4), (False, False, ("xla",) * 4)):
    monkeypatch.setattr(api, "_on_gpu", lambda gpu=gpu: gpu)
    monkeypatch.setattr(api, "_on_hopper", lambda hopper=hopper: hopper)
    got = tuple(api.default_implementation(*d) for d in ((), (128,), (64,), (32,)))
    assert got == want, (gpu, hopper)


def test_the_default_falls_back_to_triton_where_mosaic_does_not_take_the_inputs(monkeypatch,
                                                                                 caplog):
  """f32 inputs (Mosaic GPU takes bf16/f16) under the Hopper default run the Triton kernel, with a
  warning naming the reason; a Triton backward variant asked by name is Triton's too. Named,
  mosaic still refuses."""
  from pallas_kernels.dflash_attention import api
  case = INTERPRET_CASES[1]
  (q, kc, vc, kb, vb), idx = make_inputs(case, seed=11)
  x = tuple(v.astype(jnp.float32) for v in (q, kc, vc, kb, vb))
  kw = dict(block_size=case.block_size, window=case.window, interpret=True)
  monkeypatch.setattr(api, "default_implementation", lambda head_dim=None: "mosaic")
  calls = []
  real = dflash_triton.dflash_attention_triton
  monkeypatch.setattr(dflash_triton, "dflash_attention_triton",
                      lambda *a, **k: (calls.append(k.get("backward")), real(*a, **k))[1])
  api._warned.clear()
  with caplog.at_level("WARNING"):
    got = api.dflash_attention(*x, *idx, **kw)
  assert calls == [None]
  assert "Mosaic GPU kernels do not take these inputs" in caplog.text and "float32" in caplog.text
  want = api.dflash_attention(*x, *idx, block_size=case.block_size, window=case.window,
                              implementation="xla")
  _assert_close(got, want, what="out", **TOLERANCES["float32"])
  bwd = "reference"                  # the jnp backward, a Triton-path variant
  api.dflash_attention(q, kc, vc, kb, vb, *idx, **kw, backward=bwd)
  assert calls == [None, bwd]
  with pytest.raises(NotImplementedError, match="float32"):
    api.dflash_attention(*x, *idx, **kw, implementation="mosaic")


def test_interpreted_forward_under_the_triton_backward():
  """backward="triton": the Mosaic GPU forward's padded output and lse feed the Triton dQ and
  dK/dV kernels (both interpreted) and give the reference's gradients."""
  case = INTERPRET_CASES[2]
  (q, kc, vc, kb, vb), idx = make_inputs(case, seed=8)
  kw = dict(block_size=case.block_size, window=case.window)
  ct = jax.random.normal(jax.random.PRNGKey(4), q.shape, jnp.float32)
  fn = lambda *y: mg.dflash_attention_mosaic(*y, *idx, **kw, backward="triton", interpret=True)
  grads = jax.vjp(fn, q, kc, vc, kb, vb)[1](ct.astype(q.dtype))
  f32 = [x.astype(jnp.float32) for x in (q, kc, vc, kb, vb)]
  ref = jax.vjp(lambda *y: reference.dflash_attention_reference(*y, *idx, **kw), *f32)[1](ct)
  for name, a, b in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), grads, ref):
    _assert_close(a, b, what=name, **TOLERANCES["bfloat16"])


GPU_CASES = [
    Case(window=256, hq=8, hkv=2, head_dim=128, dtype="bfloat16", batch=2, blocks=64,
         seq_len=1500, docs=5, invalid_row=True),
    Case(hq=8, hkv=2, head_dim=128, dtype="bfloat16", blocks=64, seq_len=1500, docs=2),
    Case(window=1, hq=4, hkv=2, head_dim=64, dtype="bfloat16", blocks=24, seq_len=300,
         anchors="edges"),
    Case(window=24, hq=4, hkv=4, head_dim=64, dtype="bfloat16", blocks=12, seq_len=200,
         anchors="edges", docs=4),
]
# Through the entry point only: SmolLM2's drafter (9/3 heads, head size 64), which the default runs
# on Hopper since head size 64 was timed. A 64-row tile cannot hold whole blocks of 3 query heads,
# so dflash_attention_mosaic repeats each KV head 3 times (the kernels themselves refuse G = 3).
ENTRY_POINT_CASES = GPU_CASES + [
    Case(hq=9, hkv=3, head_dim=64, dtype="bfloat16", batch=2, blocks=40, seq_len=700, docs=3),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_forward_matches_the_reference_and_the_triton_forward(case, warpgroups):
  (q, kc, vc, kb, vb), idx = make_inputs(case, seed=5)
  kw = dict(block_size=case.block_size, window=case.window)
  tiles = mg.MosaicConfig(fwd_warpgroups=warpgroups)
  out, lse = jax.jit(lambda *x: mg.dflash_forward_mosaic(*x, *idx, **kw, tiles=tiles))(
      q, kc, vc, kb, vb)
  ref = reference.dflash_attention_reference(*(x.astype(jnp.float32) for x in (q, kc, vc, kb, vb)),
                                             *idx, **kw)
  _assert_close(out, ref, what="out", **TOLERANCES["bfloat16"])
  st = dflash_triton._Static(block_size=case.block_size, window=case.window,
                             scale=float(case.head_dim ** -0.5), interpret=False, backward=None,
                             config=dflash_triton.config_lib.default_config(head_dim=case.head_dim))
  _, _, tri_lse = jax.jit(lambda *x: dflash_triton._forward(*x, *idx, st))(q, kc, vc, kb, vb)
  real = np.asarray(tri_lse) < 1e29
  np.testing.assert_allclose(np.asarray(lse)[real], np.asarray(tri_lse)[real], atol=2e-2, rtol=1e-3)
  assert np.all(np.asarray(lse)[~real] > 1e29)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backward", ["triton", "mosaic", "mosaic-ws", "mosaic-wg1"])
@pytest.mark.parametrize("case", ENTRY_POINT_CASES, ids=str)
def test_forward_and_backward_match_the_reference(case, backward):
  """mosaic: the default tiles (the warp-specialised forward, the one-warpgroup dQ); mosaic-ws:
  the warp-specialised forward and dQ kernels; mosaic-wg1: the one-warpgroup forward and dQ."""
  tiles = {"mosaic-ws": mg.MosaicConfig(fwd_warpgroups=2, dq_warpgroups=2),
           "mosaic-wg1": mg.MosaicConfig(fwd_warpgroups=1)}.get(backward)
  backward = backward.split("-")[0]
  (q, kc, vc, kb, vb), idx = make_inputs(case, seed=6)
  kw = dict(block_size=case.block_size, window=case.window)
  ct = jax.random.normal(jax.random.PRNGKey(2), q.shape, q.dtype)

  def fwd_bwd(fn, *x):
    out, vjp = jax.vjp(fn, *x)
    return out, vjp(ct.astype(out.dtype))   # JAX 0.11 wants the cotangent in the output's dtype
  out, grads = jax.jit(lambda *x: fwd_bwd(
      lambda *y: mg.dflash_attention_mosaic(*y, *idx, **kw, backward=backward, tiles=tiles),
      *x))(
          q, kc, vc, kb, vb)
  f32 = [x.astype(jnp.float32) for x in (q, kc, vc, kb, vb)]
  ref_out, ref = fwd_bwd(lambda *y: reference.dflash_attention_reference(*y, *idx, **kw), *f32)
  _assert_close(out, ref_out, what="out", **TOLERANCES["bfloat16"])
  for name, a, b in zip(("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), grads, ref):
    _assert_close(a, b, what=name, **TOLERANCES["bfloat16"])


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
def test_the_default_on_this_gpu():
  """On an H100/H200 the unset implementation at head sizes 128 and 64 is the Mosaic GPU kernels;
  on any other GPU, and at head size 32, Triton."""
  from pallas_kernels.dflash_attention import api
  hopper = str(jax.devices()[0].compute_capability).startswith("9.")
  assert api.default_implementation(128) == ("mosaic" if hopper else "triton")
  assert api.default_implementation(64) == ("mosaic" if hopper else "triton")
  assert api.default_implementation(32) == "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_forward_and_backward_are_deterministic(implementation):
  """The same inputs give bit-identical out and gradients, run after run (no atomics, no split
  reductions whose order varies), at the 27B drafter's heads on a sliding and a full layer."""
  from pallas_kernels.dflash_attention import api
  for window in (512, None):
    case = Case(window=window, hq=32, hkv=8, head_dim=128, dtype="bfloat16", blocks=128,
                seq_len=4096, docs=3)
    (q, kc, vc, kb, vb), idx = make_inputs(case, seed=12)
    ct = jax.random.normal(jax.random.PRNGKey(3), q.shape, q.dtype)

    @jax.jit
    def fwd_bwd(*x):
      out, vjp = jax.vjp(lambda *y: api.dflash_attention(
          *y, *idx, block_size=case.block_size, window=window, implementation=implementation), *x)
      return (out,) + vjp(ct)
    first = [np.asarray(v) for v in fwd_bwd(q, kc, vc, kb, vb)]
    for _ in range(3):
      again = fwd_bwd(q, kc, vc, kb, vb)
      for name, a, b in zip(("out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"), first, again):
        assert np.array_equal(a, np.asarray(b)), f"{implementation} {case}: {name} differs"
