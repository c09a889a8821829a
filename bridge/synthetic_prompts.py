"""User prompts sampled from the frozen target itself: more conversations for regeneration.

A drafter learns the target's own text, and how much of it there is bounds held-out tau (the GPU
recipe: +0.95 for 6.1x the regenerated tokens). A dataset holds only so many prompts; an instruct
model's chat template, cut where a user message begins, lets the target write user messages
itself (SmolLM2-135M-Instruct at temperature 1: "Help me plan a 5k races across 12 weeks!",
"How can I effectively manage my work from home and prioritize tasks efficiently."). Each
complete message (ended by an end-of-turn token within the limit) becomes a one-turn
conversation whose answer regeneration then writes; cut, empty and repeated messages are dropped.

Prompts are sampled in chunks of `chunk` rows, each from its own seeded generator, and every
chunk is one line of an append-only JSONL cache keyed by the target's fingerprint and the
settings: a second run reads them back, an interrupted one (Ctrl-C, kill -9) generates only the
chunks it lacks (a torn last line is cut off first). The count is not part of the key, since a
chunk does not depend on it: a run asking for more prompts than an earlier one samples only the
chunks after the earlier ones (a partial last chunk, which has fewer rows, is sampled again whole).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bridge import generation
from bridge.regenerate import RegenerationError, open_jsonl_sink, read_jsonl_cache
from bridge.target import eos_token_ids

log = logging.getLogger(__name__)

_SENTINEL = "\u2063SYNTHETIC-PROMPT\u2063"


@dataclass(frozen=True)
class PromptSettings:
  count: int                 # prompts sampled (complete, distinct ones are kept)
  max_new_tokens: int = 128  # a message not ended by then is dropped
  temperature: float = 1.0
  seed: int = 0
  chunk: int = 256           # rows sampled at once (each chunk its own generator and cache line)


def user_prefix(tokenizer) -> list[int]:
  """Token ids of the chat template up to where a first user message's text starts (system
  prompt included, if the template adds one)."""
  if not getattr(tokenizer, "chat_template", None):
    raise RegenerationError("the target's tokenizer has no chat template, so it cannot be asked "
                            "for user messages; set data.synthetic_prompts: 0")
  text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
  cut = text.find(_SENTINEL)
  if cut <= 0:
    raise RegenerationError("the target's chat template does not render a user message's text "
                            "as given, so no user-turn prefix can be cut from it; set "
                            "data.synthetic_prompts: 0")
  return list(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])


def prompts_key(fingerprint: str, s: PromptSettings) -> str:
  """Names the prompts: the target and every setting that changes them, the count included (the
  data's key; chunks written before 2026-12-07 were keyed by it too, and are still read, whatever
  their count)."""
  return f"synthetic:{fingerprint}:{json.dumps(asdict(s), sort_keys=True)}"


def chunk_key(fingerprint: str, s: PromptSettings) -> str:
  """Names a chunk: the target and every setting that changes a chunk's texts, not the count
  (chunk `start` of `n` rows is the same texts whatever the count)."""
  return f"synthetic:{fingerprint}:{json.dumps(_chunk_settings(s), sort_keys=True)}"


def _chunk_settings(s: PromptSettings) -> dict:
  return {k: v for k, v in asdict(s).items() if k != "count"}


def synthesize(model, tokenizer, s: PromptSettings, *, fingerprint: str, cache_path: str,
               progress: bool = True) -> list[dict]:
  """-> one-turn conversations {"id", "messages": [user, assistant placeholder]} of the complete,
  distinct user messages among `s.count` sampled ones (cached: see the module docstring)."""
  key = chunk_key(fingerprint, s)
  path = Path(cache_path)
  chunks = _read(path, fingerprint, s)
  starts = range(0, s.count, s.chunk)
  todo = [i for i in starts if i not in chunks]
  if todo:
    prefix = user_prefix(tokenizer)
    stop = eos_token_ids(model, tokenizer, required=True)
    device = next(model.parameters()).device
    pad = min(stop)
    t0, made = time.time(), 0
    log.info("synthetic prompts: %d of %d chunks cached, sampling %d prompts (target %s)",
             len(starts) - len(todo), len(starts), sum(min(s.chunk, s.count - i) for i in todo),
             fingerprint)
    with open_jsonl_sink(path) as sink:
      for start in todo:
        n = min(s.chunk, s.count - start)
        g = torch.Generator(device=device).manual_seed(
            int.from_bytes(hashlib.sha256(f"{s.seed}:{start}".encode()).digest()[:7], "big"))
        texts = [None] * n
        for i, new in generation.generate_many(
            model, [prefix] * n, max_new_tokens=s.max_new_tokens, stop_ids=stop, pad_id=pad,
            max_rows=n, max_tokens=n * (len(prefix) + s.max_new_tokens),
            temperature=s.temperature, generator=g):
          made += len(new)
          if new and new[-1] in stop:   # a complete message; a cut one is dropped
            text = tokenizer.decode(new[:-1], skip_special_tokens=True).strip()
            texts[i] = text or None
        sink.write(json.dumps({"key": key, "start": start, "texts": texts}) + "\n")
        sink.flush()
        chunks[start] = texts
        if progress:
          log.info("synthetic prompts: %d of %d sampled, %.0f tokens/s", start + n, s.count,
                   made / max(time.time() - t0, 1e-9))
  return _conversations(chunks, s)


def cached(s: PromptSettings, *, fingerprint: str, cache_path: str) -> list[dict]:
  """The prompts `synthesize` wrote for this target and these settings, without the target."""
  chunks = _read(Path(cache_path), fingerprint, s)
  missing = [i for i in range(0, s.count, s.chunk) if i not in chunks]
  if missing:
    raise RegenerationError(f"{cache_path} lacks {len(missing)} chunks of the synthetic prompts "
                            f"of target {fingerprint} with these settings; run "
                            "`python -m jax_drafter.regenerate` with the target first")
  return _conversations(chunks, s)


def _conversations(chunks: dict[int, list], s: PromptSettings) -> list[dict]:
  seen, out = set(), []
  for start in range(0, s.count, s.chunk):
    for j, text in enumerate(chunks[start]):
      if text is None or text in seen:
        continue
      seen.add(text)
      out.append({"id": f"synthetic-{s.seed}-{start + j}",
                  "messages": [{"role": "user", "content": text},
                               {"role": "assistant", "content": ""}]})
  log.info("synthetic prompts: %d complete and distinct of %d sampled", len(out), s.count)
  return out


def _read(path: Path, fingerprint: str, s: PromptSettings) -> dict[int, list]:
  """start -> texts of the cached chunks these settings use: of the right key and as many rows as
  the chunk at `start` has for `s.count`."""
  prefix = f"synthetic:{fingerprint}:"
  mine = _chunk_settings(s)
  chunks = {}

  def ours(key):     # chunk_key, or prompts_key of any count (the older caches)
    if not key.startswith(prefix):
      return False
    settings = json.loads(key[len(prefix):])
    settings.pop("count", None)
    return settings == mine

  def take(record):
    start = int(record["start"])
    if (start < s.count and len(record["texts"]) == min(s.chunk, s.count - start)
        and ours(record["key"])):
      chunks[start] = list(record["texts"])
  read_jsonl_cache(path, take, "that chunk of synthetic prompts is sampled again")
  return chunks
