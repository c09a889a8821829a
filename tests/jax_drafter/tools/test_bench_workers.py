"""jax_drafter/tools/bench_workers.py: the PyTorch rows get exactly the JAX row's inputs."""

import argparse
import dataclasses

import numpy as np
import pytest
import torch

from jax_drafter.params import to_flat
from jax_drafter.tools import bench_workers, plans
from jax_drafter.tools.parity import step_anchors


def _plan(feature_dtype="float32"):
  args = argparse.Namespace(case=["tiny"], ce_chunk=32, remat="none", attention=None)
  return dataclasses.replace(bench_workers.plan_of(args, on_cpu=True), feature_dtype=feature_dtype)


def _np(x):
  """torch tensor or JAX array -> numpy, bf16 widened to f32 (exact)."""
  if isinstance(x, torch.Tensor):
    return x.float().numpy() if x.dtype == torch.bfloat16 else x.numpy()
  x = np.asarray(x)
  return x.astype(np.float32) if x.dtype.name == "bfloat16" else x


def _check_equal(inputs, plan, steps, shift=0):
  _, state, batch, frozen = plans.random_inputs(plan)   # the JAX row draws these itself
  for k, want in to_flat(state.params).items():
    got = inputs.state_dict[k]
    np.testing.assert_array_equal(got.numpy(), np.asarray(want).T if want.ndim == 2 else want,
                                  err_msg=k)
  assert inputs.micro["features"].dtype == getattr(torch, plan.feature_dtype)
  np.testing.assert_array_equal(_np(inputs.micro["features"]), _np(batch["features"][0]))
  for k in ("input_ids", "loss_mask", "doc_id", "position_ids"):
    assert inputs.micro[k].dtype == torch.int64
    np.testing.assert_array_equal(inputs.micro[k].numpy(), np.asarray(batch[k][0]))
  np.testing.assert_array_equal(_np(inputs.embed), _np(frozen["embed"]))
  np.testing.assert_array_equal(_np(inputs.head), _np(frozen["lm_head"]))
  assert len(inputs.anchors) == steps + 1
  for i, (a, v) in enumerate(inputs.anchors):
    wa, wv = (np.asarray(x[0]) for x in step_anchors(state.rng, i, batch["loss_mask"],
                                                     batch["doc_id"], plan.train.num_anchors))
    np.testing.assert_array_equal(v.numpy(), wv)
    np.testing.assert_array_equal(a.numpy(), np.where(wv, np.minimum(wa + shift, plan.seq_len - 2), wa))


@pytest.mark.parametrize("dlpack", [True, False])
@pytest.mark.parametrize("feature_dtype", ["float32", "bfloat16"])
def test_torch_inputs_are_the_jax_rows_inputs(monkeypatch, dlpack, feature_dtype):
  """Weights ([in, out] -> [out, in]), batch, frozen weights and each step's anchors, bit for bit;
  the same through host memory when DLPack refuses (bf16 included: numpy has no torch bf16)."""
  if not dlpack:
    def refuse(x):
      raise RuntimeError("no DLPack here")
    monkeypatch.setattr(torch, "from_dlpack", refuse)
  plan = _plan(feature_dtype)
  inputs = bench_workers.torch_inputs(plan, steps=2)
  _check_equal(inputs, plan, steps=2)
  p = inputs.state_dict["layers.0.self_attn.q_proj.weight"]
  assert p.is_contiguous() and p.dtype == torch.float32


def test_shifted_anchors_move_every_valid_anchor():
  plan = _plan()
  inputs = bench_workers.torch_inputs(plan, steps=0, shift=1)
  _check_equal(inputs, plan, steps=0, shift=1)


def test_case_plan_takes_the_bench_s_chunk_and_jax_row_trains_it():
  """The plan the GPU scripts rebuild is the bench's: the run's own LM-head chunk where it sets one
  (the SmolLM2 cases: 8192), else the bench's default; and jax_row's step trains on its inputs."""
  import jax
  from jax_drafter.tools import bench
  assert bench_workers.case_plan("smol-2k-a512", on_cpu=True).train.ce_chunk_size == 8192
  plan = bench_workers.case_plan("tiny", on_cpu=True)
  assert plan.train.ce_chunk_size == bench.CE_CHUNK and plan.train.remat == "none"
  _, fn, state, batch, frozen = bench_workers.jax_row(plan)
  _, want_batch, _ = plans.random_inputs(plan)[1:]
  np.testing.assert_array_equal(np.asarray(batch["input_ids"]), np.asarray(want_batch["input_ids"]))
  state, m = fn(state, batch, frozen)
  assert int(state.step) == 1 and np.isfinite(float(jax.device_get(m["loss"])))
