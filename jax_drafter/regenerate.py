"""python -m jax_drafter.regenerate: let the target rewrite the training conversations' answers.

DFlash trains the drafter on the target's own outputs. This runs that step alone (training with
`data.regenerate: true` runs the same code and reuses what is cached here):

  python -m jax_drafter.regenerate --config configs/smollm2-h200.yaml
  python -m jax_drafter.regenerate --config my.yaml --out runs/regen.jsonl data.regenerate_max_turns=1

The training split of `data.path` (after `data.held_out` conversations are set aside, as training
does) is decoded by the target in length-sorted batches on its device; each finished conversation is
appended to the JSONL file at once (exact token ids and the decoded text), so Ctrl-C or a crash
loses at most the batch in flight and a rerun resumes. Settings: the `data.regenerate_*` keys.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import logging
import sys


def _parser() -> argparse.ArgumentParser:
  from jax_drafter.train import DEFAULT_CONFIG
  p = argparse.ArgumentParser(prog="python -m jax_drafter.regenerate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=None,
                 help=f"YAML run config (default: {os.path.relpath(DEFAULT_CONFIG)})")
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="override config values, e.g. data.regenerate_max_new_tokens=512")
  p.add_argument("--out", metavar="FILE.jsonl", default=None,
                 help="where the regenerated conversations go (default: data.regenerate_file, or "
                      "<data.cache_dir>/regenerated.jsonl, which training reads)")
  p.add_argument("--shard", metavar="I/N", default=None,
                 help="only conversations I, I+N, I+2N, ... of the training split (one process "
                      "per GPU, each with its own --out; concatenate the files afterwards: records "
                      "are keyed, so the result is the cache training reads)")
  p.add_argument("--no-cuda-graph", action="store_true",
                 help="decode eagerly (for comparison; CUDA graphs are used when available)")
  p.add_argument("--json", metavar="FILE", help="write the summary (counts, tokens/s) here")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  from jax_drafter.cli import keep_large_allocations, setup_logging
  keep_large_allocations()
  setup_logging()
  log = logging.getLogger("jax_drafter.regenerate")

  import jax
  jax.devices()  # initialise JAX's backend before torch touches CUDA, as training does
  from bridge.regenerate import RegenerationError
  from bridge.target import TargetError
  from jax_drafter import data as data_lib
  from jax_drafter import inputs
  from jax_drafter.config import ConfigError, load_config
  from jax_drafter.train import DEFAULT_CONFIG

  overrides = list(args.overrides) + ["data.regenerate=true"]
  if args.out:
    overrides.append(f"data.regenerate_file={args.out}")
  try:
    shard = _shard(args.shard) if args.shard else None  # before anything heavy loads
    cfg = load_config(args.config or DEFAULT_CONFIG, overrides)
    inputs.check_inputs(cfg)
    from bridge.target import load_target
    tc = cfg.target
    target = load_target(tc.path, gguf_file=tc.gguf_file, dtype=tc.dtype, device=tc.device,
                         trust_remote_code=tc.trust_remote_code)
    convs = data_lib.load_conversations(cfg.data.path, max_conversations=cfg.data.max_conversations)
    train, _ = data_lib.split_held_out(convs, cfg.data.held_out, cfg.data.seed)
    if shard:
      train = train[shard[0]::shard[1]]
    stats: dict = {}
    regen = inputs.regeneration(cfg, target, progress=not args.quiet, stats=stats,
                                cuda_graph=False if args.no_cuda_graph else None)
    records = regen.fn(train)
  except (ConfigError, data_lib.DataError, TargetError, RegenerationError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted: the finished conversations are saved; rerun the same command to resume",
          file=sys.stderr)
    return 130
  path = cfg.data.regenerate_path(cfg.train.output_dir)
  new = stats["generated_tokens"]
  rate = new / stats["seconds"] if stats["seconds"] else 0.0
  summary = {"file": path, "records": len(records), **stats, "generated_tokens_per_s": rate}
  log.info("%d conversations in %s (%d were cached); generated %d tokens in %.1f s = %.0f tokens/s;"
           " skipped %d with too long a prompt; %d later turns not generated after a turn cut at"
           " the token limit; %d cut turns closed and continued", len(records), path,
           stats["cached"], new, stats["seconds"], rate, stats["skipped_long_prompt"],
           stats["cut_turns"], stats.get("closed_turns", 0))
  if args.out:
    log.info("train on it with: data.regenerate=true data.regenerate_file=%s (same settings)", path)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=2)
  return 0


def _shard(text: str) -> tuple[int, int]:
  try:
    i, n = (int(x) for x in text.split("/"))
  except ValueError:
    raise ValueError(f"--shard {text!r} must look like I/N, e.g. 0/2") from None
  if not 0 <= i < n:
    raise ValueError(f"--shard {text}: I must be in 0..N-1")
  return i, n


if __name__ == "__main__":
  sys.exit(main())
