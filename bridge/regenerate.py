"""Regenerate the assistant turns of conversations with the frozen target (DESIGN data flow step 1).

DFlash trains the drafter on the target's own outputs: each assistant turn is replaced by what the
target generates given the conversation up to that turn (earlier turns already regenerated). Results
are cached as JSONL, one line per finished conversation, appended and flushed as soon as it is done:
a second run reuses them and an interrupted run resumes where it stopped.

Plugs into `jax_drafter.data.build_dataset(regenerate=..., regenerate_key=...)` through
`make_regenerator`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from bridge.target import eos_token_ids

log = logging.getLogger(__name__)


def target_fingerprint(model, tokenizer) -> str:
  """Hash of the target's config, tokenizer and a sample of every weight (cheap, tells random inits apart)."""
  h = hashlib.sha256()
  config = model.config.to_dict()
  config.pop("transformers_version", None)
  h.update(json.dumps(config, sort_keys=True, default=str).encode())
  h.update(f"{len(tokenizer)}|{tokenizer.chat_template}".encode())
  for name, p in model.named_parameters():
    h.update(name.encode())
    h.update(p.detach().reshape(-1)[:1024].float().cpu().numpy().tobytes())
  return h.hexdigest()[:16]


def generation_settings(*, max_new_tokens: int, temperature: float, seed: int,
                        max_prompt_tokens: int | None) -> dict:
  return {"max_new_tokens": max_new_tokens, "temperature": float(temperature), "seed": seed,
          "max_prompt_tokens": max_prompt_tokens}


def regenerate_conversations(model, tokenizer, conversations: Sequence[dict], *, max_new_tokens: int,
                             temperature: float = 0.0, cache_path: str | os.PathLike | None,
                             seed: int = 0, batch_size: int = 8, max_prompt_tokens: int | None = None,
                             progress: bool = True) -> list[dict]:
  """-> the conversations ({"id", "messages"}) with every assistant turn written by `model`.

  Greedy when temperature == 0 (sampled outputs depend on the batch composition). Conversations are
  batched with left padding, turn by turn. A turn whose prompt has max_prompt_tokens or more tokens
  ends the conversation there (the data pipeline truncates at seq_len anyway, so pass seq_len).
  Generated text is cut at the first end-of-turn/eos token and decoded with special tokens kept.
  """
  if max_new_tokens < 1:
    raise ValueError(f"{max_new_tokens=} must be >= 1")
  if temperature < 0:
    raise ValueError(f"{temperature=} must be >= 0 (0 = greedy)")
  settings = generation_settings(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                 max_prompt_tokens=max_prompt_tokens)
  fingerprint = target_fingerprint(model, tokenizer)
  keys = [_key(c, fingerprint, settings) for c in conversations]
  cache = _read_cache(Path(cache_path)) if cache_path is not None else {}
  todo = [i for i, k in enumerate(keys) if k not in cache]
  log.info("regenerate: %d conversations, %d cached, %d to generate (target %s)",
           len(conversations), len(conversations) - len(todo), len(todo), fingerprint)
  bar = tqdm(total=len(conversations), initial=len(conversations) - len(todo), unit="conv",
             desc="regenerate", disable=not progress)
  out = {i: {"id": conversations[i]["id"], "messages": cache[k]} for i, k in enumerate(keys) if k in cache}
  sink = None
  if cache_path is not None and todo:
    Path(cache_path).parent.mkdir(parents=True, exist_ok=True)
    sink = open(cache_path, "a", encoding="utf-8")
  try:
    for start in range(0, len(todo), batch_size):
      idx = todo[start:start + batch_size]
      if temperature > 0:
        torch.manual_seed(int(keys[idx[0]][:8], 16) ^ seed)
      for i, messages in _generate_batch(model, tokenizer, [conversations[i] for i in idx], idx,
                                         settings):
        out[i] = {"id": conversations[i]["id"], "messages": messages}
        if sink is not None:
          sink.write(json.dumps({"key": keys[i], **out[i]}) + "\n")
          sink.flush()
        bar.update(1)
        bar.set_postfix(generated=len(out) - (len(conversations) - len(todo)), refresh=False)
  finally:
    if sink is not None:
      sink.close()
    bar.close()
  return [out[i] for i in range(len(conversations))]


