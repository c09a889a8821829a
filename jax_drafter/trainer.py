"""The training loop: feeds batches, logs, checkpoints. All step logic lives in step.py.

Order of work per iteration: host batch -> target forward (torch) -> DLPack handoff -> dispatch
step t -> read step t-1's metrics (this overlaps the target forward of step t with the drafter
step t-1 on the device) -> log -> checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_drafter import checkpoint as ckpt
from jax_drafter import data as data_lib
from jax_drafter import step as step_lib
from jax_drafter.config import DrafterConfig, RunConfig, resolve_drafter

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
  pass


@dataclasses.dataclass
class Progress:
  """Callbacks for the CLI's progress display (the library itself only logs)."""
  start: Callable[[int, int], None] = lambda first, total: None
  update: Callable[[int, dict], None] = lambda step, metrics: None
  close: Callable[[], None] = lambda: None


def _attn_impl(t) -> dict:
  return {"implementation": t.attention} if t.attention else {}


def check_inputs(cfg: RunConfig) -> None:
  """Cheap checks of the files a run needs, before anything heavy loads (a bad data path must
  not wait for the target)."""
  data_lib.check_data_path(cfg.data.path)


def regeneration(cfg: RunConfig, target, *, progress: bool = True, stats: dict | None = None,
                 cuda_graph: bool | None = None):
  """-> (fn, key) that regenerate the training conversations with `target` as configured."""
  from bridge import regenerate as regen_lib
  d = cfg.data
  settings = regen_lib.Settings(
      max_new_tokens=d.regenerate_max_new_tokens, temperature=d.regenerate_temperature,
      seed=d.seed, max_prompt_tokens=min(d.seq_len, target.info.max_position_embeddings
                                         - d.regenerate_max_new_tokens),
      max_turns=d.regenerate_max_turns)
  return regen_lib.make_regenerator(
      target.model, target.tokenizer, settings, cache_path=d.regenerate_path(cfg.train.output_dir),
      batch_rows=d.regenerate_batch_rows, batch_tokens=d.regenerate_batch_tokens,
      progress=progress, stats=stats, cuda_graph=cuda_graph)


def setup(cfg: RunConfig, *, regenerate_stats: dict | None = None, progress: bool = False):
  """Target, resolved drafter config, dataset. Separate so tests and tools can reuse it."""
  from bridge import target as target_lib
  check_inputs(cfg)
  tc = cfg.target
  target = target_lib.load_target(tc.path, gguf_file=tc.gguf_file, dtype=tc.dtype,
                                  device=tc.device, trust_remote_code=tc.trust_remote_code,
                                  memory_budget_gib=tc.memory_budget_gib,
                                  memory_cache_dir=cfg.data.cache_dir)
  mask_id = (cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None
             else target_lib.choose_mask_token_id(target))
  dcfg = resolve_drafter(cfg.drafter, target.info, mask_id)
  target.check_layer_ids(dcfg.target_layer_ids)
  target_lib.check_mask_token_id(target, dcfg.mask_token_id)
  regen, regen_key = None, ""
  if cfg.data.regenerate:
    # DFlash trains on the target's own outputs: the target rewrites the assistant turns first,
    # cached on disk and keyed by the target's fingerprint and the generation settings.
    regen, regen_key = regeneration(cfg, target, stats=regenerate_stats, progress=progress)
  ds = data_lib.build_dataset(
      target.tokenizer, cfg.data.path, cfg.data.seq_len, max_conversations=cfg.data.max_conversations,
      held_out=cfg.data.held_out, seed=cfg.data.seed, cache_dir=cfg.data.cache_dir,
      regenerate=regen, regenerate_key=regen_key)
  return target, dcfg, ds


def _jsonl(record: dict) -> str:
  """One metrics line: non-finite numbers become null (NaN is not JSON; readers would choke)."""
  clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
           for k, v in record.items()}
  return json.dumps(clean, allow_nan=False) + "\n"


class _Interrupt:
  """Turns the first Ctrl-C into a flag the loop checks (a checkpoint is written before exit)."""

  def __init__(self):
    self.hit = False

  def __enter__(self):
    # Signal handlers can only be installed from the main thread (not e.g. a notebook worker).
    self.prev = None
    if threading.current_thread() is threading.main_thread():
      self.prev = signal.signal(signal.SIGINT, self._handler)
    return self

  def _handler(self, *_):
    if self.hit:  # second Ctrl-C: give up on a clean exit
      raise KeyboardInterrupt
    self.hit = True
    log.warning("interrupt: finishing the current step, saving a checkpoint, then exiting "
                "(Ctrl-C again to abort without saving)")

  def __exit__(self, *exc):
    if self.prev is not None:
      signal.signal(signal.SIGINT, self.prev)


