"""Regenerate the assistant turns of conversations with the frozen target (docs/DESIGN.md, data
flow step 1).

DFlash trains the drafter on the target's own outputs. Each assistant turn is replaced by what the
target generates given the conversation up to that turn (earlier turns already regenerated), and
the result keeps the target's generated TOKEN IDS: decoding to text and encoding again is not the
identity (SmolLM2's greedy "\\n\\n" is one token, 1116, that re-encodes as two "\\n", 198), and one
shifted token puts every later label of the turn off by one.

A record is {"key", "id", "target", "messages", "input_ids", "assistant_spans"}: the whole
conversation as ids (template text tokenised segment by segment, generated ids verbatim) and the
[start, end) id ranges the target generated (the loss mask; the stop token is inside). `messages`
holds the decoded text for people and for prompts. Records are appended to a JSONL cache, one line
per finished conversation, flushed at once: a second run reuses them, an interrupted run (Ctrl-C,
kill -9) resumes without duplicates (a torn last line is cut off before appending).

Generation runs through `bridge.generation` (static KV cache, length-sorted batches).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from bridge import generation
from bridge.target import eos_token_ids

log = logging.getLogger(__name__)


class RegenerationError(ValueError):
  """A target or data problem a person can fix: one line naming it and the fix."""


@dataclass(frozen=True)
class Settings:
  """What a regeneration depends on besides the target and the conversation (part of the key)."""
  max_new_tokens: int = 256
  temperature: float = 0.0         # 0 = greedy
  seed: int = 0
  max_prompt_tokens: int | None = None   # a turn whose prompt is this long ends the conversation
  max_turns: int | None = None     # assistant turns regenerated per conversation (None = all)
  # A turn that reaches max_new_tokens without its stop token: False ends the conversation there;
  # True closes the turn with the template's end-of-turn token (outside the loss mask: the target
  # did not write it) and goes on with the next user turn, so later turns are regenerated too.
  close_cut_turns: bool = False

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
    if self.max_turns is not None and self.max_turns < 1:
      raise ValueError(f"max_turns={self.max_turns} must be >= 1 (or None for all turns)")


def target_fingerprint(model, tokenizer) -> str:
  """Hash of the target's config, tokenizer and a sample of every weight (cheap, tells random inits apart)."""
  h = hashlib.sha256()
  config = model.config.to_dict()
  config.pop("transformers_version", None)
  config.pop("_attn_implementation_autoset", None)
  h.update(json.dumps(config, sort_keys=True, default=str).encode())
  h.update(f"{len(tokenizer)}|{tokenizer.chat_template}".encode())
  for name, p in model.named_parameters():
    h.update(name.encode())
    h.update(p.detach().reshape(-1)[:1024].float().cpu().numpy().tobytes())
  return h.hexdigest()[:16]


def _settings_dict(settings: Settings) -> dict:
  """The settings that name a regeneration. close_cut_turns only when set: records made before it
  existed (which ended every conversation at a cut turn) keep their keys."""
  d = asdict(settings)
  if not d["close_cut_turns"]:
    del d["close_cut_turns"]
  return d


def regenerate_key(fingerprint: str, settings: Settings) -> str:
  """Names a regeneration (target + settings) for the data cache."""
  return f"{fingerprint}:{json.dumps(_settings_dict(settings), sort_keys=True)}"


@dataclass
class _Conv:
  """A conversation in progress: ids so far, the text they render, the turns left."""
  index: int
  messages: list[dict]
  turns: list[int]            # indices of the assistant messages still to generate, in order
  ids: list[int]
  spans: list[list[int]]
  rendered: str = ""


# Without a progress bar, a progress line in the log at most this often (seconds).
QUIET_PROGRESS_EVERY_S = 30.0


