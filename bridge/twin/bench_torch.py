"""The PyTorch path of `python -m jax_drafter.tools.bench` (a torch-only worker process).

What SpecForge-style trainers run: the reference drafter (bridge/twin/reference_drafter.py) with f32
master weights under bf16 autocast, compiled flex_attention, chunked CE with each chunk under
activation checkpointing (bf16 matmul, f32 logits), gradient clipping and fused AdamW.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bridge.twin import reference_drafter as ref
from jax_drafter import presets
from jax_drafter.tools.bench import CASES, sample_anchors


def chunked_ce(h_TxD, w_VxD, y_T, chunk: int):
  """bf16 logits chunk by chunk under checkpointing; f32 log-sum-exp."""
  def one(h, y):
    logits = (h @ w_VxD.T).float()
    return torch.logsumexp(logits, -1) - logits.gather(1, y[:, None])[:, 0]

  return torch.cat([checkpoint(one, h_TxD[s:s + chunk], y_T[s:s + chunk], use_reentrant=False)
                    for s in range(0, h_TxD.shape[0], chunk)])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--worker", action="store_true")
  ap.add_argument("--case", required=True, choices=sorted(CASES))
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--ce-chunk", type=int, default=2048)
  ap.add_argument("--attention", default="flex")
  args = ap.parse_args(argv)
  c = CASES[args.case]
  cfg = presets.get(c["arch"])
  S, N, B, K = c["seq_len"], c["anchors"], c["batch"], cfg.block_size
  cuda = torch.cuda.is_available()
  dev = torch.device("cuda" if cuda else "cpu")
  cd = torch.bfloat16 if cuda else torch.float32
  result = {"status": "ok", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "attention": args.attention, "remat": "CE chunks only"}
  try:
    model = ref.build_reference(cfg, device=dev, compute_dtype=cd, attention=args.attention)
    with torch.no_grad():
      for p in model.parameters():
        p.copy_(torch.ones_like(p) if p.ndim == 1 else torch.randn_like(p) * 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=cuda)
    F_ = len(cfg.target_layer_ids) * cfg.hidden_size
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size - 1, (B, S), device=dev, generator=g)
    micro = {"input_ids": ids, "loss_mask": torch.ones(B, S, dtype=torch.long, device=dev),
             "doc_id": torch.zeros(B, S, dtype=torch.long, device=dev),
             "position_ids": torch.arange(S, device=dev).expand(B, S),
             "features": torch.randn(B, S, F_, device=dev, dtype=cd, generator=g)}
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=cd, generator=g) * 0.02
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=cd, generator=g) * 0.02

    def step(i):
      anchors = torch.from_numpy(sample_anchors(S, N, B, seed=i)).to(dev)
      valid = torch.ones(B, N, dtype=torch.bool, device=dev)
      blocks = ref.build_blocks(anchors, valid, micro["input_ids"], micro["loss_mask"],
                                micro["doc_id"], micro["position_ids"], block_size=K,
                                mask_token_id=cfg.mask_token_id, gamma=7.0)
      h = model(F.embedding(blocks.noise_ids, embed), micro["features"], micro["position_ids"],
                blocks.positions, blocks.anchors, blocks.doc_start, blocks.block_valid)
      ce = chunked_ce(h.reshape(B * N * K, -1), head, blocks.labels.reshape(-1), args.ce_chunk)
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
    for i in range(args.steps):
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
  print("RESULT " + json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
