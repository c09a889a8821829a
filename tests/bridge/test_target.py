"""The frozen target: layer capture, early stop, document isolation in packed rows, bad input."""

import pytest
import torch

from bridge.target import (TargetError, check_mask_token_id, choose_mask_token_id,
                           load_target)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
  return load_target(tiny_target_dir, device="cpu")


def test_capture_equals_hidden_states_of_a_plain_forward(tiny):
  ids = torch.randint(0, 1000, (2, 10))
  pos = torch.arange(10).repeat(2, 1)
  doc = torch.zeros(2, 10, dtype=torch.long)
  f = tiny.features(ids, pos, doc, [0, 2])
  with torch.inference_mode():
    hs = tiny.model(ids, output_hidden_states=True).hidden_states
  torch.testing.assert_close(f, torch.cat([hs[1], hs[3]], -1))   # hidden_states[l+1] = layer l out
  assert f.is_contiguous() and f.shape == (2, 10, 64)


def test_final_norm_index_captures_the_lm_heads_input(tiny):
  """The distillation teacher: the state captured under final_norm_index times the LM head are the
  target's own logits; the other layers are captured alongside as usual."""
  ids = torch.randint(0, 1000, (2, 9))
  pos = torch.arange(9).repeat(2, 1)
  L = tiny.final_norm_index
  assert L == tiny.info.num_layers == 4
  f = tiny.features(ids, pos, torch.zeros(2, 9, dtype=torch.long), [1, L])
  with torch.inference_mode():
    out = tiny.model(ids, output_hidden_states=True)
  H = tiny.info.hidden_size
  torch.testing.assert_close(f[..., :H], out.hidden_states[2])
  torch.testing.assert_close(f[..., H:] @ tiny.lm_head.T, out.logits, rtol=1e-5, atol=1e-5)
  with pytest.raises(TargetError, match=r"target layer id 5 is out of range.*or 4 for the final "
                                        r"norm's output"):
    tiny.features(ids, pos, torch.zeros(2, 9, dtype=torch.long), [L + 1])


def test_layers_above_the_last_needed_one_never_run(tiny):
  ran = []
  hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
           for i, layer in enumerate(tiny.layers)]
  try:
    tiny.features(torch.randint(0, 1000, (1, 6)), torch.arange(6)[None],
                  torch.zeros(1, 6, dtype=torch.long), [1])
  finally:
    for h in hooks:
      h.remove()
  assert ran == [0, 1]


def test_packed_documents_never_see_each_other(tiny):
  a, b = torch.randint(0, 1000, (1, 7)), torch.randint(0, 1000, (1, 5))
  ids = torch.cat([a, b], 1)
  doc = torch.tensor([[0] * 7 + [1] * 5])
  pos = torch.tensor([list(range(7)) + list(range(5))])
  packed = tiny.features(ids, pos, doc, [0, 3])
  alone_a = tiny.features(a, torch.arange(7)[None], torch.zeros(1, 7, dtype=torch.long), [0, 3])
  alone_b = tiny.features(b, torch.arange(5)[None], torch.zeros(1, 5, dtype=torch.long), [0, 3])
  torch.testing.assert_close(packed[:, :7], alone_a, rtol=1e-5, atol=1e-5)
  torch.testing.assert_close(packed[:, 7:], alone_b, rtol=1e-5, atol=1e-5)


def test_flex_document_attention_equals_the_dense_mask(tiny_target_dir):
  """target.attention: flex (bridge/document_attention.py) gives the features of the dense-mask
  path on packed rows: documents of several lengths (one of a single token), a row of one
  document, padding at the end; and it leaves the model's own attention as it found it."""
  flex = load_target(tiny_target_dir, device="cpu", packed_attention="flex")
  dense = load_target(tiny_target_dir, device="cpu")
  g = torch.Generator().manual_seed(1)
  S = 150                                       # not a multiple of flex's 128-token tiles
  ids = torch.randint(0, 1000, (3, S), generator=g)
  docs = [[70, 1, 40, 39], [150], [100, 30, 20]]  # row 2: the last 20 tokens are padding
  doc, pos = torch.zeros(3, S, dtype=torch.long), torch.zeros(3, S, dtype=torch.long)
  for r, lengths in enumerate(docs):
    s0 = 0
    for d, n in enumerate(lengths):
      doc[r, s0:s0 + n], pos[r, s0:s0 + n] = d, torch.arange(n)
      s0 += n
  for layers in ([0, 3], [1, flex.final_norm_index]):
    torch.testing.assert_close(flex.features(ids, pos, doc, layers),
                               dense.features(ids, pos, doc, layers), rtol=1e-5, atol=1e-5)
  assert flex.model.config._attn_implementation == dense.model.config._attn_implementation
  alone = dense.features(ids[:1, 71:111], torch.arange(40)[None], torch.zeros(1, 40, dtype=torch.long), [3])
  torch.testing.assert_close(flex.features(ids, pos, doc, [3])[:1, 71:111], alone,
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(TargetError, match="target.attention='dense' must be one of"):
    load_target(tiny_target_dir, device="cpu", packed_attention="dense")


def test_layer_ids_out_of_range(tiny):
  with pytest.raises(TargetError, match="target layer id 4 is out of range.*4 decoder layers"):
    tiny.check_layer_ids([1, 4])
  with pytest.raises(TargetError) as e:   # without distillation the final norm's id is not offered
    tiny.check_layer_ids([4])
  assert "final norm" not in str(e.value)


def test_mask_token_checks(tiny):
  m = choose_mask_token_id(tiny)
  check_mask_token_id(tiny, m)
  tok = tiny.tokenizer
  assert m not in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)
  assert tok.convert_ids_to_tokens(m) not in (tok.chat_template or "")
  with pytest.raises(TargetError, match="outside the target's embedding"):
    check_mask_token_id(tiny, tiny.info.vocab_size)
  word = tok.convert_tokens_to_ids(tok.tokenize("hello")[0])
  with pytest.raises(TargetError, match="is a token the target emits"):
    check_mask_token_id(tiny, word)


