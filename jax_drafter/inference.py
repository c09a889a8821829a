"""The drafter's proposal step at inference time: one sequence, context K/V cached across verify steps.

z-lab style: `ctx = hidden_norm(fc(target_features))` is projected once per context position into
every layer's context keys `rope(k_norm(k_proj(ctx)), pos)` and values `v_proj(ctx)`; a verify step
appends only the newly accepted positions, and the block's own K/V are never cached (the block
`[last accepted, MASK, ...]` is recomputed every step). The proposal is the DFlash contract with one
block whose anchor is the context length n (all of the context is visible): it must equal
`Drafter.__call__` for the same context (tests/jax_drafter/test_inference.py checks it).

Static shapes so jit compiles once per (max_len, K): the cache is padded to `max_len` (a power of
two), context is appended in chunks of K rows (a verify block's) or of `prefill_chunk` rows (a
prompt's), and n is a traced scalar. A verify step's append and the next proposal run in one
call (`extend_and_propose`). Padding rows past n are never visible: the attention mask only admits
context keys j < anchor = n.
Letters as in config.py; L drafter layers, M = max_len.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_drafter import draft_vocab
from jax_drafter.config import DrafterConfig
from jax_drafter.step import frozen_in_compute_dtype


class ContextCache(NamedTuple):
  k_LxMxHkvxDh: jax.Array
  v_LxMxHkvxDh: jax.Array


def bucket(n: int, minimum: int = 64) -> int:
  """Smallest power of two >= max(n, minimum)."""
  return 1 << max(int(math.ceil(math.log2(max(n, 1)))), int(math.log2(minimum)))


def _extend(graphdef, params, cache: ContextCache, n, feats_CxF) -> ContextCache:
  """Write the context K/V of C feature rows at positions n..n+C-1 (rows past the count are junk
  that a later call overwrites; the mask never shows them)."""
  model = nnx.merge(graphdef, params)
  C = feats_CxF.shape[0]
  ctx = model.hidden_norm(model.fc(feats_CxF[None].astype(model.compute_dtype)))  # [1, C, D]
  pos = (n + jnp.arange(C, dtype=jnp.int32))[None]
  kv = [layer.self_attn.context_kv(ctx, pos) for layer in model.layers]
  at = (0, n, 0, 0)
  k = jax.lax.dynamic_update_slice(
      cache.k_LxMxHkvxDh, jnp.stack([k[0] for k, _ in kv]).astype(cache.k_LxMxHkvxDh.dtype), at)
  v = jax.lax.dynamic_update_slice(
      cache.v_LxMxHkvxDh, jnp.stack([v[0] for _, v in kv]).astype(cache.v_LxMxHkvxDh.dtype), at)
  return ContextCache(k, v)


def _block_hidden(graphdef, params, cache: ContextCache, n, last_token, mask_token_id, embed_VxD,
                  *, attn_impl: dict, K: int):
  """Final-normed hidden states [K, D] of the block [last_token, MASK x K-1] at positions
  n..n+K-1: the training layers (model.DecoderLayer.with_context_kv) over the cached context K/V.
  The block's ids are built here, on the device: no host array crosses per proposal."""
  model = nnx.merge(graphdef, params)
  noise_ids_K = jnp.full((K,), mask_token_id, jnp.int32).at[0].set(last_token)
  x = jnp.take(embed_VxD, noise_ids_K, axis=0)[None].astype(model.compute_dtype)  # [1, K, D]
  pos = (n + jnp.arange(K, dtype=jnp.int32))[None]
  anchors = jnp.reshape(n, (1, 1)).astype(jnp.int32)
  doc_start = jnp.zeros((1, 1), jnp.int32)
  valid = jnp.ones((1, 1), bool)
  for i, layer in enumerate(model.layers):
    x = layer.with_context_kv(x, cache.k_LxMxHkvxDh[i][None], cache.v_LxMxHkvxDh[i][None], pos,
                              anchors, doc_start, valid, attn_impl, block_size=K)
  return model.norm(x)[0]


def _propose(graphdef, params, cache, n, last_token, mask_token_id, embed_VxD, lm_head_VxD, key,
             draft_ids=None, *, attn_impl: dict, temperature: float, K: int):
  """-> (draft ids int32 [K-1], draft probabilities f32 [K-1, V] or None when greedy).
  draft_ids int32 [N]: lm_head_VxD holds only those rows (a reduced draft vocabulary); the
  drafted row is mapped back to its target id, the probabilities scattered to all V ids."""
  h = _block_hidden(graphdef, params, cache, n, last_token, mask_token_id, embed_VxD,
                    attn_impl=attn_impl, K=K)[1:]
  cd = h.dtype
  # Same numerics as objective.chunked_cross_entropy: compute dtype in, f32 accumulation.
  logits = jnp.einsum("kd,vd->kv", h, lm_head_VxD.astype(cd), preferred_element_type=jnp.float32)
  ids = lambda rows: rows if draft_ids is None else jnp.take(draft_ids, rows)
  if temperature <= 0:
    return ids(jnp.argmax(logits, axis=-1).astype(jnp.int32)), None
  scaled = logits / temperature
  probs = jax.nn.softmax(scaled, axis=-1)
  if draft_ids is not None:
    probs = jnp.zeros((probs.shape[0], embed_VxD.shape[0]), probs.dtype).at[:, draft_ids].set(probs)
  return ids(jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)), probs


