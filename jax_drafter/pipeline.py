"""Feeding the drafter: where it runs, and target features made while the previous step trains.

Layouts (config `target.devices` x `train.devices`):
  - shared: target and drafter on one GPU; features cross zero-copy (DLPack);
  - split: the target on its GPU(s), the drafter on others; each drafter device's rows cross by one
    explicit device-to-device copy, made on the producer thread (off the drafter's critical path);
  - replicated target + data-parallel drafter: the rows of a step are shared out over the target
    replicas, each drafter device receiving exactly the rows it trains on.

A producer thread draws the batches in the order a synchronous run would, runs the replicas (one
thread each: torch releases the GIL in its kernels), imports the features into JAX on the devices
that own their rows and queues at most `depth` steps ahead. Features never pass through the host.
With several processes (jax.distributed), each one computes only the rows of its own devices.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_drafter.config import parse_device

log = logging.getLogger(__name__)


MIN_SHARDED_SIZE = 2**14    # train.shard_state: smaller arrays (norms, biases, the rng) stay replicated


def whole(x) -> np.ndarray:
  """A state or metric array as one host array, whatever its layout: this process's copy of a
  replicated array (one device, a mesh, or several processes), a sharded one gathered."""
  if not isinstance(x, jax.Array):
    return np.asarray(x)
  if x.sharding.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def this_process(tree):
  """Arrays that span several processes as whole arrays of this process (the same tree with one
  process, where they are usable as they are)."""
  if jax.process_count() == 1:
    return tree

  def one(x):
    if isinstance(x, jax.Array) and x.sharding.is_fully_replicated:
      return x.addressable_data(0)        # already whole here, on the drafter's device: no copy
    return jnp.asarray(whole(x))
  return jax.tree.map(one, tree)


def scalars(tree: dict) -> dict[str, float]:
  """Replicated scalars (a step's metrics) as floats, in one device-to-host transfer."""
  here = jax.device_get({k: v.addressable_data(0) for k, v in tree.items()})
  return {k: float(v) for k, v in here.items()}


class LayoutError(ValueError):
  """A device layout that cannot run; the message names the config field."""


def resolve_drafter_devices(names) -> list:
  """`train.devices` entries ("gpu:1", "cuda:1", "cpu:0", or an index into the local devices) ->
  JAX devices, in order. None: every local device (data parallel over all of them)."""
  local = jax.local_devices()
  if names is None:
    return list(local)
  seen = ", ".join(f"{d.platform}:{i}" for i, d in enumerate(local))
  out = []
  for name in names:
    platform, i = parse_device(name, "train.devices")
    if i is None or (platform and platform != local[0].platform) or i >= len(local):
      raise LayoutError(f"train.devices: {name!r} is not a device JAX sees here ({seen})")
    out.append(local[i])
  if len(set(out)) != len(out):
    raise LayoutError(f"train.devices lists a device twice: {list(names)}")
  return out


class Placement:
  """Where the drafter runs: one device, or data parallel over a 1-D mesh ("data").

  With several devices the rows of every batch are split over the mesh and the state and frozen
  weights are replicated; XLA inserts the gradient all-reduce (the loss sums are over the global
  batch, so the result equals one device's). With several processes the mesh spans all of them.
  """

  def __init__(self, batch_size: int, devices=None):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    local = resolve_drafter_devices(devices)
    all_devices = local
    if jax.process_count() > 1:
      # Every process picks the same local devices; the mesh is global, in process order.
      index = [jax.local_devices().index(d) for d in local]
      all_devices = [sorted((d for d in jax.devices() if d.process_index == p),
                            key=lambda d: d.id)[i]
                     for p in range(jax.process_count()) for i in index]
    self.devices = all_devices                 # the mesh order: row shard j lives on devices[j]
    self.local = [d for d in all_devices if d.process_index == jax.process_index()]
    self.device = self.local[0]
    n = len(all_devices)
    if batch_size % n:
      raise LayoutError(f"data.batch_size={batch_size} must be a multiple of the {n} drafter "
                        "devices (set train.devices, or restrict what JAX sees with "
                        "CUDA_VISIBLE_DEVICES)")
    self.mesh = Mesh(np.array(all_devices), ("data",))
    self.replicated = NamedSharding(self.mesh, P())
    self.rows = NamedSharding(self.mesh, P(None, "data"))   # [A, B, ...]: split B
    self.multi = n > 1
    if self.multi:
      log.info("drafter data parallel over %d devices (%s): %d rows each", n,
               ", ".join(str(d) for d in all_devices), batch_size // n)

  def replicate(self, tree):
    return self.put(tree, jax.tree.map(lambda _: self.replicated, tree))

  def state_shardings(self, state, shard: bool):
    """Replicated state, or (shard=True, FSDP-style) every array split over the mesh on its
    largest axis that the device count divides (XLA gathers parameters where a step needs them):
    parameters and AdamW moments take 1/n of the memory per device."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    n = len(self.devices)

    def one(x):
      shape = np.shape(x)
      axes = [a for a in np.argsort(shape)[::-1] if shape[a] % n == 0 and shape[a] >= n]
      if not (shard and self.multi and axes) or np.prod(shape) < MIN_SHARDED_SIZE:
        return self.replicated
      spec = [None] * len(shape)
      spec[axes[0]] = "data"
      return NamedSharding(self.mesh, P(*spec))

    return jax.tree.map(one, state)

  def put(self, tree, shardings):
    """Host or single-device arrays -> arrays placed as `shardings` says (also across processes)."""
    if not self.multi:
      return jax.device_put(tree, self.device)
    if jax.process_count() == 1:
      return jax.device_put(tree, shardings)
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(
        np.shape(x), s, lambda idx: np.asarray(x)[idx]), tree, shardings)

  def split_rows(self, x: np.ndarray):
    """A host array [A, B, ...] that every process holds whole -> rows split over the mesh."""
    if not self.multi:
      return jax.device_put(x, self.device)
    return jax.make_array_from_callback(x.shape, self.rows, lambda idx: x[idx])

  def shard_rows(self, batch_size: int) -> list[tuple[int, int]]:
    """Row range [lo, hi) of each mesh device, in mesh order."""
    per = batch_size // len(self.devices)
    return [(j * per, (j + 1) * per) for j in range(len(self.devices))]


@dataclass(frozen=True)
class Piece:
  """Rows [lo, hi) of the step, computed by target replica `replica`, trained on mesh device
  `shard` (rows of one shard may come from several replicas: then pieces are concatenated)."""
  shard: int
  replica: int
  lo: int
  hi: int


def plan_pieces(batch_size: int, shard_rows: list[tuple[int, int]], replica_devices: list,
                shard_devices: list) -> list[Piece]:
  """Share the rows of a step out over the target replicas.

  Fewer (or as many) replicas as drafter shards: each shard is computed whole by one replica, one
  on its own GPU where there is one (zero-copy), else round robin. More replicas than shards: the
  rows are cut into one contiguous range per replica, and a shard gathers the ranges it overlaps.
  replica_devices / shard_devices: comparable device names ("cuda:0" / "gpu:0" -> "gpu:0").
  """
  m = len(replica_devices)
  if m == 0:
    raise LayoutError("no target replica")
  if batch_size < m:
    raise LayoutError(f"data.batch_size={batch_size} is smaller than the {m} target replicas "
                      "(target.devices): every replica needs at least one row")
  pieces = []
  if m <= len(shard_rows):
    for j, (lo, hi) in enumerate(shard_rows):
      same = [r for r, d in enumerate(replica_devices) if d == shard_devices[j]]
      pieces.append(Piece(j, same[0] if same else j % m, lo, hi))
    return pieces
  cuts = np.linspace(0, batch_size, m + 1).round().astype(int)
  for r in range(m):
    for j, (lo, hi) in enumerate(shard_rows):
      a, b = max(lo, cuts[r]), min(hi, cuts[r + 1])
      if a < b:
        pieces.append(Piece(j, r, int(a), int(b)))
  return pieces


def device_name(d) -> str:
  """'gpu:N' for torch's cuda:N and for JAX's GPU N of this host; 'cpu' for any CPU device
  (one torch CPU device stands for all of JAX's host devices: no copy between them)."""
  if hasattr(d, "platform"):                      # a JAX device
    return "cpu" if d.platform == "cpu" else f"gpu:{d.local_hardware_id}"
  s = str(d).lower()
  if s.startswith("cuda"):
    return "gpu:" + (s.split(":")[1] if ":" in s else "0")
  return "cpu"


@dataclass
class Feed:
  """One step's inputs, ready on the drafter's devices."""
  batch: dict[str, Any]           # JAX arrays, rows split over the mesh; "features" included
  handoff: Any                    # keeps the torch feature tensors alive until the step is done
  data_state: dict                # the batch iterator's position after this step's batches
  target_s: float                 # wall time of the target side for this step (forwards + copies)
  copy_s: float = 0.0             # of which: device-to-device copies of features


class Producer:
  """Makes each step's Feed: draws A micro-batches, runs the replicas over their pieces, imports
  the features on the devices that train on them. Call `next()` from one thread at a time."""

  def __init__(self, batches, grad_accum: int, batch_size: int, sources: list, layer_ids,
               place: Placement):
    self.batches, self.A, self.B = batches, grad_accum, batch_size
    self.sources, self.layer_ids, self.place = sources, tuple(layer_ids), place
    shard_devs = [device_name(d) for d in place.devices]
    rep_devs = [device_name(s.device) for s in sources]   # every feature source has a device
    self.pieces = [p for p in plan_pieces(batch_size, place.shard_rows(batch_size), rep_devs,
                                          shard_devs)
                   if place.devices[p.shard].process_index == jax.process_index()]
    self.copies = sum(rep_devs[p.replica] != shard_devs[p.shard] for p in self.pieces)
    self.pool = ThreadPoolExecutor(len(sources)) if len(sources) > 1 else None
    if len(sources) > 1 or self.copies:
      log.info("target replicas on %s; %d of %d row pieces cross devices by an explicit copy",
               ", ".join(rep_devs), self.copies, len(self.pieces))

  def _run_replica(self, r: int, micros) -> dict[Piece, Any]:
    import torch
    out = {}
    for p in self.pieces:
      if p.replica == r:
        sub = [{k: v[p.lo:p.hi] for k, v in m.items()} for m in micros]
        out[p] = self.sources[r].stacked_features(sub, self.layer_ids)
    dev = next(iter(out.values())).device if out else None
    if dev is not None and dev.type == "cuda":   # the target side's time, not the drafter's
      torch.cuda.current_stream(dev).synchronize()
    return out

  def next(self) -> Feed:
    from bridge.handoff import Handoff
    t0 = time.perf_counter()
    micro = [next(self.batches) for _ in range(self.A)]
    data_state = self.batches.state_dict()
    host = {k: np.stack([m[k] for m in micro]) for k in micro[0]}
    if self.pool is None:
      feats = self._run_replica(0, micro)
    else:
      feats = {}
      for f in [self.pool.submit(self._run_replica, r, micro) for r in range(len(self.sources))]:
        feats.update(f.result())
    h = Handoff()
    by_shard: dict[int, list] = {}
    t_copy = 0.0
    for p in sorted(self.pieces, key=lambda p: (p.shard, p.lo)):
      dev = self.place.devices[p.shard]
      t1 = time.perf_counter()
      arr = h.put(feats[p], name="target features", device=dev)
      if device_name(feats[p].device) != device_name(dev):
        arr.block_until_ready()           # measured here, on the producer's thread
        t_copy += time.perf_counter() - t1
      by_shard.setdefault(p.shard, []).append(arr)
    shards = {j: a[0] if len(a) == 1 else jnp.concatenate(a, axis=1) for j, a in by_shard.items()}
    batch = {k: self.place.split_rows(v) for k, v in host.items()}
    if not self.place.multi:
      batch["features"] = shards[0]
    else:
      A, _, S, F = next(iter(shards.values())).shape
      batch["features"] = jax.make_array_from_single_device_arrays(
          (A, self.B, S, F), self.place.rows, [shards[j] for j in sorted(shards)])
    return Feed(batch, h, data_state, time.perf_counter() - t0, t_copy)

  def close(self):
    if self.pool is not None:
      self.pool.shutdown(wait=True)


class Prefetcher:
  """Runs a Producer on a background thread, at most `depth` steps ahead of the consumer.

  `get()` returns the next Feed and how long the caller waited for it (the drafter idles that
  long: the target side is the bottleneck). An exception on the producer thread is raised by
  the next `get()`. depth 0: no thread; `get()` produces inline. Either way exactly `count` feeds,
  then StopIteration."""

  _END = object()

  def __init__(self, producer: Producer, count: int, depth: int):
    self.producer, self.depth = producer, depth
    self.left = count                 # feeds still to hand out (depth 0 counts them here)
    self.stop = threading.Event()
    self.busy = threading.Lock()      # held while a Feed is made; hold() pauses the producer
    self.thread = None
    if depth > 0:
      self.q: queue.Queue = queue.Queue(maxsize=depth)
      self.thread = threading.Thread(target=self._loop, args=(count,), daemon=True,
                                     name="target-features")
      self.thread.start()

  def _loop(self, count: int):
    try:
      for _ in range(count):
        with self.busy:
          if self.stop.is_set():
            return
          item = self.producer.next()
        if not self._put(item):
          return
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
      self._put(e)
      return
    self._put(self._END)

  def _put(self, item) -> bool:
    """Queue `item` unless the consumer has closed us meanwhile (then False): never blocks past
    close()."""
    while not self.stop.is_set():
      try:
        self.q.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def get(self) -> tuple[Feed, float]:
    if self.thread is None:
      if self.left <= 0:
        raise StopIteration
      self.left -= 1
      return self.producer.next(), 0.0
    t0 = time.perf_counter()
    item = self.q.get()
    waited = time.perf_counter() - t0
    if item is self._END:
      raise StopIteration
    if isinstance(item, BaseException):
      raise item
    return item, waited

  def hold(self):
    """Context: no target forward runs on the producer thread meanwhile (the target is shared:
    evaluation decodes with it)."""
    return self.busy

  def close(self):
    self.stop.set()
    if self.thread is not None:
      self.thread.join(timeout=60)
    self.producer.close()


@dataclass
class StepClock:
  """When each dispatched step finished on the device, timed by a watcher thread that blocks on
  the oldest step in flight. A step's drafter time is from when the device could start it (its
  dispatch, or the previous step's end) to its end; `pause()` marks host work that is not
  training (checkpoints, evaluation) so throughput excludes it."""
  done: dict = field(default_factory=dict)   # step -> (drafter seconds, wall seconds)

  def __post_init__(self):
    self.q: queue.Queue = queue.Queue()
    self.last_end = None
    self.lock = threading.Lock()
    self.cv = threading.Condition(self.lock)
    self.thread = threading.Thread(target=self._loop, daemon=True, name="step-clock")
    self.thread.start()

  def dispatched(self, i: int, result) -> None:
    self.q.put((i, result, time.perf_counter()))

  def pause(self) -> None:
    with self.lock:
      self.last_end = None      # the next step starts from its own dispatch

  def _loop(self):
    while True:
      item = self.q.get()
      if item is None:
        return
      i, result, t_dispatch = item
      try:
        jax.block_until_ready(result)
      except Exception:  # noqa: BLE001 - the consumer reads the same result and raises it
        pass
      end = time.perf_counter()
      with self.cv:
        start = t_dispatch if self.last_end is None else max(t_dispatch, self.last_end)
        wall_start = t_dispatch if self.last_end is None else self.last_end
        self.done[i] = (end - start, end - wall_start)
        self.last_end = end
        self.cv.notify_all()

  def wait(self, i: int) -> tuple[float, float]:
    with self.cv:
      self.cv.wait_for(lambda: i in self.done)
      return self.done.pop(i)

  def close(self):
    self.q.put(None)
    self.thread.join(timeout=60)
