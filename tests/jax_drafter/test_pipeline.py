"""pipeline: row pieces over target replicas, device sets, the producer thread, the step clock."""

import copy
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge.target import Target, load_target
from jax_drafter import data as data_lib
from jax_drafter import pipeline
from jax_drafter.pipeline import LayoutError, Piece, plan_pieces


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
  return load_target(tiny_target_dir, device="cpu")


def test_each_shard_is_computed_whole_by_the_replica_on_its_own_gpu():
  shards = [(0, 4), (4, 8)]
  same = plan_pieces(8, shards, ["gpu:1", "gpu:0"], ["gpu:0", "gpu:1"])
  assert same == [Piece(0, 1, 0, 4), Piece(1, 0, 4, 8)]          # zero copies
  split = plan_pieces(8, shards, ["gpu:0", "gpu:1"], ["gpu:2", "gpu:3"])
  assert split == [Piece(0, 0, 0, 4), Piece(1, 1, 4, 8)]         # one copy per shard
  one = plan_pieces(8, shards, ["gpu:0"], ["gpu:0", "gpu:1"])
  assert one == [Piece(0, 0, 0, 4), Piece(1, 0, 4, 8)]


def test_more_replicas_than_shards_share_the_rows_and_cover_each_once():
  for B, m, k in [(8, 2, 1), (6, 3, 1), (8, 4, 2), (6, 4, 2), (5, 5, 1)]:
    per = B // k
    shards = [(j * per, (j + 1) * per) for j in range(k)]
    pieces = plan_pieces(B, shards, [f"gpu:{r}" for r in range(m)], ["gpu:9"] * k)
    covered = np.zeros(B, int)
    for p in pieces:
      covered[p.lo:p.hi] += 1
      assert shards[p.shard][0] <= p.lo < p.hi <= shards[p.shard][1]
    assert (covered == 1).all(), (B, m, k)
    assert {p.replica for p in pieces} == set(range(m))


def test_a_batch_smaller_than_the_replicas_is_refused():
  with pytest.raises(LayoutError, match="batch_size=2 is smaller than the 3 target replicas"):
    plan_pieces(2, [(0, 2)], ["gpu:0", "gpu:1", "gpu:2"], ["gpu:0"])


def test_drafter_devices_name_what_jax_sees():
  assert pipeline.resolve_drafter_devices(None) == jax.local_devices()
  assert pipeline.resolve_drafter_devices(["0"]) == [jax.local_devices()[0]]
  n = len(jax.local_devices())
  with pytest.raises(LayoutError, match=f"'cpu:{n}' is not a device JAX sees here"):
    pipeline.resolve_drafter_devices([f"cpu:{n}"])
  with pytest.raises(LayoutError, match="'cuda:0' is not a device JAX sees here"):
    pipeline.resolve_drafter_devices(["cuda:0"])


def _tiny_rows(tiny_target, n_rows=4, S=24, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 200, (n_rows * 3, S)).astype(np.int32)
  pos = np.tile(np.arange(S, dtype=np.int32), (n_rows * 3, 1))
  doc = np.zeros_like(ids)
  doc[:, S // 2:] = 1                     # two documents per row
  pos[:, S // 2:] -= S // 2
  rows = {"input_ids": ids, "position_ids": pos, "doc_id": doc,
          "loss_mask": np.ones_like(ids, dtype=np.float32)}
  return rows


def _replica(target: Target) -> Target:
  return Target(copy.deepcopy(target.model), target.tokenizer, target.name)


@pytest.mark.parametrize("depth", [0, 2])
def test_two_replicas_give_the_features_of_one(tiny, depth):
  rows = _tiny_rows(tiny)
  place = pipeline.Placement(4)
  feeds = {}
  for name, sources in (("one", [tiny]), ("two", [tiny, _replica(tiny)])):
    batches = data_lib.BatchIterator(rows, 4, seed=3)
    producer = pipeline.Producer(batches, 2, 4, sources, [0, 2], place)
    pre = pipeline.Prefetcher(producer, 3, depth=depth)
    got = [pre.get()[0] for _ in range(3)]
    with pytest.raises(StopIteration):
      pre.get()                                  # exactly `count` feeds, then the end
    pre.close()
    feeds[name] = got
  for a, b in zip(feeds["one"], feeds["two"]):
    np.testing.assert_array_equal(np.asarray(a.batch["features"]), np.asarray(b.batch["features"]))
    np.testing.assert_array_equal(np.asarray(a.batch["input_ids"]), np.asarray(b.batch["input_ids"]))
    assert a.data_state == b.data_state
    assert a.batch["features"].shape[:2] == (2, 4) and a.target_s > 0


def test_data_state_is_the_position_after_the_feed_not_after_the_prefetch(tiny):
  rows = _tiny_rows(tiny)
  batches = data_lib.BatchIterator(rows, 4, seed=1)
  pre = pipeline.Prefetcher(pipeline.Producer(batches, 1, 4, [tiny], [0], pipeline.Placement(4)),
                            4, depth=2)
  first, _ = pre.get()
  time.sleep(0.5)                                # the producer runs ahead meanwhile
  again = data_lib.BatchIterator(rows, 4, seed=1)
  again.load_state_dict(first.data_state)
  second, _ = pre.get()
  np.testing.assert_array_equal(next(again)["input_ids"], np.asarray(second.batch["input_ids"])[0])
  pre.close()


def test_an_error_on_the_producer_thread_reaches_the_consumer(tiny):
  class Broken:
    device = tiny.device

    def stacked_features(self, micros, layer_ids):
      raise RuntimeError("target forward failed: out of memory")

  rows = _tiny_rows(tiny)
  pre = pipeline.Prefetcher(pipeline.Producer(data_lib.BatchIterator(rows, 4, seed=0), 1, 4,
                                              [Broken()], [0], pipeline.Placement(4)), 3, depth=1)
  with pytest.raises(RuntimeError, match="out of memory"):
    pre.get()
  pre.close()


def test_the_step_clock_leaves_checkpoint_time_out_of_throughput():
  clock = pipeline.StepClock()
  x = jnp.ones(4)
  clock.dispatched(0, x)
  clock.wait(0)
  time.sleep(0.3)                                # a checkpoint being written, not marked
  clock.dispatched(1, x + 1)
  _, wall = clock.wait(1)
  assert wall >= 0.3
  time.sleep(0.3)                                # a checkpoint, marked as a pause
  clock.pause()
  clock.dispatched(2, x + 2)
  drafter, wall = clock.wait(2)
  assert wall < 0.2 and drafter <= wall
  clock.close()
