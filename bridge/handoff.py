"""The one place where torch tensors become JAX arrays (DLPack), with every rule of docs/DESIGN.md.

Rules enforced here:
  - only detached, contiguous, 16-byte-aligned tensors are imported, and the JAX buffer must have
    the same device pointer (a silent copy raises instead of passing unnoticed);
  - the import runs on the calling (producing) thread, under torch's current stream and device;
  - the torch tensor is kept alive by a `Handoff` until every JAX result that read it is ready
    (torch's caching allocator would otherwise hand the memory to the next target forward);
  - imported arrays must never be donated (jit them as non-donated arguments);
  - token ids cross as int32.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import torch

log = logging.getLogger(__name__)

_ALIGN = 16


class HandoffError(ValueError):
  pass


def to_jax(t: torch.Tensor, *, name: str = "tensor", allow_copy: bool = False) -> jax.Array:
  """Zero-copy import of a torch tensor into JAX. Raises HandoffError if that is not possible.

  allow_copy=True is for the split placement (drafter on another GPU): the copy is then explicit.
  """
  if t.requires_grad:
    raise HandoffError(f"{name}: tensor requires grad; pass a detached tensor (tensor.detach())")
  if not t.is_contiguous():
    raise HandoffError(f"{name}: tensor of shape {tuple(t.shape)} with strides {t.stride()} is not "
                       "contiguous; DLPack import of a strided view would copy or be refused. "
                       "Call .contiguous() on the torch side first, explicitly.")
  if t.data_ptr() % _ALIGN:
    raise HandoffError(f"{name}: data pointer {t.data_ptr():#x} is not {_ALIGN}-byte aligned "
                       "(a view into the middle of a buffer?); import a freshly allocated tensor")
  if t.dtype == torch.int64:
    raise HandoffError(f"{name}: int64 tensors do not cross; convert token ids to int32 first")
  if t.numel() == 0:
    raise HandoffError(f"{name}: empty tensor of shape {tuple(t.shape)}")
  if t.device.type == "cuda":
    torch.cuda.set_device(t.device)
  arr = jnp.from_dlpack(t)
  ptr = arr.unsafe_buffer_pointer()
  if ptr != t.data_ptr() and not allow_copy:
    raise HandoffError(f"{name}: DLPack import copied the buffer (torch {t.data_ptr():#x} -> jax "
                       f"{ptr:#x}); the zero-copy handoff failed. Is JAX on the same device?")
  if arr.dtype != _expected_dtype(t.dtype):
    raise HandoffError(f"{name}: dtype changed in the handoff: torch {t.dtype} -> jax {arr.dtype}")
  return arr


def fresh_for_import(t: torch.Tensor, *, name: str = "tensor") -> torch.Tensor:
  """Return `t` itself if it can be imported zero-copy, else ONE explicit, logged copy that can.

  For long-lived tensors handed over once (frozen embedding / LM head): weights loaded from some
  formats (GGUF) are views whose alignment XLA's CPU client does not accept without copying.
  """
  t = t.detach()
  ok = t.is_contiguous() and t.data_ptr() % 64 == 0
  if ok:
    return t
  log.info("%s: one explicit copy before the DLPack handoff "
                                   "(not contiguous or not 64-byte aligned)", name)
  out = torch.empty_like(t, memory_format=torch.contiguous_format)
  out.copy_(t)
  return out


def import_frozen(embedding: torch.Tensor, lm_head: torch.Tensor, keep: "Handoff", *,
                  device=None) -> dict:
  """The target's frozen embedding and LM head as {"embed", "lm_head"} JAX arrays, imported once
  (tied weights: one array for both). `keep` holds the torch tensors for as long as they are used."""
  embed = keep.put(fresh_for_import(embedding, name="embedding"), name="embedding", device=device)
  if lm_head.data_ptr() == embedding.data_ptr():
    return {"embed": embed, "lm_head": embed}
  head = keep.put(fresh_for_import(lm_head, name="lm_head"), name="lm_head", device=device)
  return {"embed": embed, "lm_head": head}


def padded_row_chunks(t: torch.Tensor, rows: int) -> list[torch.Tensor]:
  """t's rows (dim 0) in chunks of `rows`, the last zero-padded to full size: every chunk imports
  with the same shape, so a jitted consumer compiles once and no shape-dependent pad or slice runs
  in JAX. The full chunks are contiguous views of t (importable zero-copy when t's rows are
  16-byte multiples); only a short last chunk is copied, into its padded one."""
  if rows < 1:
    raise ValueError(f"{rows=} must be >= 1")
  chunks = list(t.split(rows))
  if len(chunks[-1]) < rows:
    last = chunks[-1]
    chunks[-1] = torch.nn.functional.pad(last, (0, 0) * (t.dim() - 1) + (0, rows - len(last)))
  return chunks


def _expected_dtype(dt: torch.dtype):
  return {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
          torch.int32: jnp.int32, torch.bool: jnp.bool_}.get(dt)


class Handoff:
  """Keeps torch tensors alive until the JAX results that read them are ready.

  Usage: h = Handoff(); x = h.put(torch_tensor); out = step(x); h.release_after(out).
  """

  def __init__(self):
    self._tensors: list[torch.Tensor] = []

  def put(self, t: torch.Tensor, *, name: str = "tensor", allow_copy: bool = False,
          device: "jax.Device | None" = None) -> jax.Array:
    """Import `t` zero-copy; with `device` (the drafter's), a tensor that lives on another device
    (split placement: target and drafter on different GPUs) gets one explicit device-to-device
    copy after the zero-copy import. The torch tensor stays alive until release_after either way."""
    arr = to_jax(t, name=name, allow_copy=allow_copy)
    if device is not None and arr.devices() != {device}:
      arr = jax.device_put(arr, device)
    self._tensors.append(t)
    return arr

  def release_after(self, *results) -> None:
    """Block until `results` are computed, then let torch reuse the memory."""
    jax.block_until_ready(results)
    self._tensors.clear()

  def __len__(self) -> int:
    return len(self._tensors)
