"""DrafterSession (inference.py): its proposals equal the training forward, sampling is a distribution."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_drafter.inference import DrafterSession
from jax_drafter.model import Drafter

from tiny_fixtures import VOCAB, tiny_drafter

TOL = dict(atol=2e-5, rtol=2e-5)  # f32 drafter, cached vs one-shot context projections


def test_inference_proposal_equals_drafter_forward(block_size=3):
  """At a block size below the trained one (the general case: attention uses the inference K)."""
  cfg, graphdef, params = tiny_drafter(block_size=4, seed=1)
  rng = np.random.default_rng(0)
  S, F, K = 13, 2 * cfg.hidden_size, block_size
  feats = jnp.asarray(rng.normal(size=(S, F)), jnp.float32)
  embed = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  lm_head = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  last = 7

  # Reference: the training forward, one block whose anchor is the context length.
  cfg_k = dataclasses.replace(cfg, block_size=K)
  model = Drafter(cfg_k, rngs=nnx.Rngs(0))
  nnx.update(model, params)
  noise = jnp.asarray([last] + [cfg.mask_token_id] * (K - 1))
  forward = jax.jit(lambda *a: model(*a, attn_impl={"implementation": "xla"}))
  want = forward(embed[noise][None], feats[None], jnp.arange(S)[None], (S + jnp.arange(K))[None],
                 jnp.array([[S]]), jnp.array([[0]]), jnp.array([[True]]))[0]

  session = DrafterSession(cfg, graphdef, params, embed, lm_head, block_size=K)
  session.reset(S + 8)
  session.extend(feats[:5])                              # the prompt
  session.extend(jnp.pad(feats[5:8], ((0, 1), (0, 0))), 3)  # a verify block, 3 accepted
  session.extend(feats[8:13], 5)                          # longer than one chunk
  assert session.length == S
  np.testing.assert_allclose(np.asarray(session.block_hidden(last)), np.asarray(want), **TOL)
  draft, probs = session.propose(last)
  want_ids = np.argmax(np.asarray(want[1:]) @ np.asarray(lm_head).T, -1)
  np.testing.assert_array_equal(draft, want_ids)
  assert probs is None
  # Static shapes: one block's rows and a prefill chunk are the two shapes of extend; more steps
  # and prompts of other lengths reuse the compiled functions.
  session.extend(feats[:K], 1)
  sizes = session._extend._cache_size(), session._propose._cache_size()
  assert sizes == (2, 1)
  session.extend(feats[:K], 2)
  session.extend(feats[:K - 1])
  session.extend(feats[:11], 7)
  session.propose(3)
  assert (session._extend._cache_size(), session._propose._cache_size()) == sizes


def test_sampling_proposal_is_a_distribution():
  cfg, graphdef, params = tiny_drafter()
  rng = np.random.default_rng(4)
  embed = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  lm_head = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  s = DrafterSession(cfg, graphdef, params, embed, lm_head, temperature=0.7)
  s.reset(16)
  s.extend(jnp.asarray(rng.normal(size=(5, 2 * cfg.hidden_size)), jnp.float32))
  ids, probs = s.propose(1, jax.random.key(3))
  assert ids.shape == (3,) and probs.shape == (3, VOCAB)
  # The proposal distribution is softmax(h @ W^T / T) of the block's hidden states (offsets 1..).
  logits = np.asarray(s.block_hidden(1))[1:] @ np.asarray(lm_head).T / 0.7
  want = np.exp(logits - logits.max(-1, keepdims=True))
  want /= want.sum(-1, keepdims=True)
  np.testing.assert_allclose(probs, want, atol=1e-5)
  assert np.all((0 <= ids) & (ids < VOCAB))


def test_extend_and_propose_equals_extend_then_propose():
  """The fused verify-step call appends the same context and proposes the same block, including
  when the context must grow past its padded length, and takes exactly one verify block."""
  cfg, graphdef, params = tiny_drafter(block_size=4, seed=2)
  rng = np.random.default_rng(5)
  F, K = 2 * cfg.hidden_size, cfg.block_size
  feats = jnp.asarray(rng.normal(size=(40, F)), jnp.float32)
  embed = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  lm_head = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  # Sampling sessions: the proposal's whole distribution is compared, not only its argmax.
  a = DrafterSession(cfg, graphdef, params, embed, lm_head, temperature=0.7)
  b = DrafterSession(cfg, graphdef, params, embed, lm_head, temperature=0.7)
  for s in (a, b):
    s.reset(6)                # 64 positions: the steps below grow it
    s.extend(feats[:7])
  pos, steps = 7, 0
  for count, last in [(1, 3), (4, 9), (2, 5)] * 9:
    block = feats[pos % 30:pos % 30 + K]
    key = jax.random.key(steps)
    a.extend(block, count)
    want, want_p = a.propose(last, key)
    got, got_p = b.extend_and_propose(block, count, last, key)
    np.testing.assert_allclose(got_p, want_p, **TOL)
    np.testing.assert_array_equal(got, want)
    assert a.length == b.length == pos + count
    pos, steps = pos + count, steps + 1
  assert b.max_len == a.max_len > 64                      # grew on the way
  np.testing.assert_allclose(np.asarray(b.cache.k_LxMxHkvxDh), np.asarray(a.cache.k_LxMxHkvxDh),
                             **TOL)
  with pytest.raises(ValueError, match="rows of one verify block"):
    b.extend_and_propose(feats[:K - 1], 1, 3)
  with pytest.raises(ValueError, match="count=5"):
    b.extend_and_propose(feats[:K], 5, 3)


def test_prompt_in_prefill_chunks_equals_block_chunks_and_grows_the_cache():
  """A prompt appended in prefill-sized chunks (padded, the cache doubled twice on the way) gives
  the context that block-sized chunks give."""
  cfg, graphdef, params = tiny_drafter(block_size=4, seed=3)
  rng = np.random.default_rng(6)
  F = 2 * cfg.hidden_size
  feats = jnp.asarray(rng.normal(size=(200, F)), jnp.float32)
  embed = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  lm_head = jnp.asarray(rng.normal(size=(VOCAB, cfg.hidden_size)), jnp.float32)
  by_block = DrafterSession(cfg, graphdef, params, embed, lm_head, prefill_chunk=1)  # = block
  by_chunk = DrafterSession(cfg, graphdef, params, embed, lm_head, prefill_chunk=48)
  assert by_block.prefill_chunk == 4
  for s in (by_block, by_chunk):
    s.reset(4)
    s.extend(feats[:150])         # 150 = 3 x 48 + 6: the last chunk is mostly padding
  assert by_chunk.length == by_block.length == 150 and by_chunk.max_len == 256
  n = 150
  np.testing.assert_allclose(np.asarray(by_chunk.cache.v_LxMxHkvxDh[:, :n]),
                             np.asarray(by_block.cache.v_LxMxHkvxDh[:, :n]), **TOL)
  np.testing.assert_allclose(np.asarray(by_chunk.block_hidden(5)),
                             np.asarray(by_block.block_hidden(5)), **TOL)
