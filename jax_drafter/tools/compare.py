"""Two drafters' evaluation reports on the same prompts, compared prompt by prompt; or two
recipes, each trained several times (one report per training run), compared over their runs.

    python -m jax_drafter.tools.compare BASE.json NEW.json [--first N] [--resamples 2000] [--seed 0]
                                        [--json F]
    python -m jax_drafter.tools.compare B0.json,B1.json,B2.json N0.json,N1.json,N2.json

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

Prompt-by-prompt intervals count the noise of the prompts, not of training: two drafters trained
by one recipe on the same data with another `train.seed` differ by more than those intervals
(0.076 on the CPU default's 32 held-out prompts, with a paired standard error of 0.025;
benchmarks/cpu-2026-12-06f-layer-choice/). So a recipe change is judged over several training runs
a side: give each side as reports separated by commas (one per run, on the same prompts). Each
run's tau (mean over prompts) is printed, each side's mean and standard deviation over its runs,
and NEW's mean minus BASE's with the standard error of that difference from the runs' spread
(Welch; needs two runs or more a side). The prompt-by-prompt figures then pool each side's runs
per prompt (every run's verify steps of that prompt together).
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


def merge_runs(reports: list[dict], name: str = "BASE", *, first: int | None = None) -> dict:
  """One side's training runs as one report: each prompt's verify steps of every run together,
  in the first run's prompt order. The runs must be on the same prompts and settings."""
  rows = [dict(r, accepted=list(r["accepted"])) for r in reports[0]["per_prompt"]]
  if first is not None:
    if first < 1 or first > len(rows):
      raise CompareError(f"--first {first}: {name} has {len(rows)} prompts; give at most {len(rows)}")
    rows = rows[:first]
  for i, other in enumerate(reports[1:], 1):
    for row, (_, o) in zip(rows, pair(reports[0], other, (f"{name} run 0", f"{name} run {i}"),
                                      first=first)):
      row["accepted"] += list(o["accepted"])
  decoders = {r.get("tokens_per_second", {}).get("decoder") for r in reports}
  merged = {k: v for k, v in reports[0].items() if k != "per_prompt"}
  merged["per_prompt"] = rows
  merged["tokens_per_second"] = {"decoder": decoders.pop() if len(decoders) == 1 else
                                 "differently in its runs"}
  return merged


def run_taus(report: dict, first: int | None = None) -> float:
  """A run's tau: the mean over its prompts (the first `first`) of each prompt's tau."""
  taus = [_tau(r) for r in report["per_prompt"][:first]]
  taus = [t for t in taus if t is not None]
  if not taus:
    raise CompareError("a report has no prompt with verify steps")
  return float(np.mean(taus))


def over_runs(bases: list[dict], news: list[dict], names=("BASE", "NEW"), *,
              first: int | None = None) -> dict:
  """Each run's tau, each side's mean and standard deviation over its runs, and the difference
  of the means with its standard error from the runs' spread (Welch: sqrt(sa^2/na + sb^2/nb))."""
  taus = {names[0]: [run_taus(r, first) for r in bases], names[1]: [run_taus(r, first) for r in news]}
  mean = {k: float(np.mean(v)) for k, v in taus.items()}
  sd = {k: float(np.std(v, ddof=1)) if len(v) > 1 else None for k, v in taus.items()}
  se = None
  if all(s is not None for s in sd.values()):
    se = float(np.sqrt(sum(sd[k] ** 2 / len(taus[k]) for k in taus)))
  return {"tau": taus, "mean": mean, "sd": sd,
          "difference": mean[names[1]] - mean[names[0]], "difference_stderr": se}


def compare_runs(bases: list[dict], news: list[dict], *, resamples: int = 2000, seed: int = 0,
                 names=("BASE", "NEW"), first: int | None = None) -> dict:
  """compare() of each side's runs pooled per prompt, with the figures over runs added."""
  merged = (merge_runs(bases, names[0], first=first), merge_runs(news, names[1], first=first))
  c = compare(*merged, resamples=resamples, seed=seed, names=names)
  return {**c, "runs": over_runs(bases, news, names, first=first)}


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
  lines = []
  runs = c.get("runs")
  several = bool(runs) and min(len(v) for v in runs["tau"].values()) > 1   # runs a side
  if several:
    for nm in names:
      lines.append(f"  {nm}: {len(runs['tau'][nm])} training runs, tau "
                   + " ".join(f"{t:.3f}" for t in runs["tau"][nm])
                   + f"; mean {runs['mean'][nm]:.3f} ± {runs['sd'][nm]:.3f} (standard deviation over runs)")
    lines.append(f"  {b} - {a} over runs: {runs['difference']:+.3f} ± {runs['difference_stderr']:.3f} "
                 "(standard error from the runs' spread): the figure that judges a recipe")
    lines.append("  below, each side's runs pooled per prompt (intervals over prompts, not runs):")
  lines += [
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
  if not several:
    lines.append("  one training run on a side: this compares two drafters. Another train.seed of "
                 "the same recipe moves tau by more than these intervals; give several runs a side "
                 "(A0.json,A1.json) to compare recipes")
  dec = c.get("decoder") or {}
  if dec.get(a) != dec.get(b):
    lines.append(f"  note: the target decoded {dec.get(a) or '(not recorded)'} in {a}, "
                 f"{dec.get(b) or '(not recorded)'} in {b}: in bfloat16 a near-tie of its two best "
                 "logits may round the other way, so a few responses may differ for that reason")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jax_drafter.tools.compare",
                              description=__doc__.split("\n")[0])
  p.add_argument("base", help="the reference drafter's report (jax_drafter.evaluate --json); "
                              "several training runs of one recipe: their reports joined by commas")
  p.add_argument("new", help="the other drafter's report, on the same prompts (or its runs' "
                             "reports, joined by commas)")
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
    sides = [[load_report(f) for f in spec.split(",") if f] for spec in (args.base, args.new)]
    if not all(sides):
      raise CompareError("give at least one report a side: BASE.json NEW.json, or each side's "
                         "runs joined by commas (B0.json,B1.json N0.json,N1.json)")
    c = compare_runs(*sides, resamples=args.resamples, seed=args.seed, first=args.first)
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
