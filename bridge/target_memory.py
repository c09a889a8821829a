"""How much device memory one target forward needs, and sub-batches that keep it within a budget.

A forward over R rows of S tokens (`Target.features`: layers 0..max(layer_ids), hooks capture the
wanted layers, the hook on the last one stops the forward) peaks at

    fixed + overhead + token_bytes * R*S + square_bytes * R*S^2

`fixed` is what is resident before the forward (the weights; at planning time on CUDA, whatever
torch has allocated on the device). `token_bytes` and `square_bytes` come from the HF config
(`analytic_model`); on CUDA they are then measured once with a few probe forwards and fitted
(`fit_model`, never below the analytic values), and the fit is cached as JSON. `plan_sub_batches`
splits a call's rows into sub-batches whose predicted peak stays within the budget.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

GIB = 2**30
INPUT_BYTES = 24          # int64 ids and positions, document ids (int64 at worst) per token
LINEAR_CHUNK = 64         # the chunk length of the gated-delta-rule kernels (fla and torch)
DEFAULT_FREE_FRACTION = 0.9
SOURCES = ("analytic", "measured")


def gib(n: float) -> str:
  return f"{n / GIB:.3g} GiB"


@dataclass(frozen=True)
class TargetMemoryModel:
  """Peak bytes of one target forward over `rows` rows of `seq_len` tokens (see the module doc)."""
  fixed_bytes: float          # resident before the forward
  token_bytes: float          # per token of the sub-batch: activations alive at the peak
  square_bytes: float         # per row per seq_len^2: the [R,1,S,S] mask, its float copies, scores
  overhead_bytes: float = 0.0  # per forward, whatever the shape (measured: workspaces, tables)
  source: str = "analytic"

  def __post_init__(self):
    for f in ("fixed_bytes", "token_bytes", "square_bytes", "overhead_bytes"):
      v = getattr(self, f)
      if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"TargetMemoryModel.{f}={v} must be a finite number >= 0")
    if self.source not in SOURCES:
      raise ValueError(f"TargetMemoryModel.source={self.source!r} must be one of {SOURCES}")

  def activation_bytes(self, rows: int, seq_len: int) -> float:
    return (self.overhead_bytes + self.token_bytes * rows * seq_len
            + self.square_bytes * rows * seq_len * seq_len)

  def peak_bytes(self, rows: int, seq_len: int) -> float:
    return self.fixed_bytes + self.activation_bytes(rows, seq_len)

  def describe(self) -> str:
    return (f"{self.source}: {self.token_bytes / 1024:.1f} KiB/token + {self.square_bytes:.0f} "
            f"B/row/token^2 + {self.overhead_bytes / 2**20:.1f} MiB per forward, "
            f"{gib(self.fixed_bytes)} resident")


# ---- the analytic model: tensors alive at the peak, counted from the HF config ----

def text_config(config):
  """The decoder's config (multimodal configs such as Qwen3.5's keep it in text_config)."""
  get = getattr(config, "get_text_config", None)
  return get() if callable(get) else config


def weight_bytes(model: torch.nn.Module) -> int:
  """Bytes of the model's parameters and buffers (tied weights once): resident for the whole run."""
  seen, total = set(), 0
  for t in [*model.parameters(), *model.buffers()]:
    if id(t) not in seen:
      seen.add(id(t))
      total += t.numel() * t.element_size()
  return total


def layer_kinds(config, layers_run: int) -> set[str]:
  """Kinds of the decoder layers that run: "attention" and, in hybrids, "linear_attention"."""
  types = getattr(config, "layer_types", None) or ["full_attention"] * layers_run
  return {"linear_attention" if t == "linear_attention" else "attention"
          for t in list(types)[:layers_run]}


