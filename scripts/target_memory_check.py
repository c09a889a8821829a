"""Predicted vs measured peak memory of the target forward (bridge/target_memory.py), for a few
batch shapes, and the sub-batches each shape would be split into under the budget.

  python scripts/target_memory_check.py          # random weights of SmolLM2-135M's shapes, bf16
  python scripts/target_memory_check.py --target DIR [--gguf FILE] --dtype bfloat16 \\
      --layers 1,8,14,20,27 --shapes 1x2048,8x2048,67x122 --budget-gib 40
  XLA_PYTHON_CLIENT_PREALLOCATE=false python scripts/target_memory_check.py --random qwen3.6-27b \\
      --shapes 1x8192 --docs 4 --then "python -m jax_drafter.tools.bench --case 27b-8k --side jax"

`--random qwen3.6-27b` builds a hybrid target of Qwen3.6-27B's shapes with random weights on the
device (~54 GB in bf16: Gated DeltaNet layers through flash-linear-attention on a GPU); `--docs K`
packs K documents into every row, so a hybrid target runs its per-document path; `--then CMD` runs
a command (the 27B drafter's training step) while the target stays resident: both on one GPU.

On CUDA the memory model is measured first (probe forwards, fitted); then each shape runs one
whole forward and its measured peak is printed beside the analytic and the fitted predictions.
Exit 1 if a measured peak is above the fitted prediction (the planner would then under-count).
On a CPU only the analytic predictions and the plans are printed: nothing there to measure.
"""

import argparse
import dataclasses
import os
import subprocess
import sys
import time

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


def random_config(kind: str):
  """Shapes of a known target (random weights: memory and speed depend on the shapes only)."""
  if kind == "smollm2":
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=8192, tie_word_embeddings=True)
  from transformers import Qwen3_5TextConfig
  if kind == "qwen3.6-27b":  # 64 layers: 3 Gated DeltaNet, then 1 full attention, repeated
    return Qwen3_5TextConfig(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                             num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                             vocab_size=248320, linear_num_key_heads=16, linear_num_value_heads=48,
                             linear_key_head_dim=128, linear_value_head_dim=128,
                             linear_conv_kernel_dim=4, tie_word_embeddings=False,
                             max_position_embeddings=65536)
  if kind == "tiny-hybrid":  # the same layer pattern at toy sizes (CPU test of this script)
    return Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=128,
                             vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_conv_kernel_dim=4, tie_word_embeddings=False,
                             max_position_embeddings=4096)
  raise SystemExit(f"--random {kind!r}: choose one of {', '.join(RANDOM)}")


RANDOM = ("smollm2", "qwen3.6-27b", "tiny-hybrid")


def random_target(kind, dtype, device, budget_gib):
  """A random-weight target built directly on `device` (no download, no host copy of 54 GB)."""
  from transformers import AutoModelForCausalLM
  cfg = random_config(kind)
  budget = budget_gib * GIB if budget_gib else tm.default_budget(device)  # before the weights
  torch.manual_seed(0)
  t0 = time.perf_counter()
  with torch.device(device):
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
  n = sum(p.numel() for p in model.parameters())
  print(f"built random {kind}: {n / 1e9:.2f} B parameters, {tm.weight_bytes(model) / GIB:.2f} GiB "
        f"on {device}, in {time.perf_counter() - t0:.1f} s")
  return Target(model, _Vocab(cfg.vocab_size), f"random {kind} shapes",
                memory_budget_bytes=budget)


def packed(rows: int, tokens: int, docs: int, gen: torch.Generator, vocab: int):
  """ids, positions, doc ids of `rows` rows, each packing `docs` documents of near-equal length."""
  doc = (torch.arange(tokens) * docs // tokens).to(torch.int32)
  starts = torch.searchsorted(doc, doc, right=False)      # first index of each token's document
  pos = torch.arange(tokens) - starts
  return (torch.randint(0, vocab, (rows, tokens), generator=gen), pos.repeat(rows, 1),
          doc.repeat(rows, 1))


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
  p.add_argument("--random", default="smollm2", choices=RANDOM,
                 help="without --target: random weights of these shapes (default smollm2)")
  p.add_argument("--docs", type=int, default=1, help="documents packed into every row (default 1)")
  p.add_argument("--then", help="a shell command to run while the target stays resident (CUDA)")
  a = p.parse_args(argv)
  if a.docs < 1:
    p.error(f"--docs {a.docs}: must be >= 1")
  dev = resolve_device(a.device)
  if a.target:
    target = load_target(a.target, gguf_file=a.gguf, dtype=a.dtype, device=a.device,
                         memory_budget_gib=a.budget_gib)
  else:
    target = random_target(a.random, getattr(torch, a.dtype), dev, a.budget_gib)
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
  bad, first = 0, True
  for R, S in shapes:
    measured = ratio = "-"
    if dev.type == "cuda":
      gen = torch.Generator().manual_seed(R * 100003 + S)

      def forward(r, s):
        return target.features(*packed(r, s, min(a.docs, s), gen, target.info.vocab_size), layers)

      try:
        if first:  # the first forward compiles (and autotunes) Triton kernels such as fla's
          first = False
          for what in ("first forward (kernel compilation and autotuning included)", "again"):
            t0 = time.perf_counter()
            forward(R, S)
            torch.cuda.synchronize(dev)
            print(f"  {R}x{S}, {a.docs} document(s) a row: {what}: "
                  f"{time.perf_counter() - t0:.2f} s")
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
  if a.then:
    if dev.type == "cuda":
      torch.cuda.empty_cache()   # the target's weights stay; its cached activations are given back
      free, total = torch.cuda.mem_get_info(dev)
      print(f"target resident: {torch.cuda.memory_allocated(dev) / GIB:.2f} GiB held by torch, "
            f"{free / GIB:.2f} of {total / GIB:.2f} GiB free on the device")
    print(f"running, with the target resident: {a.then}", flush=True)
    rc = subprocess.call(a.then, shell=True)
    print(f"--then exited {rc}")
    bad += rc != 0
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
