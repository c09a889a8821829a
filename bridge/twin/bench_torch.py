"""The PyTorch rows of `python -m jax_drafter.tools.bench`: one training step, timed.

Two rows, both on the JAX row's batch, initial weights, anchors, loss and optimizer (AdamW with
its betas, eps, learning-rate schedule, weight decay on matrices only, clipping at the global
norm), with f32 master weights and bf16 compute on the GPU:
  pytorch-trainers  PyTorch as the existing DFlash trainers (SpecForge) run it: the reference
                    drafter (reference_drafter.py) under bf16 autocast, flex_attention compiled and
                    the rest eager (transformers RMSNorm and RoPE in f32), the CE on all K block
                    offsets in checkpointed chunks with bf16 logits, clip_grad_norm_, fused AdamW.
  pytorch-best      what a strong PyTorch engineer writes (fast_drafter.py): compiled layers,
                    F.rms_norm, bf16 RoPE tables, masks once per step, the LM head on supervised
                    rows only with its gradient made in the forward (linear_ce.py), fused AdamW.
The bench runs each row in a worker process of its own and hands it the tensors (TorchInputs).
"""

from __future__ import annotations

import re
import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bridge.twin import reference_drafter as ref
from bridge.twin.fast_drafter import FastDrafterStep
from bridge.twin.linear_ce import logits_dtype
from jax_drafter.config import check_names_and_shapes

ROWS = ("pytorch-trainers", "pytorch-best")
GiB = 2 ** 30


@dataclass
class TorchInputs:
  """One run's tensors on the device, as the JAX row has them."""
  state_dict: dict      # {z-lab name: f32 [out, in] tensor}: the initial weights
  micro: dict           # input_ids, loss_mask, doc_id, position_ids (int64 [B, S]), features [B, S, F]
  embed: torch.Tensor   # [V, D] frozen, in the compute dtype
  head: torch.Tensor    # [V, D] frozen, in the compute dtype
  anchors: list         # per step i: (anchors int64 [B, N], block_valid bool [B, N])


def _trainers_loss(model, inputs: TorchInputs, t, *, ce_chunk: int, cd):
  micro, K = inputs.micro, model.config.block_size

  def loss(anchors_BxN, valid_BxN):
    blocks = ref.build_blocks(anchors_BxN, valid_BxN, micro["input_ids"], micro["loss_mask"],
                              micro["doc_id"], micro["position_ids"], block_size=K,
                              mask_token_id=model.config.mask_token_id, gamma=t.loss_decay_gamma)
    h = model(F.embedding(blocks.noise_ids, inputs.embed), micro["features"],
              micro["position_ids"], blocks.positions, blocks.anchors, blocks.doc_start,
              blocks.block_valid)
    # Every block offset, as SpecForge-style trainers do (offset 0 then has weight 0); bf16 logits
    # chunk by chunk under checkpointing, f32 log-sum-exp, no argmax.
    B, Q, D = h.shape
    ce, _ = ref.chunked_cross_entropy(h.reshape(B * Q, D), inputs.head, blocks.labels.reshape(-1),
                                      chunk_size=ce_chunk, compute_dtype=cd, f32_logits=False,
                                      argmax=False)
    w = blocks.weights.reshape(-1)
    return (ce * w).sum() / w.sum().clamp(min=1e-9)
  return loss


def _optimizer(params, t, *, fused: bool):
  """torch AdamW as jax_drafter.step.make_optimizer: same betas and eps, weight decay on matrices
  only; the learning rate is set every step from the JAX schedule."""
  return torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1], "weight_decay": t.weight_decay},
                            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
                           lr=0.0, betas=(t.b1, t.b2), eps=1e-8, fused=fused)


