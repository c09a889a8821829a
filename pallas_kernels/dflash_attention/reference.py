"""Dense-mask DFlash attention in plain jnp: the math, the CPU/XLA path and the test oracle.

Shapes (one letter each): B batch, N anchor blocks per row, K block size, Q = N*K query tokens,
S context length, Hq query heads, Hkv key/value heads, G = Hq // Hkv, D head dim.

The mask is the DFlash contract of docs/DESIGN.md. For query (block n, offset o) with anchor a_n and
document start lo_n:
  context key j: lo_n <= j < a_n                         (full layers, window=None)
                 max(lo_n, a_n + o - (W - 1)) <= j < a_n  (sliding layers, window=W)
  block key o':  every o' of block n (full), o' <= o (sliding); never another block.
  an invalid block sees nothing: output 0, gradient 0.
This file materialises [Q, S] scores on purpose (it is the oracle); the Pallas kernel never does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def context_mask(anchors_BxN, doc_start_BxN, block_valid_BxN, *, block_size: int,
                 window: int | None, seq_len: int):
  """Boolean [B, N, K, S]: may query (n, o) see context key j."""
  a = anchors_BxN[:, :, None, None]
  lo = doc_start_BxN[:, :, None, None]
  o = jnp.arange(block_size)[None, None, :, None]
  j = jnp.arange(seq_len)[None, None, None, :]
  lower = lo if window is None else jnp.maximum(lo, a + o - (window - 1))
  m = (j >= lower) & (j < a) & block_valid_BxN[:, :, None, None]
  # Full layers do not depend on o: broadcast (free under XLA) so the shape is always as stated.
  return jnp.broadcast_to(m, m.shape[:2] + (block_size, seq_len))


def block_mask(block_valid_BxN, *, block_size: int, window: int | None):
  """Boolean [B, N, K, K]: may query offset o see block key offset o' of its own block."""
  o = jnp.arange(block_size)[:, None]
  o2 = jnp.arange(block_size)[None, :]
  inner = jnp.ones((block_size, block_size), bool) if window is None else (o2 <= o)
  return inner[None, None] & block_valid_BxN[:, :, None, None]


def visible_pairs(anchors_BxN, doc_start_BxN, block_valid_BxN=None, *, block_size: int,
                  window: int | None) -> int:
  """Number of (query token, visible key) pairs per head, by index arithmetic in numpy (the
  count of context_mask + block_mask without building them): the work an exact kernel does,
  the FLOP count of the benchmarks."""
  import numpy as np
  a = np.asarray(anchors_BxN, np.int64)[..., None]
  lo = np.asarray(doc_start_BxN, np.int64)[..., None]
  valid = (np.ones(a.shape[:-1], bool) if block_valid_BxN is None
           else np.asarray(block_valid_BxN, bool))
  o = np.arange(block_size)
  lower = lo if window is None else np.maximum(lo, a + o - (window - 1))
  ctx = np.clip(a - lower, 0, None) * np.ones(block_size, np.int64)         # [B, N, K]
  blk = np.full(block_size, block_size) if window is None else o + 1        # [K]
  return int(((ctx + blk) * valid[..., None]).sum())


def dflash_attention_reference(q_BxQxHqxD, k_ctx_BxSxHkvxD, v_ctx_BxSxHkvxD, k_blk_BxQxHkvxD,
                               v_blk_BxQxHkvxD, anchors_BxN, doc_start_BxN, block_valid_BxN, *,
                               block_size: int, window: int | None = None,
                               scale: float | None = None, compute_dtype=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST):
  """Masked softmax attention over [context ; own block]. Returns [B, Q, Hq, D] in q's dtype.

  compute_dtype=float32 with HIGHEST precision is the oracle; the "xla" implementation passes the
  input dtype for the matmuls (softmax statistics stay f32 either way).
  """
  B, Q, Hq, D = q_BxQxHqxD.shape
  S, Hkv = k_ctx_BxSxHkvxD.shape[1], k_ctx_BxSxHkvxD.shape[2]
  N, K, G = anchors_BxN.shape[1], block_size, Hq // Hkv
  scale = D ** -0.5 if scale is None else scale
  cd = compute_dtype
  q = q_BxQxHqxD.astype(cd).reshape(B, N, K, Hkv, G, D)
  kc, vc = k_ctx_BxSxHkvxD.astype(cd), v_ctx_BxSxHkvxD.astype(cd)
  kb = k_blk_BxQxHkvxD.astype(cd).reshape(B, N, K, Hkv, D)
  vb = v_blk_BxQxHkvxD.astype(cd).reshape(B, N, K, Hkv, D)

  # Scores in f32: context [B, N, K, Hkv, G, S] and own block [B, N, K, Hkv, G, K].
  s_ctx = jnp.einsum("bnohgd,bshd->bnohgs", q, kc, precision=precision,
                     preferred_element_type=jnp.float32) * scale
  s_blk = jnp.einsum("bnohgd,bnphd->bnohgp", q, kb, precision=precision,
                     preferred_element_type=jnp.float32) * scale
  m_ctx = context_mask(anchors_BxN, doc_start_BxN, block_valid_BxN, block_size=K, window=window,
                       seq_len=S)[:, :, :, None, None, :]
  m_blk = block_mask(block_valid_BxN, block_size=K, window=window)[:, :, :, None, None, :]

  # Masked entries use a finite fill and are zeroed after exp (not -inf): a fully masked row
  # (invalid block) then gives p = 0 everywhere, output 0 and exactly zero gradients, no NaN.
  neg = jnp.float32(-1e30)
  s_ctx = jnp.where(m_ctx, s_ctx, neg)
  s_blk = jnp.where(m_blk, s_blk, neg)
  m = jnp.maximum(s_ctx.max(-1, keepdims=True), s_blk.max(-1, keepdims=True))
  m = jax.lax.stop_gradient(m)
  p_ctx = jnp.where(m_ctx, jnp.exp(s_ctx - m), 0.0)
  p_blk = jnp.where(m_blk, jnp.exp(s_blk - m), 0.0)
  denom = p_ctx.sum(-1, keepdims=True) + p_blk.sum(-1, keepdims=True)
  inv = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)
  o = (jnp.einsum("bnohgs,bshd->bnohgd", p_ctx.astype(cd), vc, precision=precision,
                  preferred_element_type=jnp.float32)
       + jnp.einsum("bnohgp,bnphd->bnohgd", p_blk.astype(cd), vb, precision=precision,
                    preferred_element_type=jnp.float32)) * inv
  return o.reshape(B, Q, Hq, D).astype(q_BxQxHqxD.dtype)
