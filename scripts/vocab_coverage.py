"""How much of the target's answer text a draft vocabulary of the N most frequent tokens covers.

A drafter that drafts only from N tokens (EAGLE-3's reduced draft vocabulary) runs an N-row LM head
instead of the target's full one (the largest matmul of a CPU training step); it can never draft a
token outside them. This counts the answers' tokens in a regeneration cache
(`jax_drafter.regenerate`'s JSONL: exact target token ids and assistant spans), picks the top N on
all but `--held-out` dataset conversations and reports the coverage there and on the held-out
ones (an upper bound on the draft tokens such a vocabulary would lose).

  python scripts/vocab_coverage.py runs/cache/regenerated.jsonl [--held-out 2000] [--seed 0]
"""

import argparse
import collections
import json
import random


def answer_tokens(records):
  counts, n = collections.Counter(), 0
  for r in records:
    for a, b in r["assistant_spans"]:
      counts.update(r["input_ids"][a:b])
      n += b - a
  return counts, n


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("cache")
  ap.add_argument("--held-out", type=int, default=2000,
                  help="dataset conversations (not synthetic prompts) kept out of the counts")
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args()
  with open(a.cache) as f:
    records = [json.loads(line) for line in f if line.strip()]
  random.Random(a.seed).shuffle(records)
  test = [r for r in records if not str(r["id"]).startswith("synthetic")][:a.held_out]
  keys = {r["key"] for r in test}
  train = [r for r in records if r["key"] not in keys]
  c_train, n_train = answer_tokens(train)
  c_test, n_test = answer_tokens(test)
  order = [t for t, _ in c_train.most_common()]
  print(f"{len(train)} conversations counted: {n_train} answer tokens, {len(c_train)} distinct; "
        f"{len(test)} held out: {n_test} tokens")
  print("top N   coverage (counted)   coverage (held out)")
  for N in (1024, 2048, 4096, 8192, 16384, 32768):
    top = set(order[:N])
    cov = lambda c, n: sum(c[t] for t in top) / n if n else float("nan")
    print(f"{N:6d}   {cov(c_train, n_train):.4f}               {cov(c_test, n_test):.4f}")


if __name__ == "__main__":
  main()
