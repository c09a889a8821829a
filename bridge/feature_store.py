"""Target features on disk: written once (`python -m jax_drafter.cache_features`), read by training
(`data.features`) instead of running the target every step.

A cache directory holds
  manifest.json     what the cache was made with (`settings`: target fingerprint and dtype, layer
                    ids, seq_len, the data settings that change the rows), one content key per
                    packed row, and the shards written so far with their sizes and checksums;
  shard-NNNNN.bin   the features of `shard_rows` consecutive rows, [rows, S, F] bfloat16 raw bytes
                    (little-endian, torch's bf16 viewed as int16: no dependency beyond torch).

Features are stored in bfloat16 whatever the target's dtype (half the disk of float32; a float32
target's features are rounded to bf16 once, then widened back when read). A shard counts only
once its checksum is in the manifest: each shard is written, then the manifest is replaced
atomically, so an interrupted run resumes after its last complete shard. Reading memory-maps the
shards and checks a shard's checksum the first time one of its rows is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from typing import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT, VERSION = "dflash-jax target features", 1
MANIFEST = "manifest.json"
KEYED = ("input_ids", "position_ids", "doc_id")   # what a row's features depend on
REBUILD = "rebuild it with `python -m jax_drafter.cache_features` (same config), or point " \
          "data.features elsewhere"


class CacheError(ValueError):
  """A feature cache that does not fit this run, or a damaged one; the message says which part."""


def row_key(row: dict, b: int | None = None) -> str:
  """Content key of a packed row (its ids, positions and document ids): the same row gives the
  same key whatever its index. `b`: row b of a batch of rows."""
  h = hashlib.blake2b(digest_size=16)
  for k in KEYED:
    x = row[k] if b is None else row[k][b]
    h.update(np.ascontiguousarray(x, dtype=np.int32).tobytes())
  return h.hexdigest()


def row_keys(rows: dict) -> list[str]:
  return [row_key(rows, b) for b in range(len(rows["input_ids"]))]


def human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024:
      return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
    n /= 1024
  return f"{n:.2f} TiB"


def _shard_name(i: int) -> str:
  return f"shard-{i:05d}.bin"


def _checksum(path: str) -> str:
  h = hashlib.blake2b(digest_size=32)
  with open(path, "rb") as f:
    while chunk := f.read(1 << 24):
      h.update(chunk)
  return h.hexdigest()


def _write_json_atomic(path: str, obj: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)   # readers see the old manifest or the new one, never half of one


def read_manifest(directory: str) -> dict:
  path = os.path.join(directory, MANIFEST)
  if not os.path.isfile(path):
    raise CacheError(f"{directory} holds no feature cache ({MANIFEST} is missing); make one with "
                     "`python -m jax_drafter.cache_features --config CONFIG --out DIR`")
  try:
    with open(path) as f:
      m = json.load(f)
  except json.JSONDecodeError as e:
    raise CacheError(f"{path} is not valid JSON ({e}); {REBUILD}") from None
  if m.get("format") != FORMAT or m.get("version") != VERSION:
    raise CacheError(f"{path} is not a version-{VERSION} dflash-jax feature cache; {REBUILD}")
  return m


def check_settings(manifest: dict, expected: dict, directory: str) -> None:
  """Refuse a cache made with other settings, naming the first field that differs."""
  made = manifest["settings"]
  for k in list(expected) + [k for k in made if k not in expected]:
    if made.get(k) != expected.get(k):
      what = ("another target (other weights, config or tokenizer)" if k == "target.fingerprint"
              else f"{k}={made.get(k)!r}")
      raise CacheError(f"feature cache {directory} was made with {what}, this run has {k}="
                       f"{expected.get(k)!r}; {REBUILD}")


class Writer:
  """Writes the features of `rows` ({key: int32[R, S]}, the packed rows) into `directory`, resuming
  after the last complete shard of an earlier run with the same settings and rows."""

  def __init__(self, directory: str, rows: dict, settings: dict, *, feature_size: int,
               shard_rows: int, info: dict | None = None):
    if shard_rows < 1:
      raise CacheError(f"shard_rows={shard_rows} must be >= 1")
    self.directory, self.rows = directory, rows
    R, S = rows["input_ids"].shape
    self.keys = row_keys(rows)
    self.row_bytes = S * feature_size * 2
    self.num_shards = -(-R // shard_rows)
    fresh = {"format": FORMAT, "version": VERSION, "dtype": "bfloat16", "settings": settings,
             "seq_len": S, "feature_size": feature_size, "num_rows": R, "shard_rows": shard_rows,
             **(info or {}), "keys": self.keys, "shards": [], "complete": False}
    os.makedirs(directory, exist_ok=True)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
      old = read_manifest(directory)
      check_settings(old, settings, directory)
      for k in ("keys", "shard_rows", "feature_size"):
        if old[k] != fresh[k]:
          what = "other packed rows" if k == "keys" else f"{k}={old[k]}"
          raise CacheError(f"feature cache {directory} was started with {what} (this run: "
                           f"{'these rows' if k == 'keys' else fresh[k]}); delete it or use "
                           "another --out")
      fresh["shards"] = old["shards"]
    self.manifest = fresh
    self.done = len(fresh["shards"])
    if self.done:
      log.info("feature cache %s: %d of %d shards already written; continuing", directory,
               self.done, self.num_shards)

  def _span(self, i: int) -> tuple[int, int]:
    n = self.manifest["shard_rows"]
    return i * n, min((i + 1) * n, self.manifest["num_rows"])

  @property
  def total_bytes(self) -> int:
    return self.manifest["num_rows"] * self.row_bytes

  @property
  def needed_bytes(self) -> int:
    """Free disk the rest of the run needs: the shards still to write, plus the manifest (its
    row keys, one entry per shard) and its temporary copy while it is replaced."""
    todo = sum(b - a for a, b in map(self._span, range(self.done, self.num_shards)))
    manifest = len(json.dumps(self.manifest)) + 200 * self.num_shards
    return todo * self.row_bytes + 2 * manifest

  def check_space(self) -> None:
    free = shutil.disk_usage(self.directory).free
    if free < self.needed_bytes:
      raise CacheError(f"not enough disk for the feature cache in {self.directory}: it needs "
                       f"{human_bytes(self.needed_bytes)}, {human_bytes(free)} are free")

  def write(self, features: Callable[[dict], torch.Tensor], batch_rows: int,
            on_rows: Callable[[int], None] | None = None) -> None:
    """features({key: int32[b, S]}) -> [b, S, F] tensor (any float dtype and device), called on
    batches of at most `batch_rows` rows; on_rows(n) after each batch (a progress bar)."""
    S, F = self.manifest["seq_len"], self.manifest["feature_size"]
    for i in range(self.done, self.num_shards):
      lo, hi = self._span(i)
      name = _shard_name(i)
      path = os.path.join(self.directory, name)
      h = hashlib.blake2b(digest_size=32)
      with open(path + ".tmp", "wb") as f:
        for a in range(lo, hi, batch_rows):
          b = min(a + batch_rows, hi)
          f_bsf = features({k: v[a:b] for k, v in self.rows.items()})
          if tuple(f_bsf.shape) != (b - a, S, F):
            raise CacheError(f"features of rows {a}..{b} have shape {tuple(f_bsf.shape)}, "
                             f"expected {(b - a, S, F)}")
          raw = f_bsf.detach().to(torch.bfloat16).view(torch.int16).cpu().contiguous().numpy()
          f.write(raw.data)     # the buffer itself: no bytes copy of a batch that may be GiBs
          h.update(raw.data)
          if on_rows is not None:
            on_rows(b - a)
        f.flush()
        os.fsync(f.fileno())
      os.replace(path + ".tmp", path)
      self.manifest["shards"].append({"file": name, "rows": hi - lo,
                                      "bytes": (hi - lo) * self.row_bytes,
                                      "blake2b": h.hexdigest()})
      self.manifest["complete"] = i + 1 == self.num_shards
      _write_json_atomic(os.path.join(self.directory, MANIFEST), self.manifest)
      self.done = i + 1
      log.info("feature cache %s: shard %d/%d written (%s)", self.directory, i + 1,
               self.num_shards, name)
    if not self.manifest["complete"]:  # no rows at all: nothing above marked it
      self.manifest["complete"] = True
      _write_json_atomic(os.path.join(self.directory, MANIFEST), self.manifest)


class FeatureDir:
  """A complete cache directory opened for reading; shared by the FeatureStores of one run."""

  def __init__(self, directory: str):
    m = read_manifest(directory)
    if not m["complete"]:
      raise CacheError(f"feature cache {directory} is incomplete ({len(m['shards'])} of "
                       f"{-(-m['num_rows'] // m['shard_rows'])} shards): rerun "
                       "`python -m jax_drafter.cache_features` with the same settings to finish it")
    self.directory, self.manifest = directory, m
    self.layer_ids = tuple(m["settings"]["drafter.target_layer_ids"])
    self.seq_len, self.feature_size = m["seq_len"], m["feature_size"]
    self.shard_rows = m["shard_rows"]
    self.index: dict[str, int] = {}
    for i, k in enumerate(m["keys"]):
      self.index.setdefault(k, i)
    self._maps: dict[int, np.memmap] = {}
    self._lock = threading.Lock()

  def check_settings(self, expected: dict) -> None:
    check_settings(self.manifest, expected, self.directory)

  def _missing(self, n: str) -> CacheError:
    return CacheError(f"{n} packed rows of this run are not in the feature cache {self.directory}: "
                      "it was made from other rows (other data settings, tokenizer or regenerated "
                      f"answers); {REBUILD}")

  def check_rows(self, rows: dict) -> None:
    """Every row of `rows` must be in the cache (checked once, before training starts)."""
    lost = sum(k not in self.index for k in row_keys(rows))
    if lost:
      raise self._missing(f"{lost} of {len(rows['input_ids'])}")

  def _shard(self, s: int) -> np.memmap:
    with self._lock:
      if s not in self._maps:
        entry = self.manifest["shards"][s]
        path = os.path.join(self.directory, entry["file"])
        if not os.path.isfile(path):
          raise CacheError(f"feature cache shard {entry['file']} is missing from {self.directory}; "
                           f"{REBUILD}")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
          raise CacheError(f"feature cache shard {entry['file']} in {self.directory} is truncated "
                           f"or damaged: {size} bytes, the manifest says {entry['bytes']}; "
                           f"{REBUILD}")
        if _checksum(path) != entry["blake2b"]:
          raise CacheError(f"feature cache shard {entry['file']} in {self.directory} fails its "
                           f"checksum (corrupted on disk); {REBUILD}")
        self._maps[s] = np.memmap(path, dtype="<i2", mode="r",
                                  shape=(entry["rows"], self.seq_len, self.feature_size))
      return self._maps[s]

  def read(self, key: str, out: np.ndarray) -> None:
    """Copies the row with content key `key` into `out` (int16 [S, F], bf16 bit patterns)."""
    i = self.index.get(key)
    if i is None:
      raise self._missing("some")
    out[...] = self._shard(i // self.shard_rows)[i % self.shard_rows]


class FeatureStore:
  """A feature source read from a cache directory: `stacked_features` as `Target`'s, rows looked
  up by content, widened from the stored bf16 to `dtype` on `device` (one store per device)."""

  def __init__(self, cache: FeatureDir | str, *, device: str | torch.device = "cpu",
               dtype: str = "float32"):
    self.cache = cache if isinstance(cache, FeatureDir) else FeatureDir(cache)
    self.device = torch.device(device)
    self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

  def stacked_features(self, micros, layer_ids) -> torch.Tensor:
    """Features of A micro-batches (dicts of [b, S] arrays) as one contiguous [A, b, S, n*H]."""
    c = self.cache
    if tuple(layer_ids) != c.layer_ids:
      raise CacheError(f"feature cache {c.directory} holds target layers {list(c.layer_ids)}, "
                       f"not {list(layer_ids)}; {REBUILD}")
    A, b, S = len(micros), *micros[0]["input_ids"].shape
    if S != c.seq_len:
      raise CacheError(f"feature cache {c.directory} holds rows of seq_len {c.seq_len}, not {S}")
    # torch allocates the buffer (aligned as DLPack's zero-copy import wants); numpy fills it.
    raw = torch.empty((A, b, S, c.feature_size), dtype=torch.int16)
    view = raw.numpy()
    for a, m in enumerate(micros):
      for j in range(b):
        c.read(row_key(m, j), view[a, j])
    x = raw.view(torch.bfloat16)
    if self.device.type != "cpu":
      x = x.to(self.device)     # bf16 over the bus, widened on the device
    # A fresh tensor every step, never written again once handed to JAX.
    return x.to(self.dtype).contiguous()


def open_stores(directory: str, rows: dict, devices, *, dtype: str = "float32") -> list:
  """A FeatureStore per target device (`target.devices`, or `[target.device]`) over one opened
  cache, after checking that it holds every row of `rows` (the run's packed rows)."""
  from bridge.target import resolve_device
  cache = FeatureDir(directory)
  cache.check_rows(rows)
  log.info("target features from %s: %d rows in %d shards (%s), no target forward", directory,
           cache.manifest["num_rows"], len(cache.manifest["shards"]),
           human_bytes(sum(s["bytes"] for s in cache.manifest["shards"])))
  return [FeatureStore(cache, device=resolve_device(str(d)), dtype=dtype) for d in devices]
