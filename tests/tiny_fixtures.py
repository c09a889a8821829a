"""Tiny runs, targets and drafters that the tests of several modules share.

tests/ is on sys.path under pytest (its conftest.py puts it there): `from tiny_fixtures import ...`.
"""

import json
import os

from jax_drafter.config import load_config


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
