"""The rows of `python -m jax_drafter.tools.bench`, each run in a process of its own.

Each worker prints one line `RESULT {json}` (status, times, peaks, losses) and exits 0; an
out-of-memory or any other error is a status, not a crash. Both kinds of worker draw the same
inputs: plans.random_inputs of the case's Plan (same seed, same backend, so the same values), and
the PyTorch workers hand them to torch through DLPack, with the anchors that the JAX step samples
at each step (parity.step_anchors).
"""

from __future__ import annotations

import json
import re
import statistics
import time

from jax_drafter import presets
from jax_drafter.tools import plans

GiB = 2 ** 30


# Block tokens per LM-head chunk where neither --ce-chunk nor the run sets one.
CE_CHUNK = 2048


def case_ce_chunk(case: str, ce_chunk: int | None = None) -> int:
  """The LM-head chunk a case's rows run: the one asked for, else the run's, else CE_CHUNK."""
  return ce_chunk or presets.RUNS[case].ce_chunk or CE_CHUNK


def case_plan(case: str, *, on_cpu: bool, ce_chunk: int | None = None, remat: str = "none",
              attention: str | None = None) -> plans.Plan:
  """The case's Plan as the bench's JAX row trains it (f32 on the CPU, bf16 on a GPU), with the
  bench's defaults where not given (case_ce_chunk, no remat): also what the GPU scripts that
  rebuild that row (gpu_step_profile, gpu_step_clocks) run."""
  from jax_drafter.config import TrainSection
  r = presets.RUNS[case]
  t = TrainSection(steps=1000, num_anchors=r.anchors, ce_chunk_size=case_ce_chunk(case, ce_chunk),
                   remat=remat, compute_dtype="float32" if on_cpu else "bfloat16",
                   attention=attention)
  return plans.Plan(presets.get(r.arch), t, r.batch, r.seq_len,
                    feature_dtype="float32" if on_cpu else "bfloat16",
                    attn_impl={"implementation": attention} if attention else None, name=case)


def plan_of(args, on_cpu: bool) -> plans.Plan:
  """case_plan of a worker's parsed arguments (--case, --ce-chunk, --remat, --attention)."""
  return case_plan(args.case[0], on_cpu=on_cpu, ce_chunk=args.ce_chunk, remat=args.remat,
                   attention=args.attention)


def jax_row(plan: plans.Plan):
  """(graphdef, jitted train step, state, batch, frozen) of the bench's JAX row for `plan`:
  plans.random_inputs' weights and batch, the optimizer and attention of the plan."""
  from jax_drafter import step as step_lib
  graphdef, state, batch, frozen = plans.random_inputs(plan)
  t = plan.train
  fn = step_lib.jit_train_step(step_lib.make_train_step(graphdef, plan.cfg, t,
                                                        step_lib.make_optimizer(t),
                                                        plan.attn_impl))
  return graphdef, fn, state, batch, frozen


def _failed_alloc(msg: str) -> str | None:
  m = re.search(r"(?:allocate|allocating)\D{0,20}([\d.]+\s*[KMGT]i?B|\d+ bytes)", msg)
  return m.group(1) if m else None


def _emit(result: dict) -> int:
  print("RESULT " + json.dumps(result), flush=True)
  return 0


def jax_worker(args) -> int:
  import jax

  on_cpu = jax.default_backend() == "cpu"
  result = {"status": "ok", "backend": jax.default_backend(), "device": str(jax.devices()[0])}
  try:
    plan = plan_of(args, on_cpu)
    t = plan.train
    result["compute_dtype"] = t.compute_dtype
    graphdef, fn, state, batch, frozen = jax_row(plan)
    cats = plans.categories(state, batch, frozen)
    # Parameters, their gradients (as large), optimizer state, frozen weights: as bench_torch.
    fixed = (2 * cats["parameters"] + cats["optimizer state"] + cats["frozen embed + LM head"])
    t0 = time.perf_counter()
    state, m = fn(state, batch, frozen)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    metrics, times = [m], []
    for _ in range(args.steps):
      t0 = time.perf_counter()
      state, m = fn(state, batch, frozen)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t0)
      metrics.append(m)
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
    med = statistics.median(times) if times else first
    losses = [float(x["loss"]) for x in metrics]
    result.update(step_ms=med * 1e3, steps_ms=[x * 1e3 for x in times], compile_s=first - med,
                  losses=losses, first_loss=losses[0], peak_gib=peak / GiB,
                  fixed_gib=fixed / GiB,
                  peak_minus_fixed_gib=(peak - fixed) / GiB if peak else None)
    if args.breakdown:
      from jax_drafter.tools import breakdown
      parts = breakdown.step_breakdown(graphdef, state, batch, frozen, cfg=plan.cfg, t=t,
                                       attn_impl=plan.attn_impl, reps=max(args.steps, 1))
      result["breakdown_ms"] = {k: v * 1e3 for k, v in parts.items()}
  except Exception as e:  # noqa: BLE001 - an OOM must be a result, not a crash
    msg = str(e)
    oom = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    result = {"status": "out of memory" if oom else f"error: {type(e).__name__}: {msg[:300]}",
              "failed_alloc": _failed_alloc(msg) if oom else None}
  return _emit(result)


