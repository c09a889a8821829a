"""The on-disk feature cache: bf16 round trip by row content, resume after the last complete
shard, checksums, refusals of rows, layers, settings and disk space that do not fit."""

import collections
import json
import os
import shutil

import numpy as np
import pytest
import torch

from bridge import feature_store as fs

S, F, LAYERS = 8, 6, (1, 2)
SETTINGS = {"target.fingerprint": "f00d", "target.dtype": "float32",
            "drafter.target_layer_ids": list(LAYERS), "data.seq_len": S}


def make_rows(R=7, seed=0):
  rng = np.random.default_rng(seed)
  return {"input_ids": rng.integers(0, 500, (R, S)).astype(np.int32),
          "loss_mask": rng.integers(0, 2, (R, S)).astype(np.int32),
          "doc_id": np.zeros((R, S), np.int32),
          "position_ids": np.tile(np.arange(S, dtype=np.int32), (R, 1))}


def synth(rows):
  """A stand-in target: float32 features that depend on the row's ids and positions, with more
  mantissa than bf16 keeps."""
  ids = torch.as_tensor(rows["input_ids"], dtype=torch.float32)[..., None]
  pos = torch.as_tensor(rows["position_ids"], dtype=torch.float32)[..., None]
  return torch.sin(ids * 0.37 + pos * 0.11 + torch.arange(F) * 0.7) * 3.0


def write(d, rows, features=synth, shard_rows=3, settings=SETTINGS):
  w = fs.Writer(str(d), rows, settings, feature_size=F, shard_rows=shard_rows)
  w.write(features, batch_rows=2)
  return w


def pick(rows, idx):
  return {k: v[idx] for k, v in rows.items()}


def test_rows_read_back_by_content_as_the_bf16_rounding_of_the_features(tmp_path):
  rows = make_rows()
  w = write(tmp_path, rows)
  assert w.num_shards == 3 and sorted(os.listdir(tmp_path)) == [
      "manifest.json", "shard-00000.bin", "shard-00001.bin", "shard-00002.bin"]
  assert os.path.getsize(tmp_path / "shard-00002.bin") == 1 * S * F * 2   # 7 rows: 3 + 3 + 1
  micros = [pick(rows, [4, 0]), pick(rows, [6, 3])]   # any order, rows from every shard
  for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    got = fs.FeatureStore(str(tmp_path), dtype=dtype).stacked_features(micros, LAYERS)
    want = torch.stack([synth(m) for m in micros]).to(torch.bfloat16).to(torch_dtype)
    assert got.dtype == torch_dtype and got.is_contiguous() and got.shape == (2, 2, S, F)
    assert torch.equal(got, want)     # exactly bf16 rounding, nothing else
  assert not torch.equal(got.float(), torch.stack([synth(m) for m in micros]))  # it did round


def test_an_interrupted_write_resumes_after_its_last_complete_shard(tmp_path):
  rows = make_rows()
  write(tmp_path / "whole", rows)
  calls = collections.Counter()

  def dies_in_shard_2(r):
    calls["batches"] += 1
    if calls["batches"] == 5:   # batches of 2 rows: shard 0 = 2 batches, shard 1 = 2 batches
      raise KeyboardInterrupt
    return synth(r)

  part = tmp_path / "part"
  with pytest.raises(KeyboardInterrupt):
    write(part, rows, dies_in_shard_2)
  m = fs.read_manifest(str(part))
  assert [s["file"] for s in m["shards"]] == ["shard-00000.bin", "shard-00001.bin"]
  assert not m["complete"]
  with pytest.raises(fs.CacheError, match="incomplete .2 of 3 shards"):
    fs.FeatureDir(str(part))
  seen = []
  w = write(part, rows, lambda r: seen.append(len(r["input_ids"])) or synth(r))
  assert w.done == 3 and seen == [1]          # only shard 2's row was computed again
  for name in os.listdir(tmp_path / "whole"):
    assert (part / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
  assert not list(part.glob("*.tmp"))


def test_a_corrupted_or_truncated_shard_is_named_when_read(tmp_path):
  rows = make_rows()
  write(tmp_path, rows)
  data = bytearray((tmp_path / "shard-00001.bin").read_bytes())
  data[17] ^= 0x40
  (tmp_path / "shard-00001.bin").write_bytes(bytes(data))
  with open(tmp_path / "shard-00002.bin", "r+b") as f:
    f.truncate(S * F)
  store = fs.FeatureStore(str(tmp_path))
  store.stacked_features([pick(rows, [0, 2])], LAYERS)        # shard 0 is intact
  with pytest.raises(fs.CacheError, match="shard-00001.bin .* fails its checksum"):
    store.stacked_features([pick(rows, [0, 4])], LAYERS)
  with pytest.raises(fs.CacheError, match="shard-00002.bin .* truncated"):
    store.stacked_features([pick(rows, [6])], LAYERS)


def test_rows_layers_and_settings_of_another_run_are_refused(tmp_path):
  rows = make_rows()
  write(tmp_path, rows)
  cache = fs.FeatureDir(str(tmp_path))
  cache.check_rows(pick(rows, [5, 1]))
  other = make_rows(seed=1)
  mixed = {k: np.concatenate([rows[k], other[k][:1]]) for k in rows}
  with pytest.raises(fs.CacheError, match="1 of 8 packed rows .* not in the feature cache"):
    cache.check_rows(mixed)
  store = fs.FeatureStore(cache)
  with pytest.raises(fs.CacheError, match="not in the feature cache"):
    store.stacked_features([pick(other, [0])], LAYERS)
  with pytest.raises(fs.CacheError, match=r"holds target layers \[1, 2\], not \[1, 3\]"):
    store.stacked_features([pick(rows, [0])], (1, 3))
  with pytest.raises(fs.CacheError, match="made with data.seq_len=8, this run has data.seq_len=16"):
    cache.check_settings({**SETTINGS, "data.seq_len": 16})
  with pytest.raises(fs.CacheError, match="made with another target"):
    cache.check_settings({**SETTINGS, "target.fingerprint": "beef"})
  with pytest.raises(fs.CacheError, match="data.held_out=None, this run has data.held_out=3"):
    cache.check_settings({**SETTINGS, "data.held_out": 3})
  # Writing into it with other settings or other rows is refused too, before anything is written.
  with pytest.raises(fs.CacheError, match="target.dtype='float32'"):
    fs.Writer(str(tmp_path), rows, {**SETTINGS, "target.dtype": "bfloat16"}, feature_size=F,
              shard_rows=3)
  with pytest.raises(fs.CacheError, match="started with other packed rows"):
    fs.Writer(str(tmp_path), other, SETTINGS, feature_size=F, shard_rows=3)


def test_no_manifest_or_a_foreign_one_is_refused(tmp_path):
  with pytest.raises(fs.CacheError, match="manifest.json is missing"):
    fs.FeatureDir(str(tmp_path))
  (tmp_path / "manifest.json").write_text(json.dumps({"format": "something else"}))
  with pytest.raises(fs.CacheError, match="not a version-1 dflash-jax feature cache"):
    fs.FeatureDir(str(tmp_path))


def test_the_disk_space_needed_is_checked_before_writing(tmp_path, monkeypatch):
  rows = make_rows()
  w = fs.Writer(str(tmp_path), rows, SETTINGS, feature_size=F, shard_rows=3)
  assert w.total_bytes == 7 * S * F * 2 < w.needed_bytes   # plus the manifest
  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, w.needed_bytes - 1))
  with pytest.raises(fs.CacheError, match="not enough disk .* it needs .* are free"):
    w.check_space()
  monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, w.needed_bytes))
  w.check_space()
