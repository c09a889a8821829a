"""The jitted train step: (state, batch, frozen) -> (state, metrics). Pure; no loop logic here.

batch: dict of [A, B, S] int32 arrays (A = gradient-accumulation micro-steps) input_ids,
loss_mask, doc_id, position_ids, and `features` [A, B, S, F] (target hidden states, imported
through DLPack: never donated); with train.kd_weight > 0 also `final_hidden` [A, B, S, D] (the
target's final-normed last hidden states, from the same forward, imported the same way).
frozen: {"embed": [V, D], "lm_head": [V, D]} (never donated).
The loss is sum(loss * w) / sum(w) with sum(w) over the whole global batch (all micro-steps), where
loss = CE, or (1 - a) CE + a KD with a = train.kd_weight (objective.chunked_ce_kd).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_drafter import objective
from jax_drafter.config import DrafterConfig, TrainSection
from jax_drafter.model import Drafter

DTYPE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class TrainState(NamedTuple):
  step: jax.Array      # int32 scalar: optimizer steps taken
  params: Any          # nnx.State of float32 master weights
  opt_state: Any
  rng: jax.Array       # base key; step t uses fold_in(rng, t): resume reproduces the same anchors


def make_optimizer(t: TrainSection) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
      decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_lr_ratio)
  # No weight decay on norm weights (1-D).
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(t.grad_clip),
      optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask))


def learning_rate(t: TrainSection, step):
  return optax.warmup_cosine_decay_schedule(
      0.0, t.learning_rate, t.warmup_steps, max(t.steps, t.warmup_steps + 1),
      t.learning_rate * t.min_lr_ratio)(step)


def init_state(cfg: DrafterConfig, t: TrainSection, optimizer) -> tuple[Any, TrainState]:
  model = Drafter(cfg, rngs=nnx.Rngs(t.seed), compute_dtype=DTYPE[t.compute_dtype])
  graphdef, params = nnx.split(model, nnx.Param)
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                     jax.random.key_data(jax.random.key(t.seed + 1)))
  return graphdef, state


def micro_sums(graphdef, params, micro: dict, frozen: dict, key, *, cfg: DrafterConfig,
               t: TrainSection, attn_impl: dict | None = None, return_aux: bool = False,
               anchors: tuple | None = None):
  """Forward of one micro-batch -> additive Sums (and the blocks/hidden states if asked).

  anchors: optional (anchors [B, N], block_valid [B, N]) used instead of sampling with `key`
  (parity feeds the same anchors to the PyTorch reference).
  """
  use_kd = t.kd_weight > 0
  if use_kd and "final_hidden" not in micro:
    raise ValueError(f"train.kd_weight={t.kd_weight} needs the target's final hidden states in the "
                     "batch (key 'final_hidden', [B, S, D]): produce them with "
                     "Target.stacked_features(..., with_final=True), or set train.kd_weight=0")
  model = nnx.merge(graphdef, params)
  if anchors is None:
    anchors, valid = objective.sample_anchors(key, micro["loss_mask"], micro["doc_id"],
                                              t.num_anchors)
  else:
    anchors, valid = anchors
  blocks = objective.build_blocks(
      anchors, valid, micro["input_ids"], micro["loss_mask"], micro["doc_id"],
      micro["position_ids"], block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
      gamma=t.loss_decay_gamma)
  cd = DTYPE[t.compute_dtype]
  embed = jax.lax.stop_gradient(frozen["embed"])
  noise_emb = jnp.take(embed, blocks.noise_ids, axis=0).astype(cd)
  h = model(noise_emb, micro["features"].astype(cd), micro["position_ids"], blocks.positions,
            blocks.anchors, blocks.doc_start, blocks.block_valid, remat=t.remat,
            attn_impl=attn_impl)
  if use_kd:
    loss, ce, kd, pred = supervised_ce_kd(
        h, frozen["lm_head"], blocks.labels, blocks.anchors, micro["final_hidden"], cfg.block_size,
        kd_weight=t.kd_weight, kd_temperature=t.kd_temperature, chunk_size=t.ce_chunk_size,
        compute_dtype=cd)
    sums = objective.block_sums(ce, pred, blocks, cfg.block_size, kd_BxQ=kd, loss_BxQ=loss)
  else:
    ce, pred = supervised_ce(h, frozen["lm_head"], blocks.labels, cfg.block_size,
                             chunk_size=t.ce_chunk_size, compute_dtype=cd)
    sums = objective.block_sums(ce, pred, blocks, cfg.block_size)
  if return_aux:
    return sums, (blocks, h, ce, pred)
  return sums


def supervised_ce(h_BxQxD, lm_head_VxD, labels_BxQ, block_size: int, *, chunk_size: int,
                  compute_dtype):
  """CE and argmax [B, Q] of block offsets 1..K-1 only: offset 0 (the anchor's own token) never
  has a label (weight 0 by the DESIGN contract), so its LM-head rows are not computed at all,
  1/K of the largest matmul of the step. Offset 0 gets CE 0 and prediction -1."""
  h, y = _supervised_rows(h_BxQxD, labels_BxQ, block_size)
  ce, pred = objective.chunked_cross_entropy(h, lm_head_VxD, y, chunk_size=chunk_size,
                                             compute_dtype=compute_dtype)
  B, Q = labels_BxQ.shape
  return _offset0_back(ce, B, Q, block_size), _offset0_back(pred, B, Q, block_size, -1)


def supervised_ce_kd(h_BxQxD, lm_head_VxD, labels_BxQ, anchors_BxN, final_BxSxD, block_size: int,
                     *, kd_weight: float, kd_temperature: float, chunk_size: int, compute_dtype):
  """supervised_ce blended with knowledge distillation from the target (objective.chunked_ce_kd).

  The teacher of block offset k is the target's next-token distribution at position a_n + k - 1
  (the target is causal: its logits at p are the distribution of token p + 1, the label ids[a + k]).
  a_n + k - 1 is clamped inside the row; where a_n + k is outside the row or the document the
  weight is 0 anyway. final_BxSxD: the target's final-normed last hidden states (no gradient).
  Returns (loss, ce, kd, pred) [B, Q]; offset 0 gets 0, 0, 0 and prediction -1.
  """
  B, Q = labels_BxQ.shape
  S, D = final_BxSxD.shape[1:]
  K = block_size
  h, y = _supervised_rows(h_BxQxD, labels_BxQ, K)
  k = jnp.arange(1, K, dtype=jnp.int32)
  src = jnp.minimum(anchors_BxN[:, :, None] + k - 1, S - 1)              # [B, N, K-1]
  rows = (jnp.arange(B, dtype=jnp.int32)[:, None, None] * S + src).reshape(-1)
  loss, ce, kd, pred = objective.chunked_ce_kd(
      h, lm_head_VxD, y, final_BxSxD.reshape(B * S, D), rows, kd_weight=kd_weight,
      kd_temperature=kd_temperature, chunk_size=chunk_size, compute_dtype=compute_dtype)
  back = lambda x: _offset0_back(x, B, Q, K)
  return back(loss), back(ce), back(kd), _offset0_back(pred, B, Q, K, -1)


def _supervised_rows(h_BxQxD, labels_BxQ, K):
  """Hidden states [B*N*(K-1), D] and labels of the block offsets 1..K-1."""
  B, Q, D = h_BxQxD.shape
  N = Q // K
  h = h_BxQxD.reshape(B, N, K, D)[:, :, 1:].reshape(B * N * (K - 1), D)
  return h, labels_BxQ.reshape(B, N, K)[:, :, 1:].reshape(-1)


def _offset0_back(x_T, B, Q, K, fill=0):
  """[B*N*(K-1)] per-token values -> [B, Q] with `fill` at block offset 0."""
  x = x_T.reshape(B, Q // K, K - 1)
  return jnp.pad(x, ((0, 0), (0, 0), (1, 0)), constant_values=fill).reshape(B, Q)


def make_train_step(graphdef, cfg: DrafterConfig, t: TrainSection, optimizer,
                    attn_impl: dict | None = None):
  def loss_fn(params, micro, frozen, key):
    sums = micro_sums(graphdef, params, micro, frozen, key, cfg=cfg, t=t, attn_impl=attn_impl)
    return sums.wloss, sums

  grad_fn = jax.grad(loss_fn, has_aux=True)

  def train_step(state: TrainState, batch: dict, frozen: dict):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    A = batch["input_ids"].shape[0]

    def accumulate(carry, xs):
      g_acc, s_acc = carry
      micro, i = xs
      g, sums = grad_fn(state.params, micro, frozen, jax.random.fold_in(key, i))
      return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, sums)), None

    if A == 1:
      # No accumulation buffer: saves a parameter-sized f32 array and an add per step.
      g, sums = grad_fn(state.params, jax.tree.map(lambda x: x[0], batch), frozen,
                        jax.random.fold_in(key, 0))
    else:
      zeros_g = jax.tree.map(jnp.zeros_like, state.params)
      zeros_s = objective.Sums(*([jnp.zeros((), jnp.float32)] * len(objective.Sums._fields)))
      (g, sums), _ = jax.lax.scan(accumulate, (zeros_g, zeros_s), (batch, jnp.arange(A)))
    # Normalise by the global sum of weights: sum(CE*w)/sum(w) over the whole batch.
    g = jax.tree.map(lambda x: x / jnp.maximum(sums.w, 1e-9), g)
    updates, opt_state = optimizer.update(g, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = objective.metrics_from_sums(sums, kd=t.kd_weight > 0)
    grad_norm = optax.tree.norm(g)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    # A non-finite step leaves the state untouched; the loop stops the run on `finite == False`.
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = TrainState(state.step + finite.astype(jnp.int32), keep(params, state.params),
                           keep(opt_state, state.opt_state), state.rng)
    metrics.update(grad_norm=grad_norm, finite=finite, lr=learning_rate(t, state.step))
    return new_state, metrics

  return train_step


def jit_train_step(train_step, out_shardings=None):
  """State is donated (its buffers are reused for the new state); batch and frozen arrays are not:
  features and frozen weights may be DLPack imports that torch still owns. out_shardings: the
  replicated sharding when the batch rows are split over a mesh (trainer.Placement)."""
  if out_shardings is None:
    return jax.jit(train_step, donate_argnums=0)
  return jax.jit(train_step, donate_argnums=0, out_shardings=out_shardings)
