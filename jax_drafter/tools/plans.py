"""Plans and synthetic inputs: the shapes the tools compile, and the batches they feed them.

A Plan is everything that fixes the compiled train step's shapes. It comes from a named run or run
config (jax_drafter.presets) or a run-config YAML, each with `section.key=value` overrides. The
inputs, one batch layout for all (letters as in config.py; A = train.grad_accum):
  abstract_inputs      ShapeDtypeStructs: the step compiles without memory (memory plans);
  random_inputs        random state, batch and frozen weights in JAX (memory --run, bench, breakdown);
  packed_batch         packed rows of two documents with too few candidates in odd rows (parity);
  sample_anchors       sorted anchors of one fully supervised document (the bench's FLOP count).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jax_drafter import config as config_lib
from jax_drafter import params as params_lib
from jax_drafter import presets
from jax_drafter import step as step_lib
from jax_drafter.presets import TargetDims

NAMES = (*presets.RUNS, *presets.RUN_CONFIGS)
_DRAFTER_FIELDS = ("num_hidden_layers", "block_size", "layer_types", "sliding_window",
                   "mask_token_id", "target_layer_ids", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps")


@dataclass(frozen=True)
class Plan:
  """Everything that fixes the compiled step's shapes."""
  cfg: config_lib.DrafterConfig
  train: config_lib.TrainSection
  batch_size: int
  seq_len: int
  feature_dtype: str = "bfloat16"
  attn_impl: dict | None = None
  name: str = ""

  def replace(self, *, seq_len=None, num_anchors=None, **train) -> "Plan":
    if num_anchors is not None:
      train["num_anchors"] = num_anchors
    return dataclasses.replace(self, seq_len=seq_len or self.seq_len,
                               train=dataclasses.replace(self.train, **train))

  def describe(self) -> str:
    t = self.train
    return (f"S={self.seq_len} N={t.num_anchors} B={self.batch_size} A={t.grad_accum} "
            f"remat={t.remat} ce_chunk={t.ce_chunk_size} V={self.cfg.vocab_size} "
            f"compute={t.compute_dtype} features={self.feature_dtype}")


def run_config(name: str) -> tuple[TargetDims, dict]:
  """(target dims, run-config sections) of a named run config, or of a named run: its
  architecture's target, the drafter section that resolves to exactly that drafter, bf16."""
  if name in presets.RUN_CONFIGS:
    return presets.RUN_CONFIGS[name]
  r = presets.RUNS[name]
  d = presets.get(r.arch)
  drafter = {f: getattr(d, f) for f in _DRAFTER_FIELDS}
  drafter = {k: list(v) if isinstance(v, tuple) else v for k, v in drafter.items()}
  train = {"num_anchors": r.anchors, "compute_dtype": "bfloat16"}
  if r.ce_chunk:
    train["ce_chunk_size"] = r.ce_chunk
  return presets.target(r.arch), {"drafter": drafter, "target": {"dtype": "bfloat16"},
                                  "data": {"seq_len": r.seq_len, "batch_size": r.batch},
                                  "train": train}


def target_dims_from_dir(path: str) -> TargetDims:
  """TargetDims from a Hugging Face model directory's config.json (no weights read)."""
  with open(os.path.join(path, "config.json")) as f:
    c = json.load(f)
  c = c.get("text_config", c)
  rope = c.get("rope_parameters") or {}
  heads = c["num_attention_heads"]
  return TargetDims(c["num_hidden_layers"], c["hidden_size"], c["vocab_size"], heads,
                    c.get("num_key_value_heads") or heads,
                    c.get("head_dim") or c["hidden_size"] // heads, c["intermediate_size"],
                    dtype="bfloat16" if "bfloat16" in str(c.get("torch_dtype", "")) else "float32",
                    rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                    name=os.path.basename(os.path.normpath(path)))


def build_plan(config: str, overrides: list[str] = (), target: str | None = None) -> Plan:
  """A named run or run config, or a run-config YAML (+ `section.key=value` overrides) -> Plan.

  target: an architecture name (its target's dims) or a Hugging Face model directory; for a YAML
  whose target.path is not on this machine."""
  if config in NAMES:
    dims, data = run_config(config)
    data = json.loads(json.dumps(data))
    for ov in overrides:
      (section, key), value = config_lib.parse_override(ov)
      data.setdefault(section, {})[key] = value
    run = config_lib.build_config(data, where=f"preset {config}")
  elif os.path.exists(config):
    run = config_lib.load_config(config, list(overrides))
    dims = None
  else:
    raise config_lib.ConfigError(f"--config {config!r} is neither a file nor a preset "
                                 f"({', '.join(NAMES)})")
  if target is not None:
    dims = presets.target(target) if target in presets.ARCHITECTURES else target_dims_from_dir(target)
  elif dims is None:
    path = run.target.path
    if path and os.path.exists(os.path.join(path, "config.json")):
      dims = target_dims_from_dir(path)
    elif path is None:
      dims = presets.RUN_CONFIGS["smollm2-defaults"][0]
    else:
      raise config_lib.ConfigError(f"target.path={path!r} has no config.json here; pass "
                                   f"--target PRESET_OR_DIR ({', '.join(presets.ARCHITECTURES)})")
  cfg = config_lib.resolve_drafter(run.drafter, dims, mask_token_id=dims.vocab_size - 1)
  return Plan(cfg, run.train, run.data.batch_size, run.data.seq_len,
              feature_dtype=run.target.dtype, attn_impl=_attn(run.train.attention),
              name=f"{dims.name} drafter")


