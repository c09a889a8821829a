"""Checkpoints with orbax: train state + JSON metadata (config, data position, metrics).

Orbax writes each step into a temporary directory and renames it when complete, so a crash or
Ctrl-C during a save leaves the previous checkpoint intact. Checkpoints hold only arrays and JSON:
loading never executes code.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_drafter.config import DrafterConfig
from jax_drafter.params import from_flat, to_flat
from jax_drafter.pipeline import whole

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
  pass


def _flat_state(state) -> dict[str, Any]:
  """TrainState -> {"params/<name>": array, "opt/<path>": array, "step": ..., "rng": ...}."""
  out = {f"params/{k}": v for k, v in to_flat(state.params).items()}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
    out["opt/" + jax.tree_util.keystr(path)] = leaf
  out["step"] = state.step
  out["rng"] = state.rng
  return out


def latest_step(run_dir: str) -> int | None:
  """The newest finished checkpoint's step of a run directory, without loading anything (None if
  there is none). Orbax renames a step directory only when it is complete: a digit name is one."""
  path = os.path.join(run_dir, "checkpoints")
  steps = [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []
  return max(steps) if steps else None


def manager(run_dir: str, keep: int = 2) -> ocp.CheckpointManager:
  opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
  return ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, "checkpoints")), options=opts)


def save(mngr: ocp.CheckpointManager, state, meta: dict[str, Any]) -> int:
  # Whole host arrays whatever the layout (replicated, sharded, several processes).
  step = int(whole(state.step))
  flat = {k: whole(v) for k, v in _flat_state(state).items()}
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                          meta=ocp.args.JsonSave(meta)), force=True)
  mngr.wait_until_finished()
  return step


def read_meta(mngr: ocp.CheckpointManager, step: int | None = None) -> tuple[int, dict]:
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f"no checkpoint in {mngr.directory}")
  meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  return step, meta


def restore(mngr: ocp.CheckpointManager, template, step: int | None = None):
  """Restore into the structure of `template` (a TrainState). Errors name the mismatching key."""
  step, meta = read_meta(mngr, step)
  want = {k: np.asarray(v) for k, v in jax.device_get(_flat_state(template)).items()}
  abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in want.items()}
  try:
    flat = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
  except (ValueError, KeyError) as e:
    raise CheckpointError(f"checkpoint {mngr.directory}/{step} does not match this run's "
                          f"architecture/optimizer ({e}); use a fresh output directory or the "
                          "config it was trained with") from None
  params = {k[len("params/"):]: v for k, v in flat.items() if k.startswith("params/")}
  cfg = DrafterConfig.from_zlab(meta["drafter_config"], source=f"checkpoint {step} metadata")
  _, p = from_flat(cfg, params, source=f"checkpoint {mngr.directory}/{step}")
  opt_leaves = [flat["opt/" + jax.tree_util.keystr(path)]
                for path, _ in jax.tree_util.tree_flatten_with_path(template.opt_state)[0]]
  opt_state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template.opt_state),
                                           [jax.numpy.asarray(x) for x in opt_leaves])
  state = type(template)(jax.numpy.asarray(flat["step"]), p, opt_state,
                         jax.numpy.asarray(flat["rng"]))
  return state, meta


def load_params(run_dir: str, step: int | None = None):
  """(DrafterConfig, graphdef, params, meta) of a training run's checkpoint (no optimizer state)."""
  ckpt_dir = os.path.join(run_dir, "checkpoints")
  if not os.path.isdir(ckpt_dir):
    raise CheckpointError(f"{run_dir} has no checkpoints/ directory: not a training run directory")
  mngr = manager(run_dir)
  step, meta = read_meta(mngr, step)
  cfg = DrafterConfig.from_zlab(meta["drafter_config"], source=f"{ckpt_dir}/{step} metadata")
  flat = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  params = {k[len("params/"):]: v for k, v in flat.items() if k.startswith("params/")}
  graphdef, p = from_flat(cfg, params, source=f"{ckpt_dir}/{step}")
  return cfg, graphdef, p, meta


def save_json(path: str, obj: Any) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)
