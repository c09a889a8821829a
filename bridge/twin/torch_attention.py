"""DFlash attention on torch tensors: the PyTorch side of the parity check and of kernel benchmarks.

Same layout and semantics as `pallas_kernels/dflash_attention` (docs/DESIGN.md, "The DFlash contract"):
  q [B, Q, Hq, D] (Q = N*K); k_ctx/v_ctx [B, S, Hkv, D]; k_blk/v_blk [B, Q, Hkv, D];
  anchors/doc_start int [B, N]; block_valid bool [B, N]; window None for a full-attention layer.
For query (block n, offset o): context key j visible iff max(lo_n, a_n + o - (W-1) | lo_n) <= j < a_n;
block key o' of block n visible always (full) or iff o' <= o (sliding); an invalid block outputs 0.

Backends:
  "eager"  explicit masked softmax, f32 scores and statistics (the torch oracle).
  "sdpa"   torch SDPA with a dense boolean mask over [context ; blocks] keys.
  "flex"   torch flex_attention with a BlockMask built from a mask_mod (compiled on GPU).
sdpa and flex concatenate context and block K/V: this is a reference, not the production kernel.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

BACKENDS = ("eager", "sdpa", "flex")


def context_mask(anchors, doc_start, block_valid, *, block_size: int, window: int | None,
                 seq_len: int):
  """bool [B, N, K, S]: may query (n, o) see context key j."""
  dev = anchors.device
  a = anchors.long()[:, :, None, None]
  lo = doc_start.long()[:, :, None, None]
  o = torch.arange(block_size, device=dev)[None, None, :, None]
  j = torch.arange(seq_len, device=dev)[None, None, None, :]
  lower = lo if window is None else torch.maximum(lo, a + o - (window - 1))
  m = (j >= lower) & (j < a) & block_valid[:, :, None, None]
  return m.expand(*anchors.shape, block_size, seq_len)


def block_mask(block_valid, *, block_size: int, window: int | None):
  """bool [B, N, K, K]: may query offset o see key offset o' of its own block."""
  dev = block_valid.device
  o = torch.arange(block_size, device=dev)
  inner = (torch.ones(block_size, block_size, dtype=torch.bool, device=dev) if window is None
           else o[None, :] <= o[:, None])
  return inner[None, None] & block_valid[:, :, None, None]


def dense_mask(anchors, doc_start, block_valid, *, block_size: int, window: int | None,
               seq_len: int):
  """bool [B, Q, S + Q]: the full mask over the concatenated keys [context ; all blocks]."""
  B, N = anchors.shape
  K = block_size
  ctx = context_mask(anchors, doc_start, block_valid, block_size=K, window=window,
                     seq_len=seq_len).reshape(B, N * K, seq_len)
  own = block_mask(block_valid, block_size=K, window=window)              # [B, N, K, K]
  eye = torch.eye(N, dtype=torch.bool, device=anchors.device)
  blk = (eye[None, :, None, :, None] & own[:, :, :, None, :]).reshape(B, N * K, N * K)
  return torch.cat([ctx, blk], dim=-1)


def _eager(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, *, block_size, window,
           scale, masks=None):
  del masks   # the oracle builds its masks inline, every call
  B, Q, Hq, D = q.shape
  S, Hkv = k_ctx.shape[1], k_ctx.shape[2]
  N, K, G = anchors.shape[1], block_size, Hq // Hkv
  f = torch.float32
  q6 = q.to(f).reshape(B, N, K, Hkv, G, D)
  kb = k_blk.to(f).reshape(B, N, K, Hkv, D)
  vb = v_blk.to(f).reshape(B, N, K, Hkv, D)
  s_ctx = torch.einsum("bnohgd,bshd->bnohgs", q6, k_ctx.to(f)) * scale
  s_blk = torch.einsum("bnohgd,bnphd->bnohgp", q6, kb) * scale
  m_ctx = context_mask(anchors, doc_start, block_valid, block_size=K, window=window,
                       seq_len=S)[:, :, :, None, None, :]
  m_blk = block_mask(block_valid, block_size=K, window=window)[:, :, :, None, None, :]
  # Finite fill and explicit zeroing after exp: a fully masked row (invalid block) gives p = 0,
  # output 0 and zero gradients instead of NaN.
  neg = torch.tensor(-1e30, dtype=f, device=q.device)
  s_ctx = torch.where(m_ctx, s_ctx, neg)
  s_blk = torch.where(m_blk, s_blk, neg)
  m = torch.maximum(s_ctx.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True)).detach()
  p_ctx = torch.where(m_ctx, torch.exp(s_ctx - m), 0.0)
  p_blk = torch.where(m_blk, torch.exp(s_blk - m), 0.0)
  denom = p_ctx.sum(-1, keepdim=True) + p_blk.sum(-1, keepdim=True)
  inv = torch.where(denom > 0, 1.0 / torch.where(denom > 0, denom, 1.0), 0.0)
  o = (torch.einsum("bnohgs,bshd->bnohgd", p_ctx, v_ctx.to(f))
       + torch.einsum("bnohgp,bnphd->bnohgd", p_blk, vb)) * inv
  return o.reshape(B, Q, Hq, D).to(q.dtype)


