"""Tiny runs, targets and drafters that the tests of several modules share.

tests/ is on sys.path under pytest (its conftest.py puts it there): `from tiny_fixtures import ...`.
"""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from flax import nnx

from bridge.target import Target
from jax_drafter.config import DrafterConfig, load_config
from jax_drafter.model import Drafter


def load_script(filename: str):
  """A file of scripts/ (not a package) imported as a module, for tests of its CPU side."""
  path = os.path.join(os.path.dirname(__file__), "..", "scripts", filename)
  spec = importlib.util.spec_from_file_location(os.path.splitext(filename)[0], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def tiny_run_config(target_dir, data, out, *extra):
  """Six steps of a 2-layer drafter (sliding + full) on the tiny target: seconds on a CPU."""
  return load_config(None, [
      f"target.path={target_dir}", f"data.path={data}", "data.max_conversations=40",
      "data.held_out=2", "data.seq_len=96", "data.batch_size=2", "data.cache_dir=null",
      "drafter.num_hidden_layers=2", "drafter.block_size=4",
      "drafter.layer_types=[sliding_attention, full_attention]", "drafter.sliding_window=8",
      "train.num_anchors=4", "train.steps=6", "train.warmup_steps=1", "train.learning_rate=3e-3",
      "train.checkpoint_every=2", "train.log_every=1", "train.ce_chunk_size=16",
      "train.tensorboard=false", f"train.output_dir={out}", *extra])


def run_losses(out):
  """{step: loss} of a run directory's metrics.jsonl."""
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


# ---- a tiny random Llama target with a stand-in tokenizer, and a drafter for it (decoding) ----

VOCAB = 96


class TinyTokenizer:
  """Enough of a HF tokenizer for the loop: chat template, call, len; the last id is the mask."""
  chat_template = "{{ messages }}"
  eos_token_id = bos_token_id = pad_token_id = unk_token_id = None
  added_tokens_decoder = {}

  def __len__(self):
    return VOCAB - 1

  def convert_ids_to_tokens(self, i):
    return chr(i)

  def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

  def __call__(self, text, add_special_tokens=False):
    return {"input_ids": [ord(c) % (VOCAB - 1) for c in text]}


@pytest.fixture(scope="module")
def tiny_target():
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  conf = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
  return Target(LlamaForCausalLM(conf).float(), TinyTokenizer(), "tiny-llama")


def tiny_drafter(block_size=4, seed=0):
  cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                      num_target_layers=4, target_layer_ids=(1, 2), mask_token_id=VOCAB - 1,
                      block_size=block_size, layer_types=("full_attention", "sliding_attention"),
                      sliding_window=3)
  graphdef, params = nnx.split(Drafter(cfg, rngs=nnx.Rngs(seed)), nnx.Param)
  return cfg, graphdef, params


def greedy_reference(model, ids, n):
  """Greedy decoding without any cache: the full sequence every step (independent of spec_decode)."""
  seq = list(ids)
  with torch.inference_mode():
    for _ in range(n):
      seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
  return seq[len(ids):]


TINY_PROMPTS = [[{"role": "user", "content": "hello there"}],
                [{"role": "system", "content": "sys"}, {"role": "user", "content": "count: 1 2 3"}],
                [5, 17, 3, 3, 60, 2]]


# ---- an attention problem (the twin's attention and reference drafter) ----

TOL = dict(atol=2e-5, rtol=2e-5)   # f32, different summation order only

B, S, K, HQ, HKV, D = 2, 40, 4, 4, 2, 8
# Edge cases: an anchor at its document start (no context), anchor 0, anchor == S (the whole
# row is context), a second document (doc_start 20), and two invalid blocks in row 1.
ANCHORS = np.array([[0, 3, 20, 25, 40], [2, 5, 30, 0, 0]], np.int32)
DOC_START = np.array([[0, 0, 20, 20, 20], [0, 0, 20, 0, 0]], np.int32)
VALID = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
N = ANCHORS.shape[1]


class CorruptedOracle:
  """A speculative-decoding proposer that drafts `ref`, the target's own greedy continuation,
  with every third draft wrong at draft position 1: verify steps accept 1 or the whole block, so
  a decoder's crop runs at both ends. Draft tokens past `ref` are 0; `vocab` bounds the wrong one."""

  def __init__(self, ref, block_size, vocab):
    self.ref, self.K, self.vocab, self.calls = ref, block_size, vocab, 0

  def start(self, feats):
    self.T = self.ctx = feats.shape[0]

  def extend(self, feats, count):
    assert feats.shape[0] >= count
    self.ctx += count

  def propose(self, last, temperature):
    i = self.ctx - self.T          # the new-token index of `last`
    draft = [self.ref[j] if j < len(self.ref) else 0 for j in range(i + 1, i + self.K)]
    self.calls += 1
    if self.calls % 3 == 0:
      draft[1] = (draft[1] + 1) % self.vocab
    return draft, None