def token_terms(config, *, layers_run: int, n_features: int, dtype_bytes: int) -> dict[str, int]:
  """The per-token tensors alive at the forward's peak, in bytes, by name; `token_bytes` is
  inputs + rotary + max(last_layer, end).

  The count follows transformers' Llama/Qwen forward, and the peak is in the last layer that runs.
  Alive then: the layers captured before it, the embeddings (the model's forward holds them to its
  end), the layer's input (held by the model's loop) and the largest moment of the layer itself:
  - attention: the normed input, q/k/v, k/v repeated to every query head (SDPA gets an explicit
    mask, so GQA is expanded), the output and its contiguous transpose, the f32 log-sum-exp per
    head; this also covers the RoPE moment (q, q*cos, rot(q)*sin, their sum);
  - MLP: the residual after attention, the normed input, act(gate), up and their product;
  - linear attention (Gated DeltaNet), as transformers' torch kernel runs it: projections in the
    model dtype, q/k/v and the chunk matrices in f32 (fla's kernels need less; the fit on CUDA
    measures what runs).
  After the hook stops the forward: every captured layer and their concatenation.
  Checked on the CPU against torch.profiler's memory events (SmolLM2 shapes, f32 and bf16): the
  model is 3-5% above the measured peak for rows of 122-256 tokens and 15% at 1024, because the
  float masks of the S^2 term live during attention, not at the MLP's peak, but are added to it.
  """
  c, e = text_config(config), dtype_bytes
  H, I = c.hidden_size, c.intermediate_size
  Hq = c.num_attention_heads
  Hkv = getattr(c, "num_key_value_heads", None) or Hq
  Dh = getattr(c, "head_dim", None) or H // Hq
  kinds = layer_kinds(c, layers_run)
  moments = [e * (2 * H + 3 * I)]                                  # MLP
  if "attention" in kinds:
    moments.append(e * (H + 5 * Hq * Dh + 2 * Hkv * Dh) + 4 * Hq)
  if "linear_attention" in kinds:
    Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
    Dk, Dv = c.linear_key_head_dim, c.linear_value_head_dim
    Kd, Vd = Hk * Dk, Hv * Dv
    moments.append(e * (H + 2 * (2 * Kd + Vd) + Vd)                # qkv projection, conv, z
                   + 4 * (6 * Hv * Dk + 4 * Hv * Dv + 3 * Hv * LINEAR_CHUNK))
  return {
      "inputs": INPUT_BYTES,
      "rotary": 2 * Dh * e,                                        # cos and sin, whole forward
      "last_layer": e * (n_features - 1 + 2) * H + max(moments),
      "end": 2 * n_features * H * e,
  }


def square_term(config, *, dtype_bytes: int, attn_implementation: str) -> int:
  """Bytes per row per S^2. Target.features builds the mask as causal & (doc == doc^T): two [S,S]
  bools per row plus the shared causal one while it is built, one bool kept for the forward.
  SDPA with a boolean mask runs the memory-efficient kernel on CUDA and the flash kernel on the CPU;
  both take the mask as a float bias (one copy, one more when CUDA pads it to 16 columns) and never
  build the scores. Eager attention (and anything else, to be safe) builds [heads, S, S] scores:
  q.k^T and its scaled copy, or the f32 softmax beside the scores. "flex" (target.attention: flex
  on CUDA): the block mask is built compiled, without an [S, S] tensor, and compiled
  flex_attention keeps no scores."""
  c, e = text_config(config), dtype_bytes
  if attn_implementation == "flex":   # bridge/document_attention.py on CUDA: a block mask only
    return 0
  if attn_implementation == "sdpa":
    attention = 2 * e
  else:
    attention = c.num_attention_heads * max(2 * e, e + 4)
  return max(3, 1 + attention)


def cpu_attention_buffers(config, *, dtype_bytes: int, threads: int) -> int:
  """Scratch of PyTorch's flash attention on the CPU (what SDPA runs there), per forward: for each
  thread an f32 tile of at most 256 queries x 512 keys, its max, sum and output rows, and for
  bf16 a copy of the tile (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp). Grows with the
  thread count, not the batch: on a 64-core machine it outweighs a tiny model's activations."""
  c = text_config(config)
  Dh = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
  q, kv = 256, 512
  return threads * (4 * (q * kv + 2 * q + q * Dh) + (q * kv * dtype_bytes if dtype_bytes < 4 else 0))


def analytic_model(config, *, layers_run: int, n_features: int, dtype_bytes: int,
                   attn_implementation: str, fixed_bytes: float) -> TargetMemoryModel:
  """The memory model from the config alone (the CPU's model, and the floor of a measured fit)."""
  if layers_run < 1 or n_features < 1:
    raise ValueError(f"{layers_run=} and {n_features=} must be >= 1")
  t = token_terms(config, layers_run=layers_run, n_features=n_features, dtype_bytes=dtype_bytes)
  token = t["inputs"] + t["rotary"] + max(t["last_layer"], t["end"])
  square = square_term(config, dtype_bytes=dtype_bytes, attn_implementation=attn_implementation)
  return TargetMemoryModel(fixed_bytes=fixed_bytes, token_bytes=token, square_bytes=square)


