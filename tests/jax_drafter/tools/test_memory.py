"""jax_drafter.tools.memory on CPU: the compiled memory plan names its buffers, budgets, remat equality.

XLA plans memory differently on CPU and GPU; these tests assert CPU behaviour only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_drafter import objective, presets, trainer
from jax_drafter import step as step_lib
from jax_drafter.config import DrafterConfig, TrainSection
from jax_drafter.tools import bench, bench_workers, memory, plans, xla_dump

from tiny_fixtures import tiny_run_config

TOL = dict(atol=1e-5, rtol=1e-5)     # remat only reorders f32 arithmetic


def _plan(**train):
  plan = plans.build_plan("tiny-memory", ["drafter.num_hidden_layers=1",
                                          "drafter.layer_types=[sliding_attention]"])
  return plan.replace(**train) if train else plan


def _ce_buffer(rep: memory.Report) -> memory.Buffer:
  """The chunk-logits buffer [C, V] of chunked_cross_entropy (largest from objective.py)."""
  cands = [b for b in rep.all_buffers
           if b.source.startswith("jax_drafter/objective.py") and b.function.endswith(".chunk")]
  assert cands, memory.format_report(rep)
  return max(cands, key=lambda b: b.size)


def _ce_rows(plan) -> int:
  """Rows of one CE chunk: the supervised block offsets 1..K-1, split into balanced chunks."""
  t = plan.train
  return objective.ce_chunk_rows(plan.batch_size * t.num_anchors * (plan.cfg.block_size - 1),
                                 t.ce_chunk_size)


def _dims(shape: str) -> tuple[int, ...]:
  return tuple(int(d) for d in re.search(r"\[([\d,]*)\]", shape).group(1).split(",") if d)


@pytest.fixture(scope="module")
def base():
  return memory.analyze(_plan())


def test_report_names_ce_and_attention_buffers_with_project_lines(base):
  text = memory.format_report(base)
  assert "predicted peak" in text and "optimizer state" in text
  ce = _ce_buffer(base)
  plan = _plan()
  C, V = _ce_rows(plan), plan.cfg.vocab_size
  assert set(_dims(ce.shape)) >= {C, V}, ce
  assert re.match(r"jax_drafter/objective\.py:\d+$", ce.source)
  attn = [b for b in base.all_buffers
          if b.source.startswith("pallas_kernels/dflash_attention/reference.py")]
  assert attn and all(b.function == "dflash_attention_reference" for b in attn)
  S = plan.seq_len
  assert any(S in _dims(b.shape) for b in attn), [b.shape for b in attn]   # the [.., S] scores
  assert base.peak_buffers and base.peak_bytes >= base.temp_bytes > 0
  assert base.peak_bytes == (base.argument_bytes + base.output_bytes - base.alias_bytes
                             + base.temp_bytes)


# ---- the report names its attention, and a source for every buffer ----

@pytest.fixture(scope="module")
def tiny():
  plan = plans.build_plan("tiny")
  return plan, memory.analyze(plan)


def test_report_names_the_attention_and_on_cpu_the_dense_scores(tiny):
  plan, rep = tiny
  text = memory.format_report(rep)
  a = rep.attention
  if jax.default_backend() == "gpu":   # the Pallas kernel: no dense path, nothing to account for
    from pallas_kernels.dflash_attention import api
    want = api.default_implementation(plan.cfg.head_dim)      # mosaic on Hopper, else triton
    assert a.kernel and not a.dense and f"implementation={want}" in text, text
    return
  assert "implementation=xla (the default on cpu)" in text and "dense-mask path" in text, text
  assert a.dense and not a.kernel
  # One layer's f32 context scores [B, Q, Hq, S], Q = N*K: what the Pallas kernel never holds.
  B, Q, Hq, S = (plan.batch_size, plan.train.num_anchors * plan.cfg.block_size,
                 plan.cfg.num_attention_heads, plan.seq_len)
  assert a.score_bytes == 4 * B * Q * Hq * S and memory.human(a.score_bytes).strip() in text
  dense = [b for b in rep.peak_buffers if memory.DENSE_ATTENTION in b.where]
  assert dense and 0 < sum(b.size for b in dense) <= a.peak_bytes < rep.peak_bytes
  assert f"{100 * a.peak_bytes / rep.peak_bytes:.1f}% of the predicted peak" in text
  assert 0 < a.without_bytes < rep.peak_bytes
  assert "run this command on the GPU machine" in text and memory.NO_GPU_PLAN_HERE in text


def test_report_gives_every_buffer_a_source_and_no_stray_commas(tiny):
  _, rep = tiny
  text = memory.format_report(rep)
  assert "?" not in text, text
  assert not re.search(r",\s*[)\]:]|\(\s*,|,\s*$|,\s{2,}", text, re.M), text
  assert all(b.where for b in rep.all_buffers), [b for b in rep.all_buffers if not b.where]
  args = [b for b in rep.all_buffers if b.kind == "parameter"]
  assert args and all(b.where.startswith("argument ") for b in args)
  assert "argument frozen['embed']" in text and "argument batch['features']" in text
  assert rep.peak_instruction.where in text


def test_fusion_without_metadata_takes_its_fused_ops_line():
  """XLA's CPU passes build fusions with no metadata: the line comes from the op nearest the root
  of the fused computation; with none there, the value is an XLA temporary named after what it
  copies (a convert: its operand) or who reads it (a dot: its user)."""
  hlo = """HloModule m

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %mul.1 = f32[4]{0} multiply(%p, %p), metadata={op_name="jit(f)/mul" source_file="/x/jax_drafter/model.py" source_line=7}
  ROOT %bitcast.1 = f32[4]{0} bitcast(%mul.1)
}

