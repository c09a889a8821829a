"""Drafter architectures of real DFlash targets, for benchmarks, memory plans and parity.

Each preset is the z-lab-style DrafterConfig of a drafter for that target (hidden size and vocabulary
are the target's; target layer ids follow the DESIGN rule for 5 conditioning layers).
"""

from __future__ import annotations

from jax_drafter.config import DrafterConfig, default_target_layer_ids


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


def tiny() -> DrafterConfig:
  """Seconds-sized shapes for tests of tools (2 layers: sliding + full)."""
  return DrafterConfig(
      hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, vocab_size=512, num_target_layers=8,
      target_layer_ids=(1, 5), mask_token_id=511, block_size=4,
      layer_types=("sliding_attention", "full_attention"), sliding_window=8)


PRESETS = {"qwen3.6-27b": qwen36_27b, "qwen3-8b": qwen3_8b, "smollm2-135m": smollm2_135m,
           "tiny": tiny}


def get(name: str) -> DrafterConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown architecture preset {name!r}; known: {', '.join(PRESETS)}")
  return PRESETS[name]()