def fixed_bytes(params, opt, frozen) -> int:
  """Parameters + their f32 gradients + optimizer state + frozen weights: the memory every step
  holds whatever its activations (the bench subtracts it from the peak)."""
  size = lambda x: x.numel() * x.element_size()
  p = sum(size(x) for x in params)
  o = sum(size(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
  return 2 * p + o + sum(size(x) for x in frozen)


def time_steps(row: str, cfg, t, inputs: TorchInputs, *, steps: int, ce_chunk: int, ce_rows: int,
               attention: str, lr) -> dict:
  """Median time and peak memory of `steps` training steps after one warm-up (compile) step.

  t: the JAX row's TrainSection (optimizer, clipping, loss decay); lr(i): the learning rate of
  step i; ce_chunk: block tokens per CE chunk (trainers), ce_rows: LM-head rows per chunk (best,
  the JAX step's). Step i trains on inputs.anchors[i]. Returns the bench's result record; an
  out-of-memory or any other error is a result (status), not a crash.
  """
  if row not in ROWS:
    raise ValueError(f"{row=} is not one of {ROWS}")
  cuda = torch.cuda.is_available()
  dev = torch.device("cuda" if cuda else "cpu")
  cd = torch.bfloat16 if cuda else torch.float32
  result = {"status": "ok", "row": row, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "attention": attention, "compute_dtype": str(cd).removeprefix("torch.")}
  try:
    model = ref.build_reference(cfg, device=dev, compute_dtype=cd, attention=attention)
    check_names_and_shapes({k: tuple(v.shape) for k, v in model.state_dict().items()},
                           {k: tuple(v.shape) for k, v in inputs.state_dict.items()},
                           source="the JAX row's weights")
    model.load_state_dict(inputs.state_dict, strict=True, assign=True)   # no second copy
    params = list(model.parameters())
    opt = _optimizer(params, t, fused=cuda)
    if row == "pytorch-trainers":
      loss_fn = _trainers_loss(model, inputs, t, ce_chunk=ce_chunk, cd=cd)
      result.update(remat="CE chunks only", compiled="flex_attention only",
                    ce_rows="all K offsets", logits="bfloat16 rounded" if cuda else "float32")
    else:
      fast = FastDrafterStep(cfg, compute_dtype=cd, attention=attention, compiled=cuda,
                             gamma=t.loss_decay_gamma, ce_rows=ce_rows)
      named = dict(model.named_parameters())
      loss_fn = lambda a, v: fast.loss(named, inputs.micro, inputs.embed, inputs.head, a, v)
      result.update(remat="none", compiled="layers, context, final norm, CE softmax" if cuda
                    else "no (CPU)", ce_rows="supervised rows only",
                    logits=logits_dtype(inputs.head))

    def step(i):
      loss = loss_fn(*inputs.anchors[i])
      loss.backward()
      torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
      for group in opt.param_groups:
        group["lr"] = lr(i)
      opt.step()
      opt.zero_grad(set_to_none=True)
      return loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
      torch.cuda.reset_peak_memory_stats()   # the inputs are in place: from here on, the steps
    graphs = _graphs()
    t0 = time.perf_counter()
    losses = [step(0)]
    sync()
    first = time.perf_counter() - t0
    graphs_warm = _graphs()
    times = []
    for i in range(1, steps + 1):
      t0 = time.perf_counter()
      losses.append(step(i))
      sync()
      times.append(time.perf_counter() - t0)
    med = statistics.median(times) if times else first
    fixed = fixed_bytes(params, opt, (inputs.embed, inputs.head))
    peak = torch.cuda.max_memory_allocated() if cuda else None
    result.update(step_ms=med * 1e3, steps_ms=[x * 1e3 for x in times], compile_s=first - med,
                  losses=[float(x) for x in losses], first_loss=float(losses[0]),
                  peak_gib=peak / GiB if peak else 0.0, fixed_gib=fixed / GiB,
                  peak_minus_fixed_gib=(peak - fixed) / GiB if peak else None,
                  graphs_compiled=graphs_warm - graphs, recompiles_timed=_graphs() - graphs_warm)
    if row == "pytorch-best":
      result.update(lm_head_rows=fast.last_rows, mask_build_ms=_mask_ms(fast, inputs, sync))
  except torch.OutOfMemoryError as e:
    m = re.search(r"Tried to allocate ([\d.]+ [KMGT]iB)", str(e))
    result = {"status": "out of memory", "row": row, "failed_alloc": m.group(1) if m else None}
  except Exception as e:  # noqa: BLE001 - reported, not fatal to the benchmark
    result = {"status": f"error: {type(e).__name__}: {str(e)[:300]}", "row": row,
              "log": "".join(traceback.format_exc().splitlines(keepends=True)[-8:])}
  return result


def _graphs() -> int:
  """Graphs torch.compile has made in this process (growth during timed steps = recompiles)."""
  from torch._dynamo.utils import counters
  return int(counters["stats"]["unique_graphs"])


def _mask_ms(fast: FastDrafterStep, inputs: TorchInputs, sync, reps: int = 3) -> float:
  """The attention masks' build alone (already inside every timed step), median of `reps`."""
  micro = inputs.micro
  blocks = ref.build_blocks(*inputs.anchors[0], micro["input_ids"], micro["loss_mask"],
                            micro["doc_id"], micro["position_ids"],
                            block_size=fast.cfg.block_size, mask_token_id=fast.cfg.mask_token_id,
                            gamma=fast.gamma)
  times = []
  for _ in range(reps):
    sync()
    t0 = time.perf_counter()
    fast.masks(blocks, micro["input_ids"].shape[1])
    sync()
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3
