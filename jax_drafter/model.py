"""The DFlash drafter as a Flax NNX model (z-lab / Qwen3 layout, module names as in the checkpoint).

Parameters are float32 master weights; every matmul casts to `compute_dtype` and accumulates in
f32; RMSNorm and softmax statistics run in f32. The frozen target embedding and LM head are not
parameters of this module: they are passed in as arrays (no gradient is ever formed for them).
Letters as in config.py: B, S, N, K, Q = N*K, D, F, Hq, Hkv, Dh, I.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_drafter.config import DrafterConfig
from pallas_kernels.dflash_attention.api import dflash_attention


def matmul(x, w):
  """x @ w (w 2-D) with both in the compute dtype, the output too, accumulated in f32.

  XLA:CPU rewrites a bfloat16 dot with a bfloat16 output into a float32 dot of upcast operands,
  several times slower than its bfloat16 dot with a float32 output (XNNPACK's kernel). On a CPU
  the forward and the input gradient are therefore written as float32-output dots rounded back
  to bfloat16: the same arithmetic (f32 accumulation, one rounding of the result) in another
  order of the sums. The weight gradient is written the same way, but XLA:CPU still upcasts it:
  its operands are contracted over their leading dimension (an explicit transpose behind an
  optimization barrier did not change that). The CPU default's drafter step, both forms timed in
  one process on a 2-core EPYC: 166.9 -> 145.1 ms (`scripts/cpu_step_profile.py
  --compare-plain-matmul`) and 164.5 -> 137.0 ms (the same loop, earlier). Elsewhere (GPUs, where
  cuBLAS accumulates in f32 and writes bf16) it is `jnp.matmul`, unchanged."""
  if x.dtype == w.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
    return _bf16_matmul_cpu()(x, w)
  return jnp.matmul(x, w)


def _bf16_dot(a, b, contract):
  return jax.lax.dot_general(a, b, (contract, ((), ())),
                             preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@functools.cache
def _bf16_matmul_cpu():
  """The custom_vjp of `matmul` on a CPU, built on first use there only (a GPU never defines it)."""
  from jax.custom_derivatives import SymbolicZero

  @jax.custom_vjp
  def f(x, w):
    return _bf16_dot(x, w, ((x.ndim - 1,), (0,)))

  def fwd(x, w):
    # symbolic zeros: the primals say whether they are differentiated, so that no gradient is
    # computed for an input nothing differentiates (the target features entering `fc`), as
    # jnp.matmul's own transpose skips it. The flags travel as the residual's structure.
    need = (() if x.perturbed else None, () if w.perturbed else None)
    return f(x.value, w.value), (x.value, w.value, need)

  def bwd(res, g):
    x, w, (need_x, need_w) = res
    if isinstance(g, SymbolicZero):
      return None, None
    g = g.astype(jnp.bfloat16)
    dx = _bf16_dot(g, w, ((g.ndim - 1,), (1,))) if need_x is not None else None
    dw = None
    if need_w is not None:
      x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
      dw = _bf16_dot(x2, g2, ((0,), (0,)))
    return dx, dw

  f.defvjp(fwd, bwd, symbolic_zeros=True)
  return f


class Linear(nnx.Module):
  """y = x @ weight, weight stored [in, out] (the checkpoint stores [out, in])."""

  def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, compute_dtype=jnp.float32):
    std = 0.02
    self.weight = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32) * std)
    self.compute_dtype = compute_dtype

  def __call__(self, x):
    # Output directly in the compute dtype (the MXU/tensor cores still accumulate in f32). Asking
    # for an f32 output here made XLA keep f32 copies of activations and of the target features
    # for the weight-gradient matmuls (measured: f32[S, n*D] = 12.5 GiB at S=131072).
    cd = self.compute_dtype
    return matmul(x.astype(cd), self.weight[...].astype(cd))


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, compute_dtype=jnp.float32):
    self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps
    self.compute_dtype = compute_dtype

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.weight[...]).astype(self.compute_dtype)


def dropout(x, rate: float, key):
  """Inverted dropout for training: each element zeroed with probability `rate` (in steps of
  1/256: the draw is one random byte per element, a quarter of the random bits of a float draw),
  the kept ones scaled by 1 / (1 - the rate actually used). rate 0 or key None: x unchanged."""
  if not rate or key is None:
    return x
  cut = min(255, max(1, round(rate * 256)))
  keep = jax.random.bits(key, x.shape, jnp.uint8) >= cut
  return jnp.where(keep, x * (256.0 / (256 - cut)), 0).astype(x.dtype)


def rope(x_BxTxHxDh, pos_BxT, theta: float):
  """Rotary embedding, rotate-half (non-interleaved) convention of Llama/Qwen3, angles in f32."""
  dh = x_BxTxHxDh.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  ang = pos_BxT.astype(jnp.float32)[..., None] * inv_freq          # [B, T, Dh/2]
  cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None, :]
  sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None, :]
  x = x_BxTxHxDh.astype(jnp.float32)
  x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
  rot = jnp.concatenate([-x2, x1], -1)
  return (x * cos + rot * sin).astype(x_BxTxHxDh.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: DrafterConfig, layer: int, *, rngs: nnx.Rngs, compute_dtype):
    D, Hq, Hkv, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kw = dict(rngs=rngs, compute_dtype=compute_dtype)
    self.q_proj = Linear(D, Hq * Dh, **kw)
    self.k_proj = Linear(D, Hkv * Dh, **kw)
    self.v_proj = Linear(D, Hkv * Dh, **kw)
    self.o_proj = Linear(Hq * Dh, D, **kw)
    self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps, compute_dtype)
    self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps, compute_dtype)
    self.shape = (Hq, Hkv, Dh)
    self.window = cfg.window(layer)
    self.block_size = cfg.block_size
    self.theta = cfg.rope_theta

  def context_kv(self, ctx_BxSxD, ctx_pos_BxS):
    """Context K (normed, RoPE at the context positions) and V, [B, S, Hkv, Dh] each. The
    inference session caches these per position."""
    _, Hkv, Dh = self.shape
    B, S, _ = ctx_BxSxD.shape
    k_ctx = self.k_norm(self.k_proj(ctx_BxSxD).reshape(B, S, Hkv, Dh))
    v_ctx = self.v_proj(ctx_BxSxD).reshape(B, S, Hkv, Dh)
    return rope(k_ctx, ctx_pos_BxS, self.theta), v_ctx

  def attend(self, x_BxQxD, k_ctx, v_ctx, blk_pos_BxQ, anchors_BxN, doc_start_BxN,
             block_valid_BxN, attn_impl, block_size: int | None = None):
    """The blocks' queries over the given context K/V and their own block K/V, then o_proj.
    block_size: the blocks' size if not the trained one (inference may propose fewer tokens)."""
    Hq, Hkv, Dh = self.shape
    B, Q, _ = x_BxQxD.shape
    # Context and block K/V come from the same projections and are never concatenated.
    q = rope(self.q_norm(self.q_proj(x_BxQxD).reshape(B, Q, Hq, Dh)), blk_pos_BxQ, self.theta)
    k_blk = rope(self.k_norm(self.k_proj(x_BxQxD).reshape(B, Q, Hkv, Dh)), blk_pos_BxQ, self.theta)
    v_blk = self.v_proj(x_BxQxD).reshape(B, Q, Hkv, Dh)
    o = dflash_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors_BxN, doc_start_BxN,
                         block_valid_BxN, block_size=block_size or self.block_size,
                         window=self.window, scale=Dh ** -0.5, **attn_impl)
    return self.o_proj(o.reshape(B, Q, Hq * Dh))

  def __call__(self, x_BxQxD, ctx_BxSxD, ctx_pos_BxS, blk_pos_BxQ, anchors_BxN, doc_start_BxN,
               block_valid_BxN, attn_impl):
    k_ctx, v_ctx = self.context_kv(ctx_BxSxD, ctx_pos_BxS)
    return self.attend(x_BxQxD, k_ctx, v_ctx, blk_pos_BxQ, anchors_BxN, doc_start_BxN,
                       block_valid_BxN, attn_impl)


