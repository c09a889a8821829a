"""Throughput of the device layouts (README "Devices"): one table, one command per machine.

A random-weight target of a real architecture (speed does not depend on the weights) with a given
tokenizer, a drafter of `--drafter-layers` full-attention layers, and for each layout a short
training run (`python -m jax_drafter.train`, its own process) whose steady-state throughput is the
median over the last half of its steps, with each side's tokens/s and which one bounds. The
target-forward bound is measured first: the target alone, hidden states of one step's rows; then
the drafter alone (a short run whose few rows all come from the feature cache), which with the
target's rate gives what one device running both back to back makes: 1 / (1/target + 1/drafter).

  python scripts/layouts_bench.py --tokenizer DIR --data FILE.jsonl [--arch smollm2-1.7b]
      [--layouts shared,split,replicated] [--steps 300] [--out DIR]

Layouts (GPUs as CUDA numbers):
  shared      target and drafter on GPU 0
  split       target on GPU 0, drafter on GPU 1
  replicated  target replicas on GPUs 0 and 1, drafter data parallel on GPUs 0 and 1 (features
              stay on their GPU)
  seeds       target replicas on GPUs 0 and 1, drafter on GPUs 2 and 3 (four GPUs)
On a CPU (`--cpu`, for a smoke test) the layouts use JAX host devices and one torch CPU target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ARCHS = {  # Llama-style configs of real targets: name -> transformers LlamaConfig fields
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32, rope_theta=130000.0,
                         max_position_embeddings=8192),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
}

LAYOUTS = {
    "shared": ["target.device=cuda:0", "train.devices=[cuda:0]"],
    "split": ["target.device=cuda:0", "train.devices=[cuda:1]"],
    "replicated": ["target.devices=[cuda:0, cuda:1]", "train.devices=[cuda:0, cuda:1]"],
    "seeds": ["target.devices=[cuda:0, cuda:1]", "train.devices=[cuda:2, cuda:3]"],
}
CPU_LAYOUTS = {
    "shared": ["target.device=cpu", "train.devices=[cpu:0]"],
    "split": ["target.device=cpu", "train.devices=[cpu:1]"],
    "replicated": ["target.device=cpu", "train.devices=[cpu:0, cpu:1]"],
}


def build_target(arch: str, tokenizer_dir: str, out: str, dtype: str) -> str:
  import torch
  from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
  tok = AutoTokenizer.from_pretrained(tokenizer_dir)
  cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, **ARCHS[arch])
  torch.manual_seed(0)
  with torch.device("cpu"):
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
  model.save_pretrained(out)
  tok.save_pretrained(out)
  return out


def target_bound(target_dir: str, device: str, dtype: str, rows: int, seq: int, layer_ids,
                 repeats: int = 5) -> float:
  """Tokens/s of the target alone: hidden states of one step's rows (the layers the drafter
  reads), median of `repeats` after a warm-up."""
  import numpy as np
  import torch
  from bridge.target import load_target
  t = load_target(target_dir, dtype=dtype, device=device)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, t.info.vocab_size, (rows, seq))
  pos = np.tile(np.arange(seq), (rows, 1))
  doc = np.zeros((rows, seq), np.int64)
  times = []
  for i in range(repeats + 1):
    t0 = time.perf_counter()
    t.features(ids, pos, doc, layer_ids)
    if t.device.type == "cuda":
      torch.cuda.synchronize(t.device)
    if i:
      times.append(time.perf_counter() - t0)
  return rows * seq / statistics.median(times)


def run_layout(name: str, overrides: list[str], common: list[str], out: str, env: dict) -> dict:
  run_dir = os.path.join(out, name)
  cmd = [sys.executable, "-m", "jax_drafter.train", "--quiet", "--no-export",
         f"train.output_dir={run_dir}", *common, *overrides]
  t0 = time.time()
  p = subprocess.run(cmd, capture_output=True, text=True, env=env)
  with open(os.path.join(out, f"{name}.log"), "w") as f:
    f.write(" ".join(cmd) + "\n" + p.stdout + p.stderr)
  if p.returncode != 0:
    return {"layout": name, "status": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"}
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    recs = [r for r in map(json.loads, f) if "loss" in r]
  tail = recs[len(recs) // 2:]
  med = lambda k: statistics.median(r[k] for r in tail)
  res = {"layout": name, "status": "ok", "steps": len(recs), "wall_s": round(time.time() - t0, 1),
         "tokens_per_s": med("tokens_per_s"), "target_tokens_per_s": med("target_tokens_per_s"),
         "drafter_tokens_per_s": med("drafter_tokens_per_s"),
         "feature_copy_ms": 1e3 * med("feature_copy_s"), "drafter_wait_ms": 1e3 * med("drafter_wait_s")}
  res["bound"] = "target" if res["target_tokens_per_s"] < res["drafter_tokens_per_s"] else "drafter"
  return res


def train_overrides(args, target_dir: str, dtype: str) -> list[str]:
  """The `python -m jax_drafter.train` overrides every layout shares (on top of the default config)."""
  return [f"target.path={target_dir}", f"target.dtype={dtype}", f"data.path={args.data}",
          "data.max_conversations=4000", "data.held_out=8", f"data.seq_len={args.seq}",
          f"data.batch_size={args.rows}", "data.cache_dir=null", "data.synthetic_prompts=0",
          f"drafter.num_hidden_layers={args.drafter_layers}",
          f"drafter.layer_types=[{', '.join(['full_attention'] * args.drafter_layers)}]",
          "drafter.block_size=16",
          f"train.num_anchors={args.anchors}", f"train.steps={args.steps}",
          f"train.compute_dtype={dtype}", "train.dropout=0",   # the step the table measured
          "train.checkpoint_every=100000",
          "train.log_every=50", "train.tensorboard=false", "train.eval_prompts=0"]


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tokenizer", required=True, help="a directory with the target's tokenizer")
  p.add_argument("--data", required=True, help="ShareGPT JSON/JSONL for the rows")
  p.add_argument("--arch", default="smollm2-1.7b", choices=sorted(ARCHS))
  p.add_argument("--layouts", default="shared,split,replicated")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--anchors", type=int, default=256)
  p.add_argument("--drafter-layers", type=int, default=3)
  p.add_argument("--cpu", action="store_true", help="smoke test on JAX host devices")
  p.add_argument("--out", default="layouts-results")
  return p


def main(argv=None) -> int:
  p = parser()
  args = p.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  dtype = "float32" if args.cpu else "bfloat16"
  layouts = CPU_LAYOUTS if args.cpu else LAYOUTS
  names = args.layouts.split(",")
  unknown = [n for n in names if n not in layouts]
  if unknown:
    p.error(f"unknown layout(s) {unknown}; known: {sorted(layouts)}")
  target_dir = build_target(args.arch, args.tokenizer, tempfile.mkdtemp(prefix="layouts-target-"),
                            dtype)
  n_layers = ARCHS[args.arch]["num_hidden_layers"]
  # The layers the drafter reads: its default rule (docs/DESIGN.md) for `drafter-layers` features.
  from bridge.target import choose_mask_token_id, load_target
  from jax_drafter.config import DrafterSection, resolve_drafter
  t = load_target(target_dir, dtype=dtype, device="cpu")
  dcfg = resolve_drafter(DrafterSection(num_hidden_layers=args.drafter_layers), t.info,
                         choose_mask_token_id(t))
  del t
  bound = target_bound(target_dir, "cpu" if args.cpu else "cuda:0", dtype, args.rows, args.seq,
                       dcfg.target_layer_ids)
  common = train_overrides(args, target_dir, dtype)
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  if args.cpu:
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  rows = [run_layout(n, layouts[n], common, args.out, env) for n in names]
  # The drafter alone on GPU 0: a few conversations whose rows all stay in the feature cache after
  # their first step, so the median over the run's second half has no target forward in it. One
  # device running both sides back to back (no overlap) makes 1 / (1/target + 1/drafter) tokens/s;
  # the shared layout beats that only where the two overlap.
  alone = run_layout("drafter-alone", layouts["shared"] + ["data.max_conversations=60",
                                                           "target.feature_cache_gib=8"],
                     common, args.out, env)
  print(f"target forward alone ({args.arch}, {dtype}, {args.rows} x {args.seq}, layers "
        f"{list(dcfg.target_layer_ids)} of {n_layers}): {bound:,.0f} tokens/s")
  back_to_back = None
  if alone["status"] == "ok":
    d = alone["drafter_tokens_per_s"]
    back_to_back = 1 / (1 / bound + 1 / d)
    print(f"drafter alone (features cached): {d:,.0f} tokens/s; both sides back to back on one "
          f"device (no overlap): {back_to_back:,.0f} tokens/s")
    for r in rows:
      if r["status"] == "ok" and r["layout"] == "shared":
        r["of_back_to_back"] = r["tokens_per_s"] / back_to_back
        print(f"shared layout: {r['of_back_to_back']:.0%} of the back-to-back rate (above 100%: "
              "the two sides overlap)")
  else:
    print(f"drafter alone: {alone['status']}")
  print("| layout | tokens/s | of the target bound | target side | drafter side | bound | copy ms | drafter wait ms |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for r in rows:
    if r["status"] != "ok":
      print(f"| {r['layout']} | {r['status']} | | | | | | |")
      continue
    print(f"| {r['layout']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / bound:.0%} | "
          f"{r['target_tokens_per_s']:,.0f} | {r['drafter_tokens_per_s']:,.0f} | {r['bound']} | "
          f"{r['feature_copy_ms']:.1f} | {r['drafter_wait_ms']:.1f} |")
  with open(os.path.join(args.out, "layouts.json"), "w") as f:
    json.dump({"arch": args.arch, "target_bound_tokens_per_s": bound, "rows": rows,
               "drafter_alone": alone, "back_to_back_tokens_per_s": back_to_back,
               "args": vars(args)}, f, indent=2)
  return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
