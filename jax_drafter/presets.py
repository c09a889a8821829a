"""Named drafter architectures and the runs built on them: the one table of shapes.

Benchmarks, memory plans, parity, the torch twin and the tests take their shapes from here; it
depends on config only, so bridge/ may import it.
  architecture  the z-lab-style DrafterConfig of a drafter for one target (hidden size and
                vocabulary are the target's; target layer ids follow the docs/DESIGN.md rule for 5
                conditioning layers), with that target's name;
  run           an architecture and the shapes of one training step (context, anchors, rows);
  run config    a target's dimensions and the run-config sections that `train` resolves against
                them (memory plans apply `section.key=value` overrides before the drafter exists).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jax_drafter.config import DrafterConfig, default_target_layer_ids


@dataclass(frozen=True)
class TargetDims:
  """The target's dimensions, duck-typed as bridge.target.TargetInfo (no torch, no weights)."""
  num_layers: int
  hidden_size: int
  vocab_size: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  intermediate_size: int
  dtype: str = "bfloat16"           # of the target features, embedding and LM head
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 262144
  name: str = "preset"


# ---- architectures ----

def qwen36_27b() -> DrafterConfig:
  """Qwen3.6-27B target (64 layers, hidden 5120, vocab 248320): 5 layers, 4 sliding + 1 full."""
  return DrafterConfig(
      hidden_size=5120, intermediate_size=17408, num_hidden_layers=5, num_attention_heads=32,
      num_key_value_heads=8, head_dim=128, vocab_size=248320, num_target_layers=64,
      target_layer_ids=default_target_layer_ids(64, 5), mask_token_id=248319, block_size=16,
      layer_types=("sliding_attention",) * 4 + ("full_attention",), sliding_window=2048,
      rms_norm_eps=1e-6, rope_theta=10_000_000.0, max_position_embeddings=262144)


def qwen3_8b() -> DrafterConfig:
  """Qwen3-8B target (36 layers, hidden 4096, vocab 151936): 5 full-attention layers."""
  return DrafterConfig(
      hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
      num_key_value_heads=8, head_dim=128, vocab_size=151936, num_target_layers=36,
      target_layer_ids=default_target_layer_ids(36, 5), mask_token_id=151669, block_size=16,
      rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960)


def smollm2_135m(num_hidden_layers: int = 1) -> DrafterConfig:
  """SmolLM2-135M-Instruct target (30 layers, hidden 576, vocab 49152), the CPU default."""
  return DrafterConfig(
      hidden_size=576, intermediate_size=1536, num_hidden_layers=num_hidden_layers,
      num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
      num_target_layers=30, target_layer_ids=default_target_layer_ids(30, num_hidden_layers),
      mask_token_id=16, block_size=16, rms_norm_eps=1e-5, rope_theta=100_000.0,
      max_position_embeddings=8192)


def smollm2_135m_h200() -> DrafterConfig:
  """The GPU recipe's drafter for SmolLM2-135M (configs/smollm2-h200.yaml): 5 full-attention
  layers conditioned on target layers 1, 8, 14, 20, 27, MLP width 3072."""
  return dataclasses.replace(smollm2_135m(5), intermediate_size=3072)


def tiny() -> DrafterConfig:
  """Seconds-sized shapes for tests of tools (2 layers: sliding + full)."""
  return DrafterConfig(
      hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, vocab_size=512, num_target_layers=8,
      target_layer_ids=(1, 5), mask_token_id=511, block_size=4,
      layer_types=("sliding_attention", "full_attention"), sliding_window=8)


def tiny_parity() -> DrafterConfig:
  """parity's CPU drafter: tiny with a 256-token vocabulary, window 6, target layers 1 and 6."""
  return dataclasses.replace(tiny(), vocab_size=256, mask_token_id=255, sliding_window=6,
                             target_layer_ids=(1, 6))


ARCHITECTURES = {   # name -> (its target's name, the drafter)
    "qwen3.6-27b": ("Qwen3.6-27B", qwen36_27b),
    "qwen3-8b": ("Qwen3-8B", qwen3_8b),
    "smollm2-135m": ("SmolLM2-135M", smollm2_135m),
    "smollm2-135m-h200": ("SmolLM2-135M", smollm2_135m_h200),
    "tiny": ("tiny", tiny),
    "tiny-parity": ("tiny", tiny_parity),
}


def get(name: str) -> DrafterConfig:
  if name not in ARCHITECTURES:
    raise ValueError(f"unknown architecture preset {name!r}; known: {', '.join(ARCHITECTURES)}")
  return ARCHITECTURES[name][1]()


def target(name: str, **changes) -> TargetDims:
  """The dimensions of the target architecture `name` drafts for (its heads are the drafter's)."""
  d = get(name)
  dims = TargetDims(d.num_target_layers, d.hidden_size, d.vocab_size, d.num_attention_heads,
                    d.num_key_value_heads, d.head_dim, d.intermediate_size,
                    rope_theta=d.rope_theta, rms_norm_eps=d.rms_norm_eps,
                    max_position_embeddings=d.max_position_embeddings,
                    name=ARCHITECTURES[name][0])
  return dataclasses.replace(dims, **changes)


# ---- runs ----

@dataclass(frozen=True)
class Run:
  """One training step's shapes on a named architecture."""
  arch: str
  seq_len: int
  anchors: int
  batch: int
  ce_chunk: int | None = None   # block tokens per LM-head chunk; None: the tool's own default


RUNS = {
    # The H200 benchmark cases (`tools.bench --case`); memory and parity take them too.
    "27b-8k": Run("qwen3.6-27b", seq_len=8192, anchors=1024, batch=1),
    "27b-32k": Run("qwen3.6-27b", seq_len=32768, anchors=2048, batch=1),
    "27b-64k": Run("qwen3.6-27b", seq_len=65536, anchors=2048, batch=1),
    "8b-3k": Run("qwen3-8b", seq_len=3072, anchors=512, batch=4),
    "8b-8k": Run("qwen3-8b", seq_len=8192, anchors=1024, batch=1),
    # The SmolLM2 GPU recipe's step (8 rows of 2048) at its 512 anchors per row and fewer: what a
    # step costs against how many blocks it trains (the recipe's steps are drafter-bound).
    "smol-2k-a512": Run("smollm2-135m-h200", seq_len=2048, anchors=512, batch=8, ce_chunk=8192),
    "smol-2k-a256": Run("smollm2-135m-h200", seq_len=2048, anchors=256, batch=8, ce_chunk=8192),
    "smol-2k-a128": Run("smollm2-135m-h200", seq_len=2048, anchors=128, batch=8, ce_chunk=8192),
    # Seconds on a CPU: the bench harness's smoke test, and parity's default.
    "tiny": Run("tiny", seq_len=64, anchors=8, batch=2),
    "tiny-parity": Run("tiny-parity", seq_len=64, anchors=8, batch=2, ce_chunk=16),
}

_SW = "sliding_attention"
RUN_CONFIGS: dict[str, tuple[TargetDims, dict]] = {
    # The memory tests' plan: train's defaults but for these sections (f32), on the tiny target
    # with TargetDims' default context.
    "tiny-memory": (target("tiny", dtype="float32", max_position_embeddings=262144), {
        "drafter": {"num_hidden_layers": 2, "layer_types": [_SW, "full_attention"],
                    "sliding_window": 32},
        "data": {"seq_len": 128, "batch_size": 2},
        "train": {"num_anchors": 8, "ce_chunk_size": 32}}),
    # The default target (target.path null) with every run-config default.
    "smollm2-defaults": (target("smollm2-135m", dtype="float32"), {}),
}
