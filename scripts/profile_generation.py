"""Where a regeneration batch's time goes: bridge.generation's phases (prefill, CUDA-graph capture,
graph-replayed decode steps, dropping finished rows) timed on a target of SmolLM2-135M's shapes
(random weights), then the kernels of one prefill and one decode step from torch.profiler. On a GPU
(CUDA events, device time per kernel) at the recipe's shapes:

  python scripts/profile_generation.py --shapes 512x256,512x1024,384x1792 --json prof.json
  python scripts/profile_generation.py --shapes 1024x1024 --strided-head   # the head as sliced

On a CPU (the default's regeneration: eager decode steps, no graphs; wall time, and each op's own
CPU time over 4 decode steps):

  python scripts/profile_generation.py --device cpu --shapes 64x128 --new 32
"""

import argparse
import contextlib
import json
import time

import torch

from bench_generation import smollm2_shaped_model  # scripts/ is on the path when run as a script
from bridge import generation as G


def _ms(fn, n=1, cuda=True):
  if not cuda:                        # a CPU runs each call to its end
    t0 = time.perf_counter()
    for _ in range(n):
      out = fn()
    return 1e3 * (time.perf_counter() - t0) / n, out
  torch.cuda.synchronize()
  a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  a.record()
  for _ in range(n):
    out = fn()
  b.record()
  torch.cuda.synchronize()
  return a.elapsed_time(b) / n, out


def _kernels(fn, top, n=1, cuda=True):
  """(ms of kernels per call, the top rows (ms per call, calls per call, name)) over n calls of fn:
  device time per CUDA kernel on a GPU, each op's own (self) time on a CPU."""
  from torch.profiler import ProfilerActivity, profile
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  sync()
  with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
    for _ in range(n):
      fn()
    sync()
  rows = []
  for e in prof.key_averages():
    if cuda:
      t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
    else:
      t = e.self_cpu_time_total
    if t:
      rows.append((t / 1e3 / n, e.count / n, e.key[:90]))
  rows.sort(reverse=True)
  total = sum(r[0] for r in rows)
  return total, rows[:top]


@torch.inference_mode()
def profile_shape(model, B, P, new, top, contiguous_head=True):
  """The phases of one batch of B prompts of 0.8P-P tokens and `new` new tokens. A CPU runs the
  eager steps only (no graphs, no memory figures) and profiles 4 decode steps."""
  cuda = next(model.parameters()).device.type == "cuda"
  dev = "cuda" if cuda else "cpu"
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  g = torch.Generator().manual_seed(B * 7 + P)
  prompts = [torch.randint(3, 49152, (int(torch.randint(int(P * 0.8), P + 1, (1,), generator=g)),),
                           generator=g).tolist() for _ in range(B)]
  res = dict(rows=B, prompt=P, new=new)
  kw = G._cache_kw(model)
  head = G._contiguous_head_input(model) if contiguous_head else contextlib.nullcontext()
  with G._folded_attention(model), head:
    t0 = time.perf_counter()
    batch = G._Batch(model, prompts, max_new_tokens=new, pad_id=2, cache_kw=kw)
    sync()
    res["setup_ms"] = 1e3 * (time.perf_counter() - t0)
    if cuda:
      torch.cuda.reset_peak_memory_stats()
      base = torch.cuda.memory_allocated()
    res["prefill_ms"], logits = _ms(batch.prefill, cuda=cuda)
    if cuda:
      res["prefill_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    tokens = logits.argmax(-1)
    t = 1                             # the next cache column to feed
    if cuda:
      t0 = time.perf_counter()
      batch.decode(tokens, t, True)   # eager run + capture
      torch.cuda.synchronize()
      res["capture_ms"] = 1e3 * (time.perf_counter() - t0)
      steps = min(64, new - 2)
      cols = iter(range(2, 2 + steps))
      res["decode_graph_ms"], _ = _ms(lambda: batch.decode(tokens, next(cols), True), steps)
      t = 2 + steps
    # a whole step as generate_batch runs it: the decode, then select, record, stop test
    out = torch.zeros((B, new), dtype=torch.long, device=dev)
    stops = torch.tensor([2], device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)

    def full_step(i=[t]):
      lg = batch.decode(tokens, i[0], use_graph=cuda)
      nt = torch.where(done, 2, lg.argmax(-1))
      out[batch.rows, i[0]] = nt
      i[0] += 1
      return done | torch.isin(nt, stops)
    n_full = 32 if cuda else max(1, min(8, new - t - 6))
    res["decode_step_full_ms"], _ = _ms(full_step, n_full, cuda=cuda)
    t += n_full
    res["decode_eager_ms"], _ = _ms(lambda: batch.decode(tokens, t, False), 4, cuda=cuda)
    t += 1
    if cuda:
      alive = torch.arange(0, B, 2, device=dev)
      t0 = time.perf_counter()
      batch.keep(alive)
      torch.cuda.synchronize()
      res["keep_ms"] = 1e3 * (time.perf_counter() - t0)
      tokens = tokens[alive]
      t0 = time.perf_counter()
      batch.decode(tokens, t, True)
      torch.cuda.synchronize()
      res["recapture_ms"] = 1e3 * (time.perf_counter() - t0)
      res["decode_graph_half_ms"], _ = _ms(lambda: batch.decode(tokens, t + 1, True), 16)
      t += 2
    cols = iter(range(t, t + 4))
    n_prof = 1 if cuda else 4         # a CPU step is long enough to profile a few
    tot, rows = _kernels(lambda: batch.decode(tokens, next(cols), False), top, n_prof, cuda)
    res["decode_kernels"] = dict(total_ms=tot, top=rows)
    batch2 = G._Batch(model, prompts, max_new_tokens=new, pad_id=2, cache_kw=kw)
    tot, rows = _kernels(batch2.prefill, top, cuda=cuda)
    res["prefill_kernels"] = dict(total_ms=tot, top=rows)
  # what the bytes say: K/V read per decode step, weights once
  kv = B * (P + new) * 30 * 2 * 3 * 64 * 2
  res["kv_gb_per_step"] = kv / 1e9
  return res


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default="512x256,512x1024,384x1792", help="ROWSxPROMPT,...")
  p.add_argument("--new", type=int, default=192)
  p.add_argument("--top", type=int, default=10)
  p.add_argument("--strided-head", action="store_true",
                 help="leave the LM head's input as transformers slices it (what generation did "
                      "before it made the head's rows contiguous), to measure the difference")
  p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  p.add_argument("--json")
  a = p.parse_args()
  if a.device == "cpu":
    from jax_drafter.cli import keep_large_allocations
    keep_large_allocations()   # as every entry point does (CPU activations stay on the heap)
  model = smollm2_shaped_model(a.device)
  out = []
  for s in a.shapes.split(","):
    B, P = map(int, s.split("x"))
    r = profile_shape(model, B, P, a.new, a.top, contiguous_head=not a.strided_head)
    out.append(r)
    brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
             if not k.endswith("kernels")}
    print(json.dumps(brief), flush=True)
    for name in ("prefill_kernels", "decode_kernels"):
      what = "kernels" if a.device == "cuda" else "ops' own CPU time"
      print(f"  {name}: {r[name]['total_ms']:.2f} ms of {what} a call")
      for t, n, k in r[name]["top"]:
        print(f"    {t:8.3f} ms  x{n:<5g} {k}")
    if a.device == "cuda":
      torch.cuda.empty_cache()
  if a.json:
    json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
  main()
