"""A reduced draft vocabulary (draft_vocab.py): how it is chosen, the train step and the proposals
against plain jnp references, and how it travels with the drafter (checkpoint, export, errors)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_drafter import draft_vocab as dv
from jax_drafter import step as st
from jax_drafter.config import ConfigError, DrafterConfig, TrainSection, load_config
from jax_drafter.export import read_zlab, write_zlab
from jax_drafter.inference import DrafterSession

from test_step import CFG, _batch, _frozen
from tiny_fixtures import VOCAB, tiny_drafter

V = CFG.vocab_size


def _vocab(n=24, seed=3):
  """n ascending ids of CFG's vocabulary (the mask id 99 left out)."""
  return np.sort(np.random.default_rng(seed).choice(V - 1, n, replace=False)).astype(np.int32)


def test_choose_ranks_answers_then_other_text_then_ids():
  rows = {"input_ids": np.array([[5, 7, 7, 9, 3, 3, 3, 8, 0, 0]]),
          "loss_mask": np.array([[0, 1, 1, 1, 0, 0, 0, 1, 0, 0]]),
          "doc_id": np.array([[0, 0, 0, 0, 0, 0, 0, 0, -1, -1]])}   # two padding tokens (id 0)
  # answers: 7 x2, 9 x1, 8 x1; other text: 3 x3, 5 x1; padding is not text; then the lowest ids.
  np.testing.assert_array_equal(dv.choose(rows, 12, 3), [7, 8, 9])
  np.testing.assert_array_equal(dv.choose(rows, 12, 4), [3, 7, 8, 9])
  np.testing.assert_array_equal(dv.choose(rows, 12, 2), [7, 8])          # 8 and 9 tie: lower id
  np.testing.assert_array_equal(dv.choose(rows, 12, 6), [0, 3, 5, 7, 8, 9])
  assert dv.coverage(np.array([7, 9]), rows) == 0.75
  with pytest.raises(dv.DraftVocabError, match="draft_vocab_size=13"):
    dv.choose(rows, 12, 13)


def _reference_sums(h, blocks, lm_head, ids, K):
  """Plain jnp: logits over the draft rows, CE against the mapped labels on the labels inside,
  predictions mapped back; accuracy over every supervised label."""
  B, Q, D = h.shape
  logits = jnp.einsum("bqd,nd->bqn", h.astype(jnp.float32), lm_head[ids].astype(jnp.float32))
  to_draft = np.full(V, -1, np.int32)
  to_draft[ids] = np.arange(len(ids))
  d = jnp.asarray(to_draft)[blocks.labels]
  inside = d >= 0
  logp = jax.nn.log_softmax(logits, -1)
  ce = -jnp.take_along_axis(logp, jnp.maximum(d, 0)[..., None], -1)[..., 0]
  offset = (jnp.arange(Q) % K) > 0                  # offset 0 is never supervised
  w = jnp.where(inside & offset, blocks.weights, 0.0)
  pred = jnp.asarray(ids)[jnp.argmax(logits, -1)]
  on = (blocks.weights > 0) & offset
  return (jnp.sum(ce * w), jnp.sum(w), jnp.sum((pred == blocks.labels) & on), jnp.sum(on))


