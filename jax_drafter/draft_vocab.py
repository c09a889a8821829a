"""A reduced draft vocabulary (EAGLE-3's): the drafter drafts only N of the target's V tokens.

The drafter's LM head is the target's, frozen. With `drafter.draft_vocab_size: N` a run keeps the
N rows of the tokens its training answers use most (ties and the rest: the tokens of the other
text of its rows, then the lowest ids, which byte-pair tokenizers give their earliest merges), so
the largest matmul of a step shrinks by V / N: the whole CPU step is about half as long with
N = 8192 of SmolLM2's 49,152 (`benchmarks/`), and the LM-head loss is ~30% of the GPU recipe's.

Training: a label outside the N cannot be drafted. It is left out of the loss (its weight is 0,
so the loss stays a mean over the tokens the head can learn) and counts as a miss in accuracy
and acceptance, so every metric reads what decoding will see.
Decoding: the argmax (or a sample) over the N rows is mapped back to a target id; sampled draft
probabilities are 0 outside the N, which rejection sampling handles as any zero.

The ids are part of the drafter: a checkpoint holds them in its metadata (`draft_vocab`), an
exported directory in `draft_vocab.json` beside `config.json` (which says `draft_vocab_size`).
A server that reads the z-lab format but not this file decodes with the whole head: lossless
still, only with a head the drafter was not trained on outside its N tokens.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

FILE = "draft_vocab.json"


class DraftVocabError(ValueError):
  pass


def choose(rows: dict, vocab_size: int, n: int, pad_doc_id: int = -1) -> np.ndarray:
  """The n ids (int32, ascending) of packed training rows ({"input_ids", "loss_mask", "doc_id"}
  [R, S]) ranked by count among supervised tokens, then among the rows' other tokens (padding
  excluded), then by id."""
  if not 1 <= n <= vocab_size:
    raise DraftVocabError(f"draft_vocab_size={n} must be between 1 and {vocab_size}")
  ids = np.asarray(rows["input_ids"]).ravel()
  real = (np.asarray(rows["doc_id"]).ravel() != pad_doc_id) & (ids >= 0) & (ids < vocab_size)
  answer = np.asarray(rows["loss_mask"]).ravel().astype(bool) & real
  count = lambda sel: np.bincount(ids[sel], minlength=vocab_size)
  order = np.lexsort((np.arange(vocab_size), -count(real & ~answer), -count(answer)))
  return np.sort(order[:n]).astype(np.int32)


def coverage(ids: np.ndarray, rows: dict) -> float:
  """The share of the rows' supervised tokens inside `ids` (what the drafter can ever draft)."""
  labels = np.asarray(rows["input_ids"])[np.asarray(rows["loss_mask"]).astype(bool)]
  return float(np.isin(labels, ids).mean()) if labels.size else float("nan")


def check(ids, cfg, *, source: str) -> np.ndarray:
  """ids as int32 [N] after checking them against the DrafterConfig `cfg` (None when the drafter
  drafts from the whole vocabulary)."""
  n = cfg.draft_vocab_size
  if ids is None:
    if n is not None:
      raise DraftVocabError(f"{source}: the drafter has draft_vocab_size={n} but its draft "
                            f"vocabulary is missing (a checkpoint's `draft_vocab` metadata, or "
                            f"{FILE} beside an exported config.json)")
    return None
  a = np.asarray(ids)
  if n is None:
    raise DraftVocabError(f"{source}: a draft vocabulary is given for a drafter whose config has "
                          "no draft_vocab_size")
  if a.ndim != 1 or a.dtype.kind not in "iu" or len(a) != n:
    raise DraftVocabError(f"{source}: the draft vocabulary must be {n} integer token ids, got "
                          f"shape {a.shape} of {a.dtype}")
  if len(a) and (a[0] < 0 or a[-1] >= cfg.vocab_size or np.any(np.diff(a) <= 0)):
    raise DraftVocabError(f"{source}: the draft vocabulary's ids must be distinct, ascending and "
                          f"within the target's vocabulary 0..{cfg.vocab_size - 1}")
  return a.astype(np.int32)


def from_meta(meta: dict, cfg, *, source: str) -> np.ndarray | None:
  """The ids a checkpoint's metadata holds (None for a whole-vocabulary drafter)."""
  return check(meta.get("draft_vocab"), cfg, source=source)


def write(directory: str, ids: np.ndarray) -> None:
  tmp = os.path.join(directory, f".{FILE}.tmp")
  with open(tmp, "w") as f:
    json.dump({"draft_vocab_size": len(ids), "ids": [int(i) for i in ids]}, f)
  os.replace(tmp, os.path.join(directory, FILE))


def read(directory: str, cfg) -> np.ndarray | None:
  """The ids of an exported drafter directory (None when it drafts from the whole vocabulary)."""
  path = os.path.join(directory, FILE)
  if not os.path.isfile(path):
    return check(None, cfg, source=directory)
  try:
    with open(path) as f:
      ids = json.load(f)["ids"]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    raise DraftVocabError(f"{path}: not a draft vocabulary ({e!r}); it holds "
                          '{"draft_vocab_size": N, "ids": [...]}') from None
  return check(np.asarray(ids), cfg, source=path)


def with_draft_vocab(frozen: dict, ids) -> dict:
  """frozen ({"embed", "lm_head"}) plus what the step and decoding read for a draft vocabulary:
  "draft_head" (the LM head's rows of ids, [N, D], gathered once), "draft_ids" (int32 [N]) and
  "to_draft" (int32 [V]: a target id's row in draft_head, -1 outside). ids None: frozen as is.
  The new arrays are placed like the LM head."""
  if ids is None:
    return frozen
  head = frozen["lm_head"]
  to_draft = np.full(head.shape[0], -1, np.int32)
  to_draft[np.asarray(ids)] = np.arange(len(ids), dtype=np.int32)
  put = lambda x: jax.device_put(x, head.sharding)
  draft_ids = put(np.asarray(ids, np.int32))
  return {**frozen, "draft_ids": draft_ids, "to_draft": put(to_draft),
          "draft_head": jnp.take(head, draft_ids, axis=0)}


def to_draft_labels(frozen: dict, labels):
  """Target-id labels -> (rows of the draft head, with 0 outside it; inside the draft vocabulary)."""
  d = jnp.take(frozen["to_draft"], labels, mode="clip")
  return jnp.maximum(d, 0), d >= 0


def to_target_ids(frozen: dict, pred):
  """Rows of the draft head -> target ids (a negative prediction, 'none', stays -1)."""
  ids = jnp.take(frozen["draft_ids"], jnp.maximum(pred, 0), mode="clip")
  return jnp.where(pred >= 0, ids, -1)