def regenerate_conversations(model, tokenizer, conversations: Sequence[dict], settings: Settings, *,
                             cache_path: str | os.PathLike | None, batch_rows: int = 256,
                             batch_tokens: int = 1 << 19, cuda_graph: bool | None = None,
                             progress: bool = True, stats: dict | None = None,
                             fingerprint: str | None = None, concurrent: int = 1,
                             compiled: bool = False) -> list[dict]:
  """-> a record (module docstring) per conversation that kept at least one generated turn, in
  input order. Conversations whose first prompt has max_prompt_tokens or more tokens are skipped
  and counted in `stats` (not fatal). fingerprint: target_fingerprint(model, tokenizer) when the
  caller has it already. concurrent: batches decoded at once, compiled: the target's forward
  through torch.compile (both `generation.generate_many`'s)."""
  _check_target(tokenizer)
  stop = eos_token_ids(model, tokenizer, required=True)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
  fingerprint = fingerprint or target_fingerprint(model, tokenizer)
  keys = [_key(c, fingerprint, settings) for c in conversations]
  cache = _read_cache(Path(cache_path)) if cache_path is not None else {}
  todo = [i for i, k in enumerate(keys) if k not in cache]
  counts = stats if stats is not None else {}
  counts.update(conversations=len(conversations), cached=len(conversations) - len(todo),
                skipped_long_prompt=0, cut_turns=0, closed_turns=0, generated_tokens=0,
                seconds=0.0)
  log.info("regenerate: %d conversations, %d cached, %d to generate (target %s)",
           len(conversations), counts["cached"], len(todo), fingerprint)
  out = {i: cache[k] for i, k in enumerate(keys) if k in cache}
  sink = open_jsonl_sink(Path(cache_path)) if cache_path is not None and todo else None
  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=len(todo), unit="conv", desc="regenerate", dynamic_ncols=True)
  gstats = generation.GenerationStats()
  t0 = time.perf_counter()
  gen = torch.Generator(device=next(model.parameters()).device).manual_seed(settings.seed)

  finished, last_log = 0, t0

  def finish(c: _Conv):
    nonlocal finished
    finished += 1
    if c.spans:
      rec = {"key": keys[c.index], "id": conversations[c.index]["id"], "target": fingerprint,
             "messages": c.messages[:_last_turn(c) + 1], "input_ids": c.ids,
             "assistant_spans": c.spans}
      out[c.index] = rec
      if sink is not None:
        sink.write(json.dumps(rec) + "\n")
        sink.flush()
    else:
      counts["skipped_long_prompt"] += 1
    if bar is not None:
      elapsed = time.perf_counter() - t0
      bar.update(1)
      bar.set_postfix(tok_s=f"{gstats.tokens / max(elapsed, 1e-9):.0f}", refresh=False)

  def on_batch(rows, tokens):
    nonlocal last_log
    now = time.perf_counter()
    if bar is not None:
      bar.set_postfix(tok_s=f"{gstats.tokens / max(now - t0, 1e-9):.0f}")
    elif now - last_log >= QUIET_PROGRESS_EVERY_S:   # no bar (--quiet, logs): a line instead
      last_log = now
      elapsed = max(now - t0, 1e-9)
      eta = (f", ETA ~{(len(todo) - finished) * elapsed / finished / 60:.0f} min"
             if finished else "")
      log.info("regenerate: %d of %d conversations finished, %d tokens, %.0f generated tokens/s, "
               "%.0f s%s", finished, len(todo), gstats.tokens, gstats.tokens / elapsed, elapsed,
               eta)

  try:
    # Turn by turn over all conversations: every conversation's next prompt is generated in one
    # generate_many call (length-sorted batches). The host's share (templates, tokenisation,
    # records) runs while the GPU decodes the next batch (generate_many decodes in worker
    # threads), and a conversation's next prompt is prepared as soon as its turn comes back.
    pending = []
    for i in todo:
      c = _start(i, conversations[i], settings)
      pending.append((c, _next_prompt(tokenizer, c, settings)))
    while pending:
      prompts, waiting = [], []
      for c, p in pending:
        if p is None:
          finish(c)
        else:
          prompts.append(p)
          waiting.append(c)
      pending = []
      results = generation.generate_many(
          model, [p[0] for p in prompts], max_new_tokens=settings.max_new_tokens, stop_ids=stop,
          pad_id=pad, max_rows=batch_rows, max_tokens=batch_tokens,
          temperature=settings.temperature, generator=gen, cuda_graph=cuda_graph, stats=gstats,
          on_batch=on_batch, concurrent=concurrent, compiled=compiled)
      for k, new in results:
        c, (prompt_ids, segment_text) = waiting[k], prompts[k]
        left = len(c.turns) - 1
        if _add_turn(tokenizer, c, prompt_ids, segment_text, new, stop, settings.close_cut_turns):
          pending.append((c, _next_prompt(tokenizer, c, settings)))
          counts["closed_turns"] += bool(new) and new[-1] not in stop
        else:
          counts["cut_turns"] += left
          finish(c)
  finally:
    if sink is not None:
      sink.close()
    if bar is not None:
      bar.close()
    counts.update(generated_tokens=gstats.tokens, seconds=time.perf_counter() - t0,
                  decode_steps=gstats.decode_steps, batches=gstats.batches,
                  cuda_graph=gstats.cuda_graph)
  if gstats.tokens:
    log.info("regenerate: %d tokens in %.1f s (%.0f generated tokens/s, %d batches, cuda graph %s)",
             gstats.tokens, counts["seconds"], gstats.tokens / max(counts["seconds"], 1e-9),
             gstats.batches, gstats.cuda_graph)
  if counts["skipped_long_prompt"]:
    log.warning("regenerate: skipped %d conversations whose first prompt has %s or more tokens",
                counts["skipped_long_prompt"], settings.max_prompt_tokens)
  return [out[i] for i in range(len(conversations)) if i in out]


