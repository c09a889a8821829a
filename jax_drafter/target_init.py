"""A drafter whose layers start as copies of target decoder layers (train.init_from_target_layers).

The drafter's decoder layer has the target's layout (attention with q/k/v/o, a gated MLP, two
norms), and its output goes through the target's own final norm and LM head. Starting layer i
from target layer ids[i] gives it weights that already map hidden states towards the target's
next-token predictions; `fc` starts as the identity on the feature of the last target layer below
ids[0] (zero on the others) and `hidden_norm` as target layer ids[0]'s input norm, so the first
drafter layer reads the context as that target layer reads its input. Parts the target lacks
(q_norm/k_norm of a Llama target) keep their fresh values.

The arrays come from bridge.target.Target.decoder_layer_arrays (z-lab names, [out, in]).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from flax import nnx

from jax_drafter.config import ConfigError, DrafterConfig
from jax_drafter.params import from_flat, to_flat


def context_feature(target_layer_ids: Sequence[int], first_layer: int) -> int:
  """Index into target_layer_ids of the feature fc passes through: the deepest target layer below
  `first_layer` (the input of that target layer), else the shallowest feature."""
  below = [j for j, L in enumerate(target_layer_ids) if L < first_layer]
  if not below:
    return int(np.argmin(target_layer_ids))
  return max(below, key=lambda j: target_layer_ids[j])


def from_target_layers(params: nnx.State, cfg: DrafterConfig, arrays: dict[str, np.ndarray],
                       layer_ids: Sequence[int]) -> nnx.State:
  """params with the copies made (a new state; `params` is not changed). arrays: z-lab names as
  Target.decoder_layer_arrays gives them for `layer_ids`. A shape that differs names the config
  field to change."""
  flat = {k: np.asarray(v) for k, v in to_flat(params).items()}
  D, n = cfg.hidden_size, len(cfg.target_layer_ids)
  if len(layer_ids) != cfg.num_hidden_layers:
    raise ConfigError(f"train.init_from_target_layers={list(layer_ids)}: one target layer per "
                      f"drafter layer ({cfg.num_hidden_layers})")
  for name, a in arrays.items():
    if name not in flat:
      raise ConfigError(f"train.init_from_target_layers: the drafter has no {name!r} to copy "
                        "the target's into")
    a = np.asarray(a, np.float32)
    a = a.T if a.ndim == 2 else a     # torch [out, in] -> the drafter's [in, out]
    if a.shape != flat[name].shape:
      layer = name.split(".")[1] if name.startswith("layers.") else None
      src = f"target layer {layer_ids[int(layer)]}" if layer is not None else "the target"
      raise ConfigError(
          f"train.init_from_target_layers: {src}'s {name.split('.', 2)[-1]} is {a.shape[::-1]} "
          f"([out, in]) where the drafter's is {flat[name].shape[::-1]}: the drafter's sizes "
          "must be the target's (drafter.intermediate_size, num_attention_heads, "
          "num_key_value_heads, head_dim null), or leave init_from_target_layers null")
    flat[name] = a
  j = context_feature(cfg.target_layer_ids, layer_ids[0])
  fc = np.zeros((n * D, D), np.float32)
  fc[j * D:(j + 1) * D] = np.eye(D, dtype=np.float32)
  flat["fc.weight"] = fc
  flat["hidden_norm.weight"] = np.asarray(arrays["layers.0.input_layernorm.weight"], np.float32)

  return from_flat(cfg, flat, source="train.init_from_target_layers")[1]   # a new State


def start(state, cfg: DrafterConfig, t, target, optimizer):
  """A fresh TrainState made to start from the target's layers when t.init_from_target_layers
  is set (its optimizer state initialised again on the copies); otherwise `state` as it is.
  target: bridge.target.Target."""
  if t.init_from_target_layers is None:
    return state
  ids = [int(i) for i in t.init_from_target_layers]
  params = from_target_layers(state.params, cfg, target.decoder_layer_arrays(ids), ids)
  return state._replace(params=params, opt_state=optimizer.init(params))