def _attn(impl: str | None) -> dict | None:
  return {"implementation": impl} if impl else None


# ---- inputs of the JAX step ----

def _nbytes(tree) -> int:
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _shapes(plan: Plan):
  """({name: (shape, dtype)} of the batch, {name: (shape, dtype)} of the frozen weights)."""
  cfg, A, B, S = plan.cfg, plan.train.grad_accum, plan.batch_size, plan.seq_len
  fdt = jnp.dtype(plan.feature_dtype)
  batch = {k: ((A, B, S), jnp.int32) for k in ("input_ids", "loss_mask", "doc_id", "position_ids")}
  batch["features"] = ((A, B, S, len(cfg.target_layer_ids) * cfg.hidden_size), fdt)
  frozen = {k: ((cfg.vocab_size, cfg.hidden_size), fdt) for k in ("embed", "lm_head")}
  return batch, frozen


def abstract_inputs(plan: Plan):
  """(jitted step, (state, batch, frozen) as ShapeDtypeStructs, argument bytes by category)."""
  cfg, t = plan.cfg, plan.train
  opt = step_lib.make_optimizer(t)
  graphdef, params = params_lib.abstract_model(cfg, step_lib.DTYPE[t.compute_dtype])
  state = jax.eval_shape(lambda p: step_lib.TrainState(
      jnp.zeros((), jnp.int32), p, opt.init(p), jax.random.key_data(jax.random.key(0))), params)
  batch, frozen = ({k: jax.ShapeDtypeStruct(*s) for k, s in x.items()} for x in _shapes(plan))
  jitted = step_lib.jit_train_step(step_lib.make_train_step(graphdef, cfg, t, opt, plan.attn_impl))
  return jitted, (state, batch, frozen), categories(state, batch, frozen)


def categories(state, batch, frozen) -> dict[str, int]:
  return {"parameters": _nbytes(state.params), "optimizer state": _nbytes(state.opt_state),
          "frozen embed + LM head": _nbytes(frozen), "batch": _nbytes(batch),
          "step + rng": _nbytes((state.step, state.rng))}


def random_inputs(plan: Plan, seed: int = 0):
  """Real state (random init), a random batch and random frozen weights of the plan's shapes:
  one document per row, every token supervised."""
  cfg, t = plan.cfg, plan.train
  opt = step_lib.make_optimizer(t)
  graphdef, state = step_lib.init_state(cfg, t, opt)
  shapes, frozen_shapes = _shapes(plan)
  ids = shapes["input_ids"][0]
  k = jax.random.split(jax.random.key(seed), 4)
  batch = {"input_ids": jax.random.randint(k[0], ids, 0, cfg.vocab_size, jnp.int32),
           "loss_mask": jnp.ones(ids, jnp.int32), "doc_id": jnp.zeros(ids, jnp.int32),
           "position_ids": jnp.broadcast_to(jnp.arange(plan.seq_len, dtype=jnp.int32), ids),
           "features": jax.random.normal(k[1], *shapes["features"])}
  frozen = {name: 0.02 * jax.random.normal(key, *frozen_shapes[name])
            for name, key in (("embed", k[2]), ("lm_head", k[3]))}
  return graphdef, state, batch, frozen


def packed_batch(cfg, B, S, N, seed, dtype, dev):
  """Packed rows of two documents, a prompt (unsupervised) then an answer in each; row 1 has few
  supervised tokens so it gets invalid blocks. Big tensors are drawn with torch on the device."""
  import torch
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.vocab_size - 1, (B, S)).astype(np.int32)
  ids[ids == cfg.mask_token_id] = 0
  doc = np.zeros((B, S), np.int32)
  pos = np.zeros((B, S), np.int32)
  lm = np.zeros((B, S), np.int32)
  for b in range(B):
    cut = S // 2 + (b % 2) * S // 8
    doc[b, cut:] = 1
    pos[b] = np.concatenate([np.arange(cut), np.arange(S - cut)])
    if b % 2 == 0:
      lm[b, S // 8:cut] = 1
      lm[b, cut + S // 8:] = 1
    else:                               # few candidates -> some blocks invalid
      n = max(2, N // 2)
      lm[b, cut - n:cut] = 1
  g = torch.Generator(device=dev).manual_seed(seed)
  F, D, V = len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, cfg.vocab_size
  rand = lambda *shape, std: (torch.randn(*shape, generator=g, device=dev) * std).to(dtype)
  micro = {"input_ids": ids, "loss_mask": lm, "doc_id": doc, "position_ids": pos}
  micro = {k: torch.from_numpy(v).to(dev) for k, v in micro.items()}
  micro["features"] = rand(B, S, F, std=1.0)
  # Embedding rows of a trained LM are small next to what the layers add (std ~0.02).
  frozen = {"embed": rand(V, D, std=0.02), "lm_head": rand(V, D, std=D ** -0.5)}
  return micro, frozen


def sample_anchors(S: int, N: int, B: int, seed: int = 0) -> np.ndarray:
  """Sorted anchors uniform over [0, S-2] (one document, every token supervised), [B, N]."""
  r = np.random.default_rng(seed)
  return np.stack([np.sort(r.choice(S - 1, size=N, replace=False)) for _ in range(B)])
