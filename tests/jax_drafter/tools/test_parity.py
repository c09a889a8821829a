"""`python -m jax_drafter.tools.parity` on CPU: the Flax drafter equals the PyTorch reference (f32).

The tiny preset has a sliding and a full layer, GQA, packed rows of two documents and a row with
too few anchor candidates (invalid blocks); the tool's own tolerances (parity.TOLERANCES) decide.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.twin.torch_attention import dflash_attention_torch
from jax_drafter import objective, presets
from jax_drafter.tools import parity, plans
from pallas_kernels.dflash_attention.api import dflash_attention



def test_batch_has_packed_rows_and_invalid_blocks():
  p = presets.RUNS["tiny-parity"]
  cfg = presets.get(p.arch)
  micro, _ = plans.packed_batch(cfg, p.batch, p.seq_len, p.anchors, 0, torch.float32, "cpu")
  assert all(len(np.unique(row)) == 2 for row in micro["doc_id"].numpy())
  _, valid = objective.sample_anchors(jax.random.key(0), jnp.asarray(micro["loss_mask"].numpy()),
                                      jnp.asarray(micro["doc_id"].numpy()), p.anchors)
  assert np.asarray(valid)[0].all() and not np.asarray(valid)[1].all()


def test_parity_tiny_f32_with_20_step_trajectory(tmp_path, capsys):
  report = tmp_path / "parity.json"
  rc = parity.main(["--config", "tiny-parity", "--steps", "20", "--json", str(report)])
  out = capsys.readouterr().out
  assert rc == 0, out
  rep = json.loads(report.read_text())
  names = [r["name"] for r in rep["rows"]]
  for want in ("hidden.layer0", "hidden.layer1", "hidden.final", "loss", "accuracy",
               "tau_estimate", "grad.layers.0.self_attn.q_proj.weight", "grad.fc.weight",
               "train.loss[step 19]"):
    assert want in names
  assert len(rep["train_curve"]) == 20 and rep["pass"]
  assert all(r["ok"] for r in rep["rows"])


@pytest.mark.parametrize("backend", ["sdpa"])
def test_parity_torch_sdpa(backend, capsys):
  assert parity.main(["--steps", "0", "--torch-attention", backend]) == 0, capsys.readouterr().out


def test_perturbed_weight_fails(capsys):
  rc = parity.main(["--steps", "0", "--perturb"])
  out = capsys.readouterr().out
  assert rc == 1
  assert "FAIL" in out and "parity: FAIL" in out


def test_flex_on_cpu_is_refused():
  assert parity.main(["--steps", "0", "--torch-attention", "flex"]) == 2


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
