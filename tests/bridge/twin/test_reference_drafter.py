"""The PyTorch reference drafter: objective vs JAX, chunked CE, module names, shared masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.twin import reference_drafter as ref
from jax_drafter import objective
from jax_drafter.config import DrafterConfig
from jax_drafter.export import zlab_shapes

from tiny_fixtures import ANCHORS, DOC_START, HKV, HQ, TOL, VALID, B, D, K, N, S


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