def _start(index: int, conv: dict, settings: Settings) -> _Conv:
  messages = copy.deepcopy(conv["messages"])
  turns = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
  return _Conv(index, messages, turns[:settings.max_turns], [], [])


def _last_turn(c: _Conv) -> int:
  """Index of the last assistant message that was regenerated."""
  done = [j for j, m in enumerate(c.messages) if m["role"] == "assistant"][:len(c.spans)]
  return done[-1]


def _next_prompt(tokenizer, c: _Conv, settings: Settings):
  """-> (prompt ids, text of the new template segment) for the next turn, or None when done."""
  if not c.turns:
    return None
  text = tokenizer.apply_chat_template(c.messages[:c.turns[0]], tokenize=False,
                                       add_generation_prompt=True)
  if not text.startswith(c.rendered):   # the template re-renders earlier turns differently
    return None
  segment = text[len(c.rendered):]
  # Template text is tokenised per segment; each segment starts right after a special token (the
  # previous turn's end-of-turn), so BPE never merges across the cut.
  ids = c.ids + list(tokenizer(segment, add_special_tokens=False)["input_ids"])
  if settings.max_prompt_tokens is not None and len(ids) >= settings.max_prompt_tokens:
    return None
  return ids, text


def _add_turn(tokenizer, c: _Conv, prompt_ids, text, new: list[int], stop: set[int],
              close_cut: bool = False) -> bool:
  """Append a generated turn (exact ids). -> whether the conversation can continue. close_cut: a
  turn cut at max_new_tokens is closed with the template's end-of-turn token, which is appended
  after the span (not supervised: the target did not generate it)."""
  j = c.turns.pop(0)
  ended = bool(new) and new[-1] in stop
  content = tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=False)
  c.messages[j] = {**c.messages[j], "content": content}
  c.spans.append([len(prompt_ids), len(prompt_ids) + len(new)])
  c.ids = list(prompt_ids) + list(new)
  if not c.turns or not (ended or close_cut):
    c.turns = []  # a cut turn ends the conversation unless it may be closed
    return False
  full = tokenizer.apply_chat_template(c.messages[:j + 1], tokenize=False)
  if ended:
    end_id = new[-1]
  else:
    end_id = _end_of_turn_id(tokenizer, full, text + content, stop)
    if end_id is None:
      c.turns = []
      return False
    c.ids.append(end_id)
  # The text these ids render: the prompt's text, the content, then the stop token as text.
  c.rendered = text + content + tokenizer.decode([end_id], skip_special_tokens=False)
  if not full.startswith(c.rendered):  # e.g. a template that strips or rewrites assistant turns
    c.turns = []
    return False
  return True


