"""The DFlash training objective as pure functions of arrays (docs/DESIGN.md, "The DFlash contract").

Anchors -> noise blocks -> positions -> labels and decay weights -> chunked cross entropy against
the frozen LM head -> loss, accuracy and accepted-length metrics. Letters as in config.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Blocks(NamedTuple):
  anchors: jax.Array       # int32 [B, N], valid ones sorted ascending, invalid ones 0 at the end
  block_valid: jax.Array   # bool [B, N]
  doc_start: jax.Array     # int32 [B, N], first index of the anchor's document
  noise_ids: jax.Array     # int32 [B, Q]: [ids[a], MASK, ..., MASK] per block (all MASK if invalid)
  positions: jax.Array     # int32 [B, Q]: pos[a] + k
  labels: jax.Array        # int32 [B, Q]: ids[a + k] (clamped inside the row)
  weights: jax.Array       # f32 [B, Q]: the loss weight w of the contract (0 at k = 0)


def anchor_candidates(loss_mask_BxS, doc_id_BxS):
  """bool [B, S]: p is a candidate iff loss_mask[p] == loss_mask[p+1] == 1 in the same document."""
  lm = loss_mask_BxS.astype(bool)
  ok = lm[:, :-1] & lm[:, 1:] & (doc_id_BxS[:, :-1] == doc_id_BxS[:, 1:])
  return jnp.pad(ok, ((0, 0), (0, 1)))


def document_starts(doc_id_BxS):
  """int32 [B, S]: index of the first token of each token's document."""
  S = doc_id_BxS.shape[1]
  idx = jnp.arange(S, dtype=jnp.int32)[None]
  is_start = jnp.concatenate([jnp.ones_like(doc_id_BxS[:, :1], bool),
                              doc_id_BxS[:, 1:] != doc_id_BxS[:, :-1]], axis=1)
  return jax.lax.cummax(jnp.where(is_start, idx, 0), axis=1)


def sample_anchors(key, loss_mask_BxS, doc_id_BxS, num_anchors: int):
  """N anchors per row uniformly without replacement among the candidates, sorted.

  Returns (anchors int32 [B, N], block_valid bool [B, N]). Rows with fewer than N candidates get
  invalid blocks (anchor 0) at the end.
  """
  B, S = loss_mask_BxS.shape
  if num_anchors > S:
    raise ValueError(f"{num_anchors=} exceeds the sequence length {S}")
  cand = anchor_candidates(loss_mask_BxS, doc_id_BxS)
  # Uniform sampling without replacement = the N smallest of i.i.d. uniforms over the candidates.
  u = jax.random.uniform(key, (B, S))
  score = jnp.where(cand, 1.0 - u, -1.0)            # candidates in (0, 1], others -1
  top, idx = jax.lax.top_k(score, num_anchors)
  valid = top > 0
  sort_key = jnp.where(valid, idx, S + idx)         # valid first, ascending
  order = jnp.argsort(sort_key, axis=1)
  anchors = jnp.take_along_axis(jnp.where(valid, idx, 0), order, axis=1).astype(jnp.int32)
  return anchors, jnp.take_along_axis(valid, order, axis=1)


def build_blocks(anchors_BxN, block_valid_BxN, input_ids_BxS, loss_mask_BxS, doc_id_BxS,
                 position_ids_BxS, *, block_size: int, mask_token_id: int,
                 gamma: float | None) -> Blocks:
  """Noise ids, positions, labels and loss weights of every block (docs/DESIGN.md contract)."""
  B, S = input_ids_BxS.shape
  N, K = anchors_BxN.shape[1], block_size
  k = jnp.arange(K, dtype=jnp.int32)
  a = anchors_BxN[:, :, None]                                        # [B, N, 1]
  tgt = a + k                                                         # [B, N, K]
  inside = tgt < S
  tgt_c = jnp.minimum(tgt, S - 1).reshape(B, N * K)
  take = lambda x: jnp.take_along_axis(x, tgt_c, axis=1).reshape(B, N, K)
  labels = take(input_ids_BxS)
  same_doc = take(doc_id_BxS) == jnp.take_along_axis(doc_id_BxS, anchors_BxN, axis=1)[:, :, None]
  supervised = take(loss_mask_BxS).astype(bool)
  if gamma:
    decay = jnp.exp(-(k.astype(jnp.float32) - 1.0) / gamma)
  else:
    decay = jnp.ones((K,), jnp.float32)
  decay = jnp.where(k >= 1, decay, 0.0)
  valid = block_valid_BxN[:, :, None]
  weights = (valid & inside & same_doc & supervised).astype(jnp.float32) * decay

  first = jnp.take_along_axis(input_ids_BxS, anchors_BxN, axis=1)    # [B, N]
  noise = jnp.full((B, N, K), mask_token_id, jnp.int32)
  noise = noise.at[:, :, 0].set(jnp.where(block_valid_BxN, first, mask_token_id))
  pos0 = jnp.take_along_axis(position_ids_BxS, anchors_BxN, axis=1)
  positions = pos0[:, :, None] + k
  doc_start = jnp.take_along_axis(document_starts(doc_id_BxS), anchors_BxN, axis=1)
  flat = lambda x: x.reshape(B, N * K)
  return Blocks(anchors_BxN.astype(jnp.int32), block_valid_BxN,
                jnp.where(block_valid_BxN, doc_start, 0).astype(jnp.int32),
                flat(noise), flat(positions).astype(jnp.int32), flat(labels).astype(jnp.int32),
                flat(weights))


