"""bridge.synthetic_prompts with the real SmolLM2 target on the CPU: user messages the target
writes itself, complete and distinct, cached per chunk and resumed after a torn write."""

import json

import pytest

from bridge import generation
from bridge import synthetic_prompts as sp
from bridge.regenerate import RegenerationError


def test_user_prefix_is_the_template_up_to_a_user_message(smollm2_target):
  tok = smollm2_target.tokenizer
  text = tok.decode(sp.user_prefix(tok))
  assert text.endswith("<|im_start|>user\n") and text.startswith("<|im_start|>system\n")


def test_sampled_prompts_are_complete_distinct_and_cached(smollm2_target, tmp_path, monkeypatch):
  model, tok = smollm2_target.model, smollm2_target.tokenizer
  cache = str(tmp_path / "synthetic_prompts.jsonl")
  s = sp.PromptSettings(count=6, max_new_tokens=48, temperature=1.0, seed=3, chunk=4)
  convs = sp.synthesize(model, tok, s, fingerprint="fp", cache_path=cache, progress=False)
  assert 1 <= len(convs) <= 6
  texts = [c["messages"][0]["content"] for c in convs]
  assert all(t and t == t.strip() and "<|im_end|>" not in t for t in texts)
  assert len(set(texts)) == len(texts) and len({c["id"] for c in convs}) == len(convs)
  assert all(c["messages"][1] == {"role": "assistant", "content": ""} for c in convs)
  lines = open(cache).read().splitlines()
  assert [json.loads(x)["start"] for x in lines] == [0, 4]
  # Read back without sampling, with the target or without it.
  def no_sampling(*a, **k):
    raise AssertionError("sampled again")
  monkeypatch.setattr(generation, "generate_many", no_sampling)
  assert sp.synthesize(model, tok, s, fingerprint="fp", cache_path=cache, progress=False) == convs
  assert sp.cached(s, fingerprint="fp", cache_path=cache) == convs
  with pytest.raises(RegenerationError, match="lacks 2 chunks"):
    sp.cached(s, fingerprint="other target", cache_path=cache)
  monkeypatch.undo()
  # A kill -9 tore the second chunk's line: only that chunk is sampled again, to the same texts
  # (each chunk draws from its own seeded generator).
  with open(cache, "w") as f:
    f.write(lines[0] + "\n" + lines[1][:len(lines[1]) // 2])
  sampled = []
  real = generation.generate_many
  monkeypatch.setattr(generation, "generate_many",
                      lambda model, prompts, **k: (sampled.append(len(prompts)),
                                                   real(model, prompts, **k))[1])
  assert sp.synthesize(model, tok, s, fingerprint="fp", cache_path=cache, progress=False) == convs
  assert sampled == [2]
  assert [json.loads(x)["start"] for x in open(cache).read().splitlines()] == [0, 4]


def test_messages_cut_at_the_limit_are_dropped(smollm2_target, tmp_path):
  s = sp.PromptSettings(count=4, max_new_tokens=2, temperature=1.0, seed=0, chunk=4)
  convs = sp.synthesize(smollm2_target.model, smollm2_target.tokenizer, s, fingerprint="fp",
                        cache_path=str(tmp_path / "c.jsonl"), progress=False)
  record = json.loads(open(tmp_path / "c.jsonl").read())
  # A 2-token message is complete only if its second token ends the turn.
  assert len(convs) == sum(t is not None for t in record["texts"]) <= 4
  assert all(len(c["messages"][0]["content"].split()) <= 2 for c in convs)


def test_a_tokenizer_without_a_chat_template_is_refused():
  class NoTemplate:
    chat_template = None
  with pytest.raises(RegenerationError, match="no chat template"):
    sp.user_prefix(NoTemplate())


def test_more_prompts_sample_only_the_chunks_after_the_cached_ones(smollm2_target, tmp_path,
                                                                    monkeypatch):
  model, tok = smollm2_target.model, smollm2_target.tokenizer
  cache = str(tmp_path / "synthetic_prompts.jsonl")
  small = sp.PromptSettings(count=6, max_new_tokens=24, temperature=1.0, seed=5, chunk=4)
  big = sp.PromptSettings(count=12, max_new_tokens=24, temperature=1.0, seed=5, chunk=4)
  sp.synthesize(model, tok, small, fingerprint="fp", cache_path=cache, progress=False)
  sampled = []
  real = generation.generate_many
  monkeypatch.setattr(generation, "generate_many",
                      lambda model, prompts, **k: (sampled.append(len(prompts)),
                                                   real(model, prompts, **k))[1])
  grown = sp.synthesize(model, tok, big, fingerprint="fp", cache_path=cache, progress=False)
  # Chunk 0 is reused; the partial chunk at 4 (2 rows for count 6) is sampled again whole, then 8.
  assert sampled == [4, 4]
  fresh = sp.synthesize(model, tok, big, fingerprint="fp", cache_path=str(tmp_path / "new.jsonl"),
                        progress=False)
  assert grown == fresh
  # A cache written before the count left the key (its records keyed by prompts_key) is read too.
  legacy = tmp_path / "legacy.jsonl"
  with open(legacy, "w") as f:
    for line in open(tmp_path / "new.jsonl"):
      record = json.loads(line)
      record["key"] = sp.prompts_key("fp", big)
      f.write(json.dumps(record) + "\n")
  sampled.clear()
  assert sp.synthesize(model, tok, big, fingerprint="fp", cache_path=str(legacy),
                       progress=False) == fresh
  assert sampled == []
  eight = sp.PromptSettings(count=8, max_new_tokens=24, temperature=1.0, seed=5, chunk=4)
  assert sp.cached(eight, fingerprint="fp", cache_path=str(legacy)) == sp.cached(
      eight, fingerprint="fp", cache_path=str(tmp_path / "new.jsonl"))
  # Other settings (another seed) share nothing.
  with pytest.raises(RegenerationError, match="lacks 3 chunks"):
    sp.cached(sp.PromptSettings(count=12, max_new_tokens=24, temperature=1.0, seed=6, chunk=4),
              fingerprint="fp", cache_path=cache)
