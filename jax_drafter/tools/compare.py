"""Two drafters' evaluation reports on the same prompts, compared prompt by prompt.

    python -m jax_drafter.tools.compare BASE.json NEW.json [--first N] [--resamples 2000] [--seed 0]
                                        [--json F]

BASE.json and NEW.json are `jax_drafter.evaluate --json` reports. A difference in tau between two
drafters is only meaningful against the noise of the prompts: responses differ far more from each
other than two drafters differ on one response, so the comparison is made prompt by prompt on the
same prompts, and three figures are printed together, because each can mislead alone:
  - the mean over prompts of NEW's tau minus BASE's (± its standard error over prompts), with how
    many prompts got better, worse or stayed equal;
  - the pooled tau (tokens over verify steps, all prompts together) of each, and NEW minus BASE
    with a bootstrap 95% interval over prompts (prompts drawn with replacement, seeded);
  - the median of each drafter's per-prompt tau.
A few responses that repeat themselves reach the block size and move the mean over responses a
lot (two such prompts once decided a comparison of 32); the pooled figure and the median show it.

Prompts are matched by the key of their token ids (reports of evaluate since this tool), else by
position with equal prompt lengths; reports on other prompts, another --max-new-tokens or another
temperature are refused, naming the difference; reports whose target decoded differently
(evaluate --decoder) are compared with a note saying so.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


class CompareError(ValueError):
  """Reports that cannot be compared: the message names the report and the difference."""


def load_report(path: str) -> dict:
  try:
    with open(path) as f:
      report = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CompareError(f"{path}: cannot read an evaluation report ({type(e).__name__}: {e})") from None
  rows = report.get("per_prompt") if isinstance(report, dict) else None
  if not isinstance(rows, list) or not rows:
    raise CompareError(f"{path}: no per_prompt rows; write the report with "
                       "`python -m jax_drafter.evaluate ... --json FILE`")
  for i, r in enumerate(rows):
    if not isinstance(r.get("accepted"), list) or "prompt_tokens" not in r:
      raise CompareError(f"{path}: per_prompt row {i} has no 'accepted' list or 'prompt_tokens'")
  return report


def pair(base: dict, new: dict, names=("BASE", "NEW"), *,
         first: int | None = None) -> list[tuple[dict, dict]]:
  """Rows of the same prompts, in BASE's order. first: only each report's first `first` rows
  (an evaluation of a run's first 64 held-out prompts against one of its first 32)."""
  for field in ("max_new_tokens", "temperature"):
    if base.get(field) != new.get(field):
      raise CompareError(f"{names[0]} was evaluated with {field}={base.get(field)} and "
                         f"{names[1]} with {new.get(field)}: evaluate both the same way")
  a, b = base["per_prompt"], new["per_prompt"]
  if first is not None:
    if first < 1 or first > min(len(a), len(b)):
      raise CompareError(f"--first {first}: {names[0]} has {len(a)} prompts and {names[1]} "
                         f"{len(b)}; give at most {min(len(a), len(b))}")
    a, b = a[:first], b[:first]
  if all("prompt_key" in r for r in a + b):
    by_key = {r["prompt_key"]: r for r in b}
    missing = [r["prompt"] for r in a if r["prompt_key"] not in by_key]
    if missing or len(a) != len(b):
      raise CompareError(f"the reports were made on different prompts ({len(a)} and {len(b)} "
                         f"prompts; {len(missing)} of {names[0]}'s not in {names[1]}, the first "
                         f"prompt {missing[0] if missing else '-'}): evaluate both on the same "
                         "--prompts (or the same run's held-out split)")
    return [(r, by_key[r["prompt_key"]]) for r in a]
  if len(a) != len(b):
    raise CompareError(f"{names[0]} has {len(a)} prompts and {names[1]} {len(b)}: evaluate both "
                       "on the same prompts (--num-prompts)")
  for i, (ra, rb) in enumerate(zip(a, b)):
    if ra["prompt_tokens"] != rb["prompt_tokens"]:
      raise CompareError(f"prompt {i} has {ra['prompt_tokens']} tokens in {names[0]} and "
                         f"{rb['prompt_tokens']} in {names[1]}: the reports were made on "
                         "different prompts")
  return list(zip(a, b))


def _tau(row: dict) -> float | None:
  acc = row["accepted"]
  return float(np.mean(acc) + 1) if acc else None


def _pooled(tokens: np.ndarray, steps: np.ndarray) -> float | None:
  s = steps.sum()
  return float(tokens.sum() / s) if s else None


def compare(base: dict, new: dict, *, resamples: int = 2000, seed: int = 0,
            names=("BASE", "NEW"), first: int | None = None) -> dict:
  pairs = pair(base, new, names, first=first)
  both = [(_tau(x), _tau(y)) for x, y in pairs]
  both = [(x, y) for x, y in both if x is not None and y is not None]
  if not both:
    raise CompareError("no prompt has verify steps in both reports")
  ta, tb = np.array(both).T
  diff = tb - ta
  # Per prompt: tokens produced by verify steps (accepted + 1 each) and the number of steps.
  tok = np.array([[sum(x["accepted"]) + len(x["accepted"]), sum(y["accepted"]) + len(y["accepted"])]
                  for x, y in pairs], dtype=np.float64)
  steps = np.array([[len(x["accepted"]), len(y["accepted"])] for x, y in pairs], dtype=np.float64)
  pa, pb = _pooled(tok[:, 0], steps[:, 0]), _pooled(tok[:, 1], steps[:, 1])
  rng = np.random.default_rng(seed)
  n = len(pairs)
  boot = []
  for _ in range(resamples):
    i = rng.integers(0, n, n)
    sa, sb = steps[i, 0].sum(), steps[i, 1].sum()
    if sa and sb:
      boot.append(tok[i, 1].sum() / sb - tok[i, 0].sum() / sa)
  interval = [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))] if boot else None
  return {
      "prompts": n, "prompts_with_steps_in_both": len(both),
      "tau": {names[0]: float(ta.mean()), names[1]: float(tb.mean())},
      "tau_difference": float(diff.mean()),
      "tau_difference_stderr": float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else None,
      "better": int((diff > 0).sum()), "worse": int((diff < 0).sum()),
      "equal": int((diff == 0).sum()),
      "tau_pooled": {names[0]: pa, names[1]: pb},
      "tau_pooled_difference": None if pa is None or pb is None else pb - pa,
      "tau_pooled_difference_95": interval, "resamples": resamples, "seed": seed,
      "tau_median": {names[0]: float(np.median(ta)), names[1]: float(np.median(tb))},
      # How the target decoded in each (evaluate --decoder; older reports do not say).
      "decoder": {nm: r.get("tokens_per_second", {}).get("decoder")
                  for nm, r in zip(names, (base, new))},
  }