def test_step_sums_and_gradient_equal_a_jnp_reference():
  t = TrainSection(num_anchors=6, ce_chunk_size=7)
  g, state = st.init_state(CFG, t, st.make_optimizer(t))
  micro = {k: jnp.asarray(v[0]) for k, v in _batch().items()}
  ids = _vocab()
  frozen = dv.with_draft_vocab(_frozen(), ids)
  key = jax.random.key(0)
  sums, (blocks, h, _, pred) = st.micro_sums(g, state.params, micro, frozen, key, cfg=CFG, t=t,
                                             return_aux=True)
  labels = np.asarray(blocks.labels)[np.asarray(blocks.weights) > 0]
  assert 0 < np.isin(labels, ids).mean() < 1        # labels inside and outside the vocabulary
  wce, w, correct, counted = _reference_sums(h, blocks, frozen["lm_head"], ids, CFG.block_size)
  np.testing.assert_allclose(sums.wce, wce, rtol=1e-5)
  np.testing.assert_allclose(sums.w, w, rtol=1e-6)
  assert float(sums.correct) == float(correct) and float(sums.counted) == float(counted)
  assert float(sums.w) < float(jnp.sum(blocks.weights))   # the labels outside left the loss
  p = np.asarray(pred)
  assert set(p[p >= 0].tolist()) <= set(ids.tolist())     # predictions are target ids

  # The fused CE's gradient against jax.grad of the reference (labels outside: no gradient).
  def ours(params):
    return st.micro_sums(g, params, micro, frozen, key, cfg=CFG, t=t).wce

  def reference(params):
    _, (b, hh, _, _) = st.micro_sums(g, params, micro, _frozen(), key, cfg=CFG, t=t,
                                     return_aux=True)
    return _reference_sums(hh, b, frozen["lm_head"], ids, CFG.block_size)[0]

  for a, b in zip(jax.tree.leaves(jax.grad(ours)(state.params)),
                  jax.tree.leaves(jax.grad(reference)(state.params))):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def test_train_step_learns_inside_the_vocabulary():
  t = TrainSection(steps=40, num_anchors=4, ce_chunk_size=7, learning_rate=1e-2, warmup_steps=2)
  opt = st.make_optimizer(t)
  g, state = st.init_state(CFG, t, opt)
  f = st.jit_train_step(st.make_train_step(g, CFG, t, opt))
  batch = _batch()
  frozen = dv.with_draft_vocab(st.frozen_in_compute_dtype(_frozen(), "bfloat16"), _vocab(60))
  assert frozen["draft_ids"].dtype == jnp.int32 and frozen["to_draft"].dtype == jnp.int32
  losses = []
  for _ in range(40):
    state, m = f(state, batch, frozen)
    losses.append(float(m["loss"]))
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_proposals_draft_only_vocabulary_ids():
  cfg, graphdef, params = tiny_drafter(block_size=4, seed=1)
  rng = np.random.default_rng(0)
  feats = jnp.asarray(rng.normal(size=(9, 2 * cfg.hidden_size)), jnp.float32)
  embed = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  ids = np.sort(rng.choice(VOCAB - 1, 10, replace=False)).astype(np.int32)
  small = dataclasses.replace(cfg, draft_vocab_size=10)
  with pytest.raises(dv.DraftVocabError, match="draft vocabulary is missing"):
    DrafterSession(small, graphdef, params, embed, head)
  greedy = DrafterSession(small, graphdef, params, embed, head, draft_ids=ids)
  greedy.reset(16)
  greedy.extend(feats)
  draft, probs = greedy.propose(7)
  h = np.asarray(greedy.block_hidden(7))[1:]
  np.testing.assert_array_equal(draft, ids[np.argmax(h @ np.asarray(head)[ids].T, -1)])
  assert probs is None
  sampled = DrafterSession(small, graphdef, params, embed, head, draft_ids=ids, temperature=0.7)
  sampled.reset(16)
  sampled.extend(feats)
  draft, probs = sampled.propose(7, key=jax.random.key(3))
  assert set(draft.tolist()) <= set(ids.tolist()) and probs.shape == (3, VOCAB)
  outside = np.setdiff1d(np.arange(VOCAB), ids)
  assert np.all(probs[:, outside] == 0)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  want = jax.nn.softmax((h @ np.asarray(head)[ids].T) / 0.7, -1)
  np.testing.assert_allclose(probs[:, ids], want, rtol=1e-4, atol=1e-6)


def test_export_carries_the_vocabulary_and_refuses_a_wrong_one(tmp_path):
  cfg, graphdef, params = tiny_drafter(block_size=4, seed=1)
  small = dataclasses.replace(cfg, draft_vocab_size=5)
  ids = np.array([1, 4, 9, 30, 40], np.int32)
  out = str(tmp_path / "d")
  write_zlab(out, small, params, vocab=ids)
  conf = json.load(open(os.path.join(out, "config.json")))
  assert conf["draft_vocab_size"] == 5
  back, _, _ = read_zlab(out)
  assert back == small
  np.testing.assert_array_equal(dv.read(out, back), ids)
  with pytest.raises(dv.DraftVocabError, match="5 integer token ids"):
    write_zlab(out, small, params, vocab=ids[:4])
  with pytest.raises(dv.DraftVocabError, match="ascending"):
    write_zlab(out, small, params, vocab=ids[::-1].copy())
  write_zlab(out, cfg, params)                  # the whole vocabulary again: the file goes
  assert not os.path.exists(os.path.join(out, dv.FILE)) and "draft_vocab_size" not in json.load(
      open(os.path.join(out, "config.json")))
  write_zlab(out, small, params, vocab=ids)
  os.remove(os.path.join(out, dv.FILE))
  with pytest.raises(dv.DraftVocabError, match="draft_vocab_size=5 but its draft vocabulary"):
    dv.read(out, small)


def test_config_refuses_distillation_and_sizes_outside_the_vocabulary():
  with pytest.raises(ConfigError, match="distillation"):
    load_config(None, ["drafter.draft_vocab_size=64", "train.kd_weight=0.5"])
  with pytest.raises(ConfigError, match="draft_vocab_size=101"):
    dataclasses.replace(CFG, draft_vocab_size=101)
  assert DrafterConfig.from_zlab(dataclasses.replace(CFG, draft_vocab_size=64).to_zlab()) == \
      dataclasses.replace(CFG, draft_vocab_size=64)
