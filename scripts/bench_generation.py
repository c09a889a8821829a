"""Decode throughput of bridge.generation on a target of SmolLM2-135M's shapes (random weights, so
no row stops early: every row runs to max_new_tokens, the worst case for batching): CUDA graph,
several batch sizes, one or several batches decoded at once (eager with --eager, the forward
through torch.compile with --compile); the peak of torch's allocated and reserved memory per run.
Run on a GPU machine:
  python scripts/bench_generation.py --rows 512,1024 --prompt-len 1024 --new 192 --concurrent 1,2 --compile
or on a CPU (eager, bf16; no CUDA graph, no memory figures):
  python scripts/bench_generation.py --device cpu --rows 64,128,256 --prompt-len 128 --new 64
"""

import argparse
import json
import time

import torch

from bridge import generation as G


def smollm2_config():
  """SmolLM2-135M-Instruct's architecture (a transformers LlamaConfig)."""
  from transformers import LlamaConfig
  return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def smollm2_shaped_model(device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
  """SmolLM2-135M's architecture with random weights, bf16 on the GPU by default (speed does not
  depend on the weights; random ones never stop early)."""
  from transformers import LlamaForCausalLM
  torch.manual_seed(0)
  return LlamaForCausalLM(smollm2_config()).to(device, dtype).eval()


class VocabOnlyTokenizer:
  """What a bridge.target.Target of random weights needs from a tokenizer: its size."""

  def __len__(self):
    return 49152


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rows", default="64,256,512")
  p.add_argument("--prompt-len", type=int, default=128)
  p.add_argument("--new", type=int, default=256)
  p.add_argument("--concurrent", default="1", help="batches decoded at once, e.g. 1,2")
  p.add_argument("--eager", action="store_true", help="also time eager decoding")
  p.add_argument("--compile", action="store_true",
                 help="also time the target's forward through torch.compile (compiled=True); its "
                      "compilation happens in the warm-up, timed apart (warm_up_s)")
  p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  p.add_argument("--json")
  a = p.parse_args()
  cuda = a.device == "cuda"
  if not cuda:
    from jax_drafter.cli import keep_large_allocations
    keep_large_allocations()   # as every entry point does (CPU activations stay on the heap)
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  model = smollm2_shaped_model(a.device)
  rows_out = []
  for rows in [int(r) for r in a.rows.split(",")]:
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(3, 49152, (int(torch.randint(a.prompt_len // 2, a.prompt_len + 1, (1,),
                                                          generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    runs = [(cuda, int(c), False) for c in a.concurrent.split(",")]   # a CPU decodes eagerly
    runs += [(cuda, int(c), True) for c in a.concurrent.split(",")] if a.compile else []
    runs += [(False, 1, False)] if a.eager and cuda else []
    for graph, conc, comp in runs:
      kw = dict(max_new_tokens=a.new, stop_ids={2}, pad_id=2, max_rows=rows, cuda_graph=graph,
                max_tokens=rows * (a.prompt_len + a.new),   # batches of exactly `rows` rows
                compiled=comp)
      # Warm-up with 8 new tokens (compiles the forward when compiled), timed apart.
      t0 = time.perf_counter()
      list(G.generate_many(model, prompts[:8], **dict(kw, max_new_tokens=8)))
      sync()
      warm_s = time.perf_counter() - t0
      if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
      st = G.GenerationStats()
      t0 = time.perf_counter()
      # `concurrent` batches of `rows` rows at once: the same prompts repeated per worker
      list(G.generate_many(model, prompts * conc, stats=st, concurrent=conc, **kw))
      sync()
      dt = time.perf_counter() - t0
      r = dict(rows=rows, concurrent=conc, cuda_graph=graph, compiled=comp, warm_up_s=warm_s,
               captured=st.cuda_graph,
               tokens=st.tokens, seconds=dt, tokens_per_s=st.tokens / dt,
               ms_per_step=1e3 * dt * conc / max(st.decode_steps, 1),
               peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None)
      rows_out.append(r)
      print(json.dumps(r), flush=True)
  if a.json:
    json.dump(rows_out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
  main()
