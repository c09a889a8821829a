"""python -m jax_drafter.tools.bench: the full drafter training step, JAX vs PyTorch, same run.

Rows, each in a subprocess of its own (clean peaks; an out-of-memory is a result, not a crash):
  jax               the jitted train step (jax_drafter.step: Pallas attention, fused CE);
  pytorch-trainers  PyTorch as the existing DFlash trainers (SpecForge) run it: compiled
                    flex_attention, the rest eager, checkpointed CE chunks (bridge/twin/bench_torch.py);
  pytorch-best      what a strong PyTorch engineer writes: compiled layers, fused norms, masks once
                    per step, the LM head on supervised rows with its gradient made in the forward
                    (bridge/twin/fast_drafter.py).
Every row trains on one batch and one set of initial weights (plans.random_inputs, drawn by JAX and
handed to torch), on the anchors the JAX step samples, with the JAX optimizer (AdamW, schedule,
clipping), f32 master weights and bf16 compute. The first-step loss of each PyTorch row must equal
the JAX row's to LOSS_RTOL, else the bench fails (exit 1), as it does when a row errors. Ratios
are against the fastest PyTorch row; memory is the peak, and the peak minus the fixed state
(parameters, gradients, optimizer state, frozen weights) that every row holds whatever its
activations, so that remat policies compare fairly. A case is a run of jax_drafter.presets.

  python -m jax_drafter.tools.bench --case 27b-8k --devices 0,1 --json bench.json

The JSON is rewritten as each row ends, so a bench stopped by a time limit keeps its finished
rows; a later call runs the rest and joins them (`--merge`: ratios and loss checks over both):
  python -m jax_drafter.tools.bench --case 8b-3k --json a.json            # stopped after the jax row
  python -m jax_drafter.tools.bench --case 8b-3k --side pytorch-best --side pytorch-trainers \
      --merge a.json --json b.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

from jax_drafter import presets
from jax_drafter.checkpoint import save_json
from jax_drafter.tools import plans
from jax_drafter.tools.bench_workers import CE_CHUNK, case_ce_chunk
from pallas_kernels.dflash_attention.reference import visible_pairs

H200_BF16_PEAK = 989e12


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

ROWS = ("jax", "pytorch-trainers", "pytorch-best")

# First-step loss agreement |loss_row - loss_jax| / |loss_jax|: every row must train on the JAX
# row's batch, weights, anchors and objective. float32 (the CPU): only the summation order differs,
# ~1e-7 after a few layers; 1e-5 is parity's float32 loss tolerance. bfloat16: parity measured
# 3.0e-6 at 27b-8k (benchmarks/h200-2026-11-29-session2/parity-27b-bf16.log, 12.9244242 vs
# 12.9243860); these rows add independent roundings (bf16 logits in trainers, bf16 RoPE tables in
# best) that average out over ~1e4 supervised rows, so 1e-4 leaves a 30x margin. A different batch
# (e.g. anchors shifted by one) moves the loss of the random-weight drafter by ~1.5e-3 relative at
# 27b-8k (two independent means of ~1.1e4 effective rows' CE, per-row std ~1.4, over ~12.9): caught
# about 19 times in 20 there; at the tiny CPU case it moved the loss by 2.3e-3, 230x the f32 tolerance.
LOSS_RTOL = {"float32": 1e-5, "bfloat16": 1e-4}


def _worker_cmd(side: str, case: str, args) -> list[str]:
  ce_chunk = case_ce_chunk(case, args.ce_chunk)
  cmd = [sys.executable, "-m", "jax_drafter.tools.bench", "--worker", "--side", side, "--case",
         case, "--steps", str(args.steps), "--ce-chunk", str(ce_chunk), "--remat", args.remat]
  if side == "jax" and args.attention:
    cmd += ["--attention", args.attention]
  if side == "jax" and case in args.breakdown:
    cmd += ["--breakdown", case]
  if side != "jax":
    cmd += ["--torch-attention", args.torch_attention]
    if args.perturb_anchors:
      cmd += ["--perturb-anchors"]
  return cmd


def run_worker(side: str, case: str, args, device: str | None = None) -> dict:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  if side != "jax":
    # JAX only draws the PyTorch rows' inputs: its buffers go back to the driver when freed.
    env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
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


def run_all(jobs: list[tuple[str, str]], args, on_result=None) -> dict:
  """{(case, side): result}. With --devices, each GPU runs one job at a time, all GPUs at once.
  on_result(case, side, result) is called as each run ends (from one thread at a time)."""
  lock = threading.Lock()

  def done(case, side, r):
    # One line per run as soon as it ends, so that a killed benchmark still leaves its results.
    with lock:
      print(f"[{time.strftime('%H:%M:%S')}] {case} {side}: {_fmt(r, _flops(case)['total'])}",
            flush=True)
      if on_result is not None:
        on_result(case, side, r)
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


def _flops(case: str) -> dict:
  run = presets.RUNS[case]
  return model_flops(presets.get(run.arch), run.seq_len, run.anchors, run.batch)


def _gib(x) -> str:
  return f"{x:6.2f} GiB" if x else "   n/a    "


def _fmt(r: dict, flops: float) -> str:
  if r.get("status") != "ok":
    return f"{r.get('status')}" + (f" ({r['failed_alloc']})" if r.get("failed_alloc") else "")
  ms = r["step_ms"]
  tf = flops / (ms / 1e3) / 1e12
  return (f"compile {r['compile_s']:6.1f} s | step {ms:8.1f} ms | "
          f"{tf:6.1f} TFLOP/s ({100 * tf * 1e12 / H200_BF16_PEAK:4.1f}%) | peak "
          f"{_gib(r['peak_gib'])} | peak-fixed {_gib(r.get('peak_minus_fixed_gib'))} | "
          f"first loss {r['first_loss']:.7f}")


def loss_check(jax_r: dict, torch_r: dict) -> dict:
  """The first-step losses of the JAX row and a PyTorch row, against LOSS_RTOL; the later steps'
  largest relative difference is information only (the two optimizers' roundings drift apart)."""
  dtype = "bfloat16" if "bfloat16" in (jax_r["compute_dtype"], torch_r["compute_dtype"]) else "float32"
  rel = lambda a, b: abs(a - b) / max(abs(a), 1e-30)
  r = rel(jax_r["first_loss"], torch_r["first_loss"])
  later = [rel(a, b) for a, b in zip(jax_r["losses"][1:], torch_r["losses"][1:])]
  return {"jax": jax_r["first_loss"], "torch": torch_r["first_loss"], "rel": r,
          "tol": LOSS_RTOL[dtype], "dtype": dtype, "ok": bool(r <= LOSS_RTOL[dtype]),
          "later_steps_max_rel": max(later) if later else None}


def compare(res: dict) -> tuple[dict, dict]:
  """(ratios of every row against the fastest PyTorch row, loss checks of the PyTorch rows)."""
  ok = {s: r for s, r in res.items() if r.get("status") == "ok"}
  torch_ok = [s for s in ok if s != "jax"]
  ratios, checks = {}, {}
  if torch_ok:
    base = min(torch_ok, key=lambda s: ok[s]["step_ms"])
    b = ok[base]
    div = lambda k, r: r[k] / b[k] if r.get(k) and b.get(k) else None
    ratios = {"against": base, **{s: {"time": div("step_ms", r), "peak": div("peak_gib", r),
                                      "peak_minus_fixed": div("peak_minus_fixed_gib", r)}
                                  for s, r in ok.items() if s != base}}
  if "jax" in ok:
    checks = {s: loss_check(ok["jax"], ok[s]) for s in torch_ok}
  return ratios, checks


def report_case(case: str, res: dict) -> tuple[dict, list[str]]:
  """(the case's JSON record, lines to print) for the rows' results `res`."""
  run = presets.RUNS[case]
  shape = dict(arch=run.arch, seq_len=run.seq_len, anchors=run.anchors, batch=run.batch)
  flops = _flops(case)
  ratios, checks = compare(res)
  rec = {"shape": shape, "model_tflop": flops["total"] / 1e12,
         "flops_breakdown_tflop": {k: v / 1e12 for k, v in flops.items()}, **res,
         "ratios": ratios, "loss_check": checks}
  out = [f"\n== {case}: {shape} model work {flops['total'] / 1e12:.4g} TFLOP "
         f"({', '.join(f'{k} {v / 1e12:.3g}' for k, v in flops.items() if k != 'total')})"]
  for side, r in res.items():
    out.append(f"  {side:17s} {_fmt(r, flops['total'])}"
               + (f" (from {r['merged_from']})" if r.get("merged_from") else ""))
    if r.get("log"):
      out.append("        " + r["log"].replace("\n", "\n        "))
    if "lm_head_rows" in r:
      out.append(f"  {'':17s} (LM head on {r['lm_head_rows']} rows, logits {r['logits']}, masks "
                 f"{r['mask_build_ms']:.1f} ms of the step, {r['graphs_compiled']} graphs compiled, "
                 f"{r['recompiles_timed']} while timed)")
  if res.get("jax", {}).get("breakdown_ms"):
    out.append(format_breakdown(res["jax"]["breakdown_ms"], res["jax"]["step_ms"]))
  if ratios:
    x = lambda v: f"{v:.3f}x" if v else "n/a"
    out.append(f"  ratios against {ratios['against']} (the fastest PyTorch row): " + " | ".join(
        f"{s} time {x(q['time'])}, peak {x(q['peak'])}, peak-fixed {x(q['peak_minus_fixed'])}"
        for s, q in ratios.items() if s != "against"))
  for s, c in checks.items():
    later = c["later_steps_max_rel"]
    out.append(f"  first-step loss {s} vs jax: {c['torch']:.7f} vs {c['jax']:.7f}, rel. difference "
               f"{c['rel']:.2e} (tolerance {c['tol']:.0e}, {c['dtype']}) "
               f"{'PASS' if c['ok'] else 'FAIL: not the same batch, weights or objective'}"
               + (f"; later steps up to {later:.1e} (information)" if later is not None else ""))
  return rec, out


class BenchInputError(ValueError):
  """A --merge file that cannot be used: unreadable, not a bench report, or without the case."""


def merged_rows(paths: list[str], cases: list[str], running: list[str]) -> dict:
  """{case: {row: result}} of the rows that the bench reports in `paths` hold for `cases` and that
  this run does not run (`running`); each is marked with the file it came from. A later file's row
  replaces an earlier file's."""
  rows: dict = {}
  for path in paths:
    try:
      with open(path) as f:
        report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise BenchInputError(f"--merge {path}: cannot read it as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(report, dict) or not all(isinstance(v, dict) for v in report.values()):
      raise BenchInputError(f"--merge {path}: not a bench report (the --json of "
                            "python -m jax_drafter.tools.bench: one record per case)")
    found = False
    for case in cases:
      rec = report.get(case)
      if rec is None:
        continue
      found = True
      for side in ROWS:
        r = rec.get(side)
        if side in running or not isinstance(r, dict) or "status" not in r:
          continue
        rows.setdefault(case, {})[side] = {**r, "merged_from": path}
    if not found:
      raise BenchInputError(f"--merge {path}: it has none of the cases {', '.join(cases)} "
                            f"(it has {', '.join(sorted(report)) or 'no case'})")
  return rows


def failures(report: dict) -> list[str]:
  """Why the bench fails: a loss check, or a row that neither ran nor ran out of memory."""
  bad = []
  for case, rec in report.items():
    bad += [f"{case} {s}: first-step loss differs from jax by {c['rel']:.2e} > {c['tol']:.0e}"
            for s, c in rec["loss_check"].items() if not c["ok"]]
    bad += [f"{case} {s}: {rec[s]['status']}" for s in ROWS
            if s in rec and rec[s].get("status") not in ("ok", "out of memory")]
  return bad


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jax_drafter.tools.bench", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--case", action="append", choices=sorted(presets.RUNS),
                  help="repeatable; default 27b-8k")
  ap.add_argument("--steps", type=int, default=6, help="timed steps after one warm-up (median)")
  ap.add_argument("--ce-chunk", type=int, default=None,
                  help=f"default: the run's, else {CE_CHUNK}")
  ap.add_argument("--remat", default="none", choices=("none", "layer", "full", "offload"),
                  help="the JAX row's remat policy")
  ap.add_argument("--attention", default=None, help="JAX attention implementation (default: best)")
  ap.add_argument("--torch-attention", default="auto", choices=("auto", "flex", "sdpa", "eager"),
                  help="the PyTorch rows' attention; auto: flex on a GPU, eager on the CPU "
                  "(flex_attention has no backward there)")
  ap.add_argument("--side", action="append", choices=ROWS, help="repeatable; default: every row")
  ap.add_argument("--timeout", type=int, default=900, help="seconds per (case, row) worker")
  ap.add_argument("--json", default=None)
  ap.add_argument("--breakdown", action="append", default=[], choices=sorted(presets.RUNS),
                  metavar="CASE", help="for this case (repeatable), also time each part of the "
                  "JAX step on its own (jax_drafter.tools.breakdown)")
  ap.add_argument("--devices", default=None,
                  help="comma list of GPU indices: the (case, row) runs are spread over them and "
                  "run at once, one per GPU (default: one after another on the visible GPUs)")
  ap.add_argument("--perturb-anchors", action="store_true",
                  help="self-check of the loss check: the PyTorch rows train on the JAX anchors "
                  "shifted by one token, and the bench must FAIL")
  ap.add_argument("--merge", action="append", default=[], metavar="JSON",
                  help="repeatable: the --json of an earlier bench; its rows of these cases that "
                  "this run does not run join the report (ratios, first-step loss checks), marked "
                  "merged_from. For rows split over several calls of one machine kind: the rows' "
                  "weights, batch and anchors are seeded, so they are the same in every call")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    from jax_drafter.tools import bench_workers
    return (bench_workers.jax_worker if args.side == ["jax"] else bench_workers.torch_worker)(args)
  cases = args.case or ["27b-8k"]
  sides = [s for s in ROWS if s in (args.side or ROWS)]
  try:
    merged = merged_rows(args.merge, cases, sides)
  except BenchInputError as e:
    print(f"bench: {e}", file=sys.stderr)
    return 2
  results: dict = {}

  def reports() -> tuple[dict, list[str]]:
    """The report of the cases with a row so far (this run's or merged), and its lines."""
    report, lines = {}, []
    for case in cases:
      res = {side: results[case, side] for side in sides if (case, side) in results}
      res |= merged.get(case, {})
      res = {side: res[side] for side in ROWS if side in res}    # the rows in their usual order
      if res:
        report[case], case_lines = report_case(case, res)
        lines += case_lines
    return report, lines

  def keep(case, side, r):
    # Each finished row goes into the JSON at once (written whole, then renamed), so a bench
    # stopped by a time limit (a lent machine's call) still leaves every finished row's record for
    # a later --merge; the last row's write is the whole report.
    results[case, side] = r
    if args.json:
      save_json(args.json, reports()[0])

  run_all([(case, side) for case in cases for side in sides], args, on_result=keep)
  report, lines = reports()
  print("\n".join(lines))
  bad = failures(report)
  checked = sum(len(rec["loss_check"]) for rec in report.values())
  print("\nbench: " + ("FAIL\n  " + "\n  ".join(bad) if bad else
                       f"PASS ({checked} first-step loss check(s) against the JAX row, no row errored)"))
  return 1 if bad else 0


def format_breakdown(parts_ms: dict, step_ms: float) -> str:
  lines = ["  JAX step by part (each compiled and timed alone, fwd + bwd):"]
  for name, ms in parts_ms.items():
    lines.append(f"    {name:28s} {ms:8.1f} ms  {100 * ms / step_ms:5.1f}%")
  rest = step_ms - sum(parts_ms.values())
  lines.append(f"    {'rest (step - parts)':28s} {rest:8.1f} ms  {100 * rest / step_ms:5.1f}%")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