def _memo(masks: dict | None, key, build):
  """A mask built once per `masks` dict (one forward: same anchors in every layer)."""
  if masks is None:
    return build()
  if key not in masks:
    masks[key] = build()
  return masks[key]


def _sdpa(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, *, block_size, window,
          scale, masks=None):
  S = k_ctx.shape[1]
  mask = _memo(masks, ("dense", window, S), lambda: dense_mask(
      anchors, doc_start, block_valid, block_size=block_size, window=window, seq_len=S))
  # Rows of invalid blocks would be fully masked (NaN in SDPA): let them see everything and zero
  # their output below, which also zeroes every gradient that flows through them.
  row_valid = block_valid.repeat_interleave(block_size, dim=1)             # [B, Q]
  mask = mask | ~row_valid[:, :, None]
  k = torch.cat([k_ctx, k_blk], dim=1).transpose(1, 2)
  v = torch.cat([v_ctx, v_blk], dim=1).transpose(1, 2)
  o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                     scale=scale, enable_gqa=True).transpose(1, 2)
  return torch.where(row_valid[:, :, None, None], o, 0.0).to(q.dtype)


@functools.cache
def _flex_fn(compiled: bool):
  from torch.nn.attention.flex_attention import flex_attention
  if compiled:
    return torch.compile(flex_attention, dynamic=False)

  def uncompiled(*args, **kwargs):
    # On CPU the unfused path is intended (tiny test shapes); silence its "use torch.compile" note.
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
      return flex_attention(*args, **kwargs)
  return uncompiled


def flex_block_mask(anchors, doc_start, block_valid, *, block_size: int, window: int | None,
                    seq_len: int):
  """flex_attention BlockMask over keys [context (S) ; blocks (Q)] for queries [Q]."""
  from torch.nn.attention.flex_attention import create_block_mask
  B, N = anchors.shape
  K, S, Q = block_size, seq_len, N * block_size
  anchors, doc_start = anchors.to(torch.int32), doc_start.to(torch.int32)

  def mask_mod(b, h, q_idx, kv_idx):
    n, o = q_idx // K, q_idx % K
    a, lo, ok = anchors[b, n], doc_start[b, n], block_valid[b, n]
    lower = lo if window is None else torch.maximum(lo, a + o - (window - 1))
    in_ctx = (kv_idx < S) & (kv_idx >= lower) & (kv_idx < a)
    kb = kv_idx - S
    in_blk = (kv_idx >= S) & (kb // K == n)
    if window is not None:
      in_blk = in_blk & (kb % K <= o)
    return ok & (in_ctx | in_blk)

  on_gpu = anchors.device.type == "cuda"
  return create_block_mask(mask_mod, B, None, Q, S + Q, device=anchors.device, _compile=on_gpu)


def _flex(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, *, block_size, window,
          scale, masks=None):
  S = k_ctx.shape[1]
  bm = _memo(masks, ("flex", window, S), lambda: flex_block_mask(
      anchors, doc_start, block_valid, block_size=block_size, window=window, seq_len=S))
  k = torch.cat([k_ctx, k_blk], dim=1).transpose(1, 2)
  v = torch.cat([v_ctx, v_blk], dim=1).transpose(1, 2)
  fn = _flex_fn(q.device.type == "cuda")
  o = fn(q.transpose(1, 2), k, v, block_mask=bm, scale=scale, enable_gqa=True).transpose(1, 2)
  # flex_attention already returns 0 for fully masked rows; the where makes it explicit.
  row_valid = block_valid.repeat_interleave(block_size, dim=1)
  return torch.where(row_valid[:, :, None, None], o, 0.0).to(q.dtype)


_IMPL = {"eager": _eager, "sdpa": _sdpa, "flex": _flex}


def dflash_attention_torch(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid, *,
                           block_size: int, window: int | None = None, scale: float | None = None,
                           backend: str = "eager", masks: dict | None = None):
  """DFlash attention in torch; returns [B, Q, Hq, D] in q's dtype (see the module docstring).

  masks: a dict shared by the layers of one forward (same anchors): sdpa's dense mask and flex's
  BlockMask are then built once per distinct window, not once per layer.
  """
  if backend not in _IMPL:
    raise ValueError(f"{backend=} is not one of {BACKENDS}")
  B, Q, Hq, D = q.shape
  if Q % block_size:
    raise ValueError(f"q has {Q} query tokens, not a multiple of {block_size=}")
  if anchors.shape != (B, Q // block_size) or doc_start.shape != anchors.shape:
    raise ValueError(f"anchors/doc_start shape {tuple(anchors.shape)} must be {(B, Q // block_size)}")
  if block_valid.dtype != torch.bool:
    raise ValueError(f"block_valid must be bool, got {block_valid.dtype}")
  if Hq % k_ctx.shape[2]:
    raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({k_ctx.shape[2]})")
  scale = D ** -0.5 if scale is None else scale
  return _IMPL[backend](q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid,
                        block_size=block_size, window=window, scale=scale, masks=masks)
