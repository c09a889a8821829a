"""The PyTorch reference DFlash drafter and its training objective (docs/DESIGN.md, "The DFlash
contract").

Module names are exactly those of z-lab's DFlash checkpoints (`fc`, `hidden_norm`,
`layers.{i}.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `input_layernorm`,
`post_attention_layernorm`, `mlp.{gate,up,down}_proj`, `norm`), so `load_state_dict` of a z-lab
`model.safetensors` is strict. Built on transformers' Qwen3 blocks (RMSNorm, MLP, rotary embedding).
Layout follows the JAX model: hidden states [B, T, D], heads [B, T, H, Dh]. Anchors are inputs,
never sampled here, so that both frameworks see the same batch.

Numerics mirror jax_drafter/model.py: parameters are float32 masters; with compute_dtype=bfloat16
the matmuls run under autocast (bf16 in, f32 accumulate, bf16 out), RMSNorm/RoPE in f32 with the
result cast to the compute dtype, softmax statistics and LM-head logits in f32.
Letters as in jax_drafter/config.py: B, S, N, K, Q = N*K, D, F, Hq, Hkv, Dh, V.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding,
                                                      rotate_half)

from bridge.twin.torch_attention import dflash_attention_torch


def qwen3_config(cfg) -> Qwen3Config:
  """A transformers Qwen3Config with the drafter's shapes (for the Qwen3 building blocks)."""
  return Qwen3Config(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
      num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
      head_dim=cfg.head_dim, hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps,
      max_position_embeddings=cfg.max_position_embeddings,
      rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})


def _rope(x_BxTxHxDh, cos_BxTxDh, sin_BxTxDh):
  """Rotate-half RoPE in f32, result in x's dtype (as jax_drafter.model.rope)."""
  x = x_BxTxHxDh.float()
  cos, sin = cos_BxTxDh[:, :, None, :], sin_BxTxDh[:, :, None, :]
  return (x * cos + rotate_half(x) * sin).to(x_BxTxHxDh.dtype)


def _autocast(device: torch.device, dtype: torch.dtype, enabled: bool = True):
  if dtype == torch.float32 or not enabled:
    return torch.autocast(device.type, enabled=False)
  return torch.autocast(device.type, dtype=dtype)


class DFlashAttention(nn.Module):
  def __init__(self, cfg, layer: int):
    super().__init__()
    D, Hq, Hkv, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    self.q_proj = nn.Linear(D, Hq * Dh, bias=False)
    self.k_proj = nn.Linear(D, Hkv * Dh, bias=False)
    self.v_proj = nn.Linear(D, Hkv * Dh, bias=False)
    self.o_proj = nn.Linear(Hq * Dh, D, bias=False)
    self.q_norm = Qwen3RMSNorm(Dh, eps=cfg.rms_norm_eps)
    self.k_norm = Qwen3RMSNorm(Dh, eps=cfg.rms_norm_eps)
    self.shape = (Hq, Hkv, Dh)
    self.window = cfg.window(layer)
    self.block_size = cfg.block_size

  def forward(self, x_BxQxD, ctx_BxSxD, rope_ctx, rope_blk, anchors, doc_start, block_valid, *,
              backend: str, cd: torch.dtype, masks: dict | None = None):
    Hq, Hkv, Dh = self.shape
    B, Q, _ = x_BxQxD.shape
    S = ctx_BxSxD.shape[1]
    q = self.q_norm(self.q_proj(x_BxQxD).view(B, Q, Hq, Dh)).to(cd)
    # Same projections for context and block keys/values (DFlash: k = k_proj([ctx ; x])).
    k_ctx = self.k_norm(self.k_proj(ctx_BxSxD).view(B, S, Hkv, Dh)).to(cd)
    v_ctx = self.v_proj(ctx_BxSxD).view(B, S, Hkv, Dh).to(cd)
    k_blk = self.k_norm(self.k_proj(x_BxQxD).view(B, Q, Hkv, Dh)).to(cd)
    v_blk = self.v_proj(x_BxQxD).view(B, Q, Hkv, Dh).to(cd)
    q, k_blk = _rope(q, *rope_blk), _rope(k_blk, *rope_blk)
    k_ctx = _rope(k_ctx, *rope_ctx)
    with _autocast(q.device, cd, enabled=False):   # the op controls its own precision
      o = dflash_attention_torch(q, k_ctx, v_ctx, k_blk, v_blk, anchors, doc_start, block_valid,
                                 block_size=self.block_size, window=self.window,
                                 scale=Dh ** -0.5, backend=backend, masks=masks)
    return self.o_proj(o.reshape(B, Q, Hq * Dh))


class DFlashDecoderLayer(nn.Module):
  def __init__(self, cfg, layer: int, qcfg: Qwen3Config):
    super().__init__()
    self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    self.self_attn = DFlashAttention(cfg, layer)
    self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    self.mlp = Qwen3MLP(qcfg)

  def forward(self, x, ctx, rope_ctx, rope_blk, anchors, doc_start, block_valid, *, backend, cd,
              masks=None):
    h = x + self.self_attn(self.input_layernorm(x).to(cd), ctx, rope_ctx, rope_blk, anchors,
                           doc_start, block_valid, backend=backend, cd=cd, masks=masks).to(cd)
    return h + self.mlp(self.post_attention_layernorm(h).to(cd)).to(cd)


