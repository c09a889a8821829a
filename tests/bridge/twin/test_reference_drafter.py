"""The PyTorch reference: attention backends vs the JAX oracle, objective vs JAX, module names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.twin import reference_drafter as ref
from bridge.twin.torch_attention import BACKENDS, dflash_attention_torch
from jax_drafter import objective
from jax_drafter.config import DrafterConfig
from jax_drafter.export import zlab_shapes
from pallas_kernels.dflash_attention.reference import dflash_attention_reference

TOL = dict(atol=2e-5, rtol=2e-5)   # f32, different summation order only

B, S, K, HQ, HKV, D = 2, 40, 4, 4, 2, 8
# Edge cases: an anchor at its document start (no context), anchor 0, anchor == S (the whole
# row is context), a second document (doc_start 20), and two invalid blocks in row 1.
ANCHORS = np.array([[0, 3, 20, 25, 40], [2, 5, 30, 0, 0]], np.int32)
DOC_START = np.array([[0, 0, 20, 20, 20], [0, 0, 20, 0, 0]], np.int32)
VALID = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
N = ANCHORS.shape[1]


def _inputs(seed):
  rng = np.random.default_rng(seed)
  shapes = [(B, N * K, HQ, D), (B, S, HKV, D), (B, S, HKV, D), (B, N * K, HKV, D), (B, N * K, HKV, D)]
  return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("window", [None, 3, 1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_attention_matches_jax_reference(backend, window):
  x = _inputs(0)
  idx = (ANCHORS, DOC_START, VALID)
  fn = lambda *qkv: dflash_attention_reference(*qkv, *map(jnp.asarray, idx), block_size=K,
                                               window=window)
  out_j, vjp = jax.vjp(fn, *map(jnp.asarray, x))
  dout = np.random.default_rng(1).standard_normal(out_j.shape).astype(np.float32)
  grads_j = vjp(jnp.asarray(dout))

  # torch's flex_attention has no CPU backward (it raises): flex is checked forward-only here and
  # with gradients on the GPU (jax_drafter.tools.parity --torch-attention flex).
  grad = backend != "flex"
  xt = [torch.from_numpy(a).requires_grad_(grad) for a in x]
  out_t = dflash_attention_torch(*xt, *map(torch.from_numpy, idx), block_size=K, window=window,
                                 backend=backend)
  np.testing.assert_allclose(out_t.detach().numpy(), np.asarray(out_j), **TOL)
  o = out_t.detach().numpy().reshape(B, N, K, HQ, D)
  assert np.all(o[~VALID] == 0)                   # invalid blocks output exactly 0
  if not grad:
    return
  out_t.backward(torch.from_numpy(dout))
  for name, gt, gj in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), xt, grads_j):
    assert not torch.isnan(gt.grad).any(), name
    np.testing.assert_allclose(gt.grad.numpy(), np.asarray(gj), **TOL, err_msg=name)
  # Queries of invalid blocks get exactly zero gradient.
  assert np.all(xt[0].grad.numpy().reshape(B, N, K, HQ, D)[~VALID] == 0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_hidden_key_gets_zero_gradient(backend):
  """Context key 30 of row 0 is visible to no block of row 0 with window 3 (anchors 0,3,20,25,40
  see at most keys [lo or a+o-2, a)): its gradient must be exactly 0."""
  x = [torch.from_numpy(a).requires_grad_() for a in _inputs(2)]
  out = dflash_attention_torch(*x, *map(torch.from_numpy, (ANCHORS, DOC_START, VALID)),
                               block_size=K, window=3, backend=backend)
  out.sum().backward()
  assert torch.all(x[1].grad[0, 30] == 0) and torch.all(x[2].grad[0, 30] == 0)
  assert torch.any(x[1].grad[0, 24] != 0)   # key 24 is visible to anchor 25


def _batch(seed=0, B=2, S=48):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 100, (B, S)).astype(np.int32)
  doc = np.zeros((B, S), np.int32)
  doc[:, 30:] = 1
  pos = np.concatenate([np.arange(30), np.arange(S - 30)])[None].repeat(B, 0).astype(np.int32)
  lm = (rng.random((B, S)) < 0.8).astype(np.int32)
  lm[1, :] = 0
  lm[1, 40:44] = 1        # row 1: 3 candidates -> invalid blocks
  return ids, lm, doc, pos


@pytest.mark.parametrize("gamma", [7.0, None])
def test_build_blocks_matches_jax(gamma):
  ids, lm, doc, pos = _batch()
  a, v = objective.sample_anchors(jax.random.key(0), jnp.asarray(lm), jnp.asarray(doc), 8)
  a, v = np.asarray(a), np.asarray(v)
  assert not v.all()
  bj = objective.build_blocks(jnp.asarray(a), jnp.asarray(v), *map(jnp.asarray, (ids, lm, doc, pos)),
                              block_size=K, mask_token_id=101, gamma=gamma)
  bt = ref.build_blocks(torch.from_numpy(a), torch.from_numpy(v), *map(torch.from_numpy, (ids, lm, doc, pos)),
                        block_size=K, mask_token_id=101, gamma=gamma)
  for name in objective.Blocks._fields:
    want, got = np.asarray(getattr(bj, name)), getattr(bt, name).numpy()
    if name == "weights":
      np.testing.assert_allclose(got, want, atol=1e-7, rtol=1e-6, err_msg=name)
    else:
      np.testing.assert_array_equal(got, want, err_msg=name)


def test_chunked_cross_entropy_equals_unchunked():
  g = torch.Generator().manual_seed(0)
  h, w = torch.randn(37, 16, generator=g), torch.randn(50, 16, generator=g)
  y = torch.randint(0, 50, (37,), generator=g)
  h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
  ce, pred = ref.chunked_cross_entropy(h1, w, y, chunk_size=8)
  full = torch.nn.functional.cross_entropy(h2 @ w.T, y, reduction="none")
  torch.testing.assert_close(ce, full, atol=1e-5, rtol=1e-5)
  assert torch.equal(pred, (h @ w.T).argmax(-1))
  ce.sum().backward()
  full.sum().backward()
  torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)


def test_module_names_are_zlab_names():
  cfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=64, num_target_layers=4,
                      target_layer_ids=(1, 2), mask_token_id=63, block_size=4,
                      layer_types=("sliding_attention", "full_attention"), sliding_window=5)
  model = ref.build_reference(cfg)
  got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
  assert got == zlab_shapes(cfg)


def test_forward_builds_each_window_mask_once(monkeypatch):
  """The layers of one forward share their masks: 3 layers with 2 distinct windows build 2 dense
  masks (not 3), and the output equals the eager oracle's, which builds its masks inline."""
  from bridge.twin import torch_attention
  cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, vocab_size=128,
                      num_target_layers=8, target_layer_ids=(1, 4), mask_token_id=3, block_size=K,
                      layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                      sliding_window=3)
  built = []
  real = torch_attention.dense_mask
  monkeypatch.setattr(torch_attention, "dense_mask",
                      lambda *a, **kw: built.append(kw["window"]) or real(*a, **kw))
  torch.manual_seed(0)
  outs = {}
  for backend in ("eager", "sdpa"):
    model = ref.build_reference(cfg, attention=backend)
    with torch.no_grad():
      for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    idx = map(torch.from_numpy, (ANCHORS, DOC_START, VALID))
    feats = torch.randn(B, S, 2 * 32, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(B, N * K, 32, generator=torch.Generator().manual_seed(2))
    ctx_pos = torch.arange(S).expand(B, S)
    blk_pos = (torch.from_numpy(ANCHORS).long()[:, :, None] + torch.arange(K)).reshape(B, -1)
    with torch.no_grad():
      outs[backend] = model(noise, feats, ctx_pos, blk_pos, *idx)
  assert sorted(built, key=str) == [3, None]
  np.testing.assert_allclose(outs["sdpa"].numpy(), outs["eager"].numpy(), **TOL)
