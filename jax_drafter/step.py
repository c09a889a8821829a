"""The jitted train step: (state, batch, frozen) -> (state, metrics). Pure; no loop logic here.

batch: dict of [A, B, S] int32 arrays (A = gradient-accumulation micro-steps) input_ids,
loss_mask, doc_id, position_ids, and `features` [A, B, S, F] (target hidden states, imported
through DLPack: never donated). frozen: {"embed": [V, D], "lm_head": [V, D]} (never donated), plus
"draft_head", "draft_ids" and "to_draft" with a reduced draft vocabulary (draft_vocab.py).
The loss is sum(CE * w) / sum(w) with sum(w) over the whole global batch (all micro-steps).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jax_drafter import draft_vocab, objective
from jax_drafter.config import DrafterConfig, TrainSection
from jax_drafter.model import Drafter

DTYPE = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DROPOUT_STREAM = 0x0D0D   # fold_in constant: the dropout key of a micro-step, apart from its anchors'


class TrainState(NamedTuple):
  step: jax.Array      # int32 scalar: optimizer steps taken
  params: Any          # nnx.State of float32 master weights
  opt_state: Any
  rng: jax.Array       # base key; step t uses fold_in(rng, t): resume reproduces the same anchors


def lr_schedule(t: TrainSection):
  """Learning rate of update `count` (0-based): linear warm-up over train.warmup_steps, then cosine
  to min_lr_ratio x peak at train.steps. Evaluated at count + 1, so the first update already moves
  (peak / warmup_steps); at count it would be 0, a step spent on nothing."""
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
      decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_lr_ratio)
  return lambda count: base(count + 1)


def make_optimizer(t: TrainSection) -> optax.GradientTransformation:
  schedule = lr_schedule(t)
  # No weight decay on norm weights (1-D).
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(t.grad_clip),
      optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask))


def learning_rate(t: TrainSection, step):
  return lr_schedule(t)(step)


def init_state(cfg: DrafterConfig, t: TrainSection, optimizer) -> tuple[Any, TrainState]:
  model = Drafter(cfg, rngs=nnx.Rngs(t.seed), compute_dtype=DTYPE[t.compute_dtype])
  graphdef, params = nnx.split(model, nnx.Param)
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                     jax.random.key_data(jax.random.key(t.seed + 1)))
  return graphdef, state


def frozen_in_compute_dtype(frozen: dict, compute_dtype: str) -> dict:
  """The frozen embedding / LM head narrowed to the compute dtype once, where they are wider (a
  float32 target with bfloat16 compute): the step reads them only in the compute dtype, and a
  per-step cast of a [V, D] head costs ~20 ms on a CPU. Tied weights stay one array. Values are
  those the step's own cast gives, so results are bitwise unchanged."""
  cd = jnp.dtype(DTYPE[compute_dtype])
  narrowed = {}

  def cast(x):
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize <= cd.itemsize:
      return x
    if id(x) not in narrowed:
      narrowed[id(x)] = x.astype(cd)
    return narrowed[id(x)]

  return {k: cast(v) for k, v in frozen.items()}


def micro_sums(graphdef, params, micro: dict, frozen: dict, key, *, cfg: DrafterConfig,
               t: TrainSection, attn_impl: dict | None = None, return_aux: bool = False,
               anchors: tuple | None = None, training: bool = False):
  """Forward of one micro-batch -> additive Sums (and the blocks/hidden states if asked).

  anchors: optional (anchors [B, N], block_valid [B, N]) used instead of sampling with `key`
  (parity feeds the same anchors to the PyTorch reference).
  training: apply train.dropout (its key is derived from `key`, so the anchors drawn are the same
  with and without dropout); validation and acceptance never drop.
  """
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
  features, teacher = split_features(micro["features"], cfg, t)
  drop_key = (jax.random.fold_in(key, DROPOUT_STREAM)
              if training and t.dropout and key is not None else None)
  h = model(noise_emb, features.astype(cd), micro["position_ids"], blocks.positions,
            blocks.anchors, blocks.doc_start, blocks.block_valid, remat=t.remat,
            attn_impl=attn_impl, dropout_rate=t.dropout, dropout_key=drop_key)
  head, labels, loss_weights = frozen["lm_head"], blocks.labels, None
  if "draft_ids" in frozen:     # a reduced draft vocabulary (draft_vocab.py)
    labels, inside = draft_vocab.to_draft_labels(frozen, labels)
    head, loss_weights = frozen["draft_head"], jnp.where(inside, blocks.weights, 0.0)
  ce, pred, kl = supervised_ce(h, head, labels, cfg.block_size,
                               chunk_size=t.ce_chunk_size, compute_dtype=cd,
                               teacher=teacher, anchors=blocks.anchors, kd_weight=t.kd_weight)
  if "draft_ids" in frozen:
    pred = draft_vocab.to_target_ids(frozen, pred)
  sums = objective.block_sums(ce, pred, blocks, cfg.block_size, kl, loss_weights=loss_weights)
  if return_aux:
    return sums, (blocks, h, ce, pred)
  return sums


