"""python -m jax_drafter.tools.bench: the full drafter training step, JAX vs the PyTorch path, same run.

Each (case, side) runs in its own subprocess so peaks are clean and an out-of-memory on one side
is reported, not fatal. The PyTorch side (bridge/twin/bench_torch.py) is the reference drafter with
compiled flex_attention and checkpointed chunked CE, f32 master weights, bf16 autocast, fused
AdamW: what SpecForge-style trainers run. Both sides use random weights and identical shapes
(jax_drafter.tools.plans); a case is a run of jax_drafter.presets.

  python -m jax_drafter.tools.bench --case 27b-8k --case 8b-3k --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from jax_drafter import presets
from jax_drafter.tools import plans
from pallas_kernels.dflash_attention.reference import visible_pairs

H200_BF16_PEAK = 989e12
CE_CHUNK = 2048   # block tokens per LM-head chunk where neither --ce-chunk nor the run sets one


def model_flops(cfg, S: int, N: int, B: int) -> dict[str, float]:
  """Model FLOPs of one training step (GPU.md's rule): matmuls fwd + input grad + weight grad
  where those exist; the frozen LM head forward + input gradient only, on the supervised rows
  (block offsets 1..K-1: offset 0 never has a label); fc without input gradient; attention over
  visible keys only (fwd 2 matmuls, bwd 4)."""
  D, I, V, K = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.block_size
  Hq, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  T, C, F = B * N * K, B * S, len(cfg.target_layer_ids) * D
  anchors = plans.sample_anchors(S, N, B)
  parts = {"fc": 2 * C * F * D * 2, "lm_head": 2 * (B * N * (K - 1)) * D * V * 2}
  pairs = {w: visible_pairs(anchors, np.zeros_like(anchors), block_size=K, window=w)
           for w in {cfg.window(i) for i in range(cfg.num_hidden_layers)}}
  proj = mlp = attn = 0.0
  for i in range(cfg.num_hidden_layers):
    proj += 3 * 2 * (T * D * Hq * Dh * 2 + (C + T) * D * Hkv * Dh * 2)
    mlp += 3 * 2 * T * D * I * 3
    attn += 3 * 4 * Dh * Hq * pairs[cfg.window(i)]
  parts.update(projections=proj, mlp=mlp, attention=attn)
  parts["total"] = sum(parts.values())
  return parts


def _worker_cmd(side: str, case: str, args) -> list[str]:
  ce_chunk = args.ce_chunk or presets.RUNS[case].ce_chunk or CE_CHUNK
  cmd = [sys.executable, "-m", "jax_drafter.tools.bench", "--worker", "--side", side, "--case",
         case, "--steps", str(args.steps), "--ce-chunk", str(ce_chunk)]
  if side == "jax":   # --remat is the JAX drafter's; the PyTorch path checkpoints its CE chunks only
    cmd += ["--remat", args.remat]
  if side == "jax" and args.attention:
    cmd += ["--attention", args.attention]
  if side == "jax" and case in args.breakdown:
    cmd += ["--breakdown", case]
  if side == "torch":
    cmd += ["--torch-attention", args.torch_attention]
  return cmd


def run_worker(side: str, case: str, args, device: str | None = None) -> dict:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  if device is not None:
    env["CUDA_VISIBLE_DEVICES"] = device
  t0 = time.time()
  try:
    p = subprocess.run(_worker_cmd(side, case, args), capture_output=True, text=True, env=env,
                       timeout=args.timeout)
  except subprocess.TimeoutExpired:
    return {"status": f"timed out after {args.timeout} s"}
  for line in reversed(p.stdout.splitlines()):
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  tail = (p.stderr or p.stdout).strip().splitlines()[-6:]
  return {"status": f"crashed (exit {p.returncode}) after {time.time() - t0:.0f} s",
          "log": "\n".join(tail)}


def run_all(jobs: list[tuple[str, str]], args) -> dict:
  """{(case, side): result}. With --devices, each GPU runs one job at a time, all GPUs at once."""
  def done(case, side, r):
    # One line per run as soon as it ends, so that a killed benchmark still leaves its results.
    run = presets.RUNS[case]
    f = model_flops(presets.get(run.arch), run.seq_len, run.anchors, run.batch)["total"]
    print(f"[{time.strftime('%H:%M:%S')}] {case} {side}: {_fmt(r, f)}", flush=True)
    return r

  if not args.devices:
    return {(case, side): done(case, side, run_worker(side, case, args)) for case, side in jobs}
  import concurrent.futures
  import queue
  free = queue.Queue()
  for d in args.devices.split(","):
    free.put(d.strip())

  def one(job):
    case, side = job
    dev = free.get()
    try:
      print(f"[{time.strftime('%H:%M:%S')}] {case} {side} on GPU {dev}", flush=True)
      return done(case, side, run_worker(side, case, args, device=dev))
    finally:
      free.put(dev)
  with concurrent.futures.ThreadPoolExecutor(free.qsize()) as pool:
    return dict(zip(jobs, pool.map(one, jobs)))


def _fmt(r: dict, flops: float) -> str:
  if r.get("status") != "ok":
    return f"{r.get('status')}" + (f" ({r['failed_alloc']})" if r.get("failed_alloc") else "")
  ms = r["step_ms"]
  tf = flops / (ms / 1e3) / 1e12
  return (f"compile {r['compile_s']:6.1f} s | step {ms:8.1f} ms | peak {r['peak_gib']:6.2f} GiB | "
          f"{tf:6.1f} TFLOP/s ({100 * tf * 1e12 / H200_BF16_PEAK:4.1f}% of 989)")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jax_drafter.tools.bench", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--case", action="append", choices=sorted(presets.RUNS),
                  help="repeatable; default 27b-8k")
  ap.add_argument("--steps", type=int, default=6, help="timed steps after one warm-up (median)")
  ap.add_argument("--ce-chunk", type=int, default=None,
                  help=f"default: the run's, else {CE_CHUNK}")
  ap.add_argument("--remat", default="none", choices=("none", "layer", "full", "offload"))
  ap.add_argument("--attention", default=None, help="JAX attention implementation (default: best)")
  ap.add_argument("--torch-attention", default="flex", choices=("flex", "sdpa", "eager"))
  ap.add_argument("--side", action="append", choices=("jax", "torch"), help="default: both")
  ap.add_argument("--timeout", type=int, default=900)
  ap.add_argument("--json", default=None)
  ap.add_argument("--breakdown", action="append", default=[], choices=sorted(presets.RUNS),
                  metavar="CASE", help="for this case (repeatable), also time each part of the "
                  "JAX step on its own (jax_drafter.tools.breakdown)")
  ap.add_argument("--devices", default=None,
                  help="comma list of GPU indices: the (case, side) runs are spread over them and "
                  "run at once, one per GPU (default: one after another on the visible GPUs)")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    return _jax_worker(args) if args.side == ["jax"] else _torch_worker(args)
  cases = args.case or ["27b-8k"]
  sides = args.side or ["jax", "torch"]
  results = run_all([(case, side) for case in cases for side in sides], args)
  report = {}
  for case in cases:
    run = presets.RUNS[case]
    c = dict(arch=run.arch, seq_len=run.seq_len, anchors=run.anchors, batch=run.batch)
    flops = model_flops(presets.get(run.arch), run.seq_len, run.anchors, run.batch)
    res = {side: results[case, side] for side in sides}
    report[case] = {"shape": c, "model_tflop": flops["total"] / 1e12,
                    "flops_breakdown_tflop": {k: v / 1e12 for k, v in flops.items()}, **res}
    print(f"\n== {case}: {c} model work {flops['total'] / 1e12:.4g} TFLOP "
          f"({', '.join(f'{k} {v / 1e12:.3g}' for k, v in flops.items() if k != 'total')})")
    for side in sides:
      print(f"  {side:5s} {_fmt(res[side], flops['total'])}")
      if res[side].get("log"):
        print("        " + res[side]["log"].replace("\n", "\n        "))
    if res.get("jax", {}).get("breakdown_ms"):
      print(format_breakdown(res["jax"]["breakdown_ms"], res["jax"]["step_ms"]))
    if all(res.get(s, {}).get("status") == "ok" for s in ("jax", "torch")):
      j, t = res["jax"], res["torch"]
      ratio = dict(time=j["step_ms"] / t["step_ms"],
                   memory=j["peak_gib"] / t["peak_gib"] if t["peak_gib"] else None)
      report[case]["jax_over_torch"] = ratio
      mem = f"{ratio['memory']:.3f}x" if ratio["memory"] else "n/a (no device memory stats)"
      print(f"  JAX/PyTorch: time {ratio['time']:.3f}x, peak memory {mem}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0


def format_breakdown(parts_ms: dict, step_ms: float) -> str:
  lines = ["  JAX step by part (each compiled and timed alone, fwd + bwd):"]
  for name, ms in parts_ms.items():
    lines.append(f"    {name:28s} {ms:8.1f} ms  {100 * ms / step_ms:5.1f}%")
  rest = step_ms - sum(parts_ms.values())
  lines.append(f"    {'rest (step - parts)':28s} {rest:8.1f} ms  {100 * rest / step_ms:5.1f}%")
  return "\n".join(lines)


# ---- the workers (each runs in its own process) ----

def _failed_alloc(msg: str) -> str | None:
  import re
  m = re.search(r"(?:allocate|allocating)\D{0,20}([\d.]+\s*[KMGT]i?B|\d+ bytes)", msg)
  return m.group(1) if m else None


def _jax_worker(args) -> int:
  import jax
  from jax_drafter import step as step_lib
  from jax_drafter.config import TrainSection

  r = presets.RUNS[args.case[0]]
  cfg = presets.get(r.arch)
  S, N, B = r.seq_len, r.anchors, r.batch
  on_cpu = jax.default_backend() == "cpu"
  t = TrainSection(steps=1000, num_anchors=N, ce_chunk_size=args.ce_chunk, remat=args.remat,
                   compute_dtype="float32" if on_cpu else "bfloat16", attention=args.attention)
  result = {"status": "ok", "backend": jax.default_backend(), "device": str(jax.devices()[0])}
  try:
    # The same random state/batch/frozen weights the memory tool measures with.
    plan = plans.Plan(cfg, t, B, S, feature_dtype="float32" if on_cpu else "bfloat16",
                      attn_impl={"implementation": args.attention} if args.attention else None,
                      name=args.case[0])
    graphdef, state, batch, frozen = plans.random_inputs(plan)
    fn = step_lib.jit_train_step(step_lib.make_train_step(graphdef, cfg, t,
                                                          step_lib.make_optimizer(t),
                                                          plan.attn_impl))
    t0 = time.perf_counter()
    state, m = fn(state, batch, frozen)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
      t0 = time.perf_counter()
      state, m = fn(state, batch, frozen)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    med = statistics.median(times)
    result.update(step_ms=med * 1e3, steps_ms=[x * 1e3 for x in times],
                  compile_s=first - med, loss=float(m["loss"]),
                  peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30)
    if args.breakdown:
      from jax_drafter.tools import breakdown
      parts = breakdown.step_breakdown(graphdef, state, batch, frozen, cfg=cfg, t=t,
                                       attn_impl=plan.attn_impl, reps=max(args.steps, 1))
      result["breakdown_ms"] = {k: v * 1e3 for k, v in parts.items()}
  except Exception as e:  # noqa: BLE001 - an OOM must be a result, not a crash
    msg = str(e)
    oom = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    result = {"status": "out of memory" if oom else f"error: {type(e).__name__}: {msg[:300]}",
              "failed_alloc": _failed_alloc(msg) if oom else None}
  print("RESULT " + json.dumps(result), flush=True)
  return 0


def _torch_worker(args) -> int:
  from bridge.twin import bench_torch
  r = presets.RUNS[args.case[0]]
  cfg = presets.get(r.arch)
  result = bench_torch.time_steps(
      cfg, lambda dev, cd: plans.random_torch_inputs(cfg, r.batch, r.seq_len, dev, cd),
      lambda i: plans.sample_anchors(r.seq_len, r.anchors, r.batch, seed=i),
      steps=args.steps, ce_chunk=args.ce_chunk, attention=args.torch_attention)
  print("RESULT " + json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