def _extend_propose(graphdef, params, cache, n, feats_CxF, count, last_token, mask_token_id,
                    embed_VxD, lm_head_VxD, key, draft_ids=None, *, attn_impl: dict,
                    temperature: float, K: int):
  """One verify step's drafter work in one call: append the accepted positions' features
  (`count` of the C rows, at n..) and propose the next block [last_token, MASK, ...] at n + count.
  -> (cache, draft ids [K-1], draft probabilities or None)."""
  cache = _extend(graphdef, params, cache, n, feats_CxF)
  ids, probs = _propose(graphdef, params, cache, n + count, last_token, mask_token_id, embed_VxD,
                        lm_head_VxD, key, draft_ids, attn_impl=attn_impl,
                        temperature=temperature, K=K)
  return cache, ids, probs


@functools.lru_cache(maxsize=16)
def _compiled(graphdef, impl: tuple, temperature: float, K: int):
  """Jitted (extend, block_hidden, propose, extend_propose), shared by sessions of one
  architecture: evaluating again (every M training steps) reuses the compiled code instead of
  tracing anew."""
  attn_impl = dict(impl)
  # The cache is donated: each extend writes C rows in place instead of copying [L, M, Hkv, Dh]
  # twice (K and V). It is created by JAX here, never a DLPack import, so donation is safe.
  return (jax.jit(functools.partial(_extend, graphdef), donate_argnums=(1,)),
          jax.jit(functools.partial(_block_hidden, graphdef, attn_impl=attn_impl, K=K)),
          jax.jit(functools.partial(_propose, graphdef, attn_impl=attn_impl,
                                    temperature=temperature, K=K)),
          jax.jit(functools.partial(_extend_propose, graphdef, attn_impl=attn_impl,
                                    temperature=temperature, K=K), donate_argnums=(1,)))


