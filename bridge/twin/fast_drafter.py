"""A best-effort PyTorch DFlash drafter step: the bench's "pytorch-best" row.

The step that bridge/twin/reference_drafter.py spells out plainly, written the way a strong PyTorch
engineer would write it for speed. Same parameters (the reference module's, z-lab names, f32
masters), same batch and objective (reference_drafter.build_blocks), and jax_drafter's precision
policy: bf16 operands with f32 accumulation, RMSNorm and softmax statistics in f32, f32 logits.
What differs is how it runs:
  - Each decoder layer is one torch.compile'd function of tensors: flex_attention, RMSNorm, RoPE,
    SiLU, casts and residual adds fused around the cuBLAS matmuls. One layer, not the whole model:
    the layers share three compiled graphs (the first layer, whose input needs no gradient; later
    sliding layers; full layers) instead of one graph L layers long to compile, and all that is
    lost is fusion across a layer boundary (one extra read of the residual per layer).
  - F.rms_norm; RoPE from half-width cos/sin tables in the compute dtype, made once per step for
    every layer (inside a compiled layer the halves' cat is index arithmetic, not a copy).
  - q/k/v of the block tokens and k/v of the context as one matmul each.
  - The flex BlockMask of each distinct window built once per step, before the forward; its build
    is part of the step (and of its time).
  - The LM head only on rows that carry a loss weight (never block offset 0, whose token is the
    anchor's own) through linear_ce: two LM-head matmuls per row, as the JAX step.
Letters as in jax_drafter/config.py: B, S, N, K, Q = N*K, D, Hq, Hkv, Dh, V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bridge.twin import reference_drafter as ref
from bridge.twin import torch_attention
from bridge.twin.linear_ce import linear_cross_entropy


def rope_tables(pos_BxT, head_dim: int, theta: float, dtype):
  """(cos, sin) [B, T, Dh/2] of the rotate-half RoPE, angles in f32 (as jax_drafter.model.rope),
  tables rounded to `dtype` once for all layers."""
  inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                           device=pos_BxT.device) / head_dim))
  ang = pos_BxT.float()[..., None] * inv_freq
  return ang.cos().to(dtype), ang.sin().to(dtype)


def _rope(x_BxTxHxDh, cos_sin):
  cos, sin = (t[:, :, None, :] for t in cos_sin)
  x1, x2 = x_BxTxHxDh.chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _norm(x, weight, eps: float):
  """RMSNorm with f32 statistics and weight, result in x's dtype (as jax_drafter.model.RMSNorm)."""
  return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def _linear(x, *weights_OxI):
  """x @ [W1; W2; ...].T in x's dtype: the f32 masters are cast per step (fused into one copy)."""
  w = weights_OxI[0] if len(weights_OxI) == 1 else torch.cat(weights_OxI)
  return x @ w.to(x.dtype).T


def _flex(q, k_ctx, v_ctx, k_blk, v_blk, block_mask, row_valid_BxQ):
  from torch.nn.attention.flex_attention import flex_attention
  k = torch.cat([k_ctx, k_blk], dim=1).transpose(1, 2)
  v = torch.cat([v_ctx, v_blk], dim=1).transpose(1, 2)
  o = flex_attention(q.transpose(1, 2), k, v, block_mask=block_mask, scale=q.shape[-1] ** -0.5,
                     enable_gqa=True).transpose(1, 2)
  return torch.where(row_valid_BxQ[:, :, None, None], o, 0.0)


