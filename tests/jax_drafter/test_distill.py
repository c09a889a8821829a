"""Distillation from the target (train.kd_weight): the chunked fused objective against full logits
and autodiff, the teacher's position (a + k - 1) in a real step, and a trainer run that uses it."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_drafter import objective
from jax_drafter import step as st
from jax_drafter import trainer
from jax_drafter.config import ConfigError, TrainSection, feature_layer_ids

from test_step import CFG, _batch, _frozen
from tiny_fixtures import tiny_run_config


def _dense(h, w, y, t, lam):
  """The objective from full logits, for autodiff: (1 - lam) CE + lam KL(teacher || drafter)."""
  log_q = jax.nn.log_softmax(h @ w.T, axis=-1)
  log_p = jax.nn.log_softmax(t @ w.T, axis=-1)
  ce = -jnp.take_along_axis(log_q, y[:, None], axis=-1)[:, 0]
  kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  return (1 - lam) * ce + lam * kl, kl


@pytest.mark.parametrize("lam", [0.3, 1.0])
def test_chunked_distillation_equals_full_logits_and_autodiff(lam):
  r = np.random.default_rng(0)
  T, D, V = 37, 16, 50                       # 37 rows in chunks of 8: a padded last chunk
  h, t = (jnp.asarray(r.normal(size=(T, D)), jnp.float32) for _ in range(2))
  w = jnp.asarray(r.normal(size=(V, D)) * 0.5, jnp.float32)
  y = jnp.asarray(r.integers(0, V, T), jnp.int32)
  g = jnp.asarray(r.random(T), jnp.float32)  # a per-token cotangent (the loss weights)
  obj, pred, kl = objective.chunked_distillation(h, w, y, t, kd_weight=lam, chunk_size=8)
  want_obj, want_kl = _dense(h, w, y, t, lam)
  np.testing.assert_allclose(obj, want_obj, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(kl, want_kl, rtol=1e-5, atol=1e-5)
  assert (np.asarray(kl) > 0).all()
  np.testing.assert_array_equal(pred, jnp.argmax(h @ w.T, axis=-1))
  grad = jax.grad(lambda h: jnp.sum(g * objective.chunked_distillation(
      h, w, y, t, kd_weight=lam, chunk_size=8)[0]))(h)
  want = jax.grad(lambda h: jnp.sum(g * _dense(h, w, y, t, lam)[0]))(h)
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)


def test_kd_weight_outside_0_1_is_refused():
  with pytest.raises(ConfigError, match="train.kd_weight=1.5 must be in"):
    TrainSection(kd_weight=1.5)
  with pytest.raises(ValueError, match="kd_weight=0"):
    objective.chunked_distillation(jnp.zeros((2, 4)), jnp.zeros((3, 4)), jnp.zeros(2, jnp.int32),
                                   jnp.zeros((2, 4)), kd_weight=0.0, chunk_size=2)


def test_the_teacher_of_token_a_plus_k_is_the_targets_state_at_a_plus_k_minus_1():
  """In a real micro-batch: the KL sum equals one computed block by block from the raw arrays,
  and the objective is (1 - w) x the plain CE sum + w x that KL sum on the same anchors."""
  lam = 0.25
  H = CFG.hidden_size
  t_kd = TrainSection(num_anchors=4, ce_chunk_size=5, kd_weight=lam)
  t_ce = TrainSection(num_anchors=4, ce_chunk_size=5)
  assert feature_layer_ids(CFG, t_kd) == (1, 4, CFG.num_target_layers)
  assert feature_layer_ids(CFG, t_ce) == (1, 4)
  g, state = st.init_state(CFG, t_kd, st.make_optimizer(t_kd))
  micro = {k: jnp.asarray(v[0]) for k, v in _batch().items()}
  teacher = jnp.asarray(np.random.default_rng(5).normal(size=micro["features"].shape[:2] + (H,)),
                        jnp.float32)
  with_teacher = dict(micro, features=jnp.concatenate([micro["features"], teacher], -1))
  frozen, key = _frozen(), jax.random.key(3)
  sums, (blocks, h, _, _) = st.micro_sums(g, state.params, with_teacher, frozen, key, cfg=CFG,
                                          t=t_kd, return_aux=True)
  plain = st.micro_sums(g, state.params, micro, frozen, key, cfg=CFG, t=t_ce)

  w_head = np.asarray(frozen["lm_head"], np.float64)
  log_softmax = lambda x: x - x.max() - np.log(np.exp(x - x.max()).sum())
  K = CFG.block_size
  anchors, weights = np.asarray(blocks.anchors), np.asarray(blocks.weights)
  want, rows = 0.0, 0
  for b in range(anchors.shape[0]):
    for n in range(anchors.shape[1]):
      for k in range(1, K):
        wt = weights[b, n * K + k]
        if wt == 0:
          continue
        log_p = log_softmax(w_head @ np.asarray(teacher[b, anchors[b, n] + k - 1], np.float64))
        log_q = log_softmax(w_head @ np.asarray(h[b, n * K + k], np.float64))
        want += wt * np.sum(np.exp(log_p) * (log_p - log_q))
        rows += 1
  assert rows > 10
  assert float(sums.wkl) == pytest.approx(want, rel=1e-4)
  assert float(sums.wce) == pytest.approx((1 - lam) * float(plain.wce) + lam * want, rel=1e-4)
  for f in ("w", "correct", "counted", "accept", "blocks"):
    assert float(getattr(sums, f)) == float(getattr(plain, f)), f
  with pytest.raises(ValueError, match="needs features of 64 \\+ 32"):
    st.micro_sums(g, state.params, micro, frozen, key, cfg=CFG, t=t_kd)


def test_a_distilled_step_learns_the_teachers_distribution():
  t = TrainSection(steps=40, num_anchors=4, ce_chunk_size=7, learning_rate=1e-2, warmup_steps=2,
                   kd_weight=1.0)
  opt = st.make_optimizer(t)
  g, state = st.init_state(CFG, t, opt)
  f = st.jit_train_step(st.make_train_step(g, CFG, t, opt))
  batch = _batch()
  teacher = np.random.default_rng(2).normal(size=batch["features"].shape[:3] + (32,)) * 3
  batch["features"] = np.concatenate([batch["features"], teacher.astype(np.float32)], -1)
  kls = []
  for _ in range(40):
    state, m = f(state, batch, _frozen())
    kls.append(float(m["kl"]))
    assert float(m["loss"]) == pytest.approx(float(m["kl"]), rel=1e-6)  # kd_weight 1: KL only
  assert np.mean(kls[-5:]) < 0.5 * np.mean(kls[:5])


def test_training_with_distillation_logs_the_kl(tiny_target_dir, sharegpt_sample, tmp_path):
  """The whole run on the tiny target: the target captures its final-normed state next to the
  drafter's layers, the feature cache keeps both, validation reports the KL too."""
  out = str(tmp_path / "kd")
  summary = trainer.train(tiny_run_config(
      tiny_target_dir, sharegpt_sample, out, "train.kd_weight=0.5", "train.steps=4",
      "data.validation=6", "train.val_every=4", "target.feature_cache_gib=0.5"))
  assert summary["final_step"] == 4
  with open(os.path.join(out, "metrics.jsonl")) as f:
    recs = [json.loads(line) for line in f]
  steps = [r for r in recs if "kl" in r and "val_loss" not in r]
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  assert all(np.isfinite(r["kl"]) and r["kl"] > 0 for r in steps)
  val = [r for r in recs if "val_loss" in r]
  assert val and np.isfinite(val[-1]["val_kl"]) and val[-1]["val_kl"] > 0