class MLP(nnx.Module):
  def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, compute_dtype):
    kw = dict(rngs=rngs, compute_dtype=compute_dtype)
    self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
    self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
    self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, **kw)

  def __call__(self, x):
    cd = self.down_proj.compute_dtype
    return _swiglu_down(self.gate_proj(x), self.up_proj(x),
                        self.down_proj.weight[...].astype(cd))


@jax.checkpoint
def _swiglu_down(g, u, w_down):
  """down(silu(g) * u), keeping only g and u for the backward: the product, the down projection's
  input, is remade there from them (one elementwise pass) instead of being held from the forward
  to the backward, as torch.compile's partitioner does for the same chain. The 27B drafter's
  [16384, 17408] bf16 product is 544 MiB a layer at 27b-8k, 2.7 GiB over its 5 layers."""
  return matmul(jax.nn.silu(g) * u, w_down)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: DrafterConfig, layer: int, *, rngs: nnx.Rngs, compute_dtype):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, compute_dtype)
    self.self_attn = Attention(cfg, layer, rngs=rngs, compute_dtype=compute_dtype)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, compute_dtype)
    self.mlp = MLP(cfg, rngs=rngs, compute_dtype=compute_dtype)

  def __call__(self, x, ctx, ctx_pos, blk_pos, anchors, doc_start, block_valid, attn_impl,
               drop=(0.0, None)):
    k_ctx, v_ctx = self.self_attn.context_kv(ctx, ctx_pos)
    return self.with_context_kv(x, k_ctx, v_ctx, blk_pos, anchors, doc_start, block_valid,
                                attn_impl, drop=drop)

  def with_context_kv(self, x, k_ctx, v_ctx, blk_pos, anchors, doc_start, block_valid, attn_impl,
                      block_size: int | None = None, drop=(0.0, None)):
    """The layer given its context K/V (Attention.context_kv): training and inference share it.
    drop: (rate, key) of residual dropout on the attention and MLP outputs (training only)."""
    rate, key = drop
    k_attn, k_mlp = jax.random.split(key) if rate and key is not None else (None, None)
    a = self.self_attn.attend(self.input_layernorm(x), k_ctx, v_ctx, blk_pos, anchors,
                              doc_start, block_valid, attn_impl, block_size)
    h = x + dropout(a, rate, k_attn)
    return h + dropout(self.mlp(self.post_attention_layernorm(h)), rate, k_mlp)