def split_features(features_BxSxF, cfg: DrafterConfig, t: TrainSection):
  """(drafter features [B, S, n*H], the target's final-normed states [B, S, H] or None).

  With distillation (train.kd_weight > 0) the target also captures its final-normed hidden state
  after the drafter's layers (config.feature_layer_ids), the input of its LM head."""
  if not t.kd_weight:
    return features_BxSxF, None
  F = len(cfg.target_layer_ids) * cfg.hidden_size
  if features_BxSxF.shape[-1] != F + cfg.hidden_size:
    raise ValueError(f"train.kd_weight={t.kd_weight} needs features of {F} + {cfg.hidden_size} "
                     f"(the target's final-normed state), got {features_BxSxF.shape[-1]}")
  return features_BxSxF[..., :F], features_BxSxF[..., F:]


def supervised_ce(h_BxQxD, lm_head_VxD, labels_BxQ, block_size: int, *, chunk_size: int,
                  compute_dtype, teacher=None, anchors=None, kd_weight: float = 0.0):
  """CE and argmax [B, Q] of block offsets 1..K-1 only: offset 0 (the anchor's own token) never
  has a label (weight 0 by the docs/DESIGN.md contract), so its LM-head rows are not computed at all,
  1/K of the largest matmul of the step. Offset 0 gets CE 0 and prediction -1.

  teacher [B, S, D] (the target's final-normed states; needs anchors [B, N] and kd_weight > 0):
  the objective mixes in KL(target || drafter), the target's distribution for token a + k being
  its logits at position a + k - 1. Returns (objective, pred, kl or None)."""
  B, Q, D = h_BxQxD.shape
  K = block_size
  N = Q // K
  h = h_BxQxD.reshape(B, N, K, D)[:, :, 1:].reshape(B * N * (K - 1), D)
  y = labels_BxQ.reshape(B, N, K)[:, :, 1:].reshape(-1)
  pad = ((0, 0), (0, 0), (1, 0))
  unflat = lambda x, fill=0: jnp.pad(x.reshape(B, N, K - 1), pad,
                                     constant_values=fill).reshape(B, Q)
  if teacher is None:
    ce, pred = objective.chunked_cross_entropy(h, lm_head_VxD, y, chunk_size=chunk_size,
                                               compute_dtype=compute_dtype)
    return unflat(ce), unflat(pred, -1), None
  S = teacher.shape[1]
  before = anchors[:, :, None] + jnp.arange(K - 1, dtype=jnp.int32)        # a + k - 1, k = 1..K-1
  before = jnp.minimum(before, S - 1).reshape(B, N * (K - 1))
  t_rows = jnp.take_along_axis(teacher, before[:, :, None], axis=1).reshape(-1, teacher.shape[-1])
  obj, pred, kl = objective.chunked_distillation(h, lm_head_VxD, y, t_rows, kd_weight=kd_weight,
                                                 chunk_size=chunk_size, compute_dtype=compute_dtype)
  return unflat(obj), unflat(pred, -1), unflat(kl)


def make_train_step(graphdef, cfg: DrafterConfig, t: TrainSection, optimizer,
                    attn_impl: dict | None = None):
  def loss_fn(params, micro, frozen, key):
    sums = micro_sums(graphdef, params, micro, frozen, key, cfg=cfg, t=t, attn_impl=attn_impl,
                      training=True)
    return sums.wce, sums

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
    metrics = objective.metrics_from_sums(sums, distill=bool(t.kd_weight))
    grad_norm = optax.tree.norm(g)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    # A non-finite step leaves the state untouched; the loop stops the run on `finite == False`.
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = TrainState(state.step + finite.astype(jnp.int32), keep(params, state.params),
                           keep(opt_state, state.opt_state), state.rng)
    metrics.update(grad_norm=grad_norm, finite=finite, lr=learning_rate(t, state.step))
    return new_state, metrics

  return train_step


def make_eval_sums(graphdef, cfg: DrafterConfig, t: TrainSection, attn_impl: dict | None = None):
  """Jitted (params, batch [1, B, ...], frozen, key) -> Sums of one batch, no update: the
  validation loss (the same objective as training, anchors drawn from `key`)."""
  def eval_sums(params, batch, frozen, key):
    micro = jax.tree.map(lambda x: x[0], batch)
    return micro_sums(graphdef, params, micro, frozen, key, cfg=cfg, t=t, attn_impl=attn_impl)
  return jax.jit(eval_sums)


def make_accept_lengths(graphdef, cfg: DrafterConfig, t: TrainSection,
                        attn_impl: dict | None = None):
  """Jitted (params, batch [1, B, ...], frozen, anchors [1, B, N], valid [1, B, N]) -> int32 [B, N]:
  the accepted length of a greedy verify step anchored at each given position (teacher forcing
  equals decoding at temperature 0; objective.walk_tau turns these into tau)."""
  def accept(params, batch, frozen, anchors, valid):
    micro = jax.tree.map(lambda x: x[0], batch)
    _, (blocks, _, _, pred) = micro_sums(graphdef, params, micro, frozen, None, cfg=cfg, t=t,
                                         attn_impl=attn_impl, return_aux=True,
                                         anchors=(anchors[0], valid[0]))
    return objective.accepted_lengths(pred, blocks, cfg.block_size)
  return jax.jit(accept)


def jit_train_step(train_step, out_shardings=None):
  """State is donated (its buffers are reused for the new state); batch and frozen arrays are not:
  features and frozen weights may be DLPack imports that torch still owns. out_shardings: the
  replicated sharding when the batch rows are split over a mesh (pipeline.Placement)."""
  if out_shardings is None:
    return jax.jit(train_step, donate_argnums=0)
  return jax.jit(train_step, donate_argnums=0, out_shardings=out_shardings)
