"""The training loop: feeds batches, logs, checkpoints. All step logic lives in step.py; what a
run trains on (target, drafter config, rows) comes from inputs.py, its feeding from pipeline.py.

Order of work per iteration: the next step's features (made ahead on the producer thread: host
batch -> target forward (torch) -> DLPack handoff) -> dispatch step t -> read step t-1's metrics
-> log -> checkpoint / validation / evaluation.
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
from jax_drafter import config as config_lib
from jax_drafter import data as data_lib
from jax_drafter import draft_vocab
from jax_drafter import inputs
from jax_drafter import pipeline
from jax_drafter import step as step_lib
from jax_drafter import target_init
from jax_drafter.config import DrafterConfig, RunConfig

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


def _read_json(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


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


class _InOrder:
  """Batches of rows in file order, once (the validation rows: the same batches every time)."""

  def __init__(self, rows: dict, batch_size: int):
    self.rows, self.B, self.i = rows, batch_size, 0

  def __next__(self) -> dict:
    out = {k: v[self.i:self.i + self.B] for k, v in self.rows.items()}
    self.i += self.B
    return out

  def state_dict(self) -> dict:
    return {"position": self.i}


def bound(m: dict) -> str:
  """Which side limits throughput: the slower of the target side and the drafter side."""
  return "target" if m["target_tokens_per_s"] < m["drafter_tokens_per_s"] else "drafter"


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
    self.main = jax.process_index() == 0    # with several processes, process 0 writes the files
    self.target, self.dcfg, self.ds = inputs.setup_in_order(cfg, progress=show_progress and self.main)
    dcfg = self.dcfg
    # What the target captures: the drafter's layers (+ its final-normed state for distillation).
    self.layer_ids = config_lib.feature_layer_ids(dcfg, t)
    log.info("drafter: %s", json.dumps(dcfg.to_zlab()["dflash_config"]) + f" layers={dcfg.layer_types}")
    A, B = t.grad_accum, cfg.data.batch_size
    optimizer = step_lib.make_optimizer(t)
    self.graphdef, state = step_lib.init_state(dcfg, t, optimizer)
    self.batches = data_lib.BatchIterator(self.ds.rows, B, seed=cfg.data.seed)
    self.mngr = ckpt.manager(out, keep=t.keep_checkpoints)
    self.vocab = None           # the reduced draft vocabulary's ids (draft_vocab.py), if any
    if self.mngr.latest_step() is not None:
      state = self._resume(state)
    elif t.init_from_target_layers is not None:
      state = target_init.start(state, dcfg, t, self.target, optimizer)
      ids = list(t.init_from_target_layers)
      log.info("drafter layers start as copies of target layers %s (fc: the identity on layer "
               "%d's feature)", ids,
               dcfg.target_layer_ids[target_init.context_feature(dcfg.target_layer_ids, ids[0])])
    if dcfg.draft_vocab_size is not None and self.vocab is None:
      self.vocab = draft_vocab.choose(self.ds.rows, dcfg.vocab_size, dcfg.draft_vocab_size,
                                      pad_doc_id=data_lib.PAD_DOC_ID)
    if self.vocab is not None:
      log.info("draft vocabulary: %d of %d tokens, %.2f%% of the training rows' supervised tokens",
               len(self.vocab), dcfg.vocab_size, 100 * draft_vocab.coverage(self.vocab, self.ds.rows))
    if self.main:
      ckpt.save_json(os.path.join(out, "config.json"),
                     {"run_config": cfg.to_dict(), "drafter_config": dcfg.to_zlab()})

    # Frozen weights cross once; the torch tensors stay alive in `keep` for the whole run.
    # The drafter's devices: features from a target on another GPU are copied there explicitly.
    self.place = pipeline.Placement(B, t.devices)
    shardings = self.place.state_shardings(state, t.shard_state)
    self.state = self.place.put(state, shardings)
    self.keep = Handoff()
    frozen = import_frozen(self.target.embedding, self.target.lm_head, self.keep,
                           device=self.place.device)
    self.frozen = draft_vocab.with_draft_vocab(
        step_lib.frozen_in_compute_dtype(self.place.replicate(frozen), t.compute_dtype), self.vocab)
    self.step_fn = step_lib.jit_train_step(
        step_lib.make_train_step(self.graphdef, dcfg, t, optimizer, _attn_impl(t)),
        out_shardings=(shardings, self.place.replicated) if self.place.multi else None)
    gib = cfg.target.feature_cache_gib
    if cfg.data.features:   # no target forward: every row's features come from disk
      from bridge.feature_store import open_stores
      tc = cfg.target
      self.replicas = []
      self.sources = open_stores(cfg.data.features, self.ds.rows, tc.devices or (tc.device,),
                                 dtype=tc.dtype)
    else:
      self.replicas = [self.target] + inputs.load_replicas(cfg)
      host_gib = cfg.target.feature_cache_host_gib
      if gib > 0 or host_gib > 0:
        from bridge.target import FeatureCache
        # The host tier is one budget for the machine: split over the replicas.
        self.sources = [FeatureCache(r, gib * 2**30,
                                     host_bytes=host_gib * 2**30 / len(self.replicas))
                        for r in self.replicas]
      else:
        self.sources = list(self.replicas)

    self.metrics_file = open(os.path.join(out, "metrics.jsonl") if self.main else os.devnull, "a")
    self.writer = None
    if t.tensorboard and self.main:
      from tensorboardX import SummaryWriter
      self.writer = SummaryWriter(os.path.join(out, "tensorboard"))
    self.tokens_per_step = A * B * cfg.data.seq_len
    self.first = self.step
    self.summary: dict[str, Any] = {"output_dir": out, "start_step": self.first}
    self.data_state = self.batches.state_dict()     # iterator position matching `state`
    self.last_saved = self.first if self.first else None
    self.pending = None                             # (step index, metrics, handoff): not read yet
    self.history: list[dict] = []
    self.references: dict = {}  # target-only decodes of the held-out prompts: the target is frozen
    self.eval_sums = None       # the jitted validation forwards, built at the first validation
    self.accept_fn = None       # (accepted lengths at every answer position, for val_tau)
    self.val_anchors = None     # objective.ResponseAnchors of the validation rows
    self.best_score = None      # best validation tau estimate of the run (read at first use)

  @property
  def step(self) -> int:
    return int(pipeline.whole(self.state.step))

  def _resume(self, state):
    _, meta = ckpt.read_meta(self.mngr)
    saved = DrafterConfig.from_zlab(meta["drafter_config"])
    if saved != self.dcfg:
      diff = [f.name for f in dataclasses.fields(self.dcfg)
              if getattr(saved, f.name) != getattr(self.dcfg, f.name)]
      raise TrainingError(f"{self.out}/checkpoints holds a drafter with a different architecture "
                          f"(fields {diff}); use another train.output_dir or the same config")
    state, meta = ckpt.restore(self.mngr, state)
    # The vocabulary the drafter was trained with, even if the data would now choose another.
    self.vocab = draft_vocab.from_meta(meta, saved, source=f"{self.mngr.directory}")
    self.batches.load_state_dict(meta["data"])
    log.info("resumed from %s at step %d", self.mngr.directory, int(state.step))
    return state

  def validate(self, step: int):
    """Loss, accuracy and tau estimate on the validation rows (never trained on), with the same
    anchors every time: the curve that shows overfitting, which the training loss cannot. Also
    `val_tau`: the tau that greedy speculative decoding of the validation answers (their first
    train.eval_max_new_tokens tokens) measures, exactly, from anchors at every position."""
    from jax_drafter import objective
    rows = self.ds.val_rows
    if rows is None:
      return None
    B = self.cfg.data.batch_size
    R0 = R = len(rows["input_ids"])
    if R < B:                           # fewer rows than a batch: repeat them to fill one
      rows = {k: np.resize(v, (B,) + v.shape[1:]) for k, v in rows.items()}
      R = B
    if self.eval_sums is None:
      self.eval_sums = step_lib.make_eval_sums(self.graphdef, self.dcfg, self.t, _attn_impl(self.t))
      self.accept_fn = step_lib.make_accept_lengths(self.graphdef, self.dcfg, self.t,
                                                    _attn_impl(self.t))
      self.val_anchors = objective.response_anchors(rows["loss_mask"], rows["doc_id"],
                                                    self.t.eval_max_new_tokens)
    ra = self.val_anchors
    producer = pipeline.Producer(_InOrder(rows, B), 1, B, self.sources,
                                 self.layer_ids, self.place)
    key = jax.random.key(self.t.seed + 7)
    total, accepts = None, []
    for b in range(R // B):
      feed = producer.next()
      sums = self.eval_sums(self.state.params, feed.batch, self.frozen, jax.random.fold_in(key, b))
      total = sums if total is None else jax.tree.map(jnp.add, total, sums)
      sl = slice(b * B, (b + 1) * B)
      accepts.append(self.accept_fn(self.state.params, feed.batch, self.frozen,
                                    self.place.split_rows(ra.anchors[None, sl]),
                                    self.place.split_rows(ra.valid[None, sl])))
      feed.handoff.release_after((total, accepts[-1]))
    producer.close()
    m = pipeline.scalars(objective.metrics_from_sums(total, distill=bool(self.t.kd_weight)))
    accept = np.concatenate([pipeline.whole(a) for a in accepts])
    n = min(R0, len(accept))            # rows repeated to fill a batch count once
    walk = objective.walk_tau(accept[:n], ra, rows=range(n))
    rec = {"step": step, "val_loss": m["loss"], "val_accuracy": m["accuracy"],
           "val_tau_estimate": m["tau_estimate"], "val_tau": walk["tau"],
           "val_tau_stderr": walk["tau_stderr"], "val_responses": walk["responses"]}
    if "kl" in m:
      rec["val_kl"] = m["kl"]
    last = self.history[-1] if self.history else None
    err = "" if walk["tau_stderr"] is None else f" ± {walk['tau_stderr']:.3f}"
    log.info("step %d: validation (%d rows) loss %.4f acc %.3f tau %.3f%s on %d answers "
             "(first %d tokens; estimate %.2f)%s", step, R // B * B, rec["val_loss"],
             rec["val_accuracy"], rec["val_tau"], err, walk["responses"],
             self.t.eval_max_new_tokens,
             rec["val_tau_estimate"],
             "" if last is None else f"; training: loss {last['loss']:.4f} acc "
             f"{last['accuracy']:.3f} tau~ {last['tau_estimate']:.2f}")
    for i, src in enumerate(self.sources):    # how the rows' features are kept and served
      if hasattr(src, "describe"):
        log.info("feature cache%s: %s", f" {i}" if len(self.sources) > 1 else "", src.describe())
    self.metrics_file.write(_jsonl(rec))
    self.metrics_file.flush()
    if self.writer is not None:
      for k in ("val_loss", "val_accuracy", "val_tau_estimate", "val_tau", "val_kl"):
        if k in rec:
          self.writer.add_scalar(f"val/{k[4:]}", rec[k], step)
    self.summary.setdefault("validations", []).append(rec)
    if self.t.keep_best:
      self._keep_if_best(rec)
    return rec

  def _keep_if_best(self, rec: dict) -> None:
    """Export the drafter to <output_dir>/best when its validation tau (`val_tau`) is the best so
    far (the record survives a resume in best/validation.json): past the point where more epochs
    stop helping, the best drafter is not the last one."""
    from jax_drafter.export import write_zlab
    path = os.path.join(self.out, "best")
    if self.best_score is None:         # first validation of this invocation: a resumed run's best
      prev = _read_json(os.path.join(path, "validation.json")) if self.main else None
      # A best/ written before val_tau existed is not comparable: the first validation replaces it.
      score = -math.inf if prev is None else prev.get("val_tau", -math.inf)
      if jax.process_count() > 1:       # every process decides alike (the gather below is collective)
        from jax.experimental import multihost_utils
        score = float(multihost_utils.broadcast_one_to_all(np.float32(score)))
      self.best_score = score
    if not rec["val_tau"] > self.best_score:     # NaN (no answer long enough) never wins
      return
    self.best_score = rec["val_tau"]
    params = pipeline.this_process(self.state.params)
    if self.main:
      write_zlab(path, self.dcfg, params, vocab=self.vocab)
      ckpt.save_json(os.path.join(path, "validation.json"), rec)
      log.info("step %d: best validation tau so far (%.3f): drafter exported to %s",
               rec["step"], rec["val_tau"], path)
    self.summary["best"] = rec

  def feeder(self, count: int) -> pipeline.Prefetcher:
    """Target features for the next `count` steps, made ahead on a producer thread."""
    producer = pipeline.Producer(self.batches, self.t.grad_accum, self.cfg.data.batch_size,
                                 self.sources, self.layer_ids, self.place)
    return pipeline.Prefetcher(producer, count, depth=self.t.prefetch)

  def save(self):
    s = ckpt.save(self.mngr, self.state, {
        "drafter_config": self.dcfg.to_zlab(), "run_config": self.cfg.to_dict(),
        "data": self.data_state, "history_tail": self.history[-5:]}
        | ({} if self.vocab is None else {"draft_vocab": [int(i) for i in self.vocab]}))
    self.last_saved = s
    log.info("checkpoint step %d -> %s", s, self.mngr.directory)

  def flush(self):
    """Read the metrics of the step in flight (if any): log them, stop on NaN/Inf."""
    if self.pending is None:
      return
    (i, metrics, feed, waited), self.pending = self.pending, None
    t = self.t
    m = pipeline.scalars(metrics)
    feed.handoff.release_after()
    drafter_s, wall_s = self.clock.wait(i)
    tok = self.tokens_per_step
    # Throughput over the step's wall time (checkpoints and evaluations excluded); each side's
    # own rate: the target side's forwards and copies, the drafter's time on its devices.
    m["tokens_per_s"] = tok / max(wall_s, 1e-9)
    m["target_tokens_per_s"] = tok / max(feed.target_s, 1e-9)
    m["drafter_tokens_per_s"] = tok / max(drafter_s, 1e-9)
    m["feature_copy_s"] = feed.copy_s
    m["drafter_wait_s"] = waited
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
      log.info("step %d/%d loss %.4f%s acc %.3f tau~ %.2f lr %.2e gnorm %.2f tok/s %.0f (target "
               "%.0f, drafter %.0f: %s-bound)", i + 1, t.steps, m["loss"],
               f" (kl {m['kl']:.4f})" if "kl" in m else "", m["accuracy"],
               m["tau_estimate"], m["lr"], m["grad_norm"], m["tokens_per_s"],
               m["target_tokens_per_s"], m["drafter_tokens_per_s"], bound(m))
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
    # Every process takes part in gathering sharded parameters (a collective), then only
    # process 0 decodes.
    params, frozen = pipeline.this_process(self.state.params), pipeline.this_process(self.frozen)
    if not self.main:
      return None                       # process 0 decodes; the others have nothing to add
    t = self.t
    # No training work in flight while torch decodes (and captures its CUDA graphs) on the device.
    jax.block_until_ready(self.state)
    # Training from a feature cache reads only the target's embedding and LM head; decoding needs
    # the model, built at the first evaluation.
    target = self.target.load_model() if hasattr(self.target, "load_model") else self.target
    prompts = prompts_from_conversations(self.ds.held_out, t.eval_prompts, tokenizer=target.tokenizer,
                                         max_prompt_tokens=target.info.max_position_embeddings // 2)
    if not prompts:
      log.warning("evaluation skipped: no usable held-out prompt (raise data.held_out)")
      return None
    report = evaluate_tau(target, self.dcfg, self.graphdef, params, prompts,
                          max_new_tokens=t.eval_max_new_tokens, progress=False, frozen=frozen,
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
      if self.step != self.last_saved and self.step > 0:
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
          stop_after: int | None = None, time_budget_s: float | None = None,
          budget_from: float | None = None) -> dict[str, Any]:
  """Run (or resume) training as configured. Returns a summary dict.

  time_budget_s: stop (with a checkpoint, and an evaluation if configured) once this many seconds
  have passed since budget_from (a time.time(); default: the first step of this invocation, so
  start-up is not counted); rerunning resumes (a run longer than one session).
  stop_after: stop (with a checkpoint) after this many steps of this invocation (tests use it to
  simulate an interruption).
  first_step: for tools that measure the real step (jax_drafter.tools.memory.StepReport): its
  before(step_fn, state, batch, frozen) gets the first step's arguments before it is dispatched,
  its after(metrics) that step's metrics once it is.
  """
  run = _Run(cfg, progress or Progress(), show_progress=progress is not None)
  t, first, total = cfg.train, run.first, cfg.train.steps
  run.progress.start(first, total)
  stop = min(total, first + stop_after if stop_after is not None else total)
  out_of_time = completed = False
  feeder = run.feeder(max(0, stop - first))
  run.clock = pipeline.StepClock()
  t_loop = time.time()
  t_budget = t_loop if budget_from is None else budget_from
  if time_budget_s is not None and t_loop - t_budget >= time_budget_s:
    log.warning("start-up took %.0f s of the %.0f s time budget: no step fits; give more time",
                t_loop - t_budget, time_budget_s)
  try:
    with _Interrupt() as intr:
      for i in range(first, stop):
        if time_budget_s is not None and time.time() - t_budget >= time_budget_s:
          out_of_time = True
          log.info("time budget of %.0f s reached at step %d of %d: saving; rerun the same "
                   "command to continue", time_budget_s, i, total)
          break
        feed, waited = feeder.get()
        if i == first and first_step is not None:
          first_step.before(run.step_fn, run.state, feed.batch, run.frozen)
        run.state, metrics = run.step_fn(run.state, feed.batch, run.frozen)
        run.clock.dispatched(i, metrics)
        run.data_state = feed.data_state
        run.flush()                     # step t is dispatched: now read step t-1's metrics
        run.pending = (i, metrics, feed, waited)
        if i == first and first_step is not None:
          first_step.after(metrics)
        if (i + 1) % t.checkpoint_every == 0 and i + 1 < total:
          run.flush()
          run.save()
          run.clock.pause()             # the save is not training time
        if t.val_every and (i + 1) % t.val_every == 0 and i + 1 < total:
          run.flush()
          with feeder.hold():           # the target computes the validation rows' features
            run.validate(i + 1)
          run.clock.pause()
        if t.eval_every and t.eval_prompts and (i + 1) % t.eval_every == 0 and i + 1 < total:
          run.flush()
          with feeder.hold():           # the target decodes: no feature forward meanwhile
            run.evaluate(i + 1)
          run.clock.pause()
        if intr.hit:
          break
      run.flush()
      feeder.close()
      if t.val_every and not intr.hit and (run.step == total or out_of_time):
        run.validate(run.step)
      if t.eval_prompts and not intr.hit and (run.step == total or out_of_time):
        if run.step != run.last_saved:
          run.save()                    # on disk before the (long) evaluation
        run.evaluate(run.step)
    completed = True
  finally:
    feeder.close()
    run.clock.close()
    run.close(completed)
  history = run.history
  run.summary.update(final_step=run.step, last=history[-1] if history else None,
                     first=history[0] if history else None, checkpoint=run.last_saved,
                     drafter_config=run.dcfg, target=run.target, graphdef=run.graphdef,
                     params=pipeline.this_process(run.state.params), held_out=run.ds.held_out,
                     draft_vocab=run.vocab,
                     interrupted=bool(intr.hit), data_stats=run.ds.stats, out_of_time=out_of_time)
  return run.summary
