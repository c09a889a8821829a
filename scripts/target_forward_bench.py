"""The target's features forward on packed rows: dense-mask SDPA against flex_attention's block
mask (target.attention), tokens/s and peak memory, medians after a warm-up.

  python scripts/target_forward_bench.py [--random smollm2-135m,smollm2-1.7b] [--rows 8] [--seq 2048]
      [--docs 4] [--layers 5] [--repeats 5] [--json FILE]

Random weights of real architectures (speed and memory do not depend on the weights), bf16 on
CUDA (float32 on a CPU, as a smoke test). Each row packs `--docs` documents of near-equal length
(scripts/target_memory_check.py's rows); the captured layers follow the docs/DESIGN.md rule for `--layers` features.
Before timing, the two paths' features are compared (max abs. difference printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bridge.target import Target  # noqa: E402
from jax_drafter.config import default_target_layer_ids  # noqa: E402
from layouts_bench import ARCHS  # noqa: E402  (the real targets' shapes)
from target_memory_check import _Vocab, packed  # noqa: E402  (stand-in tokenizer, packed rows)


def timed(fn, device, repeats: int):
  fn()
  if device.type == "cuda":
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
      torch.cuda.synchronize(device)
    times.append(time.perf_counter() - t0)
  peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
  return statistics.median(times), peak


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--random", default="smollm2-135m,smollm2-1.7b",
                 help=f"comma-separated, of {sorted(ARCHS)}")
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--docs", type=int, default=4)
  p.add_argument("--layers", type=int, default=5)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--json")
  a = p.parse_args(argv)
  from transformers import LlamaConfig, LlamaForCausalLM
  cuda = torch.cuda.is_available()
  device = torch.device("cuda" if cuda else "cpu")
  dtype = torch.bfloat16 if cuda else torch.float32
  results = []
  for name in a.random.split(","):
    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, **ARCHS[name])
    torch.manual_seed(0)
    with torch.device(device):
      model = LlamaForCausalLM(cfg).to(dtype)
    layer_ids = list(default_target_layer_ids(cfg.num_hidden_layers, a.layers))
    ids, pos, doc = packed(a.rows, a.seq, a.docs, torch.Generator().manual_seed(0), cfg.vocab_size)
    sides = {k: Target(model, _Vocab(cfg.vocab_size), name, packed_attention=k)
             for k in ("sdpa", "flex")}
    feats = {k: t.features(ids, pos, doc, layer_ids) for k, t in sides.items()}
    diff = float((feats["sdpa"].float() - feats["flex"].float()).abs().max())
    del feats
    row = {"target": name, "rows": a.rows, "seq": a.seq, "docs": a.docs, "layers": layer_ids,
           "dtype": str(dtype), "max_abs_diff": diff}
    for k, t in sides.items():
      s, peak = timed(lambda: t.features(ids, pos, doc, layer_ids), device, a.repeats)
      row[k] = {"ms": 1e3 * s, "tokens_per_s": a.rows * a.seq / s,
                "peak_gib": None if peak is None else peak / 2**30}
    results.append(row)
    peak = lambda r: "" if r["peak_gib"] is None else f", peak {r['peak_gib']:.2f} GiB"
    print(f"{name} ({a.rows} x {a.seq}, {a.docs} documents a row, layers {layer_ids}, {dtype}): "
          f"sdpa {row['sdpa']['ms']:.1f} ms ({row['sdpa']['tokens_per_s']:,.0f} tokens/s"
          f"{peak(row['sdpa'])}); flex {row['flex']['ms']:.1f} ms "
          f"({row['flex']['tokens_per_s']:,.0f} tokens/s{peak(row['flex'])}); "
          f"max |diff| {diff:.3g}", flush=True)
    del model, sides
    if cuda:
      torch.cuda.empty_cache()
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