def torch_inputs(plan: plans.Plan, *, steps: int, shift: int = 0):
  """The JAX row's initial weights, batch, frozen weights and per-step anchors as torch tensors on
  torch's device (bench_torch.TorchInputs); JAX's own buffers are freed before returning.

  shift: move every valid anchor this many tokens right (the bench's --perturb-anchors)."""
  import jax
  import numpy as np
  import torch

  from bridge.twin.bench_torch import TorchInputs
  from jax_drafter.params import to_flat
  from jax_drafter.tools.parity import step_anchors

  _, state, batch, frozen = plans.random_inputs(plan)
  N, S = plan.train.num_anchors, plan.seq_len
  anchors_at = jax.jit(step_anchors, static_argnums=(4,))
  anchors = [anchors_at(state.rng, i, batch["loss_mask"], batch["doc_id"], N) for i in range(steps + 1)]
  flat = to_flat(state.params)
  jax.block_until_ready((flat, batch, frozen, anchors))
  dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

  def own(x, transpose=False):
    # Zero-copy DLPack view of the JAX buffer, then a torch-owned copy: the optimizer updates the
    # parameters in place, and the JAX buffers are freed below.
    try:
      t = torch.from_dlpack(x)
    except Exception:  # noqa: BLE001 - through host memory instead (numpy has no torch bf16)
      a = np.array(x)
      t = (torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16) if a.dtype.name == "bfloat16"
           else torch.from_numpy(a))
    return (t.t() if transpose else t).to(dev, copy=True, memory_format=torch.contiguous_format)

  small = lambda x: torch.from_numpy(np.array(x)).to(dev)
  pairs = []
  for a, v in anchors:
    a, v = np.asarray(a[0]), np.asarray(v[0])
    if shift:
      a = np.where(v, np.minimum(a + shift, S - 2), a)
    pairs.append((small(a).long(), small(v)))
  inputs = TorchInputs(
      state_dict={k: own(x, transpose=x.ndim == 2) for k, x in flat.items()},
      micro={**{k: small(batch[k][0]).long()
                for k in ("input_ids", "loss_mask", "doc_id", "position_ids")},
             "features": own(batch["features"][0])},
      embed=own(frozen["embed"]), head=own(frozen["lm_head"]), anchors=pairs)
  # Free JAX's copies now (the platform allocator gives the memory back to the driver).
  for x in {id(x): x for x in jax.tree.leaves((state, batch, frozen, anchors))}.values():
    if isinstance(x, jax.Array):
      x.delete()
  return inputs


def torch_worker(args) -> int:
  import jax   # before torch initialises CUDA, as everywhere JAX and torch share a GPU
  import torch

  from bridge.twin import bench_torch
  from jax_drafter import objective
  from jax_drafter.tools.parity import torch_lr

  row = args.side[0]
  on_cpu = jax.default_backend() == "cpu"
  attention = args.torch_attention
  if attention == "auto":
    attention = "flex" if torch.cuda.is_available() else "eager"
  try:
    plan = plan_of(args, on_cpu)
    t = plan.train
    inputs = torch_inputs(plan, steps=args.steps, shift=1 if args.perturb_anchors else 0)
  except Exception as e:  # noqa: BLE001 - reported, not fatal to the benchmark
    return _emit({"status": f"error: inputs: {type(e).__name__}: {str(e)[:300]}", "row": row})
  K = plan.cfg.block_size
  rows = objective.ce_chunk_rows(plan.batch_size * t.num_anchors * (K - 1), t.ce_chunk_size)
  result = bench_torch.time_steps(row, plan.cfg, t, inputs, steps=args.steps,
                                  ce_chunk=t.ce_chunk_size, ce_rows=rows, attention=attention,
                                  lr=lambda i: torch_lr(t, i))
  result["perturbed_anchors"] = bool(args.perturb_anchors)
  return _emit(result)