def _remat_policy(remat: str):
  if remat == "offload":
    # Saved matmul outputs go to pinned host memory and come back for the backward.
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
  return jax.checkpoint_policies.nothing_saveable


class Drafter(nnx.Module):
  def __init__(self, cfg: DrafterConfig, *, rngs: nnx.Rngs, compute_dtype=jnp.float32):
    self.config = cfg
    self.compute_dtype = compute_dtype
    n = len(cfg.target_layer_ids)
    self.fc = Linear(n * cfg.hidden_size, cfg.hidden_size, rngs=rngs, compute_dtype=compute_dtype)
    self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, compute_dtype)
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, compute_dtype=compute_dtype)
                            for i in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, compute_dtype)

  def __call__(self, noise_emb_BxQxD, target_feat_BxSxF, ctx_pos_BxS, blk_pos_BxQ, anchors_BxN,
               doc_start_BxN, block_valid_BxN, *, remat: str = "none",
               attn_impl: dict | None = None, return_layers: bool = False,
               dropout_rate: float = 0.0, dropout_key=None):
    """Returns the final-normed block hidden states [B, Q, D] (and per-layer outputs if asked).
    dropout_rate with dropout_key (training only): dropout on the projected target context and
    on every layer's attention and MLP outputs."""
    attn_impl = attn_impl or {}
    rate = dropout_rate if dropout_key is not None else 0.0
    keys = (jax.random.split(dropout_key, len(self.layers) + 1) if rate
            else [None] * (len(self.layers) + 1))
    ctx = dropout(self.hidden_norm(self.fc(target_feat_BxSxF)), rate, keys[-1])
    x = noise_emb_BxQxD.astype(self.compute_dtype)
    args = (ctx, ctx_pos_BxS, blk_pos_BxQ, anchors_BxN, doc_start_BxN, block_valid_BxN)

    def run_layer(layer, x, key, *args):
      return layer(*((x,) + args), attn_impl, (rate, key))

    def run_all(layers, x, *args):
      outs = []
      for i, layer in enumerate(layers):
        step = run_layer
        if remat in ("layer", "offload"):
          step = nnx.remat(run_layer, policy=_remat_policy(remat))
        x = step(layer, x, keys[i], *args)
        outs.append(x)
      return x, outs

    if remat == "full":
      x, outs = nnx.remat(run_all, policy=jax.checkpoint_policies.nothing_saveable)(
          self.layers, x, *args)
    else:
      x, outs = run_all(self.layers, x, *args)
    h = self.norm(x)
    return (h, outs) if return_layers else h