class DFlashDrafter(nn.Module):
  """z-lab DFlash drafter. `attention` is a bridge.twin.torch_attention backend (eager|sdpa|flex)."""

  def __init__(self, cfg, *, compute_dtype: torch.dtype = torch.float32, attention: str = "eager"):
    super().__init__()
    qcfg = qwen3_config(cfg)
    self.config = cfg
    self.compute_dtype = compute_dtype
    self.attention = attention
    n = len(cfg.target_layer_ids)
    self.fc = nn.Linear(n * cfg.hidden_size, cfg.hidden_size, bias=False)
    self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    self.layers = nn.ModuleList([DFlashDecoderLayer(cfg, i, qcfg)
                                 for i in range(cfg.num_hidden_layers)])
    self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    self.rotary_emb = Qwen3RotaryEmbedding(qcfg)   # no parameters, non-persistent buffers only

  def forward(self, noise_emb_BxQxD, target_feat_BxSxF, ctx_pos_BxS, blk_pos_BxQ, anchors_BxN,
              doc_start_BxN, block_valid_BxN, *, return_layers: bool = False):
    """Final-normed block hidden states [B, Q, D] in the compute dtype (and per-layer outputs)."""
    cd = self.compute_dtype
    dev = noise_emb_BxQxD.device
    f32 = torch.zeros((), dtype=torch.float32, device=dev)   # cos/sin in f32, as in JAX
    rope_ctx = self.rotary_emb(f32, ctx_pos_BxS)
    rope_blk = self.rotary_emb(f32, blk_pos_BxQ)
    outs = []
    masks = {}   # attention masks of this forward's anchors: built once per window, not per layer
    with _autocast(dev, cd):
      ctx = self.hidden_norm(self.fc(target_feat_BxSxF.to(cd))).to(cd)
      x = noise_emb_BxQxD.to(cd)
      for layer in self.layers:
        x = layer(x, ctx, rope_ctx, rope_blk, anchors_BxN, doc_start_BxN, block_valid_BxN,
                  backend=self.attention, cd=cd, masks=masks)
        outs.append(x)
      h = self.norm(x).to(cd)
    return (h, outs) if return_layers else h


def build_reference(cfg, *, device="cpu", compute_dtype=torch.float32, attention="eager"):
  """A DFlashDrafter with uninitialised float32 parameters on `device` (load weights next).

  Built on the meta device and materialised empty: at 27B-drafter shapes a random init on the
  host would cost seconds and gigabytes for weights that are overwritten anyway.
  """
  with torch.device("meta"):
    model = DFlashDrafter(cfg, compute_dtype=compute_dtype, attention=attention)
  model = model.to_empty(device=device)
  model.rotary_emb = Qwen3RotaryEmbedding(qwen3_config(cfg)).to(device)   # buffers were meta
  return model


# ---- The objective (pure functions of tensors), mirroring jax_drafter/objective.py. ----

class Blocks(NamedTuple):
  anchors: torch.Tensor      # int64 [B, N]
  block_valid: torch.Tensor  # bool [B, N]
  doc_start: torch.Tensor    # int64 [B, N]
  noise_ids: torch.Tensor    # int64 [B, Q]
  positions: torch.Tensor    # int64 [B, Q]
  labels: torch.Tensor       # int64 [B, Q]
  weights: torch.Tensor      # f32 [B, Q]


def document_starts(doc_id_BxS):
  S = doc_id_BxS.shape[1]
  idx = torch.arange(S, device=doc_id_BxS.device)[None].expand_as(doc_id_BxS)
  is_start = torch.ones_like(doc_id_BxS, dtype=torch.bool)
  is_start[:, 1:] = doc_id_BxS[:, 1:] != doc_id_BxS[:, :-1]
  return torch.cummax(torch.where(is_start, idx, 0), dim=1).values


def build_blocks(anchors_BxN, block_valid_BxN, input_ids_BxS, loss_mask_BxS, doc_id_BxS,
                 position_ids_BxS, *, block_size: int, mask_token_id: int,
                 gamma: float | None) -> Blocks:
  """Noise ids, positions, labels and loss weights of every block (docs/DESIGN.md contract)."""
  B, S = input_ids_BxS.shape
  N, K = anchors_BxN.shape[1], block_size
  dev = input_ids_BxS.device
  a = anchors_BxN.long()
  k = torch.arange(K, device=dev)
  tgt = a[:, :, None] + k                                             # [B, N, K]
  inside = tgt < S
  tgt_c = tgt.clamp(max=S - 1).reshape(B, N * K)
  take = lambda x: torch.gather(x, 1, tgt_c).reshape(B, N, K)
  labels = take(input_ids_BxS.long())
  same_doc = take(doc_id_BxS) == torch.gather(doc_id_BxS, 1, a)[:, :, None]
  supervised = take(loss_mask_BxS).bool()
  kf = k.float()
  decay = torch.exp(-(kf - 1.0) / gamma) if gamma else torch.ones(K, device=dev)
  decay = torch.where(k >= 1, decay, 0.0)
  valid = block_valid_BxN[:, :, None]
  weights = (valid & inside & same_doc & supervised).float() * decay
  first = torch.gather(input_ids_BxS.long(), 1, a)
  noise = torch.full((B, N, K), mask_token_id, dtype=torch.long, device=dev)
  noise[:, :, 0] = torch.where(block_valid_BxN, first, mask_token_id)
  positions = torch.gather(position_ids_BxS.long(), 1, a)[:, :, None] + k
  doc_start = torch.gather(document_starts(doc_id_BxS), 1, a)
  flat = lambda x: x.reshape(B, N * K)
  return Blocks(a, block_valid_BxN, torch.where(block_valid_BxN, doc_start, 0), flat(noise),
                flat(positions), flat(labels), flat(weights))


