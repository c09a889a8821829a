"""The PyTorch path of `python -m jax_drafter.tools.bench`: one training step, timed.

What SpecForge-style trainers run: the reference drafter (bridge/twin/reference_drafter.py) with
f32 master weights under bf16 autocast, compiled flex_attention, chunked CE with each chunk under
activation checkpointing (bf16 matmul, f32 logits), gradient clipping and fused AdamW. The bench
runs it in a worker process of its own and hands it the run's drafter and inputs.
"""

from __future__ import annotations

import re
import statistics
import time

import torch
import torch.nn.functional as F

from bridge.twin import reference_drafter as ref


def time_steps(cfg, inputs, anchors, *, steps: int, ce_chunk: int, attention: str) -> dict:
  """Median time and peak memory of `steps` training steps after one warm-up (compile) step.

  inputs(device, compute_dtype) -> (micro, embed, head), drawn once the model and optimizer are
  built; anchors(i) -> the [B, N] numpy anchors of step i. Returns the bench's result record; an
  out-of-memory or any other error is a result (status), not a crash.
  """
  K = cfg.block_size
  cuda = torch.cuda.is_available()
  dev = torch.device("cuda" if cuda else "cpu")
  cd = torch.bfloat16 if cuda else torch.float32
  result = {"status": "ok", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "attention": attention, "remat": "CE chunks only"}
  try:
    model = ref.build_reference(cfg, device=dev, compute_dtype=cd, attention=attention)
    with torch.no_grad():
      for p in model.parameters():
        p.copy_(torch.ones_like(p) if p.ndim == 1 else torch.randn_like(p) * 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=cuda)
    micro, embed, head = inputs(dev, cd)

    def step(i):
      a = torch.from_numpy(anchors(i)).to(dev)
      B, N = a.shape
      valid = torch.ones(B, N, dtype=torch.bool, device=dev)
      blocks = ref.build_blocks(a, valid, micro["input_ids"], micro["loss_mask"],
                                micro["doc_id"], micro["position_ids"], block_size=K,
                                mask_token_id=cfg.mask_token_id, gamma=7.0)
      h = model(F.embedding(blocks.noise_ids, embed), micro["features"], micro["position_ids"],
                blocks.positions, blocks.anchors, blocks.doc_start, blocks.block_valid)
      # bf16 logits chunk by chunk under checkpointing, f32 log-sum-exp, no argmax.
      ce, _ = ref.chunked_cross_entropy(h.reshape(B * N * K, -1), head, blocks.labels.reshape(-1),
                                        chunk_size=ce_chunk, compute_dtype=cd, f32_logits=False,
                                        argmax=False)
      w = blocks.weights.reshape(-1)
      loss = (ce * w).sum() / w.sum()
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      opt.step()
      opt.zero_grad(set_to_none=True)
      return loss

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    step(0).item()
    sync()
    first = time.perf_counter() - t0
    times = []
    for i in range(steps):
      t0 = time.perf_counter()
      loss = step(i + 1)
      sync()
      times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    result.update(step_ms=med * 1e3, steps_ms=[x * 1e3 for x in times], compile_s=first - med,
                  loss=float(loss),
                  peak_gib=(torch.cuda.max_memory_allocated() / 2**30) if cuda else 0.0)
  except torch.OutOfMemoryError as e:
    m = re.search(r"Tried to allocate ([\d.]+ [KMGT]iB)", str(e))
    result = {"status": "out of memory", "failed_alloc": m.group(1) if m else None}
  except Exception as e:  # noqa: BLE001 - reported, not fatal to the benchmark
    result = {"status": f"error: {type(e).__name__}: {str(e)[:300]}"}
  return result
