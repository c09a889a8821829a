"""Predicted vs measured peak memory of the target forward (bridge/target_memory.py), for a few
batch shapes, and the sub-batches each shape would be split into under the budget.

  python scripts/target_memory_check.py          # random weights of SmolLM2-135M's shapes, bf16
  python scripts/target_memory_check.py --target DIR [--gguf FILE] --dtype bfloat16 \\
      --layers 1,8,14,20,27 --shapes 1x2048,8x2048,67x122 --budget-gib 40

On CUDA the memory model is measured first (probe forwards, fitted); then each shape runs one
whole forward and its measured peak is printed beside the analytic and the fitted predictions.
Exit 1 if a measured peak is above the fitted prediction (the planner would then under-count).
On a CPU only the analytic predictions and the plans are printed: nothing there to measure.
"""

import argparse
import dataclasses
import os
import sys

# Run as a file on a bare GPU machine: this checkout's packages first, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bridge import target_memory as tm  # noqa: E402
from bridge.target import Target, load_target, resolve_device  # noqa: E402
from jax_drafter.config import default_target_layer_ids  # noqa: E402

MIB, GIB = 2**20, 2**30


class _Vocab:
  """The one thing Target reads from a tokenizer, for the random-weight model."""
  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n


def random_smollm2(dtype, device, budget_gib):
  """SmolLM2-135M's shapes with random weights (as scripts/bench_generation.py): runs on a bare
  GPU machine, no download. Memory depends on the shapes only."""
  from transformers import LlamaConfig, LlamaForCausalLM
  cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True)
  torch.manual_seed(0)
  model = LlamaForCausalLM(cfg).to(dtype)
  budget = budget_gib * GIB if budget_gib else tm.default_budget(device)  # before the weights move
  return Target(model.to(device), _Vocab(cfg.vocab_size), "random SmolLM2-135M shapes",
                memory_budget_bytes=budget)


def plan_for(target, model, rows, seq_len, n_features):
  """The planner's sub-batches for one call of rows x seq_len (its output buffer counted)."""
  if target.memory.budget_bytes == float("inf"):
    return [rows]
  out_bytes = rows * seq_len * n_features * target.info.hidden_size * target.embedding.element_size()
  resident = (torch.cuda.memory_allocated(target.device) if target.device.type == "cuda"
              else model.fixed_bytes)
  try:
    plan = tm.plan_sub_batches([seq_len] * rows,
                               dataclasses.replace(model, fixed_bytes=resident + out_bytes),
                               target.memory.budget_bytes)
  except ValueError as e:
    return str(e)
  return [len(b) for b in plan]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", help="a Hugging Face model directory (default: random SmolLM2 shapes)")
  p.add_argument("--gguf", help="a GGUF file inside --target")
  p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
  p.add_argument("--device", default="auto")
  p.add_argument("--layers", help="captured layer ids, e.g. 1,8,14,20,27 (default: the DFlash "
                 "rule for a 5-layer drafter)")
  p.add_argument("--shapes", default="1x2048,8x2048,67x122,32x512,2x8192",
                 help="ROWSxTOKENS,... forwards to predict and measure")
  p.add_argument("--budget-gib", type=float, help="default: 90%% of the free memory (CUDA)")
  a = p.parse_args(argv)
  dev = resolve_device(a.device)
  if a.target:
    target = load_target(a.target, gguf_file=a.gguf, dtype=a.dtype, device=a.device,
                         memory_budget_gib=a.budget_gib)
  else:
    target = random_smollm2(getattr(torch, a.dtype), dev, a.budget_gib)
  layers = ([int(x) for x in a.layers.split(",")] if a.layers
            else list(default_target_layer_ids(target.info.num_layers, 5)))
  target.check_layer_ids(layers)
  shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",")]

  c = target.model.config
  attn = getattr(c, "_attn_implementation", None) or "eager"
  analytic = tm.analytic_model(c, layers_run=max(layers) + 1, n_features=len(layers),
                               dtype_bytes=target.embedding.element_size(),
                               attn_implementation=attn, fixed_bytes=tm.weight_bytes(target.model))
  model = target.memory.model(layers)                      # measured on CUDA, analytic elsewhere
  name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
  print(f"target {target.name} on {name} ({a.dtype}, {attn}), layers {layers}, budget "
        f"{target.memory.budget_bytes / GIB:.2f} GiB")
  print(f"  floor:  {analytic.describe()}")
  print(f"  in use: {model.describe()}")
  print(f"{'shape':>10} {'analytic':>12} {'predicted':>12} {'measured':>12} {'meas/pred':>9}  "
        "sub-batches under the budget")
  bad = 0
  for R, S in shapes:
    measured = ratio = "-"
    if dev.type == "cuda":
      gen = torch.Generator().manual_seed(R * 100003 + S)

      def forward(r, s):
        ids = torch.randint(0, target.info.vocab_size, (r, s), generator=gen)
        return target.features(ids, torch.arange(s).repeat(r, 1),
                               torch.zeros(r, s, dtype=torch.int32), layers)

      try:
        (_, _, peak), = tm.measure_peaks(forward, [(R, S)], dev)
        measured = f"{peak / MIB:.1f} MiB"
        ratio = f"{peak / model.activation_bytes(R, S):.3f}"
        bad += peak > model.activation_bytes(R, S)
      except torch.cuda.OutOfMemoryError:
        measured = "OOM"
        torch.cuda.empty_cache()
    print(f"{R:>4}x{S:<5} {analytic.activation_bytes(R, S) / MIB:>8.1f} MiB "
          f"{model.activation_bytes(R, S) / MIB:>8.1f} MiB {measured:>12} {ratio:>9}  "
          f"{plan_for(target, model, R, S, len(layers))}")
  print("activations above what was resident before the forward; predicted = the model "
        f"{'fitted on this device' if model.source == 'measured' else '(analytic)'}")
  if bad:
    print(f"FAIL: {bad} measured peak(s) above the prediction")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