def make_regenerator(model, tokenizer, **kwargs) -> tuple[Callable[[list[dict]], list[dict]], str]:
  """-> (fn, key) for `build_dataset(regenerate=fn, regenerate_key=key)`; kwargs as regenerate_conversations."""
  settings = generation_settings(max_new_tokens=kwargs["max_new_tokens"],
                                 temperature=kwargs.get("temperature", 0.0), seed=kwargs.get("seed", 0),
                                 max_prompt_tokens=kwargs.get("max_prompt_tokens"))
  key = f"{target_fingerprint(model, tokenizer)}:{json.dumps(settings, sort_keys=True)}"
  return (lambda convs: regenerate_conversations(model, tokenizer, convs, **kwargs)), key


@torch.inference_mode()
def _generate_batch(model, tokenizer, convs: list[dict], idx: list[int], settings: dict):
  """Yields (index, regenerated messages) as each conversation of the batch finishes."""
  model.eval()
  msgs = [copy.deepcopy(c["messages"]) for c in convs]
  turns = [[j for j, m in enumerate(ms) if m["role"] == "assistant"] for ms in msgs]
  stop = eos_token_ids(model, tokenizer, required=True)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
  device = next(model.parameters()).device
  for t in range(max(map(len, turns))):
    active = [b for b in range(len(convs)) if t < len(turns[b])]
    if not active:
      break
    prompts = [tokenizer.apply_chat_template(msgs[b][:turns[b][t]], tokenize=False,
                                             add_generation_prompt=True) for b in active]
    enc = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    limit = settings["max_prompt_tokens"]
    keep = [k for k, seq in enumerate(enc) if limit is None or len(seq) < limit]
    for k in range(len(active)):
      if k not in keep:  # prompt too long: the conversation ends before this turn
        b = active[k]
        msgs[b], turns[b] = msgs[b][:turns[b][t]], turns[b][:t]
    if keep:
      width = max(len(enc[k]) for k in keep)
      ids = torch.full((len(keep), width), pad, dtype=torch.long)
      mask = torch.zeros((len(keep), width), dtype=torch.long)
      for row, k in enumerate(keep):  # left padding: every prompt ends where generation starts
        ids[row, width - len(enc[k]):] = torch.tensor(enc[k])
        mask[row, width - len(enc[k]):] = 1
      ids, mask = ids.to(device), mask.to(device)
      sample = settings["temperature"] > 0
      gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings["max_new_tokens"],
                           do_sample=sample, temperature=settings["temperature"] if sample else None,
                           top_k=0 if sample else None, top_p=1.0 if sample else None,
                           pad_token_id=pad, eos_token_id=sorted(stop))
      for k, seq in zip(keep, gen[:, ids.shape[1]:].tolist()):
        cut = next((n for n, tok in enumerate(seq) if tok in stop), len(seq))
        b = active[k]
        msgs[b][turns[b][t]]["content"] = tokenizer.decode(seq[:cut], skip_special_tokens=False)
    for b in active:
      if len(turns[b]) <= t + 1:  # its last turn is done (or it was cut before this one)
        yield idx[b], _finish(msgs[b], convs[b]["id"])


def _finish(messages: list[dict], cid: str) -> list[dict]:
  while messages and messages[-1]["role"] != "assistant":
    messages.pop()
  if not messages:
    log.warning("regenerate: conversation %s lost all its turns to max_prompt_tokens", cid)
  return messages


def _key(conv: dict, fingerprint: str, settings: dict) -> str:
  blob = json.dumps([conv["id"], conv["messages"], fingerprint, settings], sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()


def _read_cache(path: Path) -> dict[str, list[dict]]:
  cache = {}
  if not path.is_file():
    return cache
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      try:
        record = json.loads(line)
        cache[record["key"]] = record["messages"]
      except (json.JSONDecodeError, KeyError, TypeError):  # a line cut by an interrupted run
        log.warning("regenerate: %s line %d is incomplete; that conversation is generated again", path, n)
  return cache
