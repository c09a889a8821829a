"""Batched decoding by the frozen target at GPU speed (the engine behind `bridge.regenerate`).

Plain transformers, no custom model code: the target's own forward runs over a `StaticCache`
(preallocated K/V, written in place), with
  - length-sorted batches planned from a token budget (`plan_batches`): prompts of similar length
    share a batch, so left padding stays small;
  - an explicit 4-D boolean mask per step (left padding and finished rows never leak into a
    live row), positions restarting at 0 per prompt;
  - grouped-query attention without copies in the decode steps: the Hq/Hkv query heads of a KV head
    are folded into the query rows of one SDPA call (transformers' sdpa path copies K/V Hq/Hkv times
    when a mask is given, which is most of a decode step's memory traffic);
  - finished rows dropped from the batch every `check_every` steps once a quarter of them are done;
  - the prompts' prefill in chunks of columns (`PREFILL_TOKENS` tokens each), so its temporaries
    stay bounded whatever the batch's rows x prompt length;
  - on CUDA, the decode step captured once as a CUDA graph per batch shape (python and launch
    overhead dominate a 135M-parameter model's step), falling back to eager if capture fails;
  - a batch that runs out of device memory decoded again in halves (later ones planned smaller);
  - batches decoded by a worker thread while the caller consumes the results; with
    `concurrent=N`, N batches at once by N worker threads, each on its own
    CUDA streams: one batch's prefill, graph capture and host syncs overlap the others' decode
    steps, whose small kernels leave most of the GPU idle (a decode step at 512 rows x 1024
    tokens is 7.1 ms of kernels in 11.6 ms of graph replay on an H200). Each batch holds its own
    cache, so memory grows N-fold.
Greedy decoding is exactly argmax of the target's logits at every step: tests compare it token for
token with transformers' `generate` in float32.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import sys
import threading
import weakref
from dataclasses import dataclass, fields
from typing import Callable, Iterator, Sequence

import torch

log = logging.getLogger(__name__)

_ATTN_NAME = "gqa_fold"  # no "flash" in the name: transformers treats those as flash-attn kernels
# One CUDA-graph capture at a time in the process: concurrent batches capture in turn (the other
# workers keep replaying their graphs meanwhile).
_CAPTURE_LOCK = threading.Lock()
# Tokens (rows x prompt columns) per prefill chunk. On an H200 with SmolLM2-135M's shapes, 1024
# prompts of 900-1800 tokens: one forward 21.4k generated tokens/s at a 73 GiB peak; chunks of
# 2^19 tokens 20.4k at 56 GiB, 2^18 19.2k at 53 GiB, 2^17 17.3k at 51 GiB (the per-chunk cost is
# not only memory traffic: smaller chunks run slower). 2^19 lets two such batches decode at once
# (100 GiB): 23.4k. benchmarks/h200-2026-12-03-prefill-chunks.
PREFILL_TOKENS = 1 << 19
# Calls into a torch.compile'd target (`compiled=True`) take this lock: Dynamo may compile on any
# call with a new shape, and concurrent workers must not compile at once. A call only launches
# kernels, so the lock is held for microseconds once compiled; CUDA-graph replays never take it.
_COMPILE_LOCK = threading.Lock()
_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _compiled_model(model):
  """torch.compile(model) with dynamic shapes (rows, prompt and cache widths vary per batch),
  made once per model: its compiled graphs serve every later batch and call."""
  if model not in _COMPILED:
    _COMPILED[model] = torch.compile(model, dynamic=True)
  return _COMPILED[model]


@dataclass
class GenerationStats:
  """Counters of one `generate_many` call (tokens are the kept generated tokens, stops included)."""
  prompts: int = 0
  tokens: int = 0
  decode_steps: int = 0
  batches: int = 0
  cuda_graph: bool = False


def plan_batches(lengths: Sequence[int], *, max_new_tokens: int, max_rows: int,
                 max_tokens: int) -> list[list[int]]:
  """Indices grouped into batches, longest prompts first. A batch of R rows whose longest prompt
  has P tokens holds R * (P + max_new_tokens) cache positions: at most `max_tokens` (a prompt that
  alone exceeds it still gets a batch of its own) and at most `max_rows` rows."""
  if max_rows < 1 or max_tokens < 1:
    raise ValueError(f"{max_rows=} and {max_tokens=} must be >= 1")
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  batches, cur, width = [], [], 0
  for i in order:
    w = max(width, lengths[i] + max_new_tokens)
    if cur and (len(cur) + 1 > max_rows or (len(cur) + 1) * w > max_tokens):
      batches.append(cur)
      cur, w = [], lengths[i] + max_new_tokens
    cur.append(i)
    width = w
  if cur:
    batches.append(cur)
  return batches


def _fold_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        is_causal=None, **kwargs):
  """transformers attention function: decode-step queries ([B, Hq, q, Dh], q small) of the G = Hq/Hkv
  heads sharing a KV head become G*q rows of one head, so K/V ([B, Hkv, M, Dh]) are read once and
  never repeated. Prefill and unmasked calls go to transformers' sdpa function unchanged."""
  from transformers.integrations.sdpa_attention import sdpa_attention_forward
  B, Hq, q, Dh = query.shape
  Hkv = key.shape[1]
  if Hq == Hkv or q > 8 or attention_mask is None or attention_mask.dim() != 4:
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)
  G = Hq // Hkv
  mask = attention_mask[:, :, :, :key.shape[2]]
  mask = mask.unsqueeze(2).expand(B, mask.shape[1], G, q, mask.shape[-1])
  out = torch.nn.functional.scaled_dot_product_attention(
      query.reshape(B, Hkv, G * q, Dh), key, value,
      attn_mask=mask.reshape(B, mask.shape[1], G * q, -1), scale=scaling)
  return out.reshape(B, Hq, q, Dh).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _folded_attention(model):
  """Switch the model to the folded attention for the duration of a generation, then back."""
  from transformers import AttentionInterface
  from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
  previous = model.config._attn_implementation
  if previous != "sdpa":  # eager / flash / custom: leave the user's choice alone
    yield
    return
  AttentionInterface.register(_ATTN_NAME, _fold_gqa_attention)
  AttentionMaskInterface.register(_ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
  model.set_attn_implementation(_ATTN_NAME)
  try:
    yield
  finally:
    model.set_attn_implementation(previous)


@contextlib.contextmanager
def _contiguous_head_input(model):
  """The LM head's input made contiguous for the duration of a generation. transformers slices
  the last position (`logits_to_keep=1`) out of [B, P, D] hidden states: a strided [B, 1, D] view
  that torch's matmul cannot fold into one [B, D] x [D, V] product, so it multiplies by the head
  expanded to [B, D, V], a copy of the whole head per row (a prefill of 64 rows on a CPU: 3.1 s
  in bfloat16, 0.35 s in float32, against 0.015 / 0.046 s contiguous). On a GPU cuBLAS takes the
  slice as it is (1024 rows x 1024 prompt tokens on an H100: equal prefill kernels and peak,
  benchmarks/h100-2026-12-05-target-init-16k-vocab). Decode steps' [B, 1, D] inputs are already
  contiguous."""
  head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
  if not isinstance(head, torch.nn.Module):
    yield
    return
  handle = head.register_forward_pre_hook(
      lambda module, args: (args[0].contiguous(), *args[1:]) if args else None)
  try:
    yield
  finally:
    handle.remove()


def capture_graph(fn, device, streams: tuple | None = None):
  """fn() run once eagerly on a side stream (its warm-up: the result of this call), then recorded
  as a CUDA graph. -> (the eager result, the graph, the graph's outputs, which each replay
  rewrites). fn must read its inputs from tensors that replays refill in place.
  streams: (warm-up stream, capture stream), else a fresh side stream and torch's default.
  One capture at a time in the process (_CAPTURE_LOCK)."""
  side, capture = streams or (torch.cuda.Stream(device), None)
  with _CAPTURE_LOCK:
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
      eager = fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: JAX shares the process (its threads poll events, copy, launch), and so may
    # other decoding workers. In the default "global" mode any such call from another thread
    # during the capture invalidates it and puts JAX's stream in an error state (seen at the end
    # of a training run on the H200: the in-run evaluation's capture failed and JAX died with
    # "Callback registry is closed").
    with torch.cuda.graph(graph, stream=capture, capture_error_mode="thread_local"):
      out = fn()
  return eager, graph, out


class _Batch:
  """Decode state of one batch: the static cache, the key-validity mask, the rows still alive."""

  def __init__(self, model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad_id: int,
               cache_kw: str, streams: tuple | None = None, compiled: bool = False):
    from transformers import StaticCache
    dev = next(model.parameters()).device
    self.model, self.cache_kw, self.dev = model, cache_kw, dev
    self.fwd, self.compiled = (_compiled_model(model), True) if compiled else (model, False)
    lens = [len(p) for p in prompts]
    B, P = len(prompts), max(lens)
    M = -(-(P + max_new_tokens) // 64) * 64     # mask width a multiple of 64 (aligned SDPA bias)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    valid = torch.zeros((B, M), dtype=torch.bool)
    for b, p in enumerate(prompts):            # left padding: every prompt ends at column P - 1
      ids[b, P - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
      valid[b, P - len(p):P] = True
    self.P, self.M = P, M
    self.ids, self.valid = ids.to(dev), valid.to(dev)
    self.plen = torch.as_tensor(lens, device=dev)
    self.rows = torch.arange(B, device=dev)   # original row of each live row
    self.cache = StaticCache(config=model.config, max_cache_len=M)
    self.graph = None
    # (warm-up stream, capture stream) of this batch's worker; None: fresh ones / torch's default
    self.streams = streams

  def _forward(self, ids, pos, mask):
    with _COMPILE_LOCK if self.compiled else contextlib.nullcontext():
      out = self.fwd(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                     logits_to_keep=1, **{self.cache_kw: self.cache})
    return out.logits[:, -1]

  def prefill(self) -> torch.Tensor:
    """-> logits [B, V] after the prompts. Padding queries see only themselves (no empty rows).
    The prompts' columns go through the model in chunks of at most PREFILL_TOKENS tokens (B rows
    x columns), each appending its K/V to the cache: the temporaries of a chunk (MLP activations, the chunk's mask) stay bounded whatever the batch, instead of growing
    with rows x prompt length (3.4 GiB for one MLP activation of 1024 prompts of 1100 tokens)."""
    B, P, M = self.ids.shape[0], self.P, self.M
    pos = (self.valid[:, :P].long().cumsum(1) - 1).clamp(min=0)
    j = torch.arange(M, device=self.dev)[None]
    step = max(1, PREFILL_TOKENS // B)
    for c0 in range(0, P, step):
      c1 = min(P, c0 + step)
      i = torch.arange(c0, c1, device=self.dev)[:, None]
      mask = (self.valid[:, None, None, :] & (j <= i)) | (j == i)
      logits = self._forward(self.ids[:, c0:c1], pos[:, c0:c1], mask)
    return logits

  def decode(self, tokens: torch.Tensor, t: int, use_graph: bool) -> torch.Tensor:
    """Feed the token generated at step t-1 (cache column P + t - 1). -> logits [B, V]."""
    self.valid[:, self.P + t - 1] = True
    pos = (self.plen + (t - 1))[:, None]
    if not use_graph:
      return self._forward(tokens[:, None], pos, self.valid[:, None, None, :])
    if self.graph is None:
      return self._capture(tokens, pos)
    self.static_ids.copy_(tokens[:, None])
    self.static_pos.copy_(pos)
    self.graph.replay()
    return self.static_logits

  def _capture(self, tokens, pos):
    """Run this step eagerly (it also warms up), then record it as a graph whose replays read
    the static inputs and the in-place-updated mask `valid`."""
    self.static_ids, self.static_pos = tokens[:, None].clone(), pos.clone()
    mask = self.valid[:, None, None, :]
    logits, self.graph, self.static_logits = capture_graph(
        lambda: self._forward(self.static_ids, self.static_pos, mask), self.dev, self.streams)
    return logits

  def keep(self, alive: torch.Tensor) -> None:
    """Drop the finished rows (cache, mask, lengths); the graph is recaptured for the new shape."""
    self.cache.reorder_cache(alive)
    self.valid, self.plen, self.rows = self.valid[alive], self.plen[alive], self.rows[alive]
    self.graph = None


def _select(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
  if temperature <= 0:
    if logits.device.type == "cpu":
      # The same index (the cast is exact, ties go to the first index either way), ~4x faster:
      # torch's CPU argmax over bfloat16 [64, 49152] takes 5.6 ms, the cast and float32 one 1.4.
      logits = logits.float()
    return torch.argmax(logits, dim=-1)
  probs = torch.softmax(logits.float() / temperature, dim=-1)
  return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _cache_kw(model) -> str:
  import inspect
  # transformers >= 5.2x names it `cache`; the GPU machine's 5.17 `past_key_values`.
  return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def supports_static_decoding(model) -> bool:
  """Full-attention decoder layers only (sliding-window or linear-attention layers have caches of
  another shape; those targets fall back to transformers' generate)."""
  cfg = model.config
  if hasattr(cfg, "get_text_config"):
    cfg = cfg.get_text_config(decoder=True)
  types = getattr(cfg, "layer_types", None)
  if types is not None:
    return all(t == "full_attention" for t in types)
  return not (getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True))


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                   stop_ids: set[int], pad_id: int, temperature: float = 0.0,
                   generator: torch.Generator | None = None, cuda_graph: bool | None = None,
                   check_every: int = 16, stats: GenerationStats | None = None,
                   streams: tuple | None = None, compiled: bool = False) -> list[list[int]]:
  """New tokens of each prompt, cut after the first stop token (kept) or at max_new_tokens.
  streams: (warm-up, capture) CUDA streams for the graph capture (a worker's own; see
  generate_many), else fresh ones. compiled: the target's forward through torch.compile (fused
  norms, RoPE and casts; see generate_many)."""
  if max_new_tokens < 1:
    raise ValueError(f"{max_new_tokens=} must be >= 1")
  if any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  stats = stats if stats is not None else GenerationStats()
  batch = _Batch(model, prompts, max_new_tokens=max_new_tokens, pad_id=pad_id,
                 cache_kw=_cache_kw(model), streams=streams, compiled=compiled)
  dev = batch.dev
  use_graph = (dev.type == "cuda") if cuda_graph is None else (cuda_graph and dev.type == "cuda")
  stops = torch.as_tensor(sorted(stop_ids), device=dev)
  B = len(prompts)
  out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=dev)
  tokens = _select(batch.prefill(), temperature, generator)
  out[:, 0] = tokens
  done = torch.isin(tokens, stops)
  for t in range(1, max_new_tokens):
    if t % check_every == 0:
      n_done = int(done.sum())  # the only host sync: every check_every steps
      if n_done == len(done):
        break
      if n_done * 4 >= len(done):
        alive = torch.nonzero(~done)[:, 0]
        batch.keep(alive)
        tokens, done = tokens[alive], done[alive]
    try:
      logits = batch.decode(tokens, t, use_graph)
    except RuntimeError as e:
      if not use_graph or batch.graph is not None:
        raise
      # Capture failed (a host sync inside the model's forward, say): this step was not run.
      log.warning("CUDA graph capture of the decode step failed (%s); decoding eagerly", e)
      use_graph = False
      logits = batch.decode(tokens, t, use_graph)
    stats.decode_steps += 1
    tokens = torch.where(done, pad_id, _select(logits, temperature, generator))
    out[batch.rows, t] = tokens
    done = done | torch.isin(tokens, stops)
  stats.cuda_graph = stats.cuda_graph or (use_graph and batch.graph is not None)
  results = []
  for row in out.tolist():
    cut = next((n + 1 for n, tok in enumerate(row) if tok in stop_ids), max_new_tokens)
    results.append(row[:cut])
  stats.prompts += B
  stats.tokens += sum(map(len, results))
  stats.batches += 1
  return results


def generate_many(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                  stop_ids: set[int], pad_id: int, max_rows: int = 256,
                  max_tokens: int = 1 << 19, temperature: float = 0.0,
                  generator: torch.Generator | None = None, cuda_graph: bool | None = None,
                  stats: GenerationStats | None = None,
                  on_batch: Callable[[int, int], None] | None = None, concurrent: int = 1,
                  compiled: bool = False) -> Iterator[tuple[int, list[int]]]:
  """Yields (prompt index, new tokens) batch by batch (longest prompts first). Targets with
  sliding-window or linear-attention layers go through transformers' `generate` instead.

  Batches are decoded by worker threads while the caller consumes what they yield, so the
  caller's own work (regeneration's templates and records) overlaps the decoding. concurrent=1:
  one worker, batches in order, sampling from `generator` batch after batch. concurrent > 1:
  that many batches at once, each worker on its own CUDA streams, yielded as they finish; greedy
  results are those of concurrent=1, sampled ones draw from one generator per batch, seeded in
  batch order from `generator`, so they do not depend on the workers' timing (but differ from
  concurrent=1's single stream of draws).

  A batch that runs out of device memory (the planned budget meeting a fragmented or shared GPU)
  is decoded again as two halves, down to one prompt, and every later batch of the call stays
  under half the failed batch's cache positions; a warning says so. Greedy tokens are unchanged
  (up to the rounding of other batch shapes in bf16); a single prompt that does not fit raises.

  compiled: the target's forward goes through torch.compile (dynamic shapes, compiled once per
  model and process, at its first batch): eager transformers runs hundreds of small elementwise
  kernels per step (f32 norms, RoPE, casts) that inductor fuses. The first batch pays the
  compilation; the tokens are those of eager decoding up to floating-point rounding."""
  if concurrent < 1:
    raise ValueError(f"{concurrent=} must be >= 1")
  stats = stats if stats is not None else GenerationStats()
  static = supports_static_decoding(model)
  if not static:
    log.warning("%s has sliding-window or non-attention layers: decoding with transformers' "
                "generate (slower than the static-cache path%s)", type(model).__name__,
                "; compiled=True does not apply to it" if compiled else "")
  batches = plan_batches([len(p) for p in prompts], max_new_tokens=max_new_tokens,
                         max_rows=max_rows, max_tokens=max_tokens)
  kw = dict(max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
            temperature=temperature, cuda_graph=cuda_graph)
  if static:
    kw["compiled"] = compiled
  with (_folded_attention(model) if static else contextlib.nullcontext(),
        _contiguous_head_input(model)):
    for idx, outs, part in _decode_in_threads(model, prompts, batches, concurrent if static else 1,
                                              generator, static, kw):
      _add_stats(stats, part)
      if on_batch is not None:
        on_batch(len(idx), part.tokens)
      yield from zip(idx, outs)


def _add_stats(total: GenerationStats, part: GenerationStats) -> None:
  for f in fields(GenerationStats):
    a, b = getattr(total, f.name), getattr(part, f.name)
    setattr(total, f.name, (a or b) if isinstance(a, bool) else a + b)


def _decode_in_threads(model, prompts, batches, n, generator, static, kw):
  """Yields (indices, outputs, stats) of each batch as one of `n` worker threads finishes it.
  n > 1: each worker decodes on its own CUDA streams (compute, warm-up, capture), taken from
  torch's stream pool here, before any worker starts, so no two workers ever share one. A worker's
  error is raised here; a caller that stops early stops the workers after their current batch."""
  dev = next(model.parameters()).device
  cuda = dev.type == "cuda"
  seeds = None
  if n > 1 and kw["temperature"] > 0:   # one generator per batch, seeded in batch order
    g = generator if generator is not None else torch.Generator(device=dev).manual_seed(0)
    seeds = [int(torch.randint(0, 2**62, (1,), generator=g, device=g.device)) for _ in batches]
  own_streams = n > 1 and cuda
  streams = [tuple(torch.cuda.Stream(dev) for _ in range(3)) if own_streams else None
             for _ in range(n)]
  run = generate_batch if static else _generate_batch_hf
  todo: queue.Queue = queue.Queue()
  for b in range(len(batches)):
    todo.put(b)
  done: queue.Queue = queue.Queue()
  stop = threading.Event()

  # Cache positions (rows x (prompt + new tokens)) a batch may hold: unbounded until a batch runs
  # out of device memory, then half of that batch's, for the rest of the call (batch shapes vary,
  # so the budget the caller planned with can still meet a fragmented or shared GPU).
  limit = [None]
  width = lambda idx: len(idx) * (max(len(prompts[i]) for i in idx) + kw["max_new_tokens"])

  def decode_fitting(idx, gen, extra):
    """Decode batch idx and hand its results to the caller; a batch of several rows over the
    limit, or that runs out of device memory, is decoded as two halves in turn."""
    if len(idx) > 1 and limit[0] is not None and width(idx) > limit[0]:
      h = len(idx) // 2
      decode_fitting(idx[:h], gen, extra)
      decode_fitting(idx[h:], gen, extra)
      return
    part = GenerationStats()
    try:
      outs = run(model, [prompts[i] for i in idx], generator=gen, stats=part, **kw, **extra)
    except torch.OutOfMemoryError as e:
      if len(idx) == 1:
        raise
      first = str(e).splitlines()[0] if str(e) else "out of memory"
    else:
      done.put((idx, outs, part, None))
      return
    # The failed batch's cache is unreachable once the exception is gone: return it to the
    # device before the halves allocate theirs (not while another worker captures a graph).
    gc.collect()
    if cuda:
      with _CAPTURE_LOCK:
        torch.cuda.empty_cache()
    limit[0] = min(limit[0] or width(idx), width(idx) // 2)
    log.warning("a batch of %d prompts (%d cache positions) ran out of device memory (%s): "
                "decoding it in halves; later batches stay under %d positions (a smaller "
                "max_tokens avoids the retries)", len(idx), width(idx), first[:160], limit[0])
    decode_fitting(idx, gen, extra)

  def work(own):
    try:
      if cuda:
        torch.cuda.set_device(dev)  # per thread: graph capture streams use the current device
      with torch.cuda.stream(own[0]) if own else contextlib.nullcontext():
        while not stop.is_set():
          try:
            b = todo.get_nowait()
          except queue.Empty:
            break
          gen = generator if seeds is None else torch.Generator(device=dev).manual_seed(seeds[b])
          extra = {"streams": own[1:]} if own else {}
          decode_fitting(batches[b], gen, extra)
    except BaseException as e:  # noqa: BLE001 (raised in the caller's thread)
      stop.set()
      done.put((None, None, None, e))
    finally:
      done.put(None)

  workers = [threading.Thread(target=work, args=(streams[w],), name=f"decode-{w}", daemon=True)
             for w in range(min(n, len(batches)))]
  # The caller's Python (e.g. template rendering) can hold the GIL for long stretches: switch
  # threads every 0.5 ms (default 5) so a worker's few lines per decode step are not held up.
  interval = sys.getswitchinterval()
  sys.setswitchinterval(min(interval, 5e-4))
  for t in workers:
    t.start()
  try:
    running = len(workers)
    while running:
      item = done.get()
      if item is None:
        running -= 1
        continue
      idx, outs, part, err = item
      if err is not None:
        raise err
      yield idx, outs, part
  finally:
    stop.set()
    for t in workers:
      t.join()
    sys.setswitchinterval(interval)


@torch.inference_mode()
def _generate_batch_hf(model, prompts, *, max_new_tokens, stop_ids, pad_id, temperature=0.0,
                       generator=None, cuda_graph=None, stats=None):
  """transformers' generate with left padding (any cache type); same output contract."""
  dev = next(model.parameters()).device
  P = max(map(len, prompts))
  ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
  mask = torch.zeros_like(ids)
  for b, p in enumerate(prompts):
    ids[b, P - len(p):] = torch.as_tensor(list(p))
    mask[b, P - len(p):] = 1
  if generator is not None and temperature > 0:  # generate() takes no generator: seed from it
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator,
                                        device=generator.device)))
  sample = temperature > 0
  gen = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                       max_new_tokens=max_new_tokens, do_sample=sample,
                       temperature=temperature if sample else None, top_k=0 if sample else None,
                       top_p=1.0 if sample else None, pad_token_id=pad_id,
                       eos_token_id=sorted(stop_ids))
  results = []
  for row in gen[:, P:].tolist():
    cut = next((n + 1 for n, tok in enumerate(row) if tok in stop_ids), len(row))
    results.append(row[:cut])
  if stats is not None:
    stats.prompts += len(prompts)
    stats.tokens += sum(map(len, results))
    stats.batches += 1
  return results