# ---- the measured model: probe forwards, a least-squares fit, a JSON cache ----

def fit_model(analytic: TargetMemoryModel, probes) -> TargetMemoryModel:
  """Fit overhead + token_bytes*R*S + square_bytes*R*S^2 to probes [(R, S, bytes above what was
  allocated before the forward)], by least squares. The coefficients never go below the analytic
  ones, and the overhead is then raised until no probe is above the model: the fitted model bounds
  every measurement it was fitted on."""
  p = np.asarray(probes, dtype=np.float64).reshape(-1, 3)
  R, S, y = p[:, 0], p[:, 1], p[:, 2]
  X = np.stack([np.ones_like(R), R * S, R * S * S], axis=1)
  scale = np.abs(X).max(axis=0, initial=1.0)  # columns span 1 .. 1e9: solve in well-scaled units
  if len(p) < 3 or np.linalg.matrix_rank(X / scale) < 3:
    raise ValueError(f"probes {p[:, :2].astype(int).tolist()} cannot separate the per-token and "
                     "per-token^2 terms: give 3 shapes with 2 token counts at one length and 2 lengths")
  coef = np.linalg.lstsq(X / scale, y, rcond=None)[0] / scale
  token = max(float(coef[1]), analytic.token_bytes)
  square = max(float(coef[2]), analytic.square_bytes)
  overhead = max(0.0, float(np.max(y - token * R * S - square * R * S * S)))
  return dataclasses.replace(analytic, token_bytes=token, square_bytes=square,
                             overhead_bytes=overhead, source="measured")