class DrafterSession:
  """Proposal state of one sequence. Arrays in, numpy out; no torch here.

  Usage: s.reset(max_len); s.extend(prompt_features, T); s.propose(last); loop { verify ...;
  s.extend_and_propose(block_features, accepted + 1, new_last) } (or extend, then propose).
  """

  def __init__(self, cfg: DrafterConfig, graphdef, params, embed_VxD, lm_head_VxD, *,
               block_size: int | None = None, attn_impl: dict | None = None,
               temperature: float = 0.0, prefill_chunk: int = 256, draft_ids=None):
    """prefill_chunk: rows a call appends when more than one block's are given (a prompt): one
    compiled shape for every prompt length, a 1000-token prompt in 4 calls instead of 63.
    draft_ids: the drafter's reduced draft vocabulary (int32 [N], draft_vocab.py), None for the
    whole one; lm_head_VxD is the target's whole head either way."""
    self.cfg = cfg
    self.block_size = block_size or cfg.block_size
    if not 2 <= self.block_size <= cfg.block_size:
      raise ValueError(f"block_size={self.block_size} must be in [2, {cfg.block_size}] "
                       f"(the drafter was trained with block_size={cfg.block_size})")
    self.params, self.embed, self.lm_head = params, embed_VxD, lm_head_VxD
    ids = draft_vocab.check(None if draft_ids is None else np.asarray(draft_ids), cfg,
                            source="the drafter session")
    self.temperature = float(temperature)
    self.prefill_chunk = max(int(prefill_chunk), self.block_size)
    model = nnx.merge(graphdef, params)
    layer0 = model.layers[0].self_attn
    self._kv_shape = layer0.shape[1:]
    self._dtype = model.compute_dtype
    # The head's rows of the draft vocabulary, gathered once as the train step reads them, and
    # narrowed once to the compute dtype as training narrows it: every proposal multiplies by the
    # head in that dtype, and casting a float32 [V, D] head there on each call cost more than the
    # rest of a proposal on a CPU. A head given narrowed (the training run's) is kept as it is.
    frozen = frozen_in_compute_dtype(
        draft_vocab.with_draft_vocab({"lm_head": lm_head_VxD}, ids), jnp.dtype(self._dtype).name)
    self.lm_head, self.draft_ids = frozen.get("draft_head", frozen["lm_head"]), frozen.get("draft_ids")
    # The inference block is one block over a short context: the dense-mask XLA path is cheap.
    impl = tuple(sorted((attn_impl or {"implementation": "xla"}).items()))
    self._extend, self._hidden, self._propose, self._extend_propose = _compiled(
        graphdef, impl, self.temperature, self.block_size)
    self.cache: ContextCache | None = None
    self.length = 0

  def reset(self, max_len: int) -> None:
    """Empty context with room for max_len positions (rounded up to a power of two, with room
    for a last prefill chunk's padding rows)."""
    L, M = self.cfg.num_hidden_layers, self.positions_for(max_len)
    shape = (L, M) + tuple(self._kv_shape)
    # Committed to the parameters' device like every cache a call returns: an uncommitted first
    # cache would compile each call a second time for the second chunk of a prompt.
    devices = jax.tree.leaves(self.params)[0].devices()
    device = next(iter(devices)) if len(devices) == 1 else None
    self.cache = ContextCache(jnp.zeros(shape, self._dtype, device=device),
                              jnp.zeros(shape, self._dtype, device=device))
    self.length = 0

  def positions_for(self, max_len: int) -> int:
    """Rows of the context cache reset(max_len) makes (each size compiles the calls once)."""
    return bucket(max_len + self.prefill_chunk)

  @property
  def max_len(self) -> int:
    return self.cache.k_LxMxHkvxDh.shape[1]

  def extend(self, feats_RxF, count: int | None = None) -> None:
    """Append the first `count` rows of feats_RxF (default all) as the next context positions."""
    count = feats_RxF.shape[0] if count is None else count
    if not 0 <= count <= feats_RxF.shape[0]:
      raise ValueError(f"{count=} must be in [0, {feats_RxF.shape[0]}] (rows of the features)")
    # A verify block's rows in one block-sized call, more (a prompt) in prefill-sized chunks:
    # two compiled shapes in all.
    C = self.block_size if feats_RxF.shape[0] <= self.block_size else self.prefill_chunk
    pad = (-feats_RxF.shape[0]) % C
    feats = jnp.pad(feats_RxF, ((0, pad), (0, 0))) if pad else feats_RxF
    for c in range(0, count, C):
      self._room(C)
      self.cache = self._extend(self.params, self.cache, jnp.int32(self.length), feats[c:c + C])
      self.length += min(C, count - c)

  def _room(self, rows: int) -> None:
    """Grow the cache until `rows` more fit (rare: recompiles for each new shape). A write past
    the end would not fail: XLA clamps dynamic_update_slice's start and overwrites earlier rows."""
    while self.length + rows > self.max_len:
      grow = ((0, 0), (0, self.max_len), (0, 0), (0, 0))
      self.cache = ContextCache(*(jnp.pad(x, grow) for x in self.cache))

  def extend_and_propose(self, feats_CxF, count: int, last_token: int, key=None):
    """extend(feats_CxF, count) then propose(last_token) in one compiled call (one dispatch and
    one wait a verify step instead of two): feats_CxF has exactly block_size rows (a verify
    block's features), of which the first `count` are appended. -> as propose."""
    C = self.block_size
    if feats_CxF.shape[0] != C:
      raise ValueError(f"extend_and_propose takes the {C} rows of one verify block, got "
                       f"{feats_CxF.shape[0]}; use extend() for other lengths")
    if not 0 <= count <= C:
      raise ValueError(f"{count=} must be in [0, {C}] (rows of the features)")
    self._room(C)
    key = jax.random.key(0) if key is None else key
    self.cache, ids, probs = self._extend_propose(
        self.params, self.cache, np.int32(self.length), feats_CxF, np.int32(count),
        np.int32(last_token), np.int32(self.cfg.mask_token_id), self.embed, self.lm_head, key,
        self.draft_ids)
    self.length += count
    return np.asarray(ids), None if probs is None else np.asarray(probs)

  def block_hidden(self, last_token: int) -> jax.Array:
    """Final hidden states [K, D] of the block [last_token, MASK, ...] at positions n..n+K-1."""
    return self._hidden(self.params, self.cache, np.int32(self.length), np.int32(last_token),
                        np.int32(self.cfg.mask_token_id), self.embed)

  def propose(self, last_token: int, key=None):
    """-> (draft ids np.int32 [K-1], draft probabilities np.float32 [K-1, V] or None if greedy)."""
    key = jax.random.key(0) if key is None else key
    ids, probs = self._propose(self.params, self.cache, np.int32(self.length),
                               np.int32(last_token), np.int32(self.cfg.mask_token_id), self.embed,
                               self.lm_head, key, self.draft_ids)
    return np.asarray(ids), None if probs is None else np.asarray(probs)
