"""bridge/twin/bench_torch.py: both PyTorch rows train the reference objective on the inputs given."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.twin import bench_torch
from bridge.twin import reference_drafter as ref
from jax_drafter import objective, presets
from jax_drafter.config import TrainSection
from jax_drafter.tools import plans

CFG = presets.get("tiny-parity")
B, S, N = 2, 64, 8
T = TrainSection(num_anchors=N, ce_chunk_size=16, warmup_steps=2, learning_rate=1e-3)


def _inputs(seed=0, steps=1):
  """A packed batch (two documents a row, invalid blocks in row 1), random weights, and the
  anchors of `steps + 1` steps."""
  micro, frozen = plans.packed_batch(CFG, B, S, N, seed, torch.float32, torch.device("cpu"))
  micro = {k: v.long() if k != "features" else v for k, v in micro.items()}
  g = torch.Generator().manual_seed(seed)
  state = {k: (1 + 0.1 * torch.randn(v.shape, generator=g)) if v.ndim == 1
           else 0.1 * torch.randn(v.shape, generator=g)
           for k, v in ref.build_reference(CFG).state_dict().items()}
  anchors = []
  for i in range(steps + 1):
    a, v = objective.sample_anchors(jax.random.key(i), jnp.asarray(micro["loss_mask"].numpy()),
                                    jnp.asarray(micro["doc_id"].numpy()), N)
    anchors.append((torch.from_numpy(np.array(a)).long(), torch.from_numpy(np.array(v))))
  assert not anchors[0][1].all()
  return bench_torch.TorchInputs(state, micro, frozen["embed"], frozen["lm_head"], anchors)


def _reference_loss(inputs):
  model = ref.build_reference(CFG)
  model.load_state_dict(inputs.state_dict)   # copies: time_steps trains the given tensors in place
  with torch.no_grad():
    s = ref.micro_sums(model, inputs.micro, {"embed": inputs.embed, "lm_head": inputs.head},
                       *inputs.anchors[0], gamma=T.loss_decay_gamma, chunk_size=16)
  return float(s["wce"] / s["w"])


def _run(row, inputs, steps=1):
  return bench_torch.time_steps(row, CFG, T, inputs, steps=steps, ce_chunk=16, ce_rows=24,
                                attention="eager", lr=lambda i: 1e-3 * (i + 1))


def test_both_rows_train_the_reference_objective():
  want = _reference_loss(_inputs())
  res = {row: _run(row, _inputs()) for row in bench_torch.ROWS}
  for row, r in res.items():
    assert r["status"] == "ok", r
    assert r["compute_dtype"] == "float32" and r["attention"] == "eager"
    np.testing.assert_allclose(r["first_loss"], want, rtol=1e-6, err_msg=row)
    assert r["graphs_compiled"] == 0 and r["recompiles_timed"] == 0   # nothing compiles on CPU
  # The same optimizer (and learning rate) on both rows: the second step's loss agrees too, and it
  # moved (a learning rate of 1e-3 on the first update).
  l_t, l_b = res["pytorch-trainers"]["losses"], res["pytorch-best"]["losses"]
  np.testing.assert_allclose(l_b[1], l_t[1], rtol=1e-5)
  assert abs(l_t[1] - l_t[0]) > 1e-4
  best = res["pytorch-best"]
  assert best["lm_head_rows"] < B * N * (CFG.block_size - 1) and best["logits"] == "float32"


def test_fixed_state_is_parameters_gradients_adam_state_and_frozen_weights():
  inputs = _inputs()
  r = _run("pytorch-best", inputs)
  n = sum(v.numel() for v in inputs.state_dict.values())
  frozen = 2 * CFG.vocab_size * CFG.hidden_size * 4
  # f32 master + f32 gradient + two f32 Adam moments per parameter; a step count per tensor.
  got = r["fixed_gib"] * 2 ** 30
  assert 16 * n + frozen <= got <= 16 * n + frozen + 8 * len(inputs.state_dict)


def test_a_failing_row_is_a_result_not_a_crash():
  inputs = _inputs()
  del inputs.state_dict["norm.weight"]
  r = _run("pytorch-best", inputs)
  assert r["status"].startswith("error: ") and "norm.weight" in r["status"], r
  with pytest.raises(ValueError, match="row='pytorch'"):
    _run("pytorch", _inputs())
