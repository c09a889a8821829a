"""The training loop: feeds batches, logs, checkpoints. All step logic lives in step.py.

Order of work per iteration: host batch -> target forward (torch) -> DLPack handoff -> dispatch
step t -> read step t-1's metrics (this overlaps the target forward of step t with the drafter
step t-1 on the device) -> log -> checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
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


def setup(cfg: RunConfig, *, regenerate_stats: dict | None = None):
  """Target, resolved drafter config, dataset. Separate so tests and tools can reuse it."""
  from bridge import target as target_lib
  check_inputs(cfg)
  tc = cfg.target
  target = target_lib.load_target(tc.path, gguf_file=tc.gguf_file, dtype=tc.dtype,
                                  device=tc.device, trust_remote_code=tc.trust_remote_code)
  mask_id = (cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None
             else target_lib.choose_mask_token_id(target))
  dcfg = resolve_drafter(cfg.drafter, target.info, mask_id)
  target.check_layer_ids(dcfg.target_layer_ids)
  target_lib.check_mask_token_id(target, dcfg.mask_token_id)
  regen, regen_key = None, ""
  if cfg.data.regenerate:
    # DFlash trains on the target's own outputs: the target rewrites the assistant turns first,
    # cached on disk and keyed by the target's fingerprint and the generation settings.
    regen, regen_key = regeneration(cfg, target, stats=regenerate_stats)
  ds = data_lib.build_dataset(
      target.tokenizer, cfg.data.path, cfg.data.seq_len, max_conversations=cfg.data.max_conversations,
      held_out=cfg.data.held_out, seed=cfg.data.seed, cache_dir=cfg.data.cache_dir,
      regenerate=regen, regenerate_key=regen_key)
  return target, dcfg, ds


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


def train(cfg: RunConfig, *, progress: Progress | None = None, memory_report: str | None = None,
          stop_after: int | None = None, time_budget_s: float | None = None) -> dict[str, Any]:
  """Run (or resume) training as configured. Returns a summary dict.

  time_budget_s: stop (with a checkpoint, and an evaluation if configured) once this many seconds
  of training have passed in this invocation; rerunning resumes (a run longer than one session).
  stop_after: stop (with a checkpoint) after this many steps of this invocation (tests use it to
  simulate an interruption).
  """
  from bridge.handoff import Handoff, import_frozen

  progress = progress or Progress()
  t = cfg.train
  out = t.output_dir
  os.makedirs(out, exist_ok=True)
  target, dcfg, ds = setup(cfg)
  log.info("drafter: %s", json.dumps(dcfg.to_zlab()["dflash_config"]) + f" layers={dcfg.layer_types}")
  A, B = t.grad_accum, cfg.data.batch_size
  optimizer = step_lib.make_optimizer(t)
  graphdef, state = step_lib.init_state(dcfg, t, optimizer)
  batches = data_lib.BatchIterator(ds.rows, B, seed=cfg.data.seed)
  mngr = ckpt.manager(out, keep=t.keep_checkpoints)
  if mngr.latest_step() is not None:
    _, meta = ckpt.read_meta(mngr)
    saved = DrafterConfig.from_zlab(meta["drafter_config"])
    if saved != dcfg:
      diff = [f.name for f in dataclasses.fields(dcfg) if getattr(saved, f.name) != getattr(dcfg, f.name)]
      raise TrainingError(f"{out}/checkpoints holds a drafter with a different architecture "
                          f"(fields {diff}); use another train.output_dir or the same config")
    state, meta = ckpt.restore(mngr, state)
    batches.load_state_dict(meta["data"])
    log.info("resumed from %s at step %d", mngr.directory, int(state.step))
  ckpt.save_json(os.path.join(out, "config.json"),
                 {"run_config": cfg.to_dict(), "drafter_config": dcfg.to_zlab()})

  # Frozen weights cross once; the torch tensors stay alive in `keep` for the whole run.
  # The drafter's device: features from a target on another GPU are copied there explicitly.
  place = Placement(B)
  device = place.device
  state = place.replicate(state)
  keep = Handoff()
  frozen = import_frozen(target.embedding, target.lm_head, keep, device=device)
  frozen = place.replicate(frozen)
  step_fn = step_lib.jit_train_step(
      step_lib.make_train_step(graphdef, dcfg, t, optimizer, _attn_impl(t)),
      out_shardings=None if place.mesh is None else place.replicated)

  def next_batch():
    micro = [next(batches) for _ in range(A)]
    host = {k: np.stack([m[k] for m in micro]) for k in micro[0]}
    return host, target.stacked_features(micro, dcfg.target_layer_ids)

  metrics_file = open(os.path.join(out, "metrics.jsonl"), "a")
  writer = None
  if t.tensorboard:
    from tensorboardX import SummaryWriter
    writer = SummaryWriter(os.path.join(out, "tensorboard"))
  tokens_per_step = A * B * cfg.data.seq_len
  first = int(state.step)
  total = t.steps
  summary: dict[str, Any] = {"output_dir": out, "start_step": first}
  data_state = batches.state_dict()     # iterator position matching `state`
  last_saved = first if first else None
  pending = None                        # (step index, metrics, handoff, data_state, t_dispatch)
  completed = False
  t_prev = time.time()
  history: list[dict] = []

  def save():
    nonlocal last_saved
    s = ckpt.save(mngr, state, {"drafter_config": dcfg.to_zlab(), "run_config": cfg.to_dict(),
                                "data": data_state, "history_tail": history[-5:]})
    last_saved = s
    log.info("checkpoint step %d -> %s", s, mngr.directory)

  def finish(p):
    nonlocal t_prev
    i, metrics, h, _, _ = p
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    h.release_after()
    now = time.time()
    m["tokens_per_s"] = tokens_per_step / max(now - t_prev, 1e-9)
    t_prev = now
    m["step"] = i + 1
    if not m.pop("finite"):
      raise TrainingError(
          f"loss or gradients became NaN/Inf at step {i + 1} (loss={m['loss']}, grad_norm="
          f"{m['grad_norm']}); that update was not applied and the run stopped. The last good "
          f"state is saved in {mngr.directory}. Lower train.learning_rate or check the data, "
          "then rerun the same command to resume.")
    history.append(m)
    progress.update(i + 1, m)
    if (i + 1) % t.log_every == 0 or i + 1 == total or i == first:
      log.info("step %d/%d loss %.4f acc %.3f tau~ %.2f lr %.2e gnorm %.2f tok/s %.0f", i + 1, total,
               m["loss"], m["accuracy"], m["tau_estimate"], m["lr"], m["grad_norm"], m["tokens_per_s"])
    metrics_file.write(json.dumps(m) + "\n")
    metrics_file.flush()
    if writer is not None:
      for k, v in m.items():
        if k != "step":
          writer.add_scalar(f"train/{k}", v, i + 1)

  references: dict = {}  # target-only decodes of the held-out prompts: the target is frozen

  def evaluate(step):
    """Real speculative decoding on held-out prompts; logs tau next to the training estimate.

    The target-only reference is decoded at the first evaluation only (`references`)."""
    from jax_drafter.evaluate import evaluate_tau, prompts_from_conversations
    prompts = prompts_from_conversations(ds.held_out, t.eval_prompts, tokenizer=target.tokenizer,
                                         max_prompt_tokens=target.info.max_position_embeddings // 2)
    if not prompts:
      log.warning("evaluation skipped: no usable held-out prompt (raise data.held_out)")
      return None
    report = evaluate_tau(target, dcfg, graphdef, state.params, prompts,
                          max_new_tokens=t.eval_max_new_tokens, progress=False, frozen=frozen,
                          reference_cache=references)
    est = history[-1]["tau_estimate"] if history else float("nan")
    ll = report["lossless"]
    log.info("step %d: speculative decoding on %d held-out prompts: tau %.3f (training estimate "
             "%.2f), lossless %s (%d near-ties within rounding noise)", step, len(prompts),
             report["tau"], est, ll["passed"], len(ll["ties"]))
    rec = {"step": step, "eval_tau": report["tau"], "train_tau_estimate": est,
           "lossless": ll["passed"], "near_ties": len(ll["ties"])}
    metrics_file.write(json.dumps(rec) + "\n")
    if writer is not None:
      writer.add_scalar("eval/tau", report["tau"], step)
    summary.setdefault("evaluations", []).append(rec)
    summary["eval_report"] = report
    return report

  progress.start(first, total)
  stop = first + stop_after if stop_after is not None else total
  out_of_time = False
  t_loop = time.time()
  try:
    with _Interrupt() as intr:
      for i in range(first, min(total, stop)):
        if time_budget_s is not None and time.time() - t_loop >= time_budget_s:
          out_of_time = True
          log.info("time budget of %.0f s reached at step %d of %d: saving; rerun the same "
                   "command to continue", time_budget_s, i, total)
          break
        host, feats_t = next_batch()
        h = Handoff()
        batch = {k: place.split_rows(v) for k, v in host.items()}
        batch["features"] = place.features(h, feats_t)
        if i == first and memory_report:
          from jax_drafter.tools import memory
          summary["memory"] = memory.memory_report_for_step(step_fn, state, batch, frozen,
                                                            memory_report)
        state, metrics = step_fn(state, batch, frozen)
        data_state = batches.state_dict()
        if pending is not None:
          finish(pending)
        pending = (i, metrics, h, data_state, time.time())
        if i == first and memory_report:
          jax.block_until_ready(metrics)
          measured = memory.measured_peak_bytes()
          summary["memory"]["measured_peak_bytes"] = measured
          log.info("memory at step 1: predicted peak %s GiB, measured %s",
                   memory.gib(summary["memory"]["predicted_peak_bytes"]).strip(),
                   "n/a on this backend" if measured is None else f"{memory.gib(measured).strip()} GiB")
        if (i + 1) % t.checkpoint_every == 0 and i + 1 < total:
          finish(pending)
          pending = None
          save()
        if t.eval_every and t.eval_prompts and (i + 1) % t.eval_every == 0 and i + 1 < total:
          if pending is not None:
            finish(pending)
            pending = None
          evaluate(i + 1)
        if intr.hit:
          break
      if pending is not None:
        finish(pending)
        pending = None
      if t.eval_prompts and not intr.hit and (int(state.step) == total or out_of_time):
        evaluate(int(state.step))
    completed = True
  finally:
    # Reached on normal exit, Ctrl-C, and errors: the state in hand is always a good one
    # (a non-finite step leaves it untouched), so it is saved unless it is already on disk.
    try:
      if pending is not None:
        jax.block_until_ready(pending[1])
      if int(state.step) != last_saved and int(state.step) > 0:
        save()
    except Exception as e:  # noqa: BLE001 - never hide the error that got us here
      if completed:
        raise
      log.error("could not write a final checkpoint (%s); the last one on disk is step %s",
                e, last_saved)
    finally:
      metrics_file.close()
      if writer is not None:
        writer.close()
      progress.close()
  summary.update(final_step=int(state.step), last=history[-1] if history else None,
                 first=history[0] if history else None, checkpoint=last_saved,
                 drafter_config=dcfg, target=target, graphdef=graphdef, params=state.params,
                 held_out=ds.held_out, interrupted=bool(intr.hit), data_stats=ds.stats,
                 out_of_time=out_of_time)
  return summary
