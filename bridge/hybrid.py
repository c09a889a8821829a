"""Hybrid targets: recurrent (linear-attention) layers next to full attention, documents kept apart.

A block-diagonal mask keeps the documents of a packed row apart in attention layers only. A
recurrent layer (Gated DeltaNet in Qwen3.5/3.6 and Qwen3-Next, Mamba, a short convolution) carries
its state along the row, from the end of one document into the next. So a hybrid target's rows
are run so that every document gets exactly the features it would get alone (data flow step 3):

- `varlen`: one forward per row with the documents' boundaries handed to the kernels, as
  `cu_seq_lens_q` to flash-linear-attention's (fla) chunked gated delta rule and as `seq_idx` to
  the causal-conv1d package's short convolution, and a block-diagonal mask for the attention
  layers. Only on CUDA, only for the Gated DeltaNet families whose layers read `cu_seq_lens_q`,
  and only with both packages importable: transformers' torch fallbacks ignore the boundaries.
- `per_document`: each contiguous run of one doc_id (the padding tail, doc_id -1, is a run of its
  own, as in the dense path's mask) is a forward of its own, runs of equal length batched
  together, and the outputs are scattered back into the row. Works for any model; on a GPU the
  fla kernels still run inside each forward.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from collections import defaultdict
from typing import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

# `layer_types` entries of transformers configs whose layers carry state along the sequence.
RECURRENT_LAYER_KINDS = frozenset({"linear_attention", "mamba", "mamba2", "conv", "recurrent",
                                   "rwkv"})
# Families whose configs name no layer_types but whose layers are recurrent all the same.
RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "falcon_h1", "rwkv", "xlstm",
                                   "recurrent_gemma", "jamba", "zamba", "zamba2", "bamba",
                                   "nemotron_h", "granitemoehybrid", "lfm2"})
# Gated DeltaNet families: their linear-attention layers want fla's kernels on a GPU.
GATED_DELTANET_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                  "qwen3_5_moe_text"})

# A capture function: one forward of the decoder stack (keyword inputs), the outputs of the wanted
# layers concatenated, [rows, tokens, n*H]. Target._capture.
Capture = Callable[..., torch.Tensor]


def recurrent_kinds(config) -> set[str]:
  """The recurrent layer kinds of a transformers config (empty for a plain attention model)."""
  configs = [config, getattr(config, "text_config", None)]
  kinds = {k for c in configs if c is not None for k in (getattr(c, "layer_types", None) or ())
           if k in RECURRENT_LAYER_KINDS}
  if not kinds and any(getattr(c, "model_type", None) in RECURRENT_MODEL_TYPES for c in configs
                       if c is not None):
    kinds.add(config.model_type)
  return kinds


def _target_error(message: str):
  from bridge.target import TargetError  # bridge.target imports this module: resolved when raised
  return TargetError(message)


def _import_error(module: str) -> str | None:
  """Why `module` cannot be imported (its exception's first line), or None when it can."""
  try:
    importlib.import_module(module)
  except Exception as e:  # a broken install (triton without a driver, say) counts as missing too
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
  return None


def _reads_cu_seqlens(model) -> bool:
  """Whether the model's linear-attention layers hand `cu_seq_lens_q` to their kernel (transformers
  releases differ; read from the layer's source, never from a version number)."""
  for m in model.modules():
    if hasattr(m, "linear_attn"):
      try:
        return "cu_seq_lens_q" in inspect.getsource(type(m.linear_attn).forward)
      except (OSError, TypeError):
        return False
  return False


class HybridRows:
  """Runs packed rows through a hybrid target so that no document sees another one."""

  def __init__(self, name: str, kinds: set[str], varlen: bool):
    self.name, self.kinds, self.varlen = name, kinds, varlen

  @classmethod
  def for_model(cls, model, device: torch.device, name: str) -> "HybridRows | None":
    """None for a target without recurrent layers; raises TargetError when a GPU lacks fla."""
    kinds = recurrent_kinds(model.config)
    if not kinds:
      return None
    gdn = model.config.model_type in GATED_DELTANET_TYPES
    fla_missing = _import_error("fla.ops.gated_delta_rule") if gdn else None
    if device.type == "cuda" and gdn and fla_missing:
      raise _target_error(f"{name} has Gated DeltaNet layers, which on a GPU need "
                          f"flash-linear-attention ({fla_missing}): run `pip install .[hybrid]`")
    # Both kernels must see the boundaries: transformers hands cu_seq_lens_q to fla's delta rule
    # only, and the short convolution honours seq_idx only in the causal-conv1d package.
    varlen = (device.type == "cuda" and gdn and _import_error("causal_conv1d") is None
              and _reads_cu_seqlens(model))
    how = ("one forward per row, document boundaries passed to the fla and causal-conv1d kernels"
           if varlen else "one forward per document, documents of equal length batched")
    kernels = ""
    if device.type == "cpu" and (fla_missing or not gdn):
      kernels = " transformers' torch reference for the recurrent layers,"
    elif device.type == "cpu":
      kernels = " flash-linear-attention is installed and transformers calls it on CPU tensors too,"
    log.info("hybrid target %s (%s layers) on %s:%s %s", name, "/".join(sorted(kinds)),
             "the CPU" if device.type == "cpu" else device, kernels, how)
    return cls(name, kinds, varlen)

  def features(self, capture: Capture, ids, pos, doc, layer_ids) -> torch.Tensor:
    """[B, S, n*H] features of packed rows, each document computed as if it were alone."""
    runs = document_runs(doc.cpu().numpy() if isinstance(doc, torch.Tensor) else np.asarray(doc))
    with kernel_errors(self.name):
      if self.varlen:
        return _varlen(capture, ids, pos, runs, layer_ids)
      return _per_document(capture, ids, pos, runs, layer_ids)


def document_runs(doc: np.ndarray) -> list[list[tuple[int, int]]]:
  """[start, end) of every contiguous run of one doc_id, per row. The padding tail (doc_id -1) is
  a run like any other: the dense path's mask makes it a document of its own too."""
  out = []
  for b, row in enumerate(np.asarray(doc)):
    cuts = np.flatnonzero(row[1:] != row[:-1]) + 1
    starts, ends = np.r_[0, cuts], np.r_[cuts, len(row)]
    ids = row[starts]
    if len(set(ids.tolist())) != len(ids):
      d = next(int(i) for i in ids if (ids == i).sum() > 1)
      raise _target_error(f"doc_id row {b}: document {d} is split into separate runs; the "
                          "documents of a packed row must be contiguous")
    out.append(list(zip(starts.tolist(), ends.tolist())))
  return out


def _per_document(capture: Capture, ids, pos, runs, layer_ids) -> torch.Tensor:
  by_length = defaultdict(list)
  for b, row in enumerate(runs):
    for s0, s1 in row:
      by_length[s1 - s0].append((b, s0))
  out = None
  for length, members in sorted(by_length.items()):
    rows = torch.tensor([b for b, _ in members], device=ids.device)[:, None]
    cols = torch.tensor([s for _, s in members], device=ids.device)[:, None] + torch.arange(
        length, device=ids.device)
    # No mask: a lone document is plain causal attention, and the recurrent layers start fresh.
    f = capture(layer_ids, input_ids=ids[rows, cols], position_ids=pos[rows, cols])
    if out is None:
      out = f.new_empty(*ids.shape, f.shape[-1])
    out[rows, cols] = f
  return out


def _varlen(capture: Capture, ids, pos, runs, layer_ids) -> torch.Tensor:
  out = None
  S = ids.shape[1]
  causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
  for b, row in enumerate(runs):
    lengths = torch.tensor([s1 - s0 for s0, s1 in row], device=ids.device)
    cu = torch.tensor([0] + [s1 for _, s1 in row], dtype=torch.int32, device=ids.device)
    seq_idx = torch.repeat_interleave(torch.arange(len(row), device=ids.device, dtype=torch.int32),
                                      lengths)[None]
    mask = (causal & (seq_idx[0, :, None] == seq_idx[0, None, :]))[None, None]  # [1, 1, S, S]
    longest = int(lengths.max())
    # cu_seq_lens_q reaches fla (and flash-attention, were it the attention implementation);
    # seq_idx reaches causal_conv1d; the 4-D mask keeps sdpa/eager attention block-diagonal.
    f = capture(layer_ids, input_ids=ids[b:b + 1], position_ids=pos[b:b + 1], attention_mask=mask,
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest,
                seq_idx=seq_idx)
    if out is None:
      out = f.new_empty(*ids.shape, f.shape[-1])
    out[b] = f[0]
  return out


def _raised_in(e: BaseException, packages: tuple[str, ...]) -> set[str]:
  """The packages among `packages` that own a frame of e's traceback."""
  found, tb = set(), e.__traceback__
  while tb is not None:
    top = str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0]
    if top in packages:
      found.add(top)
    tb = tb.tb_next
  return found


@contextlib.contextmanager
def kernel_errors(name: str):
  """A failure inside fla's or Triton's code (production saw the Triton autotuner crash) becomes a
  one-line TargetError saying which step failed, instead of a traceback through generated kernel
  code; anything else, running out of memory included, passes through unchanged."""
  try:
    yield
  except Exception as e:
    where = _raised_in(e, ("fla", "triton"))
    if not where or isinstance(e, torch.OutOfMemoryError):
      raise
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    what = ("Triton failed while autotuning or compiling the flash-linear-attention kernels"
            if "triton" in where else "the flash-linear-attention kernels failed")
    raise _target_error(f"{name}: {what}: {type(e).__name__}: {first} (check that the installed "
                        "triton and flash-linear-attention work together: "
                        "`pip install -U .[hybrid]`)") from e
