"""Weights between the Flax drafter, the PyTorch reference drafter and z-lab directories (torch side).

Flat numpy dicts use the z-lab names with JAX's [in, out] Linear layout (jax_drafter.params.to_flat);
torch state dicts use [out, in]. Arrays cross via numpy (copies, never aliases: the torch optimizer
updates its parameters in place).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from safetensors.torch import load_file

from jax_drafter.config import ZLAB_CONFIG, ZLAB_WEIGHTS, check_names_and_shapes


def state_dict_from_flat(flat: dict, *, device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
  """{name: [in, out] array} -> torch state dict ({name: [out, in] tensor})."""
  out = {}
  for k, v in flat.items():
    # Copy to the device first and transpose there: a host-side transpose of GB-sized weights
    # is slow and cache-unfriendly.
    t = torch.from_numpy(np.array(v, np.float32)).to(device=device, dtype=dtype)
    out[k] = t.t().contiguous() if t.ndim == 2 else t
  return out


def flat_from_torch(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
  """{name: [out, in] tensor} (a state dict or grads) -> {name: [in, out] float32 numpy}."""
  out = {}
  for k, t in tensors.items():
    a = t.detach().float().cpu().numpy()
    out[k] = np.ascontiguousarray(a.T if a.ndim == 2 else a)
  return out


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], *, source: str) -> None:
  """Strict load: exact key set and shapes, errors naming the offending key."""
  want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
  check_names_and_shapes(want, {k: tuple(v.shape) for k, v in state.items()}, source=source)
  result = model.load_state_dict(state, strict=True)
  assert not result.missing_keys and not result.unexpected_keys, result


def load_flat_into(model: torch.nn.Module, flat: dict, *, source: str = "flax params") -> None:
  p = next(model.parameters())
  load_into(model, state_dict_from_flat(flat, device=p.device, dtype=p.dtype), source=source)


def load_zlab_into(model: torch.nn.Module, zlab_dir: str) -> None:
  """Load a z-lab directory's model.safetensors into the reference drafter (strict)."""
  path = os.path.join(zlab_dir, ZLAB_WEIGHTS)
  if not os.path.isfile(path) or not os.path.isfile(os.path.join(zlab_dir, ZLAB_CONFIG)):
    raise FileNotFoundError(f"{zlab_dir} must hold {ZLAB_CONFIG} and {ZLAB_WEIGHTS}")
  p = next(model.parameters())
  state = {k: v.to(device=p.device, dtype=p.dtype) for k, v in load_file(path).items()}
  load_into(model, state, source=path)