def ce_chunk_rows(T: int, chunk_size: int) -> int:
  """Rows per CE chunk: the fewest chunks of at most `chunk_size` rows, balanced, rounded up to
  a multiple of 8, so padding stays under 8 rows per chunk (15360 rows with chunk_size 2048 give
  8 chunks of 1920, not 8 of 2048 with 1024 rows of padding)."""
  if chunk_size < 1:
    raise ValueError(f"train.ce_chunk_size={chunk_size} must be >= 1")
  if T <= chunk_size:
    return T
  m = -(-T // chunk_size)
  c = -(-T // m)
  return min(chunk_size, -(-c // 8) * 8) if chunk_size >= 8 else c


def chunked_cross_entropy(h_TxD, lm_head_VxD, labels_T, *, chunk_size: int,
                          compute_dtype=jnp.float32):
  """Per-token CE and argmax against a frozen LM head, `chunk_size` tokens of logits at a time.

  Fused forward/backward: each chunk's [C, V] logits are used once, in the forward, to produce the
  CE, the argmax and d CE_t / d h_t ([C, D]); the backward only scales the saved [T, D] gradient
  by the incoming per-token cotangent. So at most one chunk of logits is ever alive, and the LM
  head costs two matmuls (logits, d h) instead of three under remat (logits, logits again, d h).
  The LM head gets no gradient (it is frozen). Returns (ce f32 [T], pred int32 [T]).
  """
  ce, pred, _ = _chunked(h_TxD, lm_head_VxD, labels_T, None, 0.0, chunk_size, compute_dtype)
  return ce, pred


def chunked_distillation(h_TxD, lm_head_VxD, labels_T, teacher_TxD, *, kd_weight: float,
                         chunk_size: int, compute_dtype=jnp.float32):
  """chunked_cross_entropy with knowledge distillation from the target (train.kd_weight).

  teacher_TxD: the target's final-normed hidden state at the position before each label, so
  teacher_t @ lm_head.T are the target's own next-token logits for token t (computed in the same
  chunks as the drafter's, never as full logits). Per token the objective is
  (1 - kd_weight) * CE(label) + kd_weight * KL(target || drafter), its gradient fused the same way
  (d/d logits = softmax - (1 - kd_weight) onehot - kd_weight p_target).
  Returns (objective f32 [T], pred int32 [T], kl f32 [T]); kl is a metric (no gradient)."""
  if not 0.0 < kd_weight <= 1.0:
    raise ValueError(f"kd_weight={kd_weight} must be in (0, 1]")
  return _chunked(h_TxD, lm_head_VxD, labels_T, teacher_TxD, float(kd_weight), chunk_size,
                  compute_dtype)


def _chunked(h_TxD, lm_head_VxD, labels_T, teacher_TxD, lam: float, chunk_size: int,
             compute_dtype):
  """Rows padded to whole chunks of ce_chunk_rows, through _fused_ce, cut back to T."""
  T = h_TxD.shape[0]
  C = ce_chunk_rows(T, chunk_size)
  pad = (-T) % C
  chunks = lambda x: jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(
      (-1, C) + x.shape[1:])
  t = None if teacher_TxD is None else chunks(jax.lax.stop_gradient(teacher_TxD))
  obj, pred, kl = _fused_ce(chunks(h_TxD), jax.lax.stop_gradient(lm_head_VxD), chunks(labels_T),
                            t, compute_dtype, lam)
  cut = lambda x: None if x is None else x.reshape(-1)[:T]
  return cut(obj), cut(pred), cut(kl)


def row_argmax_max(x_CxV, block: int | None = 128):
  """(argmax int32 [C], max [C]) of each row, the argmax exactly jnp.argmax's (the first index of
  the maximum). block: in two passes, the max of each `block` columns, then the argmax over those
  maxima and within the block that holds the first one: XLA:CPU's argmax reduction of a [384,
  49152] f32 array takes 34 ms, these passes 6 ms, its plain max 4 ms (2-core CPU). None: one
  argmax, whose value is then read back."""
  if block is None:
    pred = jnp.argmax(x_CxV, axis=-1).astype(jnp.int32)
    return pred, jnp.take_along_axis(x_CxV, pred[:, None], axis=-1)[:, 0]
  C, V = x_CxV.shape
  pad = (-V) % block
  if pad:
    x_CxV = jnp.pad(x_CxV, ((0, 0), (0, pad)), constant_values=-jnp.inf)
  blocks = x_CxV.reshape(C, -1, block)
  block_max = jnp.max(blocks, axis=-1)                                    # [C, V / block]
  j = jnp.argmax(block_max, axis=-1)                                      # the first block with it
  within = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]    # [C, block]
  pred = j * block + jnp.argmax(within, axis=-1)
  return pred.astype(jnp.int32), jnp.max(block_max, axis=-1)


def _ce_chunks(h_MxCxD, w_VxD, y_MxC, t_MxCxD, compute_dtype, lam: float, with_grad: bool,
               reuse_exp: bool | None = None):
  """Per chunk: (objective, argmax, KL or None[, d objective / d h]). t_MxCxD None: plain CE.
  reuse_exp: how the distillation gradient's softmax is made (below); None = by the default
  backend."""
  w = w_VxD.astype(compute_dtype)
  # Contract D of both operands directly: XLA:CPU materialises `w.T` for `x @ w.T` (a [D, V] copy
  # per step, 3x the matmul's own time for SmolLM2's head); GPUs fold it either way.
  logits_of = lambda x: jnp.einsum("cd,vd->cv", x.astype(compute_dtype), w,
                                   preferred_element_type=jnp.float32)

  # With distillation, the gradient's softmax: on a CPU from the exp the log-sum-exp already made
  # (one [C, V] buffer more, 46 ms less of a 250 ms CPU step); on a GPU recomputed from the
  # logits, so no second [C, V] f32 buffer is kept alive (8192 x 49152 is 1.6 GB).
  on_cpu = jax.default_backend() == "cpu"
  if reuse_exp is None:
    reuse_exp = on_cpu
  # The argmax in two passes on a CPU (row_argmax_max); GPUs keep XLA's one-pass argmax (the
  # two-pass form is not measured there).
  argmax_block = 128 if on_cpu else None

  def chunk(args):
    h_CxD, y_C, t_CxD = args
    logits_CxV = logits_of(h_CxD)
    # The row max comes with the argmax instead of a max reduction of its own: one pass less over
    # the [C, V] logits, which is most of the CE's time on a CPU (XLA:CPU runs a [384, 49152]
    # log-sum-exp in ~50 ms, the bf16 matmul that makes it in ~35 ms).
    pred, top_C = row_argmax_max(logits_CxV, argmax_block)
    top = top_C[:, None]
    e_CxV = jnp.exp(logits_CxV - top)
    sum_e = jnp.sum(e_CxV, axis=-1)
    lse = top[:, 0] + jnp.log(sum_e)
    gold = jnp.take_along_axis(logits_CxV, y_C[:, None], axis=-1)[:, 0]
    ce = lse - gold
    obj, kl = ce, None
    if t_CxD is not None:
      log_p = jax.nn.log_softmax(logits_of(t_CxD), axis=-1)
      p = jnp.exp(log_p)
      kl = jnp.sum(p * (log_p - (logits_CxV - lse[:, None])), axis=-1)
      obj = (1.0 - lam) * ce + lam * kl
    if not with_grad:
      return obj, pred, kl
    if t_CxD is None:
      # d ce / d h = softmax @ W - W[y] = (e @ W) / sum(e) - W[y], e = exp(logits - max): the
      # operand of the matmul is the exp the sum above already reads, so XLA emits both from one
      # pass over the [C, V] logits (a reduction with a side output) instead of a third pass
      # for softmax - onehot; and the label's -1 stays exact in f32 instead of rounding in bf16.
      e_dot_w = jnp.matmul(e_CxV.astype(compute_dtype), w, preferred_element_type=jnp.float32)
      dh_CxD = e_dot_w * (1.0 / sum_e)[:, None] - jnp.take(w, y_C, axis=0).astype(jnp.float32)
      return obj, pred, kl, dh_CxD
    # With a teacher: d obj / d logits = softmax - (1 - lam) onehot - lam p_teacher; d obj / d h
    # = that @ W.
    onehot = jax.nn.one_hot(y_C, logits_CxV.shape[-1], dtype=jnp.float32)
    if reuse_exp:
      dlogits = e_CxV * (1.0 / sum_e)[:, None]
    else:
      dlogits = jnp.exp(logits_CxV - lse[:, None])
    dlogits = dlogits - (1.0 - lam) * onehot - lam * p
    dh_CxD = jnp.matmul(dlogits.astype(compute_dtype), w, preferred_element_type=jnp.float32)
    return obj, pred, kl, dh_CxD

  return jax.lax.map(chunk, (h_MxCxD, y_MxC, t_MxCxD))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_ce(h_MxCxD, w_VxD, y_MxC, t_MxCxD, compute_dtype, lam):
  return _ce_chunks(h_MxCxD, w_VxD, y_MxC, t_MxCxD, compute_dtype, lam, with_grad=False)


def _fused_ce_fwd(h_MxCxD, w_VxD, y_MxC, t_MxCxD, compute_dtype, lam):
  obj, pred, kl, dh = _ce_chunks(h_MxCxD, w_VxD, y_MxC, t_MxCxD, compute_dtype, lam, with_grad=True)
  return (obj, pred, kl), (dh.astype(h_MxCxD.dtype), w_VxD, y_MxC, t_MxCxD)


def _fused_ce_bwd(compute_dtype, lam, res, cotangents):
  dh, w, y, t = res
  g_obj = cotangents[0]          # pred and kl are metrics: their cotangents are dropped
  g_h = (dh.astype(jnp.float32) * g_obj[..., None]).astype(dh.dtype)
  # No gradient for the frozen head, the integer labels or the target's states.
  return (g_h, jnp.zeros_like(w), np.zeros(y.shape, jax.dtypes.float0),
          None if t is None else jnp.zeros_like(t))


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


class Sums(NamedTuple):
  """Additive statistics of a micro-batch; the loss is wce / w over the global batch."""
  wce: jax.Array          # sum(CE * w): the objective (with distillation, its mix of CE and KL)
  w: jax.Array            # sum(w)
  correct: jax.Array      # sum([argmax == label] * [w > 0])
  counted: jax.Array      # sum([w > 0])
  accept: jax.Array       # sum over valid blocks of the accepted-prefix length
  blocks: jax.Array       # number of valid blocks
  wkl: jax.Array          # sum(KL(target || drafter) * w) with distillation, else 0


def accepted_lengths(pred_BxQ, blocks: Blocks, block_size: int):
  """int32 [B, N]: the accepted prefix of each block, the leading correct offsets among k = 1..K-1
  (a position past the document end or unsupervised stops the chain: it cannot be accepted)."""
  B = pred_BxQ.shape[0]
  ok = (pred_BxQ == blocks.labels) & (blocks.weights > 0)
  ok = ok.reshape(B, -1, block_size)[:, :, 1:]
  return jnp.cumprod(ok.astype(jnp.int32), axis=-1).sum(-1)


def block_sums(ce_BxQ, pred_BxQ, blocks: Blocks, block_size: int, kl_BxQ=None, *,
               loss_weights=None) -> Sums:
  """ce_BxQ: the per-token objective; kl_BxQ: the distillation KL (a metric) when there is one.
  loss_weights: the objective's weights where they differ from blocks.weights (a reduced draft
  vocabulary leaves out labels it cannot draft); accuracy and acceptance count every supervised
  token either way."""
  on = blocks.weights > 0
  w = blocks.weights if loss_weights is None else loss_weights
  correct = (pred_BxQ == blocks.labels) & on
  accept = accepted_lengths(pred_BxQ, blocks, block_size)
  valid = blocks.block_valid
  wkl = jnp.zeros((), jnp.float32) if kl_BxQ is None else jnp.sum(kl_BxQ * w)
  return Sums(jnp.sum(ce_BxQ * w), jnp.sum(w), jnp.sum(correct).astype(jnp.float32),
              jnp.sum(on).astype(jnp.float32),
              jnp.sum(jnp.where(valid, accept, 0)).astype(jnp.float32),
              jnp.sum(valid).astype(jnp.float32), wkl)


def metrics_from_sums(s: Sums, *, distill: bool = False) -> dict[str, jax.Array]:
  """distill: also report kl, the mean KL(target || drafter) over supervised tokens."""
  safe = lambda x: jnp.maximum(x, 1e-9)
  m = {"loss": s.wce / safe(s.w), "accuracy": s.correct / safe(s.counted),
       "tau_estimate": s.accept / safe(s.blocks) + 1.0,
       "supervised_tokens": s.counted, "valid_blocks": s.blocks}
  if distill:
    m["kl"] = s.wkl / safe(s.w)
  return m


# ---- Exact greedy acceptance length from teacher forcing (validation) ---------------------------
#
# At temperature 0 a DFlash verify step at position j of a target answer sees exactly the context
# that teacher forcing gives it (the target's features of prompt + answer[:j], the token answer[j]),
# so the accepted length a(j) of a block anchored at j is the same number in training and in real
# decoding. Real decoding visits j = 0, then j + a(j) + 1, ...: walking a(j) over every position of
# an answer gives the tau that speculative decoding of that answer measures, without decoding. The
# per-block mean of a(j) + 1 over random anchors (`tau_estimate`) weighs every position alike and
# overstates tau where easy stretches (repetition) and hard ones alternate: decoding crosses an
# easy stretch in few steps.


class ResponseAnchors(NamedTuple):
  """Anchors at every position of every response (a maximal run of supervised tokens of one
  document) up to its first `max_new_tokens` tokens; numpy, [R, N], padded with invalid slots."""
  anchors: np.ndarray      # int32 [R, N]
  valid: np.ndarray        # bool [R, N]
  response: np.ndarray     # int32 [R, N]: index of the anchor's response (-1 in padding)
  offset: np.ndarray       # int32 [R, N]: position j of the anchor inside its response
  lengths: np.ndarray      # int32 [num responses]: anchors of each response, min(L, M) - 1


def response_anchors(loss_mask_RxS: np.ndarray, doc_id_RxS: np.ndarray,
                     max_new_tokens: int) -> ResponseAnchors:
  lm = np.asarray(loss_mask_RxS).astype(bool)
  doc = np.asarray(doc_id_RxS)
  R, S = lm.shape
  rows, lengths = [], []
  for r in range(R):
    slots = []
    p = 0
    while p < S:
      if not lm[r, p]:
        p += 1
        continue
      q = p
      while q + 1 < S and lm[r, q + 1] and doc[r, q + 1] == doc[r, p]:
        q += 1
      n = min(q - p + 1, max_new_tokens) - 1   # the last token of the stretch has no next token
      if n > 0:
        slots += [(p + j, len(lengths), j) for j in range(n)]
        lengths.append(n)
      p = q + 1
    rows.append(slots)
  N = max(1, max(len(s) for s in rows))
  out = ResponseAnchors(np.zeros((R, N), np.int32), np.zeros((R, N), bool),
                        np.full((R, N), -1, np.int32), np.zeros((R, N), np.int32),
                        np.asarray(lengths, np.int32))
  for r, slots in enumerate(rows):
    for i, (a, s, j) in enumerate(slots):
      out.anchors[r, i], out.valid[r, i], out.response[r, i], out.offset[r, i] = a, True, s, j
  return out


def stderr(values) -> float | None:
  """Standard error of the mean of `values` (sample standard deviation / sqrt(n)); None below 2."""
  return float(np.std(values, ddof=1) / np.sqrt(len(values))) if len(values) > 1 else None


def walk_tau(accept_RxN: np.ndarray, ra: ResponseAnchors, rows=None) -> dict:
  """Greedy decoding's tau from a(j) at every anchor of `ra` (rows: which rows of `ra` the
  accept lengths are for, default all): per response the mean of a + 1 over the visited
  positions, then the mean over responses (as jax_drafter.evaluate reports), and its standard
  error over responses (tau_stderr)."""
  rows = range(len(ra.anchors)) if rows is None else rows
  per = {}
  for i, r in enumerate(rows):
    sel = ra.valid[r]
    for s, j, a in zip(ra.response[r][sel], ra.offset[r][sel], np.asarray(accept_RxN[i])[sel]):
      per.setdefault(int(s), np.zeros(ra.lengths[s], np.int32))[j] = a
  taus, steps, tokens = [], 0, 0
  for s, a in per.items():
    j, acc = 0, []
    while j < len(a):
      acc.append(int(a[j]))
      j += int(a[j]) + 1
    taus.append(float(np.mean(acc)) + 1.0)
    steps, tokens = steps + len(acc), tokens + sum(acc) + len(acc)
  return {"tau": float(np.mean(taus)) if taus else float("nan"), "responses": len(taus),
          "tau_stderr": stderr(taus),
          "verify_steps": steps, "tokens": tokens}