def chunked_cross_entropy(h_TxD, lm_head_VxD, labels_T, *, chunk_size: int,
                          compute_dtype=torch.float32, f32_logits: bool = True,
                          argmax: bool = True):
  """Per-token CE and argmax against the frozen LM head, `chunk_size` tokens of logits at a time.

  Each chunk runs under activation checkpointing, so one chunk's [C, V] logits is alive at once.
  Logits are f32 from compute-dtype operands (as preferred_element_type=f32 in JAX); with
  f32_logits=False the matmul runs in the compute dtype and its logits are rounded to it before the
  f32 log-sum-exp, as SpecForge-style trainers do (the bench's PyTorch path). argmax=False returns
  None for the argmax and spares its pass over the logits.
  """
  w = lm_head_VxD.detach().to(compute_dtype)
  w = w.float() if f32_logits else w

  def chunk(h_CxD, y_C):
    h_CxD = h_CxD.to(compute_dtype)
    logits_CxV = ((h_CxD.float() if f32_logits else h_CxD) @ w.T).float()
    ce = torch.logsumexp(logits_CxV, -1) - logits_CxV.gather(1, y_C[:, None])[:, 0]
    return ce, logits_CxV.argmax(-1) if argmax else None

  ces, preds = [], []
  with torch.autocast(h_TxD.device.type, enabled=False):
    for s in range(0, h_TxD.shape[0], chunk_size):
      ce, pred = checkpoint(chunk, h_TxD[s:s + chunk_size], labels_T[s:s + chunk_size],
                            use_reentrant=False)
      ces.append(ce)
      preds.append(pred)
  return torch.cat(ces), torch.cat(preds) if argmax else None


def block_sums(ce_BxQ, pred_BxQ, blocks: Blocks, block_size: int) -> dict[str, torch.Tensor]:
  B, Q = ce_BxQ.shape
  w = blocks.weights
  on = w > 0
  correct = (pred_BxQ == blocks.labels) & on
  c = correct.reshape(B, -1, block_size)[:, :, 1:]
  accept = torch.cumprod(c.long(), dim=-1).sum(-1)
  valid = blocks.block_valid
  return {"wce": (ce_BxQ * w).sum(), "w": w.sum(), "correct": correct.sum().float(),
          "counted": on.sum().float(), "accept": torch.where(valid, accept, 0).sum().float(),
          "blocks": valid.sum().float()}


def metrics_from_sums(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
  safe = lambda x: torch.clamp(x, min=1e-9)
  return {"loss": s["wce"] / safe(s["w"]), "accuracy": s["correct"] / safe(s["counted"]),
          "tau_estimate": s["accept"] / safe(s["blocks"]) + 1.0}


def micro_sums(model: DFlashDrafter, micro: dict, frozen: dict, anchors_BxN, block_valid_BxN, *,
               gamma: float | None, chunk_size: int, return_aux: bool = False):
  """The objective of one micro-batch with explicit anchors (torch twin of jax_drafter.step)."""
  cfg, cd = model.config, model.compute_dtype
  blocks = build_blocks(anchors_BxN, block_valid_BxN, micro["input_ids"], micro["loss_mask"],
                        micro["doc_id"], micro["position_ids"], block_size=cfg.block_size,
                        mask_token_id=cfg.mask_token_id, gamma=gamma)
  noise_emb = F.embedding(blocks.noise_ids, frozen["embed"].detach()).to(cd)
  h, outs = model(noise_emb, micro["features"], micro["position_ids"], blocks.positions,
                  blocks.anchors, blocks.doc_start, blocks.block_valid, return_layers=True)
  B, Q, D = h.shape
  ce, pred = chunked_cross_entropy(h.reshape(B * Q, D), frozen["lm_head"], blocks.labels.reshape(-1),
                                   chunk_size=chunk_size, compute_dtype=cd)
  sums = block_sums(ce.view(B, Q), pred.view(B, Q), blocks, cfg.block_size)
  if return_aux:
    return sums, (blocks, h, outs)
  return sums


@contextlib.contextmanager
def no_tf32():
  """f32 matmuls in f32 (not TF32) on GPU while parity is measured."""
  old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
  torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
  try:
    yield
  finally:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
