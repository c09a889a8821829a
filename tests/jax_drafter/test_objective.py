"""Hand-computed checks of the DFlash contract: anchors, noise blocks, positions, labels, weights,
the attention mask, chunked CE, and the metrics."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_drafter import objective
from pallas_kernels.dflash_attention import reference

MASK = 99


def _row(ids, lm, doc, pos=None):
  ids, lm, doc = (np.asarray(x, np.int32)[None] for x in (ids, lm, doc))
  if pos is None:
    starts = objective.document_starts(jnp.asarray(doc))
    pos = np.arange(ids.shape[1])[None] - np.asarray(starts)
  return ids, lm, doc, np.asarray(pos, np.int32)


def test_anchor_candidates_need_two_supervised_tokens_in_one_document():
  # doc 0 = positions 0..4, doc 1 = 5..9
  lm = [0, 1, 1, 1, 0, 1, 1, 0, 1, 1]
  doc = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
  cand = objective.anchor_candidates(jnp.asarray([lm]), jnp.asarray([doc]))
  assert np.asarray(cand[0]).nonzero()[0].tolist() == [1, 2, 5, 8]
  # Across a document boundary: 4 -> 5 both supervised but different docs -> not a candidate.
  lm2 = [0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
  doc2 = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
  cand2 = objective.anchor_candidates(jnp.asarray([lm2]), jnp.asarray([doc2]))
  assert np.asarray(cand2[0]).nonzero()[0].tolist() == [3]


def test_sample_anchors_uniform_sorted_without_replacement_and_padding():
  lm = np.ones((3, 40), np.int32)
  lm[1, :] = 0
  lm[1, 10:13] = 1          # row 1: exactly 2 candidates (10, 11)
  doc = np.zeros((3, 40), np.int32)
  anchors, valid = objective.sample_anchors(jax.random.key(0), jnp.asarray(lm), jnp.asarray(doc), 5)
  a, v = np.asarray(anchors), np.asarray(valid)
  assert v[0].all() and v[2].all()
  assert v[1].tolist() == [True, True, False, False, False]
  assert a[1, :2].tolist() == [10, 11] and a[1, 2:].tolist() == [0, 0, 0]
  for r in (0, 2):
    assert (np.diff(a[r]) > 0).all()           # sorted, no repeats
    assert a[r].max() <= 38                     # p + 1 must exist
  # Uniformity: over many draws every candidate of row 0 is picked about equally often.
  counts = np.zeros(40)
  for s in range(200):
    an, _ = objective.sample_anchors(jax.random.key(s), jnp.asarray(lm[:1]), jnp.asarray(doc[:1]), 5)
    counts[np.asarray(an[0])] += 1
  assert counts[39] == 0
  expected = 200 * 5 / 39
  assert np.abs(counts[:39] - expected).max() < 0.6 * expected


def test_build_blocks_hand_computed():
  # Two documents: doc 0 = 0..5 (positions 0..5), doc 1 = 6..11 (positions 0..5). K = 4.
  ids = list(range(100, 112))
  lm = [0, 1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1]
  doc = [0] * 6 + [1] * 6
  ids, lm, doc, pos = _row(ids, lm, doc)
  anchors = jnp.asarray([[4, 7, 10, 0]], jnp.int32)
  valid = jnp.asarray([[True, True, True, False]])
  b = objective.build_blocks(anchors, valid, jnp.asarray(ids), jnp.asarray(lm), jnp.asarray(doc),
                             jnp.asarray(pos), block_size=4, mask_token_id=MASK, gamma=7.0)
  noise = np.asarray(b.noise_ids).reshape(4, 4)
  assert noise.tolist() == [[104, MASK, MASK, MASK], [107, MASK, MASK, MASK],
                            [110, MASK, MASK, MASK], [MASK] * 4]
  # Positions restart per document: anchor 4 -> pos 4; anchor 7 -> pos 1; anchor 10 -> pos 4.
  assert np.asarray(b.positions).reshape(4, 4)[:3].tolist() == [[4, 5, 6, 7], [1, 2, 3, 4],
                                                                 [4, 5, 6, 7]]
  assert np.asarray(b.doc_start)[0].tolist() == [0, 6, 6, 0]
  # Labels: block position k predicts ids[a + k] (no shift), clamped at the row end.
  assert np.asarray(b.labels).reshape(4, 4)[:3].tolist() == [[104, 105, 106, 107],
                                                              [107, 108, 109, 110],
                                                              [110, 111, 111, 111]]
  d = lambda k: math.exp(-(k - 1) / 7.0)
  w = np.asarray(b.weights).reshape(4, 4)
  # Block 0 (a=4, doc 0 ends at 5): k=1 -> 5 ok; k=2 -> 6 other doc; k=3 -> 7 other doc.
  np.testing.assert_allclose(w[0], [0, d(1), 0, 0], rtol=1e-6)
  # Block 1 (a=7): k=1 -> 8 lm 1; k=2 -> 9 lm 0; k=3 -> 10 lm 1.
  np.testing.assert_allclose(w[1], [0, d(1), 0, d(3)], rtol=1e-6)
  # Block 2 (a=10): k=1 -> 11; k=2, 3 -> outside the row.
  np.testing.assert_allclose(w[2], [0, d(1), 0, 0], rtol=1e-6)
  assert (w[3] == 0).all()


def test_no_decay_when_gamma_is_none():
  ids, lm, doc, pos = _row(range(10), [1] * 10, [0] * 10)
  b = objective.build_blocks(jnp.asarray([[0]]), jnp.asarray([[True]]), jnp.asarray(ids),
                             jnp.asarray(lm), jnp.asarray(doc), jnp.asarray(pos), block_size=4,
                             mask_token_id=MASK, gamma=None)
  assert np.asarray(b.weights).tolist() == [[0.0, 1.0, 1.0, 1.0]]


def test_mask_hand_computed_full_and_sliding_window():
  # anchors 5 (doc starting at 2) and 3 (doc at 0); K = 3; S = 8; window 2 for sliding.
  anchors = jnp.asarray([[3, 5]])
  lo = jnp.asarray([[0, 2]])
  valid = jnp.asarray([[True, True]])
  full = np.broadcast_to(np.asarray(reference.context_mask(anchors, lo, valid, block_size=3,
                                                          window=None, seq_len=8)), (1, 2, 3, 8))
  assert full[0, 0, 0].nonzero()[0].tolist() == [0, 1, 2]        # j < 3, anchor excluded
  assert full[0, 1, 2].nonzero()[0].tolist() == [2, 3, 4]        # doc start 2 .. anchor 5
  sl = np.asarray(reference.context_mask(anchors, lo, valid, block_size=3, window=2, seq_len=8))
  # offset o sees max(lo, a + o - 1) <= j < a
  assert sl[0, 0, 0].nonzero()[0].tolist() == [2]
  assert sl[0, 0, 1].nonzero()[0].tolist() == []
  assert sl[0, 1, 0].nonzero()[0].tolist() == [4]
  # window 1: no context at all
  w1 = np.asarray(reference.context_mask(anchors, lo, valid, block_size=3, window=1, seq_len=8))
  assert not w1.any()
  bm_full = np.asarray(reference.block_mask(valid, block_size=3, window=None))
  bm_sl = np.asarray(reference.block_mask(valid, block_size=3, window=2))
  assert bm_full.all()
  assert bm_sl[0, 0].astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
  invalid = np.asarray(reference.context_mask(anchors, lo, jnp.asarray([[True, False]]),
                                              block_size=3, window=2, seq_len=8))
  assert not invalid[0, 1].any()


def _ce_inputs(seed, T, D, V):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(T, D)), jnp.float32),
          jnp.asarray(rng.normal(size=(V, D)) * 0.3, jnp.float32),
          jnp.asarray(rng.integers(0, V, T), jnp.int32), jnp.asarray(rng.random(T), jnp.float32))


def test_chunked_cross_entropy_equals_unchunked_loss_and_gradients():
  T, D, V = 37, 16, 50
  h, head, y, w = _ce_inputs(0, T, D, V)

  def full(h):
    logits = h @ head.T
    return jnp.sum((jax.nn.logsumexp(logits, -1) - logits[jnp.arange(T), y]) * w)

  def chunked(h, c):
    ce, _ = objective.chunked_cross_entropy(h, head, y, chunk_size=c)
    return jnp.sum(ce * w)

  ref_val, ref_grad = jax.value_and_grad(full)(h)
  for c in (1, 8, 37, 64):
    val, grad = jax.value_and_grad(chunked)(h, c)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
  _, pred = objective.chunked_cross_entropy(h, head, y, chunk_size=8)
  assert (np.asarray(pred) == np.asarray(jnp.argmax(h @ head.T, -1))).all()


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_both_forms_of_the_fused_gradient_match_autodiff(lam):
  """Plain CE's gradient is (exp(logits - max) @ W) / sum - W[label] on every backend; with a
  teacher, the softmax comes from the log-sum-exp's exp on a CPU and is recomputed on a GPU.
  Every form equals autodiff of the objective."""
  T, D, V, C = 24, 16, 50, 8
  h, head, y, _ = _ce_inputs(3, T, D, V)
  teacher = jnp.asarray(np.random.default_rng(4).normal(size=(T, D)), jnp.float32) if lam else None

  def objective_t(h):
    logits = h @ head.T
    log_q = jax.nn.log_softmax(logits, -1)
    ce = -log_q[jnp.arange(T), y]
    if teacher is None:
      return ce
    log_p = jax.nn.log_softmax(teacher @ head.T, -1)
    return (1 - lam) * ce + lam * jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1)

  ref_obj = objective_t(h)
  ref_dh = jax.grad(lambda h: objective_t(h).sum())(h)
  chunks = lambda x: None if x is None else x.reshape((T // C, C) + x.shape[1:])
  for reuse in ((True, False) if lam else (None,)):   # plain CE has one form
    obj, pred, _, dh = objective._ce_chunks(chunks(h), head, chunks(y), chunks(teacher),
                                            jnp.float32, lam, with_grad=True, reuse_exp=reuse)
    np.testing.assert_allclose(obj.reshape(T), ref_obj, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dh.reshape(T, D), ref_dh, rtol=1e-5, atol=1e-6)
    assert (np.asarray(pred).reshape(T) == np.asarray(jnp.argmax(h @ head.T, -1))).all()


def test_chunked_ce_never_materialises_full_logits():
  T, D, V, C = 256, 8, 4096, 32
  h = jax.ShapeDtypeStruct((T, D), jnp.float32)
  head = jax.ShapeDtypeStruct((V, D), jnp.float32)
  y = jax.ShapeDtypeStruct((T,), jnp.int32)
  f = jax.grad(lambda h, hd, y: objective.chunked_cross_entropy(h, hd, y, chunk_size=C)[0].sum())
  hlo = jax.jit(f).lower(h, head, y).compile().as_text()
  assert f"f32[{T},{V}]" not in hlo
  assert f"f32[{C},{V}]" in hlo


def test_block_sums_accuracy_and_accepted_length():
  K = 4
  labels = jnp.asarray([[5, 6, 7, 8, 1, 2, 3, 4]])
  pred = jnp.asarray([[0, 6, 7, 0, 0, 9, 3, 4]])   # block 0: k1 ok, k2 ok, k3 wrong; block 1: k1 wrong
  w = jnp.asarray([[0, 1, 1, 1, 0, 1, 1, 1]], jnp.float32)
  blocks = objective.Blocks(jnp.zeros((1, 2), jnp.int32), jnp.asarray([[True, True]]),
                            jnp.zeros((1, 2), jnp.int32), labels, labels, labels, w)
  ce = jnp.ones((1, 8))
  s = objective.block_sums(ce, pred, blocks, K)
  m = objective.metrics_from_sums(s)
  assert float(m["accuracy"]) == pytest.approx(4 / 6)
  assert float(s.accept) == 2 + 0
  assert float(m["tau_estimate"]) == pytest.approx(1 + 2 / 2)
  assert float(m["loss"]) == pytest.approx(1.0)


def test_chunked_ce_bf16_gradient_close_to_f32():
  h, head, y, _ = _ce_inputs(1, 20, 16, 64)
  f = lambda h, cd: objective.chunked_cross_entropy(h, head, y, chunk_size=8, compute_dtype=cd)[0].sum()
  g32 = jax.grad(f)(h, jnp.float32)
  g16 = jax.grad(f)(h.astype(jnp.bfloat16), jnp.bfloat16)
  assert g16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(g16, np.float32), g32, rtol=0.05, atol=0.05)


def test_response_anchors_cover_every_answer_position_up_to_max_new_tokens():
  # row 0: doc 0 = prompt(2) + answer(5); doc 1 = prompt(1) + answer(3); row 1: one answer of 1
  lm = np.array([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1], [0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
  doc = np.array([[0] * 7 + [1] * 4, [0] * 11])
  ra = objective.response_anchors(lm, doc, max_new_tokens=4)
  assert ra.lengths.tolist() == [3, 2]               # min(L, M) - 1; the 1-token answer has none
  assert ra.anchors[0][ra.valid[0]].tolist() == [2, 3, 4, 8, 9]
  assert ra.response[0][ra.valid[0]].tolist() == [0, 0, 0, 1, 1]
  assert ra.offset[0][ra.valid[0]].tolist() == [0, 1, 2, 0, 1]
  assert not ra.valid[1].any()


def test_walk_tau_follows_the_verify_steps_of_greedy_decoding():
  lm = np.array([[1] * 9 + [0] + [1] * 4])
  doc = np.array([[0] * 10 + [1] * 4])
  ra = objective.response_anchors(lm, doc, max_new_tokens=100)
  # response 0 (8 anchors): j=0 accepts 3 -> j=4 accepts 0 -> j=5 accepts 2 -> j=8 stop
  # response 1 (3 anchors): j=0 accepts 1 -> j=2 accepts 0 -> stop
  a = np.zeros(ra.anchors.shape, np.int32)
  values = [3, 9, 9, 9, 0, 2, 9, 9] + [1, 9, 0]   # 9s are skipped by the walk
  a[0, :len(values)] = values
  w = objective.walk_tau(a, ra)
  assert w["responses"] == 2 and w["verify_steps"] == 3 + 2
  taus = [(3 + 0 + 2) / 3 + 1, (1 + 0) / 2 + 1]
  assert w["tau"] == pytest.approx(np.mean(taus))
  assert w["tau_stderr"] == pytest.approx(np.std(taus, ddof=1) / np.sqrt(2))  # over responses
  # The per-block mean over all anchors would say more: easy stretches count once per position.
  assert np.mean(np.array(values) + 1) > w["tau"]


@pytest.mark.parametrize("block", [None, 128, 7])
def test_row_argmax_max_is_jnp_argmax_ties_and_padding_included(block):
  """The two-pass argmax (blocks' maxima, then within the first block holding the maximum) gives
  jnp.argmax's first index of the maximum and the row max, for a vocabulary that is not a multiple
  of the block, ties inside and across blocks, -inf entries and rows of one value."""
  rng = np.random.default_rng(5)
  x = rng.standard_normal((9, 1000)).astype(np.float32)
  x[1, [3, 700]] = 9.0              # a tie across blocks: the first index wins
  x[2, [130, 131]] = 9.0            # a tie inside one block
  x[3, :] = -np.inf
  x[3, 999] = 0.0                   # the maximum in the last, partial block
  x[4, :] = 1.5                     # every entry equal: index 0
  x[5, :] = np.round(x[5, :])       # many ties
  pred, top = objective.row_argmax_max(jnp.asarray(x), block)
  np.testing.assert_array_equal(np.asarray(pred), np.argmax(x, axis=-1))
  np.testing.assert_array_equal(np.asarray(top), np.max(x, axis=-1))
  assert pred.dtype == jnp.int32
