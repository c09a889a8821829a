"""`python -m jax_drafter.tools.parity` on CPU: the Flax drafter equals the PyTorch reference (f32).

The tiny preset has a sliding and a full layer, GQA, packed rows of two documents and a row with
too few anchor candidates (invalid blocks); the tool's own tolerances (parity.TOLERANCES) decide.
"""

import json

import pytest

from jax_drafter.tools import parity


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


def test_a_run_configs_dropout_is_off(tmp_path, capsys):
  # A run config (the default's has dropout 0.2) drives the real train step, which would drop on
  # the JAX side only: the trajectory would part from step 1.
  run = tmp_path / "run.yaml"
  run.write_text("train:\n  dropout: 0.2\n")
  _, t, _, _ = parity.resolve(parity.parse(["--config", str(run), "--run-dir", str(tmp_path)]))
  assert t.dropout == 0.0
  assert "train.dropout=0.2" in capsys.readouterr().err