%fused_b (p.1: bf16[4]) -> f32[4] {
  %p.1 = bf16[4]{0} parameter(0)
  ROOT %convert.1 = f32[4]{0} convert(%p.1)
}

%fused_c (p.2: f32[4], p.3: f32[4]) -> f32[4,4] {
  %p.2 = f32[4]{0} parameter(0)
  %p.3 = f32[4]{0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p.2, %p.3)
}

ENTRY %main (x.1: bf16[4]) -> f32[4,4] {
  %x.1 = bf16[4]{0} parameter(0), metadata={op_name="batch[\\'features\\']"}
  %convert_fusion = f32[4]{0} fusion(%x.1), kind=kLoop, calls=%fused_b
  %mul_fusion = f32[4]{0} fusion(%convert_fusion), kind=kLoop, calls=%fused_a
  %dot_fusion = f32[4,4]{1,0} fusion(%mul_fusion, %convert_fusion), kind=kCustom, calls=%fused_c
  ROOT %exp.1 = f32[4,4]{1,0} exponential(%dot_fusion), metadata={op_name="jit(f)/exp" source_file="/x/pallas_kernels/dflash_attention/reference.py" source_line=95}
}
"""
  ins = xla_dump.parse_hlo(hlo)
  assert ins["x.1"].where == "argument batch['features']"
  assert ins["mul_fusion"].source == "jax_drafter/model.py:7"
  assert ins["mul_fusion"].op_name == "jit(f)/mul"
  assert ins["convert_fusion"].where == "XLA temporary: convert of argument batch['features']"
  assert ins["dot_fusion"].where == ("XLA temporary: dot read at "
                                     "pallas_kernels/dflash_attention/reference.py:95")


def test_gpu_plan_cannot_be_compiled_on_a_cpu_machine():
  """The report says so (NO_GPU_PLAN_HERE); when a JAX release can, offer that plan instead."""
  if jax.default_backend() == "gpu":
    pytest.skip("this machine has a GPU: the report is its plan")
  jitted, args, _ = plans.abstract_inputs(plans.build_plan("tiny", ["train.attention=triton"]))
  lowered = jitted.trace(*args).lower(lowering_platforms=("cuda",))
  assert "__gpu$xla.gpu.triton" in lowered.as_text()
  with pytest.raises(Exception, match="triton"):
    lowered.compile()


def test_the_step_lowers_for_cuda_with_the_mosaic_kernels(monkeypatch):
  """train.attention=mosaic: the whole train step (forward, backward, optimizer) lowers for CUDA
  with the Mosaic GPU kernels in place of the Triton ones (Mosaic GPU's layout inference and
  TMA checks run at lowering). The API refuses mosaic where JAX sees no GPU; here the lowering
  targets one."""
  from pallas_kernels.dflash_attention import api
  monkeypatch.setattr(api, "_on_gpu", lambda: True)
  jitted, args, _ = plans.abstract_inputs(plans.build_plan("tiny", ["train.attention=mosaic"]))
  text = jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  assert "__gpu$xla.gpu.triton" not in text, "a Triton kernel in the mosaic step"
  assert memory._KERNEL_CALLS.search(text), "the report would not find the kernels by name"


def test_doubling_vocab_and_chunk_moves_the_ce_buffer(base):
  # One compile for both (CPU compiles are slow): the [C, V] chunk logits become [2C, 2V].
  plan = _plan()
  plan = dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, vocab_size=2 * plan.cfg.vocab_size))
  plan = plan.replace(ce_chunk_size=2 * plan.train.ce_chunk_size)
  old, new = _ce_buffer(base), _ce_buffer(memory.analyze(plan))
  C, V = _ce_rows(plan), plan.cfg.vocab_size
  assert C == 2 * _ce_rows(_plan())
  assert set(_dims(new.shape)) >= {C, V}, new
  assert new.size == 4 * old.size, (old, new)
  assert new.source == old.source and new.function == old.function


def test_budget_smaller_than_parameters_cannot_fit(base):
  fit = memory.fit_to_budget(_plan(), base.arguments["parameters"] // 2, base, log=lambda *_: None)
  assert not fit.fits
  assert "cannot fit" in fit.message and "arguments alone" in fit.message
  assert "parameters" in fit.message and "optimizer state" in fit.message


def test_budget_that_fits_keeps_the_config(base):
  fit = memory.fit_to_budget(_plan(), 2 * base.peak_bytes, base)
  assert fit.fits and fit.plan.train.remat == "none" and "fits" in fit.message
  assert memory.parse_size("96GiB") == 96 << 30 and memory.parse_size("1.5 GB") == 1_500_000_000
  with pytest.raises(ValueError, match="96GiB"):
    memory.parse_size("lots")


def test_budget_search_picks_a_config_that_fits(base):
  # A budget just under the default's peak: the search must try the other configs and return
  # one whose compiled peak really is within the budget (on CPU, halving the CE chunk does it).
  smaller = memory.analyze(_plan(ce_chunk_size=_plan().train.ce_chunk_size // 2))
  assert smaller.peak_bytes < base.peak_bytes
  budget = (smaller.peak_bytes + base.peak_bytes) // 2
  fit = memory.fit_to_budget(_plan(), budget, base, log=lambda *_: None)
  assert fit.fits and "fits with" in fit.message, fit.message
  assert fit.plan.train != _plan().train
  assert memory.analyze(fit.plan).peak_bytes <= budget < base.peak_bytes


def test_traced_flops_count_every_chunk_of_a_loop_and_remat():
  # XLA's cost analysis counts a loop's body once (2 x 128 x 256 x 512 for the 8 chunks below);
  # the traced count multiplies it by the trip count, and counts what remat recomputes.
  x, w = jnp.ones((8, 128, 256)), jnp.ones((256, 512))
  one = 2 * 128 * 256 * 512
  assert memory.traced_flops(lambda x, w: jax.lax.map(lambda a: a @ w, x), x, w) == 8 * one
  assert memory.traced_flops(jax.jit(lambda x, w: x.reshape(-1, 256) @ w), x, w) == 8 * one

  def loss(x, remat):
    f = lambda a: jnp.tanh(a @ w) @ w.T
    return (jax.checkpoint(f) if remat else f)(x[0]).sum()
  plain = memory.traced_flops(jax.grad(lambda x: loss(x, False)), x)
  again = memory.traced_flops(jax.grad(lambda x: loss(x, True)), x)
  assert again == plain + one, (plain, again)   # the first matmul, once more


@pytest.mark.parametrize("case", ["tiny", "smol-2k-a512", "27b-8k"])
def test_traced_flops_are_the_bench_model_flops_less_the_kernel_attention(case):
  # Two independent counts: the bench's formula for MFU (bench.model_flops) and the jaxpr of the
  # step the bench runs (traced only, never compiled). The Pallas attention kernel is the one
  # thing the jaxpr count leaves out.
  r = presets.RUNS[case]
  args = argparse.Namespace(case=[case], ce_chunk=8192, remat="none", attention="triton")
  jitted, inputs, _ = plans.abstract_inputs(bench_workers.plan_of(args, on_cpu=False))
  model = bench.model_flops(presets.get(r.arch), r.seq_len, r.anchors, r.batch)
  traced = memory.traced_flops(jitted, *inputs)
  assert traced == pytest.approx(model["total"] - model["attention"], rel=1e-9)


def test_flops_count_the_recomputation_of_a_remat_policy(base):
  full = memory.analyze(_plan(remat="full"))
  assert base.flops > 0
  assert full.flops > 1.1 * base.flops, (base.flops, full.flops)


# ---- remat policies give the same loss and gradients as no remat ----

CFG = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, vocab_size=128, num_target_layers=8,
                    target_layer_ids=(1, 4), mask_token_id=3,
                    layer_types=("sliding_attention", "full_attention"), sliding_window=16)
T0 = TrainSection(num_anchors=4, ce_chunk_size=16)


@pytest.fixture(scope="module")
def remat_inputs():
  graphdef, state = step_lib.init_state(CFG, T0, step_lib.make_optimizer(T0))
  B, S = 2, 48
  k = jax.random.split(jax.random.key(0), 5)
  micro = {"input_ids": jax.random.randint(k[0], (B, S), 0, CFG.vocab_size),
           "loss_mask": (jax.random.uniform(k[4], (B, S)) < 0.8).astype(jnp.int32),
           "doc_id": (jnp.arange(S) >= S // 2).astype(jnp.int32)[None].repeat(B, 0),
           "position_ids": jnp.tile(jnp.arange(S) % (S // 2), (B, 1)),
           "features": jax.random.normal(k[1], (B, S, 2 * CFG.hidden_size))}
  frozen = {"embed": jax.random.normal(k[2], (CFG.vocab_size, CFG.hidden_size)),
            "lm_head": jax.random.normal(k[3], (CFG.vocab_size, CFG.hidden_size))}
  return graphdef, state.params, micro, frozen


def _loss_and_grad(remat, graphdef, params, micro, frozen):
  t = dataclasses.replace(T0, remat=remat)
  fn = lambda p: step_lib.micro_sums(graphdef, p, micro, frozen, jax.random.key(1), cfg=CFG, t=t).wce
  return jax.jit(jax.value_and_grad(fn))(params)


@pytest.fixture(scope="module")
def no_remat(remat_inputs):
  return _loss_and_grad("none", *remat_inputs)


@pytest.mark.parametrize("remat", ["layer", "full", "offload"])
def test_remat_policy_same_loss_and_grads(remat, remat_inputs, no_remat):
  if remat == "offload" and not memory.offload_supported():
    with pytest.raises(Exception):
      jax.block_until_ready(_loss_and_grad(remat, *remat_inputs))
    pytest.skip("this backend has no pinned_host memory: offload is unsupported here")
  loss, grads = _loss_and_grad(remat, *remat_inputs)
  loss0, grads0 = no_remat
  assert float(loss0) > 0
  np.testing.assert_allclose(loss, loss0, **TOL)
  flat, flat0 = jax.tree.leaves(grads), jax.tree.leaves(grads0)
  assert len(flat) == len(flat0)
  for g, g0 in zip(flat, flat0):
    np.testing.assert_allclose(g, g0, **TOL)


@pytest.mark.parametrize("name", ["27b-8k", "8b-8k"])
def test_memory_presets_describe_the_bench_drafters(name):
  """A named run's plan goes through the run config (target dims + drafter section) and must
  come out as exactly the drafter that bench and parity use."""
  from jax_drafter import presets
  assert plans.build_plan(name).cfg == presets.get(presets.RUNS[name].arch)


# ---- the real run's first step (StepReport) ----

def test_memory_report_for_the_run_it_starts(tiny_target_dir, sharegpt_sample, tmp_path):
  out, rep = str(tmp_path / "mem"), str(tmp_path / "mem_report")
  report = memory.StepReport(rep)
  trainer.train(tiny_run_config(tiny_target_dir, sharegpt_sample, out, "train.steps=1"),
                first_step=report)
  m = report.result
  assert m["predicted_peak_bytes"] > m["arguments"]["parameters"] > 0
  # The backend's measured peak where it keeps allocator statistics (GPU), None where not (CPU).
  stats = jax.local_devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    assert m["measured_peak_bytes"] > 0
  else:
    assert m["measured_peak_bytes"] is None
  text = open(os.path.join(rep, "report.txt")).read()
  assert "objective.py" in text                # the chunked-CE buffer is named with its source
