"""Public entry point of the DFlash attention op: validates inputs, then picks an implementation.

implementation:
  None         best available: on a Hopper GPU (H100/H200, sm_90) the Mosaic GPU kernels for
               head sizes 64-128, where they take the inputs (bf16/f16, ...), else the
               Pallas-Triton kernel; on any other CUDA GPU the Pallas-Triton kernel; on a CPU
               "xla". Head sizes below 64 keep Triton on Hopper too: the Mosaic GPU kernels are
               measured faster at head sizes 128 (the 27B drafter) and 64 (SmolLM2's) only.
  "reference"  reference.py in f32 at HIGHEST precision (the oracle; slow, memory O(Q*S)).
  "xla"        the same dense-mask math, matmuls in the input dtype, f32 softmax statistics.
  "triton"     the Pallas-Triton kernel (triton.py); with interpret=True it runs on CPU.
  "mosaic"     the Pallas Mosaic GPU kernels for Hopper (mosaic_gpu.py: forward, dQ, dK/dV; bf16 /
               f16, head sizes up to 128); with interpret=True JAX's Mosaic GPU interpreter runs
               them on CPU. On one H100 (2026-12-06) they ran the 27B drafter's attention forward +
               backward at 320 useful TF/s against Triton's 261 (sliding window 2048, 8k
               tokens, 1024 anchors) and 381 against 354-361 (full layer, 64k tokens, 2048
               anchors): benchmarks/h100-2026-12-06-mosaic-default.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.dflash_attention import reference

IMPLEMENTATIONS = ("reference", "xla", "triton", "mosaic")
log = logging.getLogger(__name__)
_warned: set[str] = set()   # fallback reasons already reported (once per process each)


def _check(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, block_size, window):
  """Shape/dtype checks that run before anything is compiled. Raises ValueError naming the input."""
  for name, x in (("q", q), ("k_ctx", k_ctx), ("v_ctx", v_ctx), ("k_blk", k_blk), ("v_blk", v_blk)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be [batch, tokens, heads, head_dim], got shape {x.shape}")
  B, Q, Hq, D = q.shape
  _, S, Hkv, _ = k_ctx.shape
  if block_size < 1:
    raise ValueError(f"{block_size=} must be >= 1")
  if window is not None and window < 1:
    raise ValueError(f"{window=} must be >= 1 (or None for a full-attention layer)")
  if Q % block_size:
    raise ValueError(f"q has {Q} query tokens, not a multiple of {block_size=}")
  N = Q // block_size
  if Hkv == 0 or Hq % Hkv:
    raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
  if v_ctx.shape != k_ctx.shape:
    raise ValueError(f"v_ctx shape {v_ctx.shape} != k_ctx shape {k_ctx.shape}")
  if k_blk.shape != (B, Q, Hkv, D):
    raise ValueError(f"k_blk shape {k_blk.shape} must be {(B, Q, Hkv, D)} (batch, Q, Hkv, D of q/k_ctx)")
  if v_blk.shape != k_blk.shape:
    raise ValueError(f"v_blk shape {v_blk.shape} != k_blk shape {k_blk.shape}")
  if k_ctx.shape[0] != B or k_ctx.shape[3] != D:
    raise ValueError(f"k_ctx shape {k_ctx.shape} does not match q {q.shape} in batch or head_dim")
  for name, x in (("anchors", anchors), ("doc_start", doc_start)):
    if x.shape != (B, N):
      raise ValueError(f"{name} shape {x.shape} must be (batch, anchors) = {(B, N)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
  if block_valid.shape != (B, N) or block_valid.dtype != jnp.bool_:
    raise ValueError(f"block_valid must be bool of shape {(B, N)}, got {block_valid.dtype}{block_valid.shape}")
  # Index values can only be checked when they are concrete (outside jit).
  if not isinstance(anchors, jax.core.Tracer) and not isinstance(doc_start, jax.core.Tracer):
    a, lo = np.asarray(anchors), np.asarray(doc_start)
    bv = None if isinstance(block_valid, jax.core.Tracer) else np.asarray(block_valid)
    sel = bv if bv is not None else np.ones_like(a, bool)
    # a == S is allowed: at inference the context is exactly the tokens before the anchor.
    if np.any(sel & ((a < 0) | (a > S))):
      raise ValueError(f"anchors must lie in [0, {S}] (S = context length); got min {a.min()}, max {a.max()}")
    if np.any(sel & ((lo < 0) | (lo > a))):
      raise ValueError("doc_start must satisfy 0 <= doc_start <= anchor for every valid block")
    for b in range(B):
      row = a[b][sel[b]]
      if np.any(np.diff(row) < 0):
        raise ValueError(f"anchors of row {b} are not sorted; sort valid anchors ascending")


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _on_hopper() -> bool:
  """JAX's first device is an sm_90 GPU (H100/H200): the GPUs with wgmma that Mosaic GPU targets."""
  if not _on_gpu():
    return False
  cc = str(getattr(jax.devices()[0], "compute_capability", ""))
  return cc.split(".")[0] == "9"