def decoder_layer(x_BxQxD, ctx_BxSxD, rope_blk, rope_ctx, p: dict, attn: tuple, *, backend: str,
                  window: int | None, shape: tuple, block_size: int, eps: float):
  """One DFlash decoder layer (reference_drafter.DFlashDecoderLayer's math). p: this layer's
  parameters by their names under `layers.i.`; attn: (BlockMask, row_valid) for flex, else
  (anchors, doc_start, block_valid) for a torch_attention backend."""
  Hq, Hkv, Dh = shape
  B, Q, _ = x_BxQxD.shape
  S = ctx_BxSxD.shape[1]
  a = "self_attn."
  h = _norm(x_BxQxD, p["input_layernorm.weight"], eps)
  q, k_blk, v_blk = _linear(h, p[a + "q_proj.weight"], p[a + "k_proj.weight"],
                            p[a + "v_proj.weight"]).split([Hq * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
  k_ctx, v_ctx = _linear(ctx_BxSxD, p[a + "k_proj.weight"],
                         p[a + "v_proj.weight"]).split([Hkv * Dh, Hkv * Dh], dim=-1)
  q = _rope(_norm(q.reshape(B, Q, Hq, Dh), p[a + "q_norm.weight"], eps), rope_blk)
  k_blk = _rope(_norm(k_blk.reshape(B, Q, Hkv, Dh), p[a + "k_norm.weight"], eps), rope_blk)
  k_ctx = _rope(_norm(k_ctx.reshape(B, S, Hkv, Dh), p[a + "k_norm.weight"], eps), rope_ctx)
  v_blk, v_ctx = v_blk.reshape(B, Q, Hkv, Dh), v_ctx.reshape(B, S, Hkv, Dh)
  if backend == "flex":
    o = _flex(q, k_ctx, v_ctx, k_blk, v_blk, *attn)
  else:
    o = torch_attention.dflash_attention_torch(q, k_ctx, v_ctx, k_blk, v_blk, *attn,
                                               block_size=block_size, window=window,
                                               scale=Dh ** -0.5, backend=backend)
  h = x_BxQxD + _linear(o.reshape(B, Q, Hq * Dh), p[a + "o_proj.weight"])
  gate, up = _linear(_norm(h, p["post_attention_layernorm.weight"], eps),
                     p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]).chunk(2, dim=-1)
  return h + _linear(F.silu(gate) * up, p["mlp.down_proj.weight"])


def context_states(features_BxSxF, fc_weight, norm_weight, eps: float, cd):
  """hidden_norm(fc(target features)) in the compute dtype."""
  return _norm(_linear(features_BxSxF.to(cd), fc_weight), norm_weight, eps)


class FastDrafterStep:
  """loss(params, micro, embed, head, anchors, valid) -> the DFlash loss of one micro-batch.

  params: {name: f32 parameter} of a reference_drafter.DFlashDrafter (its named_parameters);
  micro: the reference's rows {input_ids, loss_mask, doc_id, position_ids, features}.
  attention: "flex" (GPU) or a torch_attention backend ("eager", "sdpa": the CPU path);
  compiled: torch.compile the layer, the context states, the final norm and the CE's softmax part.
  ce_rows: LM-head rows per chunk (the JAX step's: objective.ce_chunk_rows).
  """

  def __init__(self, cfg, *, compute_dtype, attention: str, compiled: bool, gamma: float | None,
               ce_rows: int):
    if attention not in torch_attention.BACKENDS:
      raise ValueError(f"{attention=} is not one of {torch_attention.BACKENDS}")
    self.cfg, self.cd, self.attention, self.compiled = cfg, compute_dtype, attention, compiled
    self.gamma, self.ce_rows = gamma, ce_rows
    wrap = (lambda f: torch.compile(f, dynamic=False)) if compiled else (lambda f: f)
    self._layer, self._context, self._norm = wrap(decoder_layer), wrap(context_states), wrap(_norm)
    self.last_rows = 0   # LM-head rows of the last call (supervised rows only)

  def masks(self, blocks: ref.Blocks, seq_len: int) -> dict:
    """{window: attention argument tuple} for every distinct window of the layers."""
    K = self.cfg.block_size
    windows = {self.cfg.window(i) for i in range(self.cfg.num_hidden_layers)}
    if self.attention != "flex":
      return {w: (blocks.anchors, blocks.doc_start, blocks.block_valid) for w in windows}
    row_valid = blocks.block_valid.repeat_interleave(K, dim=1)
    return {w: (torch_attention.flex_block_mask(blocks.anchors, blocks.doc_start,
                                                blocks.block_valid, block_size=K, window=w,
                                                seq_len=seq_len), row_valid) for w in windows}

  def hidden(self, params: dict, micro: dict, embed, blocks: ref.Blocks):
    """Final-normed block hidden states [B, Q, D] in the compute dtype."""
    cfg, cd, eps = self.cfg, self.cd, self.cfg.rms_norm_eps
    S = micro["input_ids"].shape[1]
    masks = self.masks(blocks, S)
    rope_ctx = rope_tables(micro["position_ids"], cfg.head_dim, cfg.rope_theta, cd)
    rope_blk = rope_tables(blocks.positions, cfg.head_dim, cfg.rope_theta, cd)
    ctx = self._context(micro["features"], params["fc.weight"], params["hidden_norm.weight"], eps, cd)
    x = F.embedding(blocks.noise_ids, embed.detach()).to(cd)
    shape = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
      prefix = f"layers.{i}."
      p = {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
      w = cfg.window(i)
      x = self._layer(x, ctx, rope_blk, rope_ctx, p, masks[w], backend=self.attention, window=w,
                      shape=shape, block_size=cfg.block_size, eps=eps)
    return self._norm(x, params["norm.weight"], eps)

  def loss(self, params: dict, micro: dict, embed, head, anchors_BxN, valid_BxN):
    """sum(CE * w) / sum(w) over the micro-batch (the JAX step's loss)."""
    cfg = self.cfg
    blocks = ref.build_blocks(anchors_BxN, valid_BxN, micro["input_ids"], micro["loss_mask"],
                              micro["doc_id"], micro["position_ids"], block_size=cfg.block_size,
                              mask_token_id=cfg.mask_token_id, gamma=self.gamma)
    w = blocks.weights.reshape(-1)
    # Rows of weight 0 (block offset 0 always; past the document or row end, unsupervised, or in an
    # invalid block) add nothing to the loss or its gradient: their logits are never made.
    # nonzero waits for the device: done here, before the forward is queued, the wait is short and
    # the device never idles between the forward and the CE.
    rows = torch.nonzero(w > 0)[:, 0]
    self.last_rows = int(rows.numel())
    h = self.hidden(params, micro, embed, blocks)
    ce, _ = linear_cross_entropy(h.reshape(-1, h.shape[-1]).index_select(0, rows), head,
                                 blocks.labels.reshape(-1).index_select(0, rows),
                                 rows=self.ce_rows, compiled=self.compiled)
    return (ce * w.index_select(0, rows)).sum() / w.sum().clamp(min=1e-9)
