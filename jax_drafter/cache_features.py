"""python -m jax_drafter.cache_features: run the target once over the training rows, keep the
features on disk, and train many epochs from them (`data.features: DIR`) without the target.

  python -m jax_drafter.cache_features --config my.yaml --out /data/features
  python -m jax_drafter.train --config my.yaml data.features=/data/features

The rows are the ones training packs (the same data loading, regeneration and packing); the
target runs over them in batches of data.batch_size rows. Features are stored in bfloat16:
rows x seq_len x (target layers x hidden) x 2 bytes, printed before anything is written and
refused when the disk does not have it. Rerunning the same command continues after the last
complete shard. Training refuses a cache made with another target, other target layers, another
seq_len or other data settings, and a shard that fails its checksum.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import dataclasses
import sys
import time

SHARD_BYTES = 1 << 30   # a shard: whole batches of rows, about 1 GiB...
MAX_SHARDS = 1024       # ...but no more than ~1024 shards: the manifest (every row's key) is
                        # rewritten after each one


def prepare(cfg, out: str, *, shard_rows: int | None = None, progress: bool = False):
  """Packs the rows as training does and loads the target. -> (Writer for `out`, features fn)."""
  from bridge import regenerate as regen_lib
  from bridge.feature_store import Writer
  import numpy as np
  from jax_drafter import config as config_lib
  from jax_drafter import data as data_lib
  from jax_drafter import inputs
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, features=None))
  target, dcfg, ds = inputs.setup(cfg, progress=progress)
  layer_ids = config_lib.feature_layer_ids(dcfg, cfg.train)   # + the final norm with KD
  F = len(layer_ids) * target.info.hidden_size
  rows = ds.rows if ds.val_rows is None else {   # validation rows need their features too
      k: np.concatenate([ds.rows[k], ds.val_rows[k]]) for k in ds.rows}
  R, S = rows["input_ids"].shape
  B = cfg.data.batch_size
  if shard_rows is None:
    batches = max(SHARD_BYTES // (B * S * F * 2), -(-R // (B * MAX_SHARDS)), 1)
    shard_rows = B * batches
  info = {"target": {"name": target.name, "num_layers": target.info.num_layers,
                     "hidden_size": target.info.hidden_size},
          # what training without the model needs to find the regenerated answers in their cache
          "regenerate_fingerprint": (regen_lib.target_fingerprint(target.model, target.tokenizer)
                                     if cfg.data.regenerate else None)}
  writer = Writer(out, rows, data_lib.feature_cache_settings(cfg, layer_ids), feature_size=F,
                  shard_rows=shard_rows, info=info)

  def features(rows):   # in sub-batches within target.memory_budget_gib, as training runs them
    return target.stacked_features([rows], layer_ids)[0]

  return writer, features


def _parser() -> argparse.ArgumentParser:
  from jax_drafter.train import DEFAULT_CONFIG
  p = argparse.ArgumentParser(prog="python -m jax_drafter.cache_features", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=None,
                 help=f"YAML run config (default: {os.path.relpath(DEFAULT_CONFIG)})")
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="override config values, e.g. data.seq_len=1024")
  p.add_argument("--out", metavar="DIR", default=None,
                 help="the cache directory (default: data.features of the config)")
  p.add_argument("--shard-rows", type=int, default=None, metavar="N",
                 help="rows per shard file (default: whole batches of about 1 GiB)")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  from jax_drafter.cli import keep_large_allocations, setup_logging
  keep_large_allocations()
  setup_logging()
  import jax
  jax.devices()  # initialise JAX's backend before torch touches CUDA, as training does
  from bridge.feature_store import CacheError, human_bytes
  from bridge.regenerate import RegenerationError
  from bridge.target import TargetError
  from jax_drafter.config import ConfigError, load_config
  from jax_drafter.data import DataError
  from jax_drafter.train import DEFAULT_CONFIG

  try:
    cfg = load_config(args.config or DEFAULT_CONFIG, list(args.overrides))
    out = args.out or cfg.data.features
    if not out:
      raise ConfigError("give --out DIR (or set data.features in the config)")
    writer, features = prepare(cfg, out, shard_rows=args.shard_rows, progress=not args.quiet)
    m = writer.manifest
    print(f"feature cache {out}: {m['num_rows']} rows x {m['seq_len']} tokens x "
          f"{m['feature_size']} features x 2 bytes (bf16) = {human_bytes(writer.total_bytes)} in "
          f"{writer.num_shards} shards ({writer.done} already written); needs "
          f"{human_bytes(writer.needed_bytes)} free", flush=True)
    writer.check_space()
    bar = None
    if not args.quiet:
      from tqdm import tqdm
      done = sum(s["rows"] for s in m["shards"])
      bar = tqdm(total=m["num_rows"], initial=done, unit="row", desc="target features",
                 dynamic_ncols=True)
    t0, rows = time.perf_counter(), 0

    def on_rows(n):
      nonlocal rows
      rows += n
      if bar is not None:
        bar.update(n)
        bar.set_postfix(tok_s=f"{rows * m['seq_len'] / (time.perf_counter() - t0):.0f}")

    try:
      writer.write(features, cfg.data.batch_size, on_rows)
    finally:
      if bar is not None:
        bar.close()
  except (ConfigError, DataError, TargetError, RegenerationError, CacheError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted: the complete shards are kept; rerun the same command to continue",
          file=sys.stderr)
    return 130
  print(f"done: train from it with data.features={out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