def _end_of_turn_id(tokenizer, full: str, upto_content: str, stop: set[int]) -> int | None:
  """The stop token the template writes right after an assistant turn's content (e.g. SmolLM2's
  <|im_end|>), or None if the rendered turn does not continue with one."""
  if not full.startswith(upto_content):
    return None
  tail = full[len(upto_content):]
  for s in sorted(stop):
    if tail.startswith(tokenizer.decode([s], skip_special_tokens=False)):
      return s
  return None


def _check_target(tokenizer) -> None:
  if not getattr(tokenizer, "chat_template", None):
    name = getattr(tokenizer, "name_or_path", "the target")
    raise RegenerationError(f"tokenizer of {name} has no chat template, so prompts cannot be "
                            "rendered; use the chat/instruct variant of the target or set "
                            "tokenizer.chat_template")


def make_regenerator(model, tokenizer, settings: Settings, *, fingerprint: str | None = None,
                     **kwargs) -> tuple[Callable[[list[dict]], list[dict]], str]:
  """-> (fn, key) for `build_dataset(regenerate=fn, regenerate_key=key)`; kwargs as
  regenerate_conversations (cache_path, batch_rows, ...); fingerprint: the target's, if known."""
  fingerprint = fingerprint or target_fingerprint(model, tokenizer)
  key = regenerate_key(fingerprint, settings)
  return (lambda convs: regenerate_conversations(model, tokenizer, convs, settings,
                                                 fingerprint=fingerprint, **kwargs)), key


def cached_regenerator(tokenizer, settings: Settings, fingerprint: str, cache_path
                       ) -> tuple[Callable[[list[dict]], list[dict]], str]:
  """make_regenerator for a target whose model is not loaded (training from a feature cache):
  every record comes from `cache_path`, written earlier by the target of `fingerprint`. A
  conversation that regeneration would skip (its first prompt is too long) is skipped here too;
  any other one missing from the cache is an error."""
  def fn(convs: list[dict]) -> list[dict]:
    cache = _read_cache(Path(cache_path))
    out, missing = [], []
    for c in convs:
      k = _key(c, fingerprint, settings)
      if k in cache:
        out.append(cache[k])
      elif _next_prompt(tokenizer, _start(0, c, settings), settings) is not None:
        missing.append(c["id"])
    if missing:
      raise RegenerationError(
          f"{len(missing)} of {len(convs)} conversations (first: {missing[0]!r}) are not in the "
          f"regeneration cache {cache_path}, and the target's model is not loaded to generate "
          "them; rerun `python -m jax_drafter.cache_features` with this config")
    return out
  return fn, regenerate_key(fingerprint, settings)


def _key(conv: dict, fingerprint: str, settings: Settings) -> str:
  blob = json.dumps([conv["id"], conv["messages"], fingerprint, _settings_dict(settings)],
                    sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()


def open_jsonl_sink(path: Path):
  """An append-only JSONL cache (regenerated answers, synthetic prompts) opened for appending,
  after cutting a torn last line (kill -9 mid-write) so the next record starts on a line of its
  own. read_jsonl_cache reads such a file back."""
  path.parent.mkdir(parents=True, exist_ok=True)
  if path.is_file() and path.stat().st_size:
    with open(path, "rb+") as f:
      data = f.read()
      if not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        log.warning("%s ends in an incomplete line (interrupted write); removing its %d bytes",
                    path, len(data) - cut)
        f.truncate(cut)
  return open(path, "a", encoding="utf-8")


def read_jsonl_cache(path: Path, take: Callable[[dict], None], again: str) -> None:
  """Each record of an append-only JSONL cache to `take`; a line that does not parse or lacks
  what `take` reads (cut by an interrupted run) is skipped with a warning naming the file, the
  line and `again` (what is then made again)."""
  if not path.is_file():
    return
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      try:
        take(json.loads(line))
      except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        log.warning("%s line %d is incomplete; %s", path, n, again)


def _read_cache(path: Path) -> dict[str, dict]:
  cache = {}

  def take(record):
    cache[record["key"]] = {k: record[k] for k in ("key", "id", "target", "messages",
                                                   "input_ids", "assistant_spans")}
  read_jsonl_cache(path, take, "that conversation is generated again")
  return cache
