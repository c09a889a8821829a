"""The train step on random inputs: it learns, jit == no-jit, hidden features get zero gradient,
gradient accumulation equals one big batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_drafter import step as st
from jax_drafter.config import DrafterConfig, TrainSection

CFG = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100,
                    num_target_layers=6, target_layer_ids=(1, 4), mask_token_id=99, block_size=4,
                    layer_types=("sliding_attention", "full_attention"), sliding_window=3)


def _batch(A=1, B=2, S=24, seed=0):
  r = np.random.default_rng(seed)
  doc = np.broadcast_to(np.array([0] * 10 + [1] * 14, np.int32), (A, B, S))
  pos = np.broadcast_to(np.where(np.arange(S) < 10, np.arange(S), np.arange(S) - 10).astype(np.int32),
                        (A, B, S))
  return dict(input_ids=r.integers(0, 99, (A, B, S)).astype(np.int32),
              loss_mask=(r.random((A, B, S)) < 0.7).astype(np.int32), doc_id=np.array(doc),
              position_ids=np.array(pos),
              features=r.normal(size=(A, B, S, 64)).astype(np.float32))


def _frozen(seed=1):
  e = jnp.asarray(np.random.default_rng(seed).normal(size=(100, 32)) * 0.1, jnp.float32)
  return {"embed": e, "lm_head": e}


def test_step_learns_a_fixed_batch():
  t = TrainSection(steps=40, num_anchors=4, ce_chunk_size=7, learning_rate=1e-2, warmup_steps=2)
  opt = st.make_optimizer(t)
  g, state = st.init_state(CFG, t, opt)
  f = st.jit_train_step(st.make_train_step(g, CFG, t, opt))
  batch, frozen = _batch(), _frozen()
  losses = []
  for _ in range(40):
    state, m = f(state, batch, frozen)
    losses.append(float(m["loss"]))
  assert int(state.step) == 40
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_jit_equals_no_jit():
  t = TrainSection(num_anchors=4, ce_chunk_size=5)
  opt = st.make_optimizer(t)
  g, state = st.init_state(CFG, t, opt)
  fn = st.make_train_step(g, CFG, t, opt)
  batch = {k: jnp.asarray(v) for k, v in _batch().items()}
  s1, m1 = jax.jit(fn)(state, batch, _frozen())
  with jax.disable_jit():
    s2, m2 = fn(state, batch, _frozen())
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_features_no_block_can_see_get_exactly_zero_gradient():
  t = TrainSection(num_anchors=3)
  g, state = st.init_state(CFG, t, st.make_optimizer(t))
  micro = {k: jnp.asarray(v[0]) for k, v in _batch(B=1).items()}
  micro["loss_mask"] = micro["loss_mask"].at[:, 10:].set(0)       # doc 1 has no anchor candidates
  key = jax.random.key(3)

  def loss(features):
    return st.micro_sums(g, state.params, {**micro, "features": features}, _frozen(), key,
                         cfg=CFG, t=t).wce

  grad = np.asarray(jax.jit(jax.grad(loss))(micro["features"]))
  sums, (blocks, *_) = st.micro_sums(g, state.params, micro, _frozen(), key, cfg=CFG, t=t,
                                     return_aux=True)
  a = np.asarray(blocks.anchors)[np.asarray(blocks.block_valid)]
  assert a.size and a.max() < 10
  # Keys strictly before the last anchor may be visible; everything from max(anchor) on is not.
  assert (grad[0, a.max():] == 0).all()
  assert np.abs(grad[0, : a.max()]).sum() > 0


def test_accumulated_loss_is_normalised_by_the_global_weight_sum():
  t1 = TrainSection(num_anchors=4, grad_accum=1)
  opt = st.make_optimizer(t1)
  g, state = st.init_state(CFG, t1, opt)
  big = _batch(A=2, B=1)
  # Anchors are drawn per micro-step, so compare at the step's own keys through micro_sums.
  frozen = _frozen()
  fn = st.make_train_step(g, CFG, t1, opt)
  _, m = jax.jit(fn)(state, {k: jnp.asarray(v) for k, v in big.items()}, frozen)
  # The step's key for micro i is fold_in(fold_in(rng, step), i): reproduce it.
  base = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  parts = [st.micro_sums(g, state.params, {k: jnp.asarray(v[i]) for k, v in big.items()}, frozen,
                         jax.random.fold_in(base, i), cfg=CFG, t=t1) for i in range(2)]
  wce = sum(float(p.wce) for p in parts)
  w = sum(float(p.w) for p in parts)
  assert float(m["loss"]) == pytest.approx(wce / w, rel=1e-5)


def test_drafter_with_the_pallas_kernel_in_interpret_mode_matches_xla():
  import dataclasses
  cfg = dataclasses.replace(CFG, head_dim=16)       # the kernel needs head_dim >= 16
  t = TrainSection(num_anchors=3)
  g, state = st.init_state(cfg, t, st.make_optimizer(t))
  micro = {k: jnp.asarray(v[0]) for k, v in _batch(B=1).items()}
  key = jax.random.key(5)

  def loss_and_grad(attn):
    f = lambda p: st.micro_sums(g, p, micro, _frozen(), key, cfg=cfg, t=t, attn_impl=attn).wce
    return jax.jit(jax.value_and_grad(f))(state.params)

  ref_val, ref_grad = loss_and_grad({"implementation": "xla"})
  val, grad = loss_and_grad({"implementation": "triton", "interpret": True})
  np.testing.assert_allclose(val, ref_val, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_first_update_has_a_nonzero_learning_rate():
  t = TrainSection(steps=100, warmup_steps=10, learning_rate=1e-3, min_lr_ratio=0.1)
  lrs = [float(st.learning_rate(t, i)) for i in range(100)]
  assert lrs[0] == pytest.approx(1e-4)                  # peak / warmup_steps, not 0
  assert lrs[9] == pytest.approx(1e-3) and max(lrs) == pytest.approx(1e-3)
  assert lrs[99] == pytest.approx(1e-4)                 # min_lr_ratio * peak at the last update
  assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))


def test_frozen_weights_narrowed_once_give_the_same_bf16_step_bit_for_bit():
  """frozen_in_compute_dtype casts a float32 target's embedding / LM head to bfloat16 once (tied
  weights stay one array); the bfloat16 step on them equals the step that casts them itself."""
  frozen = _frozen()
  narrowed = st.frozen_in_compute_dtype(frozen, "bfloat16")
  assert narrowed["lm_head"].dtype == jnp.bfloat16 and narrowed["embed"] is narrowed["lm_head"]
  assert st.frozen_in_compute_dtype(frozen, "float32")["lm_head"] is frozen["lm_head"]
  assert st.frozen_in_compute_dtype(narrowed, "float32")["lm_head"] is narrowed["lm_head"]
  t = TrainSection(num_anchors=4, ce_chunk_size=5, compute_dtype="bfloat16")
  opt = st.make_optimizer(t)
  g, state = st.init_state(CFG, t, opt)
  f = jax.jit(st.make_train_step(g, CFG, t, opt))
  s1, m1 = f(state, _batch(), frozen)
  s2, m2 = f(state, _batch(), narrowed)
  assert float(m1["loss"]) == float(m2["loss"])
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_array_equal(a, b)


def test_dropout_helper_drops_at_the_rate_and_keeps_the_mean():
  from jax_drafter.model import dropout
  x = jnp.ones((256, 1024), jnp.float32)
  y = np.asarray(dropout(x, 0.1, jax.random.key(0)))
  dropped = (y == 0).mean()
  assert abs(dropped - 26 / 256) < 0.005            # 0.1 rounds to 26/256
  np.testing.assert_allclose(y[y != 0], 256 / 230, rtol=1e-6)
  assert abs(y.mean() - 1.0) < 0.01
  assert dropout(x, 0.0, jax.random.key(0)) is x and dropout(x, 0.1, None) is x
  assert y.dtype == np.float32 and dropout(x.astype(jnp.bfloat16), 0.5, jax.random.key(1)).dtype == jnp.bfloat16


def test_dropout_changes_training_only_and_is_reproducible():
  t0 = TrainSection(num_anchors=4, ce_chunk_size=5)
  td = TrainSection(num_anchors=4, ce_chunk_size=5, dropout=0.25)
  g, state = st.init_state(CFG, t0, st.make_optimizer(t0))
  micro = {k: jnp.asarray(v[0]) for k, v in _batch().items()}
  key = jax.random.key(7)
  run = lambda t, training: st.micro_sums(g, state.params, micro, _frozen(), key, cfg=CFG, t=t,
                                          training=training)
  plain = run(t0, True)
  # Validation (training=False) never drops: the same sums as without dropout.
  np.testing.assert_array_equal(np.asarray(run(td, False).wce), np.asarray(plain.wce))
  a, b = run(td, True), run(td, True)
  np.testing.assert_array_equal(np.asarray(a.wce), np.asarray(b.wce))      # same key, same masks
  assert float(a.wce) != float(plain.wce)
  np.testing.assert_array_equal(np.asarray(a.w), np.asarray(plain.w))      # same anchors and labels
  # The jitted step trains with it and still learns a fixed batch.
  tl = TrainSection(steps=40, num_anchors=4, ce_chunk_size=7, learning_rate=1e-2, warmup_steps=2,
                    dropout=0.25)
  opt = st.make_optimizer(tl)
  _, s = st.init_state(CFG, tl, opt)
  f = st.jit_train_step(st.make_train_step(g, CFG, tl, opt))
  batch, frozen, losses = _batch(), _frozen(), []
  for _ in range(40):
    s, m = f(s, batch, frozen)
    losses.append(float(m["loss"]))
  assert np.isfinite(losses).all() and int(s.step) == 40
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


def test_dropout_works_under_every_remat_policy():
  for remat in ("layer", "full"):
    t = TrainSection(num_anchors=4, ce_chunk_size=5, dropout=0.2, remat=remat)
    tn = TrainSection(num_anchors=4, ce_chunk_size=5, dropout=0.2)
    g, state = st.init_state(CFG, t, st.make_optimizer(t))
    micro = {k: jnp.asarray(v[0]) for k, v in _batch().items()}
    key = jax.random.key(2)
    grad = lambda tt: jax.jit(jax.grad(lambda p: st.micro_sums(
        g, p, micro, _frozen(), key, cfg=CFG, t=tt, training=True).wce))(state.params)
    for a, b in zip(jax.tree.leaves(grad(t)), jax.tree.leaves(grad(tn))):
      np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