class Placement:
  """Where the drafter runs: the first local device, or data parallel over all local devices.

  With several devices the rows of every batch are split over a 1-D mesh ("data") and the state
  and frozen weights are replicated; XLA inserts the gradient all-reduce (the loss sums are over
  the global batch, so the result equals one device's). Target features are produced by one
  target and copied to the devices that own their rows (explicit device_put).
  """

  def __init__(self, batch_size: int):
    devices = jax.local_devices()
    self.device = devices[0]
    self.mesh = None
    if len(devices) > 1:
      if batch_size % len(devices):
        raise TrainingError(f"data.batch_size={batch_size} must be a multiple of the {len(devices)} "
                            "drafter devices JAX sees (or restrict them with "
                            "jax_cuda_visible_devices / CUDA_VISIBLE_DEVICES)")
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      self.mesh = Mesh(np.array(devices), ("data",))
      self.replicated = NamedSharding(self.mesh, P())
      self.rows = NamedSharding(self.mesh, P(None, "data"))   # [A, B, ...]: split B
      log.info("data parallel over %d devices: %d rows each", len(devices),
               batch_size // len(devices))

  def replicate(self, tree):
    return tree if self.mesh is None else jax.device_put(tree, self.replicated)

  def split_rows(self, x):
    return jnp.asarray(x) if self.mesh is None else jax.device_put(x, self.rows)

  def features(self, handoff, feats_t):
    """Target features (torch) -> JAX, placed once: on the drafter's device, or straight to
    the devices that own their rows (not via the first device)."""
    if self.mesh is None:
      return handoff.put(feats_t, name="target features", device=self.device)
    return self.split_rows(handoff.put(feats_t, name="target features"))


class _Run:
  """One invocation of train(): the state that the loop, checkpoints, metrics and evaluation share.

  Built in the order a run starts: target and data, drafter state (resumed if the output directory
  holds a checkpoint), devices, frozen weights, the jitted step, the metric sinks.
  """

  def __init__(self, cfg: RunConfig, progress: Progress, show_progress: bool = False):
    from bridge.handoff import Handoff, import_frozen

    self.cfg, self.progress = cfg, progress
    t = self.t = cfg.train
    out = self.out = t.output_dir
    os.makedirs(out, exist_ok=True)
    self.target, self.dcfg, self.ds = setup(cfg, progress=show_progress)
    dcfg = self.dcfg
    log.info("drafter: %s", json.dumps(dcfg.to_zlab()["dflash_config"]) + f" layers={dcfg.layer_types}")
    A, B = t.grad_accum, cfg.data.batch_size
    optimizer = step_lib.make_optimizer(t)
    self.graphdef, state = step_lib.init_state(dcfg, t, optimizer)
    self.batches = data_lib.BatchIterator(self.ds.rows, B, seed=cfg.data.seed)
    self.mngr = ckpt.manager(out, keep=t.keep_checkpoints)
    if self.mngr.latest_step() is not None:
      state = self._resume(state)
    ckpt.save_json(os.path.join(out, "config.json"),
                   {"run_config": cfg.to_dict(), "drafter_config": dcfg.to_zlab()})

    # Frozen weights cross once; the torch tensors stay alive in `keep` for the whole run.
    # The drafter's device: features from a target on another GPU are copied there explicitly.
    self.place = Placement(B)
    self.state = self.place.replicate(state)
    self.keep = Handoff()
    frozen = import_frozen(self.target.embedding, self.target.lm_head, self.keep,
                           device=self.place.device)
    self.frozen = self.place.replicate(frozen)
    self.step_fn = step_lib.jit_train_step(
        step_lib.make_train_step(self.graphdef, dcfg, t, optimizer, _attn_impl(t)),
        out_shardings=None if self.place.mesh is None else self.place.replicated)
    from bridge.target import FeatureCache
    gib = cfg.target.feature_cache_gib
    self.features = FeatureCache(self.target, gib * 2**30) if gib > 0 else self.target

    self.metrics_file = open(os.path.join(out, "metrics.jsonl"), "a")
    self.writer = None
    if t.tensorboard:
      from tensorboardX import SummaryWriter
      self.writer = SummaryWriter(os.path.join(out, "tensorboard"))
    self.tokens_per_step = A * B * cfg.data.seq_len
    self.first = int(self.state.step)
    self.summary: dict[str, Any] = {"output_dir": out, "start_step": self.first}
    self.data_state = self.batches.state_dict()     # iterator position matching `state`
    self.last_saved = self.first if self.first else None
    self.pending = None                             # (step index, metrics, handoff): not read yet
    self.history: list[dict] = []
    self.references: dict = {}  # target-only decodes of the held-out prompts: the target is frozen
    self.t_prev = time.time()

  def _resume(self, state):
    _, meta = ckpt.read_meta(self.mngr)
    saved = DrafterConfig.from_zlab(meta["drafter_config"])
    if saved != self.dcfg:
      diff = [f.name for f in dataclasses.fields(self.dcfg)
              if getattr(saved, f.name) != getattr(self.dcfg, f.name)]
      raise TrainingError(f"{self.out}/checkpoints holds a drafter with a different architecture "
                          f"(fields {diff}); use another train.output_dir or the same config")
    state, meta = ckpt.restore(self.mngr, state)
    self.batches.load_state_dict(meta["data"])
    log.info("resumed from %s at step %d", self.mngr.directory, int(state.step))
    return state

  def next_batch(self):
    micro = [next(self.batches) for _ in range(self.t.grad_accum)]
    host = {k: np.stack([m[k] for m in micro]) for k in micro[0]}
    return host, self.features.stacked_features(micro, self.dcfg.target_layer_ids)

  def save(self):
    s = ckpt.save(self.mngr, self.state, {
        "drafter_config": self.dcfg.to_zlab(), "run_config": self.cfg.to_dict(),
        "data": self.data_state, "history_tail": self.history[-5:]})
    self.last_saved = s
    log.info("checkpoint step %d -> %s", s, self.mngr.directory)

  def flush(self):
    """Read the metrics of the step in flight (if any): log them, stop on NaN/Inf."""
    if self.pending is None:
      return
    (i, metrics, h), self.pending = self.pending, None
    t = self.t
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    h.release_after()
    now = time.time()
    m["tokens_per_s"] = self.tokens_per_step / max(now - self.t_prev, 1e-9)
    self.t_prev = now
    m["step"] = i + 1
    if not m.pop("finite"):
      raise TrainingError(
          f"loss or gradients became NaN/Inf at step {i + 1} (loss={m['loss']}, grad_norm="
          f"{m['grad_norm']}); that update was not applied and the run stopped. The last good "
          f"state is saved in {self.mngr.directory}. Lower train.learning_rate or check the data, "
          "then rerun the same command to resume.")
    self.history.append(m)
    self.progress.update(i + 1, m)
    if (i + 1) % t.log_every == 0 or i + 1 == t.steps or i == self.first:
      log.info("step %d/%d loss %.4f acc %.3f tau~ %.2f lr %.2e gnorm %.2f tok/s %.0f", i + 1,
               t.steps, m["loss"], m["accuracy"], m["tau_estimate"], m["lr"], m["grad_norm"],
               m["tokens_per_s"])
    self.metrics_file.write(_jsonl(m))
    self.metrics_file.flush()
    if self.writer is not None:
      for k, v in m.items():
        if k != "step":
          self.writer.add_scalar(f"train/{k}", v, i + 1)

  def evaluate(self, step):
    """Real speculative decoding on held-out prompts; logs tau next to the training estimate.

    The target-only reference is decoded at the first evaluation only (`references`)."""
    from jax_drafter.evaluate import evaluate_tau, prompts_from_conversations
    t, target = self.t, self.target
    prompts = prompts_from_conversations(self.ds.held_out, t.eval_prompts, tokenizer=target.tokenizer,
                                         max_prompt_tokens=target.info.max_position_embeddings // 2)
    if not prompts:
      log.warning("evaluation skipped: no usable held-out prompt (raise data.held_out)")
      return None
    report = evaluate_tau(target, self.dcfg, self.graphdef, self.state.params, prompts,
                          max_new_tokens=t.eval_max_new_tokens, progress=False, frozen=self.frozen,
                          reference_cache=self.references)
    est = self.history[-1]["tau_estimate"] if self.history else None  # None, never NaN: JSONL
    ll = report["lossless"]
    log.info("step %d: speculative decoding on %d held-out prompts: tau %.3f (training estimate "
             "%s), lossless %s (%d near-ties within rounding noise)", step, len(prompts),
             report["tau"], "n/a" if est is None else f"{est:.2f}", ll["passed"], len(ll["ties"]))
    rec = {"step": step, "eval_tau": report["tau"], "train_tau_estimate": est,
           "lossless": ll["passed"], "near_ties": len(ll["ties"])}
    self.metrics_file.write(_jsonl(rec))
    if self.writer is not None:
      self.writer.add_scalar("eval/tau", report["tau"], step)
    self.summary.setdefault("evaluations", []).append(rec)
    self.summary["eval_report"] = report
    return report

  def close(self, completed: bool):
    """Reached on normal exit, Ctrl-C, and errors: the state in hand is always a good one (a
    non-finite step leaves it untouched), so it is saved unless it is already on disk."""
    try:
      if self.pending is not None:
        jax.block_until_ready(self.pending[1])
      if int(self.state.step) != self.last_saved and int(self.state.step) > 0:
        self.save()
    except Exception as e:  # noqa: BLE001 - never hide the error that got us here
      if completed:
        raise
      log.error("could not write a final checkpoint (%s); the last one on disk is step %s",
                e, self.last_saved)
    finally:
      self.metrics_file.close()
      if self.writer is not None:
        self.writer.close()
      self.progress.close()


def train(cfg: RunConfig, *, progress: Progress | None = None, first_step=None,
          stop_after: int | None = None, time_budget_s: float | None = None) -> dict[str, Any]:
  """Run (or resume) training as configured. Returns a summary dict.

  time_budget_s: stop (with a checkpoint, and an evaluation if configured) once this many seconds
  of training have passed in this invocation; rerunning resumes (a run longer than one session).
  stop_after: stop (with a checkpoint) after this many steps of this invocation (tests use it to
  simulate an interruption).
  first_step: for tools that measure the real step (jax_drafter.tools.memory.StepReport): its
  before(step_fn, state, batch, frozen) gets the first step's arguments before it is dispatched,
  its after(metrics) that step's metrics once it is.
  """
  from bridge.handoff import Handoff

  run = _Run(cfg, progress or Progress(), show_progress=progress is not None)
  t, first, total = cfg.train, run.first, cfg.train.steps
  run.progress.start(first, total)
  stop = first + stop_after if stop_after is not None else total
  out_of_time = completed = False
  t_loop = time.time()
  try:
    with _Interrupt() as intr:
      for i in range(first, min(total, stop)):
        if time_budget_s is not None and time.time() - t_loop >= time_budget_s:
          out_of_time = True
          log.info("time budget of %.0f s reached at step %d of %d: saving; rerun the same "
                   "command to continue", time_budget_s, i, total)
          break
        host, feats_t = run.next_batch()
        h = Handoff()
        batch = {k: run.place.split_rows(v) for k, v in host.items()}
        batch["features"] = run.place.features(h, feats_t)
        if i == first and first_step is not None:
          first_step.before(run.step_fn, run.state, batch, run.frozen)
        run.state, metrics = run.step_fn(run.state, batch, run.frozen)
        run.data_state = run.batches.state_dict()
        run.flush()                     # step t is dispatched: now read step t-1's metrics
        run.pending = (i, metrics, h)
        if i == first and first_step is not None:
          first_step.after(metrics)
        if (i + 1) % t.checkpoint_every == 0 and i + 1 < total:
          run.flush()
          run.save()
        if t.eval_every and t.eval_prompts and (i + 1) % t.eval_every == 0 and i + 1 < total:
          run.flush()
          run.evaluate(i + 1)
        if intr.hit:
          break
      run.flush()
      if t.eval_prompts and not intr.hit and (int(run.state.step) == total or out_of_time):
        run.evaluate(int(run.state.step))
    completed = True
  finally:
    run.close(completed)
  history = run.history
  run.summary.update(final_step=int(run.state.step), last=history[-1] if history else None,
                     first=history[0] if history else None, checkpoint=run.last_saved,
                     drafter_config=run.dcfg, target=run.target, graphdef=run.graphdef,
                     params=run.state.params, held_out=run.ds.held_out,
                     interrupted=bool(intr.hit), data_stats=run.ds.stats, out_of_time=out_of_time)
  return run.summary
