"""The target's features forward on packed rows: dense-mask SDPA against flex_attention's block
mask (target.attention), tokens/s and peak memory, medians after a warm-up.

  python scripts/target_forward_bench.py [--random smollm2,smollm2-1.7b] [--rows 8] [--seq 2048]
      [--docs 4] [--layers 5] [--repeats 5] [--json FILE]

Random weights of real architectures (speed and memory do not depend on the weights), bf16 on
CUDA (float32 on a CPU, as a smoke test). Each row packs `--docs` documents of random lengths, as
training rows do; the captured layers follow the docs/DESIGN.md rule for `--layers` features.
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

import torch  # noqa: E402

from bridge.target import Target  # noqa: E402
from jax_drafter.config import default_target_layer_ids  # noqa: E402

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3),
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32),
}


class _Vocab:
  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n


def packed_rows(rows: int, seq: int, docs: int, vocab: int, seed: int = 0):
  g = torch.Generator().manual_seed(seed)
  ids = torch.randint(0, vocab, (rows, seq), generator=g)
  doc, pos = torch.zeros(rows, seq, dtype=torch.long), torch.zeros(rows, seq, dtype=torch.long)
  for r in range(rows):
    cuts = sorted(torch.randperm(seq - 1, generator=g)[:docs - 1].add(1).tolist())
    for d, (a, b) in enumerate(zip([0] + cuts, cuts + [seq])):
      doc[r, a:b], pos[r, a:b] = d, torch.arange(b - a)
  return ids, pos, doc


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
  p.add_argument("--random", default="smollm2,smollm2-1.7b")
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
    cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                      **SHAPES[name])
    torch.manual_seed(0)
    with torch.device(device):
      model = LlamaForCausalLM(cfg).to(dtype)
    layer_ids = list(default_target_layer_ids(cfg.num_hidden_layers, a.layers))
    ids, pos, doc = packed_rows(a.rows, a.seq, a.docs, cfg.vocab_size)
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
