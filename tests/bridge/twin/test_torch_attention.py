"""The twin's DFlash attention (bridge/twin/torch_attention.py) vs the JAX oracle and the Pallas kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.twin.torch_attention import BACKENDS, dflash_attention_torch
from pallas_kernels.dflash_attention.api import dflash_attention
from pallas_kernels.dflash_attention.reference import dflash_attention_reference

from tiny_fixtures import ANCHORS, DOC_START, HKV, HQ, TOL, VALID, B, D, K, N, S


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


@pytest.mark.parametrize("window", [None, 3])
def test_pallas_interpret_matches_torch_eager(window):
  rng = np.random.default_rng(0)
  B, S, N, K, Hq, Hkv, D = 2, 48, 4, 4, 4, 2, 16
  shapes = [(B, N * K, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, N * K, Hkv, D), (B, N * K, Hkv, D)]
  x = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  idx = (np.array([[0, 5, 24, 40], [3, 30, 0, 0]], np.int32),
         np.array([[0, 0, 24, 24], [0, 24, 0, 0]], np.int32),
         np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool))
  fn = lambda *qkv: dflash_attention(*qkv, *map(jnp.asarray, idx), block_size=K, window=window,
                                     implementation="triton", interpret=True)
  out_j, vjp = jax.vjp(fn, *map(jnp.asarray, x))
  dout = rng.standard_normal(out_j.shape).astype(np.float32)
  grads_j = vjp(jnp.asarray(dout))
  xt = [torch.from_numpy(a).requires_grad_() for a in x]
  out_t = dflash_attention_torch(*xt, *map(torch.from_numpy, idx), block_size=K, window=window,
                                 backend="eager")
  out_t.backward(torch.from_numpy(dout))
  np.testing.assert_allclose(np.asarray(out_j), out_t.detach().numpy(), atol=1e-4, rtol=1e-4)
  for name, gj, gt in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads_j, xt):
    np.testing.assert_allclose(np.asarray(gj), gt.grad.numpy(), atol=1e-4, rtol=1e-4, err_msg=name)
