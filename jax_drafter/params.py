"""Drafter parameters as flat name -> array dicts.

Flat names are the z-lab checkpoint names (`layers.0.self_attn.q_proj.weight`, `fc.weight`, ...).
Linear weights are stored [in, out] here and [out, in] in z-lab/PyTorch files (export transposes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_drafter.config import DrafterConfig
from jax_drafter.model import Drafter


def to_flat(params) -> dict[str, jax.Array]:
  """nnx.State of Params -> {"layers.0.self_attn.q_proj.weight": array, ...}."""
  out = {}

  def walk(prefix, node):
    if isinstance(node, dict):
      for k, v in node.items():
        walk(f"{prefix}{k}.", v)
    else:
      out[prefix[:-1]] = node

  walk("", params.to_pure_dict() if hasattr(params, "to_pure_dict") else params)
  return out


def abstract_model(cfg: DrafterConfig, compute_dtype=jnp.float32):
  """(graphdef, abstract params) without allocating any weight."""
  model = nnx.eval_shape(lambda: Drafter(cfg, rngs=nnx.Rngs(0), compute_dtype=compute_dtype))
  return nnx.split(model, nnx.Param)


def from_flat(cfg: DrafterConfig, flat: dict, *, compute_dtype=jnp.float32, source: str = "weights"):
  """Flat dict -> (graphdef, nnx.State). Key set and shapes must match exactly; errors name the key."""
  graphdef, abstract = abstract_model(cfg, compute_dtype)
  want = {k: v.shape for k, v in to_flat(abstract).items()}
  missing = sorted(set(want) - set(flat))
  unexpected = sorted(set(flat) - set(want))
  if missing:
    raise ValueError(f"{source}: missing parameter {missing[0]!r}"
                     + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                     + "; was it written for a different architecture?")
  if unexpected:
    raise ValueError(f"{source}: unexpected parameter {unexpected[0]!r}"
                     + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                     + "; was it written for a different architecture?")
  for k, shape in want.items():
    if tuple(np.shape(flat[k])) != tuple(shape):
      raise ValueError(f"{source}: parameter {k!r} has shape {tuple(np.shape(flat[k]))}, this "
                       f"config expects {tuple(shape)}")
  pure = abstract.to_pure_dict()

  def fill(prefix, node):
    return {k: fill(f"{prefix}{k}.", v) if isinstance(v, dict)
            else jnp.asarray(flat[f"{prefix}{k}"], jnp.float32) for k, v in node.items()}

  nnx.replace_by_pure_dict(abstract, fill("", pure))
  return graphdef, abstract
