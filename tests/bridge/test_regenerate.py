"""Regeneration of assistant turns by the target: exact ids, greedy equality, cache, resume."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from bridge import generation
from bridge import regenerate as rg

MAX_NEW = 6


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
  return smollm2_tokenizer


@pytest.fixture(scope="module")
def model(tok):
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)
  return LlamaForCausalLM(config).eval()


CONVS = [
    {"id": "one", "messages": [{"role": "user", "content": "Hello"},
                               {"role": "assistant", "content": "old answer"}]},
    {"id": "two", "messages": [{"role": "system", "content": "Be brief and precise."},
                               {"role": "user", "content": "Name a prime number larger than ten."},
                               {"role": "assistant", "content": "old"},
                               {"role": "user", "content": "Another?"},
                               {"role": "assistant", "content": "old too"}]},
    {"id": "three", "messages": [{"role": "user", "content": "x"},
                                 {"role": "assistant", "content": "y"}]},
]


def _greedy(model, prompt_ids, stop, max_new=MAX_NEW):
  """transformers' greedy generate on one unpadded prompt: what every generated span must be."""
  ids = torch.tensor([list(prompt_ids)])
  out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                       do_sample=False, eos_token_id=sorted(stop), pad_token_id=2)[0, ids.shape[1]:]
  row = out.tolist()
  return row[:next((n + 1 for n, t in enumerate(row) if t in stop), len(row))]


def _settings(**kw):
  return rg.Settings(max_new_tokens=kw.pop("max_new_tokens", MAX_NEW), **kw)


def _turns_of_two_tokens(tok, monkeypatch):
  """The random model rarely emits eos: each turn becomes its first 2 greedy tokens + eos (the
  end-of-turn token the template expects), so multi-turn conversations continue."""
  real = generation.generate_many

  def gm(model_, prompts, **kw):
    kw["max_new_tokens"] = 2
    for i, new in real(model_, prompts, **kw):
      yield i, new[:2] + [tok.eos_token_id]

  monkeypatch.setattr(generation, "generate_many", gm)