def test_missing_target_directory_is_a_clear_error(tmp_path):
  with pytest.raises(TargetError, match="not a directory"):
    load_target(str(tmp_path / "nope"))
  with pytest.raises(TargetError, match="no config.json"):
    load_target(str(tmp_path))


def test_feature_cache_equals_the_target_and_runs_each_row_once(tiny, monkeypatch):
  import numpy as np
  from bridge.target import FeatureCache
  rng = np.random.default_rng(0)
  rows = [{"input_ids": rng.integers(0, 1000, (2, 9)).astype(np.int32),
           "position_ids": np.tile(np.arange(9, dtype=np.int32), (2, 1)),
           "doc_id": np.zeros((2, 9), np.int32)} for _ in range(3)]
  ref = [tiny.stacked_features([m], [0, 2]) for m in rows]
  calls = []
  real = tiny.features
  monkeypatch.setattr(tiny, "features", lambda *a: (calls.append(len(a[0])), real(*a))[1])
  cache = FeatureCache(tiny, max_bytes=1 << 30)
  for _ in range(2):  # two epochs over the same rows: the target runs in the first only
    for m, r in zip(rows, ref):
      torch.testing.assert_close(cache.stacked_features([m], [0, 2]), r, rtol=1e-5, atol=1e-6)
  assert calls == [2, 2, 2] and cache.hits == 6 and cache.misses == 6
  # Another position or document layout is another key; a full cache still answers correctly.
  other = dict(rows[0], doc_id=np.array([[0] * 4 + [1] * 5] * 2, np.int32))
  small = FeatureCache(tiny, max_bytes=0)
  torch.testing.assert_close(small.stacked_features([other], [0, 2]),
                             tiny.stacked_features([other], [0, 2]))
  assert small.full and not small.rows


def test_feature_cache_leaves_the_device_memory_it_was_not_given(tiny):
  """On a GPU the cache stops growing once less than its reserve of device memory is free, even
  below max_bytes (the drafter's allocator shares the device); the rows it does not keep still
  come out right."""
  import numpy as np
  from bridge.target import FeatureCache
  rng = np.random.default_rng(1)
  rows = [{"input_ids": rng.integers(0, 1000, (2, 9)).astype(np.int32),
           "position_ids": np.tile(np.arange(9, dtype=np.int32), (2, 1)),
           "doc_id": np.zeros((2, 9), np.int32)} for _ in range(3)]
  row_bytes = tiny.stacked_features([rows[0]], [0, 2])[0, 0].nbytes
  total = 100 * row_bytes
  free = {"bytes": 13 * row_bytes}       # 10% (10 rows' worth) must stay free: room for 3 rows

  def probe():
    return free["bytes"], total

  cache = FeatureCache(tiny, max_bytes=1 << 30, free_memory=probe)
  out = []
  for m in rows:
    out.append(cache.stacked_features([m], [0, 2]))
    free["bytes"] -= 2 * row_bytes       # what the kept rows took
  assert len(cache.rows) == 3 and cache.full     # 2 rows, then 1, then no room
  for m, o in zip(rows, out):
    torch.testing.assert_close(o, tiny.stacked_features([m], [0, 2]))
    torch.testing.assert_close(cache.stacked_features([m], [0, 2]), o)