# The smallest head size for which the default takes the Mosaic GPU kernels on Hopper: they were
# timed against Triton at head sizes 128 (benchmarks/h100-2026-12-06-mosaic-default) and 64
# (SmolLM2's 9/3 heads, fwd+bwd 0.95 against 1.48 ms at 2048x512, 4.29 against 5.72 ms at
# 8192x2048: benchmarks/h100-2026-12-06b-step-profile), not below.
MOSAIC_DEFAULT_MIN_HEAD_DIM = 64


def default_implementation(head_dim: int | None = None) -> str:
  """The implementation used when none is named, for this head size (None: the largest)."""
  try:
    if _on_gpu():
      from pallas_kernels.dflash_attention import triton  # noqa: F401
      big = head_dim is None or head_dim >= MOSAIC_DEFAULT_MIN_HEAD_DIM
      return "mosaic" if _on_hopper() and big else "triton"
  except (ImportError, NotImplementedError):
    pass
  return "xla"


def _fallback_warning(e: Exception, to: str, cost: str) -> None:
  if str(e) not in _warned:  # once per reason and process
    _warned.add(str(e))
    log.warning("dflash_attention: the %s (%s); using %s", cost, e, to)


def dflash_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, *,
                     block_size: int, window: int | None = None, scale: float | None = None,
                     implementation: str | None = None, interpret: bool = False,
                     backward: str | None = None):
  """DFlash attention: queries of N anchor blocks over their context range and their own block.

  q [B, N*K, Hq, D]; k_ctx/v_ctx [B, S, Hkv, D]; k_blk/v_blk [B, N*K, Hkv, D] (never concatenate
  context and block K/V); anchors/doc_start int [B, N] (valid anchors sorted per row, 0 <= anchor <= S); block_valid
  bool [B, N]; window None for a full-attention layer. Returns [B, N*K, Hq, D] in q's dtype.
  """
  _check(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, block_size, window)
  impl = implementation or default_implementation(q.shape[-1])
  if implementation is None and impl == "mosaic" and backward not in (None, "mosaic"):
    impl = "triton"                # a Triton backward variant was asked for by name
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={impl!r} is not one of {IMPLEMENTATIONS}")
  anchors = anchors.astype(jnp.int32)
  doc_start = doc_start.astype(jnp.int32)
  if impl == "mosaic":
    from pallas_kernels.dflash_attention import mosaic_gpu
    if backward not in (None, "mosaic"):
      raise ValueError(f"backward={backward!r}: the mosaic implementation has its own backward")
    if not interpret and not _on_gpu():
      raise ValueError("implementation='mosaic' runs on an NVIDIA Hopper GPU (H100/H200), and JAX "
                       f"sees {jax.default_backend()!r}: leave the implementation unset (the "
                       "best available), or pass interpret=True to interpret it on a CPU")
    try:
      return mosaic_gpu.dflash_attention_mosaic(
          q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, block_size=block_size,
          window=window, scale=scale, backward="mosaic", interpret=interpret)
    except NotImplementedError as e:
      if implementation is not None:
        raise
      # the default's choice on Hopper: the Triton kernel takes what Mosaic GPU's does not
      _fallback_warning(e, "the Pallas-Triton kernel",
                        "Mosaic GPU kernels do not take these inputs")
      impl = "triton"
  if impl == "triton":
    try:
      from pallas_kernels.dflash_attention import triton
      return triton.dflash_attention_triton(
          q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, block_size=block_size,
          window=window, scale=scale, interpret=interpret, backward=backward)
    except (ImportError, NotImplementedError) as e:
      if implementation is not None:
        raise
      # a silent fallback would hide a many-fold cost in memory
      _fallback_warning(e, "the dense XLA path, which holds [queries, keys] score matrices",
                        "Pallas kernel does not take these inputs")
      impl = "xla"
  if impl == "reference":
    fn = functools.partial(reference.dflash_attention_reference, compute_dtype=jnp.float32,
                           precision=jax.lax.Precision.HIGHEST)
  else:
    fn = functools.partial(reference.dflash_attention_reference, compute_dtype=q.dtype,
                           precision=None)
  return fn(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, block_size=block_size,
            window=window, scale=scale)