def test_records_hold_the_exact_greedy_ids(model, tok, tmp_path):
  recs = rg.regenerate_conversations(model, tok, CONVS, _settings(), cache_path=None, progress=False)
  stop = {tok.eos_token_id}
  assert [r["id"] for r in recs] == ["one", "two", "three"]
  for rec, conv in zip(recs, CONVS):
    # The first prompt is the chat template rendered and tokenised as the data pipeline does.
    first = conv["messages"][:next(j for j, m in enumerate(conv["messages"])
                                   if m["role"] == "assistant")]
    prompt = tok(tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    a, b = rec["assistant_spans"][0]
    assert rec["input_ids"][:a] == prompt
    assert rec["input_ids"][a:b] == _greedy(model, prompt, stop)
    assert rec["messages"][len(first)]["role"] == "assistant"
    assert rec["messages"][len(first)]["content"] != conv["messages"][len(first)]["content"]


def test_multi_turn_continues_from_the_exact_ids(model, tok, monkeypatch):
  _turns_of_two_tokens(tok, monkeypatch)
  rec = rg.regenerate_conversations(model, tok, CONVS[1:2], _settings(), cache_path=None,
                                    progress=False)[0]
  assert len(rec["assistant_spans"]) == 2
  for a, b in rec["assistant_spans"]:  # each turn is the greedy output given the exact ids before it
    assert rec["input_ids"][a:b] == _greedy(model, rec["input_ids"][:a], set(), 2) + [tok.eos_token_id]
  # Between the turns: the template's text (end of turn, the user turn, the generation prompt).
  (_, b0), (a1, _) = rec["assistant_spans"]
  segment = tok.decode(rec["input_ids"][b0:a1])
  assert "Another?" in segment and segment.endswith("assistant\n")
  full = tok.apply_chat_template(rec["messages"], tokenize=False)
  assert full.startswith(tok.decode(rec["input_ids"])) and not full[len(tok.decode(rec["input_ids"])):].strip()
  assert rg.regenerate_conversations(model, tok, CONVS[1:2], _settings(max_turns=1),
                                     cache_path=None, progress=False)[0]["assistant_spans"] == \
      rec["assistant_spans"][:1]


def test_cut_turns_end_the_conversation_or_are_closed_and_continued(model, tok, monkeypatch):
  """A turn that reaches max_new_tokens unfinished ends its conversation (default); with
  close_cut_turns it is closed with the template's end-of-turn token, appended outside the loss
  mask (the target did not write it), and the next turn is the greedy output given those ids."""
  stop = {tok.eos_token_id}
  plain = rg.regenerate_conversations(model, tok, CONVS[1:2], _settings(max_new_tokens=2),
                                      cache_path=None, progress=False, stats=(counts := {}))[0]
  cut = plain["input_ids"][slice(*plain["assistant_spans"][0])]
  assert cut[-1] not in stop and len(cut) == 2      # the random model's 2 tokens: no stop token
  assert len(plain["assistant_spans"]) == 1 and counts["cut_turns"] == 1

  rec = rg.regenerate_conversations(model, tok, CONVS[1:2],
                                    _settings(max_new_tokens=2, close_cut_turns=True),
                                    cache_path=None, progress=False, stats=(counts := {}))[0]
  (a0, b0), (a1, b1) = rec["assistant_spans"]
  assert rec["input_ids"][:b0] == plain["input_ids"]
  assert rec["input_ids"][b0] == tok.eos_token_id    # the closing token, outside both spans
  assert rec["input_ids"][a1:b1] == _greedy(model, rec["input_ids"][:a1], stop, 2)
  # The first turn was closed; the last one is cut too, but nothing follows it to continue.
  assert counts["closed_turns"] == 1 and counts["cut_turns"] == 0
  assert rec["input_ids"][-1] != tok.eos_token_id
  # The ids are the template's rendering of the record's messages (prefix-stable, nothing re-encoded).
  full = tok.apply_chat_template(rec["messages"], tokenize=False)
  assert full.startswith(tok.decode(rec["input_ids"]))
  assert "Another?" in tok.decode(rec["input_ids"][b0:a1])
  # Different settings, different records: the cache keys tell them apart; records made before
  # the setting existed keep their keys.
  conv = CONVS[1]
  assert rg._key(conv, "fp", _settings()) != rg._key(conv, "fp", _settings(close_cut_turns=True))
  assert "close_cut_turns" not in rg.regenerate_key("fp", _settings())


def test_generated_ids_are_kept_even_when_text_would_re_encode_differently(model, tok, monkeypatch):
  """SmolLM2's "\\n\\n" is one token (1116) that re-encodes as two "\\n" (198): ids must survive."""
  answer = [1116, tok("Hi", add_special_tokens=False)["input_ids"][0], tok.eos_token_id]

  def fake(model_, prompts, **kw):
    for i in range(len(prompts)):
      yield i, list(answer)

  monkeypatch.setattr(generation, "generate_many", fake)
  rec = rg.regenerate_conversations(model, tok, CONVS[:1], _settings(), cache_path=None,
                                    progress=False)[0]
  a, b = rec["assistant_spans"][0]
  assert rec["input_ids"][a:b] == answer
  text = tok.apply_chat_template(rec["messages"], tokenize=False)
  assert tok(text, add_special_tokens=False)["input_ids"][a:b] != answer  # the text round trip drifts


def test_cache_is_reused_and_keyed_by_settings(model, tok, tmp_path, monkeypatch):
  cache = tmp_path / "regen.jsonl"
  first = rg.regenerate_conversations(model, tok, CONVS, _settings(), cache_path=cache,
                                      progress=False)
  assert len(cache.read_text().splitlines()) == 3
  calls = []
  real = generation.generate_many
  monkeypatch.setattr(generation, "generate_many",
                      lambda m, p, **kw: (calls.append(len(p)), (yield from real(m, p, **kw)))[1])
  assert rg.regenerate_conversations(model, tok, CONVS, _settings(), cache_path=cache,
                                     progress=False) == first
  assert calls == []
  rg.regenerate_conversations(model, tok, CONVS[:1], _settings(max_new_tokens=MAX_NEW + 1),
                              cache_path=cache, progress=False)
  assert calls == [1]


def test_interrupted_run_resumes_without_duplicates_or_torn_lines(model, tok, tmp_path, monkeypatch):
  cache = tmp_path / "regen.jsonl"
  settings = _settings(max_turns=1)
  reference = rg.regenerate_conversations(model, tok, CONVS, settings, cache_path=None,
                                          progress=False)
  real = generation.generate_many

  def dies_after_one(m, prompts, **kw):
    for n, item in enumerate(real(m, prompts, **dict(kw, max_rows=1))):
      if n == 1:
        raise KeyboardInterrupt
      yield item

  monkeypatch.setattr(generation, "generate_many", dies_after_one)
  with pytest.raises(KeyboardInterrupt):
    rg.regenerate_conversations(model, tok, CONVS, settings, cache_path=cache, progress=False)
  assert len(cache.read_text().splitlines()) == 1
  with open(cache, "a") as f:
    f.write('{"key": "abc", "id": "thr')  # kill -9 in the middle of a write
  monkeypatch.setattr(generation, "generate_many", real)
  resumed = rg.regenerate_conversations(model, tok, CONVS, settings, cache_path=cache,
                                        progress=False)
  assert resumed == reference
  lines = [json.loads(line) for line in cache.read_text().splitlines()]  # every line parses
  assert sorted(r["id"] for r in lines) == ["one", "three", "two"]


def test_long_prompts_are_skipped_and_counted(model, tok):
  first = lambda c: c["messages"][:next(j for j, m in enumerate(c["messages"])
                                        if m["role"] == "assistant")]
  lens = [len(tok(tok.apply_chat_template(first(c), tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]) for c in CONVS]
  limit = min(lens) + 1
  keep = [c["id"] for c, n in zip(CONVS, lens) if n < limit]
  assert 0 < len(keep) < len(CONVS)
  stats = {}
  recs = rg.regenerate_conversations(model, tok, CONVS, _settings(max_prompt_tokens=limit),
                                     cache_path=None, progress=False, stats=stats)
  assert [r["id"] for r in recs] == keep
  assert stats["skipped_long_prompt"] == len(CONVS) - len(keep)


def test_target_without_chat_template_or_eos_is_a_one_line_error(model, tok):
  import copy
  bare = copy.deepcopy(tok)
  bare.chat_template = None
  with pytest.raises(rg.RegenerationError, match="no chat template"):
    rg.regenerate_conversations(model, bare, CONVS, _settings(), cache_path=None, progress=False)
  no_eos = copy.deepcopy(model)
  no_eos.generation_config.eos_token_id = None
  tok2 = copy.deepcopy(tok)
  tok2.eos_token = None
  with pytest.raises(ValueError, match="eos"):
    rg.regenerate_conversations(no_eos, tok2, CONVS, _settings(), cache_path=None, progress=False)


def test_fingerprint_tells_models_apart(model, tok):
  from transformers import LlamaForCausalLM
  torch.manual_seed(1)
  other = LlamaForCausalLM(model.config)
  assert rg.target_fingerprint(model, tok) == rg.target_fingerprint(model, tok)
  assert rg.target_fingerprint(model, tok) != rg.target_fingerprint(other, tok)


def test_regenerated_ids_reach_the_packed_rows(model, tok, tmp_path, sharegpt_sample):
  from jax_drafter import data
  fn, key = rg.make_regenerator(model, tok, _settings(max_turns=1), cache_path=None, progress=False)
  assert key.startswith(rg.target_fingerprint(model, tok))
  ds = data.build_dataset(tok, sharegpt_sample, 256, max_conversations=4, held_out=1,
                          regenerate=fn, regenerate_key=key, cache_dir=None)
  recs = fn(data.split_held_out(data.load_conversations(sharegpt_sample, max_conversations=4),
                                1, 0)[0])
  rows, masks = ds.rows["input_ids"].tolist(), ds.rows["loss_mask"].tolist()
  for r in recs:  # each record's exact ids and mask sit contiguously in one packed row
    ids, n = r["input_ids"][:256], min(len(r["input_ids"]), 256)
    mask = [0] * n
    for a, b in r["assistant_spans"]:
      mask[a:min(b, n)] = [1] * (min(b, n) - a)
    if sum(mask[i] and mask[i + 1] for i in range(n - 1)) == 0:
      continue  # no anchor: dropped by packing
    hits = [(row, off) for row in range(len(rows)) for off in range(257 - n)
            if rows[row][off:off + n] == ids and masks[row][off:off + n] == mask]
    assert hits, r["id"]
  assert ds.stats["train_conversations"] == len(recs)



def test_without_a_progress_bar_the_log_shows_progress(model, tok, monkeypatch, caplog):
  """progress=False (the CLIs' --quiet, logs to a file): a log line with the conversations
  finished, the tokens and tokens/s instead of the bar, at most every QUIET_PROGRESS_EVERY_S."""
  import logging
  monkeypatch.setattr(rg, "QUIET_PROGRESS_EVERY_S", 0.0)
  with caplog.at_level(logging.INFO, logger="bridge.regenerate"):
    rg.regenerate_conversations(model, tok, CONVS, _settings(), cache_path=None, progress=False,
                                batch_rows=1)
  lines = [r.getMessage() for r in caplog.records if "conversations finished" in r.getMessage()]
  assert lines and "generated tokens/s" in lines[-1] and f"of {len(CONVS)} conversations" in lines[-1]
  caplog.clear()
  monkeypatch.setattr(rg, "QUIET_PROGRESS_EVERY_S", 3600.0)
  with caplog.at_level(logging.INFO, logger="bridge.regenerate"):
    rg.regenerate_conversations(model, tok, CONVS, _settings(), cache_path=None, progress=False,
                                batch_rows=1)
  assert not [r for r in caplog.records if "conversations finished" in r.getMessage()]