def format_comparison(c: dict, names=("BASE", "NEW")) -> str:
  a, b = names
  se = c["tau_difference_stderr"]
  iv = c["tau_pooled_difference_95"]
  lines = [
      f"{c['prompts']} prompts ({c['prompts_with_steps_in_both']} with verify steps in both)",
      f"  tau (mean over prompts)   {a} {c['tau'][a]:.3f}   {b} {c['tau'][b]:.3f}",
      f"  {b} - {a}, prompt by prompt: {c['tau_difference']:+.3f}"
      + ("" if se is None else f" ± {se:.3f} (standard error over prompts)")
      + f"; better on {c['better']}, worse on {c['worse']}, equal on {c['equal']}",
      f"  tau pooled over verify steps   {a} {c['tau_pooled'][a]:.3f}   {b} "
      f"{c['tau_pooled'][b]:.3f}   difference {c['tau_pooled_difference']:+.3f}"
      + ("" if iv is None else f" (bootstrap 95% interval over prompts {iv[0]:+.3f} .. {iv[1]:+.3f},"
         f" {c['resamples']} resamples)"),
      f"  median of per-prompt tau   {a} {c['tau_median'][a]:.3f}   {b} {c['tau_median'][b]:.3f}",
  ]
  dec = c.get("decoder") or {}
  if dec.get(a) != dec.get(b):
    lines.append(f"  note: the target decoded {dec.get(a) or '(not recorded)'} in {a}, "
                 f"{dec.get(b) or '(not recorded)'} in {b}: in bfloat16 a near-tie of its two best "
                 "logits may round the other way, so a few responses may differ for that reason")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jax_drafter.tools.compare",
                              description=__doc__.split("\n")[0])
  p.add_argument("base", help="the reference drafter's report (jax_drafter.evaluate --json)")
  p.add_argument("new", help="the other drafter's report, on the same prompts")
  p.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--first", type=int, metavar="N",
                 help="compare only each report's first N prompts (evaluate takes a run's "
                      "held-out prompts in order: 64 of them begin with the 32)")
  p.add_argument("--json", help="write the comparison here")
  args = p.parse_args(argv)
  if args.resamples < 0:
    p.error("--resamples must be >= 0")
  try:
    c = compare(load_report(args.base), load_report(args.new), resamples=args.resamples,
                seed=args.seed, first=args.first)
  except CompareError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"BASE {args.base}\nNEW  {args.new}")
  print(format_comparison(c))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"base": args.base, "new": args.new, **c}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
