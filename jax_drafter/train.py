"""python -m jax_drafter.train: train a DFlash drafter (default: SmolLM2-135M on ShareGPT, CPU).

Examples:
  python -m jax_drafter.train                                  # the built-in default run
  python -m jax_drafter.train --config configs/smollm2.yaml train.steps=50
  python -m jax_drafter.train --config my.yaml --set train.output_dir=runs/x
Rerunning the same command with the same output_dir resumes from the last checkpoint.
"""

from __future__ import annotations

import os

# Before JAX initialises: never grab all GPU memory up front (the target shares the machine).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import logging
import sys
import time

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "smollm2.yaml")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jax_drafter.train", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=None,
                 help=f"YAML run config (default: {os.path.relpath(DEFAULT_CONFIG)})")
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="override config values, e.g. train.steps=100 data.seq_len=256")
  p.add_argument("--set", dest="more", action="append", default=[], metavar="section.key=value",
                 help="same as a positional override (repeatable)")
  p.add_argument("--max-minutes", type=float, default=None, metavar="M",
                 help="stop with a checkpoint (and the evaluation, if configured) once M minutes "
                      "have passed since the command started (start-up included: loading the "
                      "target, reading or regenerating data, compiling); rerun the same command "
                      "to continue")
  p.add_argument("--re-evaluate", action="store_true",
                 help="for a finished run: evaluate (train.eval_prompts) and export it again "
                      "instead of reporting that it is complete")
  p.add_argument("--no-export", action="store_true", help="skip the z-lab export at the end")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  g = p.add_argument_group("several hosts (one process per host, each with its own target)")
  g.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                 help="address of process 0, the same on every process")
  g.add_argument("--num-processes", type=int, default=1, metavar="N")
  g.add_argument("--process-id", type=int, default=0, metavar="I", help="0 .. N-1")
  return p


def init_processes(args) -> None:
  """jax.distributed over N processes (before anything touches JAX's backend). Every process
  runs the same command with its own --process-id; process 0 writes the run directory."""
  if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
    raise SystemExit(f"error: --process-id {args.process_id} must be in 0..{args.num_processes - 1}")
  if args.num_processes == 1:
    return
  if not args.coordinator:
    raise SystemExit("error: --num-processes > 1 needs --coordinator HOST:PORT (process 0's "
                     "address, reachable from every process)")
  import jax
  jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id)


def main(argv=None, *, first_step=None) -> int:
  """first_step: passed to trainer.train (a tool's measurement of the real step)."""
  started = time.time()   # --max-minutes counts from here
  args = _parser().parse_args(argv)
  from jax_drafter.cli import keep_large_allocations, setup_logging
  keep_large_allocations()
  setup_logging()
  log = logging.getLogger("jax_drafter.train")

  init_processes(args)
  import jax
  jax.devices()  # initialise JAX's backend before torch touches CUDA (import alone does not)
  from jax_drafter.config import ConfigError, load_config
  from jax_drafter import trainer

  t0 = time.time()
  try:
    cfg = load_config(args.config or DEFAULT_CONFIG, list(args.overrides) + list(args.more))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  from jax_drafter.checkpoint import latest_step
  done = latest_step(cfg.train.output_dir)
  if done is not None and done >= cfg.train.steps and not args.re_evaluate:
    out = cfg.train.output_dir
    print(f"{out}: this run is complete (step {done} of train.steps={cfg.train.steps}); nothing to "
          f"do. Evaluate it with `python -m jax_drafter.evaluate --run-dir {out}`, rerun with "
          "--re-evaluate, or raise train.steps to train on.")
    return 0
  import yaml
  log.info("resolved config:\n%s", yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
  progress = None if args.quiet or jax.process_index() else _tqdm_progress()
  try:
    summary = trainer.train(cfg, progress=progress, first_step=first_step,
                            time_budget_s=None if args.max_minutes is None else 60 * args.max_minutes,
                            budget_from=started)
  except (trainer.TrainingError, ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  out = cfg.train.output_dir
  if not args.no_export and summary["final_step"] > 0 and jax.process_index() == 0:
    from jax_drafter.export import write_zlab
    export_dir = cfg.train.export_dir or os.path.join(out, "export")
    write_zlab(export_dir, summary["drafter_config"], summary["params"],
               vocab=summary["draft_vocab"])
    log.info("exported z-lab drafter to %s", export_dir)
  first, last = summary["first"], summary["last"]
  if first and last:
    log.info("done in %.0f s: step %d, loss %.4f -> %.4f, accuracy %.3f -> %.3f, tau estimate "
             "%.2f -> %.2f", time.time() - t0, summary["final_step"], first["loss"], last["loss"],
             first["accuracy"], last["accuracy"], first["tau_estimate"], last["tau_estimate"])
  if summary.get("eval_report"):
    from jax_drafter.evaluate import format_report
    r = summary["eval_report"]
    log.info("held-out speculative decoding:\n%s", format_report(r))
    # Only a real mismatch fails the run: near-ties within rounding noise are reported, not errors,
    # and at temperature > 0 nothing is checked (passed is None).
    if r["lossless"]["passed"] is False:
      m = r["lossless"]["mismatches"][0]
      print(f"error: speculative decoding differed from the target's greedy output: prompt "
            f"{m['prompt']}, new token {m['position']}: speculative {m['speculative']} vs target "
            f"{m['target']} ({m['reason']})", file=sys.stderr)
      return 1
  return 130 if summary.get("interrupted") else 0


def _tqdm_progress():
  from tqdm import tqdm
  from jax_drafter.trainer import Progress, bound
  bar = {}

  def start(first, total):
    bar["b"] = tqdm(total=total, initial=first, unit="step", dynamic_ncols=True)

  def update(step, m):
    b = bar["b"]
    b.update(step - b.n)
    b.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['accuracy']:.3f}",
                  tau=f"{m['tau_estimate']:.2f}", tok_s=f"{m['tokens_per_s']:.0f}",
                  target=f"{m['target_tokens_per_s']:.0f}",
                  drafter=f"{m['drafter_tokens_per_s']:.0f}", bound=bound(m))

  return Progress(start=start, update=update, close=lambda: bar.get("b") and bar["b"].close())


if __name__ == "__main__":
  sys.exit(main())