def probe_shapes(analytic: TargetMemoryModel, budget: float, max_len: int) -> list[tuple[int, int]]:
  """(rows, seq_len) of the probe forwards: (1, s), (4, s), (1, 4s), with s <= 512 and the largest
  predicted to use at most half of what the budget leaves; [] when no s >= 16 is that small."""
  s = min(512, max_len // 4)
  room = (budget - analytic.fixed_bytes) / 2
  while s >= 16 and max(analytic.activation_bytes(4, s), analytic.activation_bytes(1, 4 * s)) > room:
    s //= 2
  return [(1, s), (4, s), (1, 4 * s)] if s >= 16 else []


def measure_peaks(forward, shapes, device: torch.device) -> list[tuple[int, int, int]]:
  """[(R, S, peak bytes above the allocation before the call)] of forward(R, S) on a CUDA device."""
  forward(1, 16)  # warm-up: workspaces allocated on first use stay resident, not activations
  out = []
  for R, S in shapes:
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = forward(R, S)
    torch.cuda.synchronize(device)
    out.append((R, S, torch.cuda.max_memory_allocated(device) - base))
    del result
  return out


def cache_key(name: str, config, *, dtype: str, device_name: str, attn_implementation: str,
              layers_run: int, n_features: int) -> dict:
  """What a measured fit depends on: the target, its dtype, the device, the library versions and
  the layers that run and are captured."""
  import transformers
  conf = json.dumps(text_config(config).to_dict(), sort_keys=True, default=str)
  return {"target": name, "config_sha256": hashlib.sha256(conf.encode()).hexdigest(),
          "dtype": dtype, "device": device_name, "torch": torch.__version__,
          "transformers": transformers.__version__, "attn_implementation": attn_implementation,
          "layers_run": layers_run, "n_features": n_features}


def cache_path(cache_dir: str, key: dict) -> str:
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(cache_dir, f"target-memory-{digest}.json")


def load_fit(path: str, key: dict, analytic: TargetMemoryModel) -> TargetMemoryModel | None:
  """The cached fit under `key`, refitted from its probes (a changed analytic floor still
  applies); None when there is none or the file is unreadable (then it is measured again)."""
  try:
    with open(path) as f:
      rec = json.load(f)
    return fit_model(analytic, rec["probes"]) if rec.get("key") == key else None
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return None


def save_fit(path: str, key: dict, probes, model: TargetMemoryModel) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump({"key": key, "probes": [list(map(int, p)) for p in probes],
               "token_bytes": model.token_bytes, "square_bytes": model.square_bytes,
               "overhead_bytes": model.overhead_bytes}, f, indent=1)
  os.replace(tmp, path)  # atomic: replicas measuring at once never leave a torn file


# ---- budgets and the planner ----

def default_budget(device: torch.device) -> float:
  """target.memory_budget_gib=None: 90% of the device's free memory (measured before the weights
  load, so the budget covers them); unlimited on the CPU."""
  if device.type != "cuda":
    return math.inf
  return DEFAULT_FREE_FRACTION * torch.cuda.mem_get_info(device)[0]


def plan_sub_batches(lengths, model: TargetMemoryModel, budget_bytes: float) -> list[list[int]]:
  """Row indices of each sub-batch, so that no sub-batch's predicted peak (its rows padded to its
  longest) exceeds budget_bytes. Rows go longest first, greedily; consecutive sub-batches padded
  to the same length then share their rows evenly. Indices are ascending inside a sub-batch (rows
  of one length stay contiguous). Raises TargetError when one row alone does not fit."""
  from bridge.target import TargetError
  lengths = [int(n) for n in lengths]
  if any(n < 1 for n in lengths):
    raise ValueError(f"row lengths must be >= 1, got {min(lengths)}")
  if not lengths:
    return []
  longest = max(lengths)
  need = model.peak_bytes(1, longest)
  if need > budget_bytes:
    raise TargetError(
        f"one row of {longest} tokens needs {gib(need)} in the target forward "
        f"({gib(model.fixed_bytes)} resident + {gib(model.activation_bytes(1, longest))} of "
        f"activations, {model.source} memory model), over the target memory budget of "
        f"{gib(budget_bytes)}: raise target.memory_budget_gib, shorten rows "
        "(data.seq_len), or free device memory")
  order = sorted(range(len(lengths)), key=lambda i: -lengths[i])   # stable: ties keep index order
  batches: list[list[int]] = []
  for i in order:
    if batches and model.peak_bytes(len(batches[-1]) + 1, lengths[batches[-1][0]]) <= budget_bytes:
      batches[-1].append(i)
    else:
      batches.append([i])
  return [sorted(b) for b in _even_out(batches, lengths)]


def _even_out(batches, lengths):
  """Runs of sub-batches padded to one length share their rows evenly: as many forwards, a lower
  peak (67 rows that fit 30 at a time go 23+22+22, not 30+30+7); sizes only shrink."""
  out, k = [], 0
  while k < len(batches):
    j, pad = k, lengths[batches[k][0]]
    while j + 1 < len(batches) and lengths[batches[j + 1][0]] == pad:
      j += 1
    rows = [i for b in batches[k:j + 1] for i in b]
    n = j - k + 1
    sizes = [len(rows) // n + (r < len(rows) % n) for r in range(n)]
    for s in sizes:
      out.append(rows[:s])
      rows = rows[s:]
    k = j + 1
  return out


# ---- running a target's forwards under its budget ----

class ForwardPlanner:
  """A target's forwards in sub-batches that stay within its memory budget (one per Target).

  The memory model of each (layers run, features captured) is built on first use: analytic on the
  CPU; on CUDA measured once (probe forwards) and cached as JSON under `cache_dir`.
  """

  def __init__(self, target, budget_bytes: float = math.inf, cache_dir: str | None = None):
    if not budget_bytes > 0:
      raise ValueError(f"target memory budget {budget_bytes} bytes must be > 0")
    self.target, self.budget_bytes, self.cache_dir = target, budget_bytes, cache_dir
    self.models: dict[tuple[int, int], TargetMemoryModel] = {}
    self.logged = False

  def model(self, layer_ids) -> TargetMemoryModel:
    # the final norm's id (one past the last layer, for distillation) runs every layer
    key = (min(max(layer_ids) + 1, self.target.info.num_layers), len(layer_ids))
    if key not in self.models:
      self.models[key] = self._build(*key, layer_ids)
    return self.models[key]

  def _build(self, layers_run: int, n_features: int, layer_ids) -> TargetMemoryModel:
    t = self.target
    config, dtype = t.model.config, t.embedding.dtype
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if getattr(t, "packed_attention", "sdpa") == "flex" and getattr(t, "hybrid", None) is None:
      # Compiled flex_attention (CUDA) keeps nothing of size S^2; eager flex (CPU) builds scores.
      attn = "flex" if t.device.type == "cuda" else "eager"
    analytic = analytic_model(config, layers_run=layers_run, n_features=n_features,
                              dtype_bytes=dtype.itemsize, attn_implementation=attn,
                              fixed_bytes=weight_bytes(t.model))
    if t.device.type != "cuda":
      if attn != "sdpa":
        return analytic
      return dataclasses.replace(analytic, overhead_bytes=cpu_attention_buffers(
          config, dtype_bytes=dtype.itemsize, threads=torch.get_num_threads()))
    key = cache_key(t.name, config, dtype=str(dtype), device_name=torch.cuda.get_device_name(t.device),
                    attn_implementation=attn, layers_run=layers_run, n_features=n_features)
    path = cache_path(self.cache_dir, key) if self.cache_dir else None
    fit = load_fit(path, key, analytic) if path else None
    if fit is None:
      shapes = probe_shapes(analytic, self.budget_bytes, t.info.max_position_embeddings)
      if not shapes:
        log.warning("target memory budget too small to measure the forward; using the analytic "
                    "model (%s)", analytic.describe())
        return analytic
      gen = torch.Generator().manual_seed(0)

      def forward(R, S):
        ids = torch.randint(0, t.info.vocab_size, (R, S), generator=gen)
        return t.features(ids, torch.arange(S).repeat(R, 1), torch.zeros(R, S, dtype=torch.int32),
                          layer_ids)

      probes = measure_peaks(forward, shapes, t.device)
      fit = fit_model(analytic, probes)
      if path:
        save_fit(path, key, probes, fit)
    log.info("target forward memory, layers 0..%d with %d captured: %s (analytic floor: %s)",
             layers_run - 1, n_features, fit.describe(), analytic.describe())
    return fit

  def plan(self, n_rows: int, seq_len: int, layer_ids, out: torch.Tensor) -> list[list[int]]:
    """Sub-batches of n_rows rows of seq_len tokens, with `out` already allocated."""
    if math.isinf(self.budget_bytes):
      return [list(range(n_rows))]
    model, dev = self.model(layer_ids), self.target.device
    budget, cap = self.budget_bytes, math.inf
    if dev.type == "cuda":
      # Resident now: weights, the output, cached features and those JAX still reads. JAX also
      # allocates on this device after the budget was set, so plan within what is free now too.
      resident = torch.cuda.memory_allocated(dev)
      cap = torch.cuda.memory_reserved(dev) + DEFAULT_FREE_FRACTION * torch.cuda.mem_get_info(dev)[0]
    else:
      resident = model.fixed_bytes + out.numel() * out.element_size()
    from bridge.target import TargetError
    try:
      return plan_sub_batches([seq_len] * n_rows, dataclasses.replace(model, fixed_bytes=resident),
                              min(budget, cap))
    except TargetError as e:
      if cap < budget:
        raise TargetError(f"{e} (the budget is capped at what the device can give now: torch's "
                          f"cached memory + 90% of the free memory = {gib(cap)})") from None
      raise

  @torch.inference_mode()
  def features_into(self, out: torch.Tensor, dest, input_ids, position_ids, doc_id,
                    layer_ids) -> None:
    """Writes the features of row j of the [R, S] host arrays to out[dest[j]], running the rows
    in planned sub-batches (each one's result is copied in, never concatenated)."""
    ids, pos, doc = (np.asarray(x) for x in (input_ids, position_ids, doc_id))
    dest = np.asarray(dest, dtype=np.int64)
    plan = self.plan(len(ids), ids.shape[1], layer_ids, out)
    if len(plan) > 1 and not self.logged:
      self.logged = True
      log.info("target forward of %d rows x %d tokens split into %d sub-batches of %s rows to stay "
               "within the %s target memory budget", len(ids), ids.shape[1], len(plan),
               "+".join(str(len(b)) for b in plan), gib(self.budget_bytes))
    for rows in plan:
      f = self.target.features(ids[rows], pos[rows], doc[rows], layer_ids)
      if f.dtype != out.dtype:
        raise TypeError(f"target features are {f.dtype}, the output buffer {out.dtype}")
      d = dest[rows]
      if np.array_equal(d, np.arange(d[0], d[0] + len(d))):
        out[d[0]:d[0] + len(d)].copy_(f)
      else:
        out.index_copy_(0, torch.as_tensor(d, device=out.device), f)
      del f  # free this sub-batch's features before the next forward
