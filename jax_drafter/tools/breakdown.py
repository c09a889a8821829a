"""Where the time of one drafter training step goes: each part compiled and timed on its own.

Used by `python -m jax_drafter.tools.bench --breakdown`. The parts are the step's own modules on the
plan's shapes, each as forward + backward (the gradients the train step forms for it):

  fc + hidden_norm        target features -> context states (parameter gradients only)
  layer i (<type>)        one decoder layer: projections, RoPE, DFlash attention, MLP
                          (gradients for its parameters, the block states and the context states)
  norm + LM-head CE       final norm, chunked CE over the supervised rows (gradient for h)
  optimizer               clipping + AdamW update of all parameters
  rest                    the whole step minus the parts (embedding gather, anchors and blocks,
                          metrics, non-finite guard, and what XLA overlaps or fuses across parts)

Each part is a separate executable, so fusions across part boundaries are lost and the parts can
sum to more than the step; the "rest" line then goes negative, which is itself informative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_drafter import objective
from jax_drafter import step as step_lib
from pallas_kernels.timing import median_seconds


def _timed(fn, args, reps: int) -> float:
  return median_seconds(lambda: fn(*args), warmup=1, reps=reps)


def _fwd_bwd(f, n_diff: int):
  """jit((ct, *xs, *consts) -> grads of sum(f(*xs, *consts) * ct) w.r.t. the n_diff xs).
  Arrays reach f only as arguments: a closed-over array would be embedded in the program as a
  constant (the 2.4 GB LM head, the 0.4 GB features), which makes XLA's compile take minutes."""
  def run(ct, *args):
    xs, consts = args[:n_diff], args[n_diff:]
    out, vjp = jax.vjp(lambda *x: f(*x, *consts), *xs)
    return vjp(ct.astype(out.dtype))
  return jax.jit(run)


def step_breakdown(graphdef, state, batch, frozen, *, cfg, t, attn_impl=None,
                   reps: int = 5) -> dict[str, float]:
  """Seconds per part (median of `reps`), in step order. Does not modify `state`."""
  cd = step_lib.DTYPE[t.compute_dtype]
  micro = jax.tree.map(lambda x: x[0], batch)
  model = nnx.merge(graphdef, state.params)
  anchors, valid = jax.jit(objective.sample_anchors, static_argnums=3)(
      jax.random.key(0), micro["loss_mask"], micro["doc_id"], t.num_anchors)
  blocks = jax.jit(lambda a, v, m: objective.build_blocks(
      a, v, m["input_ids"], m["loss_mask"], m["doc_id"], m["position_ids"],
      block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, gamma=t.loss_decay_gamma))(
          anchors, valid, micro)
  feats = micro["features"].astype(cd)
  x = jnp.take(frozen["embed"], blocks.noise_ids, axis=0).astype(cd)
  key = jax.random.key(1)
  rnd = lambda shape: jax.random.normal(jax.random.fold_in(key, len(shape) + sum(shape)), shape,
                                        jnp.float32)
  idx = (micro["position_ids"], blocks.positions, blocks.anchors, blocks.doc_start,
         blocks.block_valid)
  parts: dict[str, float] = {}

  # fc + hidden_norm: no input gradient (the features are the frozen target's).
  gd_fc, p_fc = nnx.split(model.fc, nnx.Param)
  gd_hn, p_hn = nnx.split(model.hidden_norm, nnx.Param)
  ctx_fn = lambda pf, ph, f: nnx.merge(gd_hn, ph)(nnx.merge(gd_fc, pf)(f))
  ctx = jax.jit(ctx_fn)(p_fc, p_hn, feats)
  fn = _fwd_bwd(ctx_fn, 2)
  parts["fc + hidden_norm"] = _timed(fn, (rnd(ctx.shape), p_fc, p_hn, feats), reps)

  for i, layer in enumerate(model.layers):
    gd_l, p_l = nnx.split(layer, nnx.Param)
    run = lambda p, h, c, *ix, gd_l=gd_l: nnx.merge(gd_l, p)(h, c, *ix, attn_impl or {})
    fn = _fwd_bwd(run, 3)
    kind = "full" if cfg.window(i) is None else f"sliding {cfg.window(i)}"
    parts[f"layer {i} ({kind})"] = _timed(fn, (rnd(x.shape), p_l, x, ctx, *idx), reps)

  gd_n, p_n = nnx.split(model.norm, nnx.Param)

  def ce_loss(p, h, head, labels, weights):
    ce, _, _ = step_lib.supervised_ce(nnx.merge(gd_n, p)(h), head, labels, cfg.block_size,
                                      chunk_size=t.ce_chunk_size, compute_dtype=cd)
    return jnp.sum(ce * weights)
  fn = jax.jit(jax.grad(ce_loss, argnums=(0, 1)))
  parts["norm + LM-head CE"] = _timed(
      fn, (p_n, x, frozen["lm_head"], blocks.labels, blocks.weights), reps)

  opt = step_lib.make_optimizer(t)

  def update(params, opt_state):
    grads = jax.tree.map(lambda p: p * 1e-3, params)
    u, s = opt.update(grads, opt_state, params)
    return jax.tree.map(jnp.add, params, u), s
  parts["optimizer (clip + AdamW)"] = _timed(jax.jit(update), (state.params, state.opt_state),
                                             reps)
  return parts