def test_feature_cache_host_tier_takes_the_rows_the_device_tier_cannot(tiny, monkeypatch):
  """Rows past the device tier go to the host tier (until it is full or the machine's available
  memory reaches the reserve); both tiers answer with the target's own features, the target runs
  only the rows in neither, and the counters say which tier answered."""
  import numpy as np
  from bridge.target import FeatureCache
  rng = np.random.default_rng(2)
  rows = [{"input_ids": rng.integers(0, 1000, (1, 9)).astype(np.int32),
           "position_ids": np.arange(9, dtype=np.int32)[None],
           "doc_id": np.zeros((1, 9), np.int32)} for _ in range(5)]
  ref = [tiny.stacked_features([m], [0, 2]) for m in rows]
  row_bytes = ref[0][0, 0].nbytes
  calls = []
  real = tiny.features
  monkeypatch.setattr(tiny, "features", lambda *a: (calls.append(len(a[0])), real(*a))[1])
  cache = FeatureCache(tiny, max_bytes=1 * row_bytes, host_bytes=3 * row_bytes,
                       host_free_memory=lambda: (1000 * row_bytes, 1000 * row_bytes))
  for epoch in range(2):
    for m, r in zip(rows, ref):
      torch.testing.assert_close(cache.stacked_features([m], [0, 2]), r, rtol=1e-5, atol=1e-6)
  assert len(cache.rows) == 1 and len(cache.host_rows) == 3 and cache.full and cache.host_full
  assert cache.bytes == row_bytes and cache.host_bytes == 3 * row_bytes
  assert calls == [1] * 5 + [1]               # epoch 2 runs the target for the fifth row only
  assert (cache.hits, cache.host_hits, cache.misses) == (4, 3, 6)
  assert cache.describe().endswith("rows served so far: 1 from the device, 3 from host memory, "
                                   "6 by the target")
  assert cache.describe().startswith("1 rows on the device (0.00 GiB), 3 in host memory")
  assert all(not t.is_pinned() for t in cache.host_rows.values())   # a CPU target: no pinning
  # The machine's available memory at the reserve: the host tier stops below its own limit.
  # 10% of 1000 rows' worth stays available; the machine has 101 rows' worth, less what it keeps.
  # Checked before each slab (one row each here): the second would leave 99 rows' worth.
  low = FeatureCache(tiny, max_bytes=0, host_bytes=10 * row_bytes, host_slab_bytes=row_bytes)
  low.host_free_memory = lambda: (101 * row_bytes - low._slabs.allocated, 1000 * row_bytes)
  for m, r in zip(rows, ref):
    torch.testing.assert_close(low.stacked_features([m], [0, 2]), r, rtol=1e-5, atol=1e-6)
  assert len(low.host_rows) == 1 and low.host_full and not low.rows
  assert low._slabs.allocated == row_bytes


def test_config_numbers_read_through_float32_are_written_as_decimals():
  import numpy as np
  from bridge.target import _decimal
  assert float(np.float32(1e-5)) == 9.999999747378752e-06
  assert _decimal(float(np.float32(1e-5))) == 1e-05          # GGUF's rms_norm_eps, 1e-05 again
  assert _decimal(1e-6) == 1e-6 and _decimal(100000.0) == 100000.0
  assert _decimal(0.1) == 0.1                                # not a float32 value: left as it is


def test_host_slabs_hand_out_disjoint_rows_and_pin_ahead():
  """Rows come from slabs, never overlapping, each keeping what was written to it; the next slab
  is requested as soon as one starts filling; slabs stop at the limit, at a refusal of room (its
  reason kept), and where the last, smaller slab cannot hold a row."""
  from bridge.target import _HostSlabs
  row = (4, 4)                                    # 64 bytes of float32: 2 rows a 128-byte slab
  slabs = _HostSlabs(limit=320, slab_bytes=128, pin=False)
  got = []
  for i in range(6):
    t = slabs.take(row, torch.float32)
    if t is None:
      break
    t.copy_(torch.full(row, float(i)))
    got.append(t)
    if i == 0:
      assert slabs._next is not None and slabs.allocated == 256   # the second slab, ahead
  assert len(got) == 5 and [s.numel() for s in slabs.slabs] == [128, 128, 64]
  assert all(bool((t == i).all()) for i, t in enumerate(got))     # nothing overwritten
  assert "raise target.feature_cache_host_gib" in slabs.why
  # Rows whose size is not a multiple of the alignment start at aligned offsets.
  odd = _HostSlabs(limit=1000, slab_bytes=1000, pin=False)
  a, b = odd.take((5,), torch.float32), odd.take((5,), torch.float32)
  assert b.data_ptr() - a.data_ptr() == 64
  # A refusal of room stops the slabs; the reason is kept for the cache's message.
  refused = _HostSlabs(limit=10_000, slab_bytes=128, pin=False,
                       room=lambda n: "no memory" if refused.allocated >= 128 else None)
  assert refused.take(row, torch.float32) is not None
  assert refused.take(row, torch.float32) is not None              # the first slab's second row
  assert refused.take(row, torch.float32) is None and refused.why == "no memory"
  assert refused.allocated == 128
  # A last slab smaller than a row is given back, not used.
  short = _HostSlabs(limit=160, slab_bytes=128, pin=False)
  assert short.take(row, torch.float32) is not None and short.take(row, torch.float32) is not None
  assert short.take(row, torch.float32) is None and short.allocated == 128
  short.close()
