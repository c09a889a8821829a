"""Regeneration's decode step on a CPU: times and a torch.profiler table (README here)."""
import time, torch, sys
sys.path[:0] = [".", "scripts"]   # run from the repository root
from jax_drafter.cli import keep_large_allocations
keep_large_allocations()
from bench_generation import smollm2_shaped_model
from bridge import generation as G
torch.set_num_threads(2)
model = smollm2_shaped_model("cpu")
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 49152, (int(torch.randint(64, 129, (1,), generator=g)),), generator=g).tolist() for _ in range(64)]
batch = G._Batch(model, prompts, max_new_tokens=32, pad_id=2, cache_kw=G._cache_kw(model))
with torch.inference_mode(), G._folded_attention(model), G._contiguous_head_input(model):
  t0=time.perf_counter(); logits = batch.prefill(); print("prefill", time.perf_counter()-t0)
  tok = logits.float().argmax(-1)
  ts=[]
  for t in range(1, 9):
    t0=time.perf_counter(); logits = batch.decode(tok, t, False); tok = logits.float().argmax(-1); ts.append(time.perf_counter()-t0)
  print("decode ms", [round(1000*x,1) for x in ts])
  from torch.profiler import profile, ProfilerActivity
  with profile(activities=[ProfilerActivity.CPU]) as prof:
    for t in range(9, 13):
      logits = batch.decode(tok, t, False); tok = logits.float().argmax(-1)
  print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
