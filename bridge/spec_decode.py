"""The target half of DFlash speculative decoding (PyTorch) and the target-only baseline.

One sequence at a time. Positions: the prompt holds positions 0..T-1; generated token i sits at
position T + i. The target's KV cache (`DynamicCache`) always holds exactly the tokens whose
target states are final; a verify step appends the block, then is cropped to the accepted length.

The drafter side is duck-typed (`Proposer` below): `speculative_generate` never imports JAX, so an
oracle proposer in a test and the JAX drafter (jax_drafter/evaluate.py) plug in the same way.
"""

from __future__ import annotations

import copy
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from bridge.target import Target, TargetError
from bridge.target import eos_token_ids as target_eos_ids

log = logging.getLogger(__name__)

class Proposer(Protocol):
  """The drafter as the decoding loop sees it (features are torch tensors, ids python ints)."""

  def start(self, features_TxF: torch.Tensor) -> None:
    """New sequence: the context is the prompt's T positions."""

  def extend(self, features_KxF: torch.Tensor, count: int) -> None:
    """Append the first `count` rows (the newly accepted positions) to the context."""

  def propose(self, last_token: int, temperature: float):
    """-> (draft ids [K-1], draft probabilities [K-1, V] or None for a deterministic draft)."""


@dataclass
class Generation:
  tokens: list[int]                                   # new tokens (eos included, cut at max)
  accepted: list[int] = field(default_factory=list)   # accepted draft tokens per verify step
  seconds: float = 0.0


class TargetDecoder:
  """Prefill / verify / crop with the target's KV cache, capturing decoder-layer outputs."""

  def __init__(self, target: Target, layer_ids: Sequence[int] = ()):
    if layer_ids:
      target.check_layer_ids(layer_ids)
    self.target = target
    self.layer_ids = tuple(layer_ids)
    self.cache = None
    # transformers >= 5.2x renamed `past_key_values` to `cache`; the GPU machine has 5.17.
    params = inspect.signature(target.model.forward).parameters
    self._cache_kw = "cache" if "cache" in params else "past_key_values"
    self._keep_kw = "logits_to_keep" in params  # absent in some remote-code models

  @property
  def length(self) -> int:
    return 0 if self.cache is None else int(self.cache.get_seq_length())

  @property
  def kind(self) -> str:
    """How this decoder runs the target (evaluation reports it beside its speeds)."""
    return "with a dynamic KV cache, eager"

  def _run(self, capture: bool, last_only: bool, **inputs):
    """The target's forward over self.cache -> (its output, {layer id: that layer's output} for
    the captured layers when `capture`)."""
    captured: dict[int, torch.Tensor] = {}

    def hook(index):
      def fn(module, args, output):
        captured[index] = output[0] if isinstance(output, tuple) else output
      return fn

    layers = self.target.layers
    handles = ([layers[i].register_forward_hook(hook(i)) for i in sorted(set(self.layer_ids))]
               if capture else [])
    kw = {self._cache_kw: self.cache}
    if self._keep_kw:
      kw["logits_to_keep"] = 1 if last_only else 0  # 0 = all positions
    try:
      out = self.target.model(use_cache=True, **kw, **inputs)
    finally:
      for h in handles:
        h.remove()
    return out, captured

  def _step(self, ids_t, pos, *, capture: bool, last_only: bool, graph: bool):
    """One forward of ids_t ([1, n]) at positions pos appended to the cache (the DynamicCache is
    updated in place). -> (raw logits, captured layer outputs)."""
    out, captured = self._run(capture, last_only, input_ids=ids_t, position_ids=pos)
    return out.logits, captured

  @torch.inference_mode()
  def _forward(self, ids: Sequence[int], *, capture: bool, last_only: bool, graph: bool = True):
    """-> (logits f32 [T or 1, V], features [T, F] or None) of `ids` appended to the cache.
    graph: a decoder that replays CUDA graphs may replay this step (prefill passes False)."""
    dev = self.target.device
    start = self.length
    ids_t = torch.as_tensor([list(ids)], device=dev, dtype=torch.long)
    pos = torch.arange(start, start + len(ids), device=dev)[None]
    logits, captured = self._step(ids_t, pos, capture=capture, last_only=last_only, graph=graph)
    logits = logits[0, -1:].float() if last_only else logits[0].float()
    feats = None
    if capture and self.layer_ids:
      # A fresh contiguous tensor: it is handed to JAX through DLPack and never written again.
      feats = torch.cat([captured[i][0] for i in self.layer_ids], dim=-1).contiguous()
    return logits, feats

  def prefill(self, prompt_ids: Sequence[int], *, capture: bool = True):
    """New sequence. -> (logits [V] of the last prompt position, features [T, F] or None)."""
    from transformers import DynamicCache
    self.cache = DynamicCache(config=self.target.model.config)
    if hasattr(self.cache, "activate_past_recording"):  # sliding layers must be able to roll back
      self.cache.activate_past_recording()
    logits, feats = self._forward(prompt_ids, capture=capture, last_only=True)
    return logits[-1], feats

  def verify(self, block_ids: Sequence[int], *, capture: bool = True):
    """Append a block. -> (logits [K, V]: row i predicts the token after block_ids[i], features [K, F])."""
    return self._forward(block_ids, capture=capture, last_only=False)

  def crop(self, length: int) -> None:
    """Keep the first `length` cached positions."""
    remove = self.length - length
    if remove < 0:
      raise ValueError(f"cannot crop the target cache of {self.length} positions to {length=}")
    if remove:
      try:
        self.cache.crop(-remove)  # a negative count removes tokens in every transformers version
      except (NotImplementedError, RuntimeError) as e:
        raise TargetError(f"{self.target.name}: its KV cache cannot be rolled back ({e}); "
                          "speculative decoding needs a croppable cache") from None


class StaticTargetDecoder(TargetDecoder):
  """TargetDecoder over a preallocated `StaticCache` of `max_len` positions; on CUDA each verify
  length (the block, and 1 for target-only decoding) is captured once as a CUDA graph and replayed.

  An eager forward of a small target is mostly Python and kernel launches (SmolLM2-135M decodes
  ~22 tokens/s alone on an H200 that way, ~44 ms a forward); a replay launches the same kernels
  at once. Positions and the 4-D mask (key j visible to the query at position p iff j <= p) come
  from a static position buffer, so cached positions past the accepted length (left by `crop`)
  are never seen and are overwritten by the next verify step. Prefill runs eagerly (its length
  varies).
  Full-attention targets only (bridge.generation.supports_static_decoding)."""

  def __init__(self, target: Target, layer_ids: Sequence[int] = (), *, max_len: int,
               cuda_graph: bool | None = None):
    super().__init__(target, layer_ids)
    from transformers import StaticCache
    from bridge.generation import supports_static_decoding
    if not supports_static_decoding(target.model):
      raise TargetError(f"{target.name}: a static KV cache needs full-attention layers only; "
                        "decode it with TargetDecoder")
    self.max_len = -(-max_len // 64) * 64          # a multiple of 64: aligned SDPA masks
    self.cache = StaticCache(config=target.model.config, max_cache_len=self.max_len)
    self._len = 0
    # Versions of transformers whose forward takes `cache_position` write a static cache there;
    # later ones track its length in the cache (on the device) and crop it there.
    self._explicit_positions = "cache_position" in inspect.signature(target.model.forward).parameters
    on_cuda = target.device.type == "cuda"
    self.cuda_graph = on_cuda if cuda_graph is None else (cuda_graph and on_cuda)
    self._graphs: dict[tuple, dict] = {}
    self._key_pos = torch.arange(self.max_len, device=target.device)

  @property
  def length(self) -> int:
    return self._len

  @property
  def kind(self) -> str:
    return "with a static KV cache, " + ("CUDA graphs" if self.cuda_graph else "eager")

  def _call(self, ids_t, pos, *, capture: bool, last_only: bool):
    """The eager forward at positions `pos` ([1, n]). -> (raw logits, captured)."""
    mask = self._key_pos[None, None, None, :] <= pos[:, None, :, None]   # [1, 1, n, max_len]
    kw = {"cache_position": pos[0]} if self._explicit_positions else {}
    out, captured = self._run(capture, last_only, input_ids=ids_t, position_ids=pos,
                              attention_mask=mask, **kw)
    return out.logits, captured

  def _graphed(self, ids_t, pos, *, capture: bool, last_only: bool):
    """The same forward through the CUDA graph of its (length, capture, last_only); the first
    call per key runs eagerly (its result is this call's), then captures. The capture runs
    nothing: the cache (and a length it tracks on the device) stays as the eager run left it;
    replays read and advance them on the device."""
    from bridge.generation import capture_graph
    key = (ids_t.shape[1], capture, last_only)
    g = self._graphs.get(key)
    if g is None:
      g = {"ids": ids_t.clone(), "pos": pos.clone()}
      result, g["graph"], g["out"] = capture_graph(
          lambda: self._call(g["ids"], g["pos"], capture=capture, last_only=last_only),
          self.target.device)
      self._graphs[key] = g
      return result
    g["ids"].copy_(ids_t)
    g["pos"].copy_(pos)
    g["graph"].replay()
    return g["out"]

  def _step(self, ids_t, pos, *, capture: bool, last_only: bool, graph: bool):
    n, start = ids_t.shape[1], self._len
    if start + n > self.max_len:
      raise ValueError(f"the static KV cache holds {self.max_len} positions: {start} cached + "
                       f"{n} new exceed it (raise max_len)")
    run = self._graphed if (graph and self.cuda_graph) else self._call
    result = run(ids_t, pos, capture=capture, last_only=last_only)
    self._len = start + n
    return result

  def prefill(self, prompt_ids: Sequence[int], *, capture: bool = True):
    self.crop(0)
    logits, feats = self._forward(prompt_ids, capture=capture, last_only=True, graph=False)
    return logits[-1], feats

  @torch.inference_mode()   # the cache's length counter was made in inference mode, on a GPU
  def crop(self, length: int) -> None:
    remove = self._len - length
    if remove < 0:
      raise ValueError(f"cannot crop the target cache of {self._len} positions to {length=}")
    if remove and not self._explicit_positions:
      for layer in self.cache.layers:
        if hasattr(layer, "crop"):
          layer.crop(-remove)
        else:   # transformers < 5.18: a static layer tracks its length but has no crop
          layer.cumulative_length.sub_(remove)   # in place: CUDA graphs hold its address
    self._len = length


def power_of_two_at_least(n: int, minimum: int = 1) -> int:
  return 1 << (max(int(n), int(minimum), 1) - 1).bit_length()


class BucketedStaticDecoder:
  """Static-cache decoders of a few sizes: each sequence (a prefill) runs in the smallest one that
  holds its prompt and `room` more positions (the new tokens and a block), powers of two from
  `minimum`, never more than `max_len`.

  A verify step's attention reads every position of its static cache, masked or not: on an H200 a
  16-token verify of SmolLM2-135M took 3.87 ms over a 384-position cache and 5.65 ms over 3,968
  (one cache sized for the longest prompt of an evaluation); a target token alone 2.99 vs 3.41 ms
  (benchmarks/h200-2026-12-04k-caches-per-prompt). Each size keeps its own cache and CUDA graphs, so
  a size's first sequence captures them (evaluate's warm-up runs one per size)."""

  def __init__(self, target: Target, layer_ids: Sequence[int] = (), *, room: int, max_len: int,
               minimum: int = 256, cuda_graph: bool | None = None):
    if room < 1 or max_len < room:
      raise ValueError(f"{room=} must be in [1, {max_len=}]")
    self.target, self.layer_ids = target, tuple(layer_ids)
    self.room, self.max_len, self.minimum = int(room), int(max_len), int(minimum)
    self._make = lambda n: StaticTargetDecoder(target, layer_ids, max_len=n, cuda_graph=cuda_graph)
    self.decoders: dict[int, StaticTargetDecoder] = {}
    self.current = self.decoder_for(1)

  def size_for(self, prompt_len: int) -> int:
    """Positions of the cache a prompt of `prompt_len` tokens decodes in."""
    return min(power_of_two_at_least(prompt_len + self.room, self.minimum), self.max_len)

  def decoder_for(self, prompt_len: int) -> StaticTargetDecoder:
    n = self.size_for(prompt_len)
    if n not in self.decoders:
      self.decoders[n] = self._make(n)
    return self.decoders[n]

  @property
  def length(self) -> int:
    return self.current.length

  @property
  def kind(self) -> str:
    return (f"with static KV caches sized per prompt (at most {self.max_len} positions), "
            + ("CUDA graphs" if self.current.cuda_graph else "eager"))

  def prefill(self, prompt_ids: Sequence[int], *, capture: bool = True):
    self.current = self.decoder_for(len(prompt_ids))
    return self.current.prefill(prompt_ids, capture=capture)

  def verify(self, block_ids: Sequence[int], *, capture: bool = True):
    return self.current.verify(block_ids, capture=capture)

  def crop(self, length: int) -> None:
    self.current.crop(length)


def sample(logits_V: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
  if temperature <= 0:
    return int(torch.argmax(logits_V))
  probs = torch.softmax(logits_V / temperature, dim=-1)
  return int(torch.multinomial(probs, 1, generator=generator))


def accept(draft: Sequence[int], logits_KxV: torch.Tensor, *, temperature: float = 0.0,
           draft_probs=None, generator: torch.Generator | None = None) -> tuple[int, int]:
  """-> (accepted draft tokens, the target's bonus token) for block [last, *draft].

  Greedy: the longest prefix of the draft equal to the target's argmax, then the target's argmax.
  Sampling: the standard speculative rule (Leviathan et al. 2023, Chen et al. 2023): accept draft
  token d with probability min(1, p(d) / q(d)), on rejection sample from norm(max(p - q, 0)); if
  all are accepted, sample the bonus from p. q = None means a deterministic draft (q one-hot at d).
  The output is then distributed exactly as sampling from the target.
  """
  if temperature <= 0:
    pred = torch.argmax(logits_KxV, dim=-1).tolist()
    acc = 0
    while acc < len(draft) and int(draft[acc]) == pred[acc]:
      acc += 1
    return acc, pred[acc]
  p = torch.softmax(logits_KxV / temperature, dim=-1)
  q = None if draft_probs is None else torch.as_tensor(draft_probs, dtype=p.dtype, device=p.device)
  for i, d in enumerate(int(t) for t in draft):
    qd = 1.0 if q is None else float(q[i, d])
    u = float(torch.rand((), generator=generator))
    if qd > 0 and u < min(1.0, float(p[i, d]) / qd):
      continue
    if q is None:
      residual = p[i].clone()
      residual[d] = 0
    else:
      residual = torch.clamp(p[i] - q[i], min=0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: any sample of p is correct
      residual = p[i]
    return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
  return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def _generator(decoder: TargetDecoder, seed: int) -> torch.Generator:
  return torch.Generator(device=decoder.target.device).manual_seed(seed)


def _finish(tokens: list[int], max_new_tokens: int, eos_ids) -> tuple[list[int], bool]:
  """Cut at the first eos (kept) and at max_new_tokens. -> (tokens, done)."""
  for i, t in enumerate(tokens[:max_new_tokens]):
    if t in eos_ids:
      return tokens[:i + 1], True
  return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def speculative_generate(decoder: TargetDecoder, proposer: Proposer, prompt_ids: Sequence[int], *,
                         max_new_tokens: int, block_size: int, eos_ids=(),
                         temperature: float = 0.0, seed: int = 0) -> Generation:
  """DFlash decoding of one prompt: prefill -> (propose K-1, verify K, accept, crop, extend)*."""
  t0 = time.perf_counter()
  generator = _generator(decoder, seed)
  eos_ids = set(eos_ids)
  logits, feats = decoder.prefill(prompt_ids)
  proposer.start(feats)
  gen = Generation([])
  out, done = _finish([sample(logits, temperature, generator)], max_new_tokens, eos_ids)
  while not done:
    last = out[-1]
    draft, q = proposer.propose(last, temperature)
    draft = [int(t) for t in draft]
    if len(draft) != block_size - 1:
      raise ValueError(f"the proposer returned {len(draft)} tokens for {block_size=} (want {block_size - 1})")
    base = decoder.length  # the position of `last`
    logits, feats = decoder.verify([last] + draft)
    acc, bonus = accept(draft, logits, temperature=temperature, draft_probs=q, generator=generator)
    decoder.crop(base + acc + 1)  # keep `last` and the accepted drafts; the bonus is not cached yet
    gen.accepted.append(acc)
    out, done = _finish(out + draft[:acc] + [bonus], max_new_tokens, eos_ids)
    if not done:
      proposer.extend(feats, acc + 1)
  gen.tokens = out
  gen.seconds = time.perf_counter() - t0
  return gen


def target_generate(decoder: TargetDecoder, prompt_ids: Sequence[int], *, max_new_tokens: int,
                    eos_ids=(), temperature: float = 0.0, seed: int = 0,
                    until_differs: Sequence[int] | None = None) -> Generation:
  """The target alone, one token per forward, with the same cache code (speed and lossless oracle).

  until_differs: stop right after the first new token that differs from this sequence (the
  lossless check only needs the stretch up to the next difference, not the whole response)."""
  t0 = time.perf_counter()
  generator = _generator(decoder, seed)
  eos_ids = set(eos_ids)
  logits, _ = decoder.prefill(prompt_ids, capture=False)
  out, done = _finish([sample(logits, temperature, generator)], max_new_tokens, eos_ids)
  while not done and not _differs(out, until_differs):
    logits, _ = decoder.verify(out[-1:], capture=False)
    out, done = _finish(out + [sample(logits[-1], temperature, generator)], max_new_tokens, eos_ids)
  return Generation(out, seconds=time.perf_counter() - t0)


def _differs(out: list[int], expected: Sequence[int] | None) -> bool:
  if expected is None:
    return False
  return len(out) > len(expected) or out[-1] != expected[len(out) - 1]


def eos_token_ids(target: Target) -> set[int]:
  """The target's end-of-sequence ids (bridge.target.eos_token_ids)."""
  return target_eos_ids(target.model, target.tokenizer)


# ---- the lossless check (temperature 0) ---------------------------------------------------------
# The speculative tokens must equal the target-only greedy tokens. But the verify step runs the
# target over K tokens at once and the target-only path one token at a time; the two round
# differently, so where the target's two best logits nearly tie the argmax can flip (bf16 on an
# H200: "position 4: speculative 4237 vs target 724" in a correct run). Only a near-tie can flip,
# so at each difference the position is recomputed (TieArbiter) and the gap between the two decides.
#
# TIE_TOLERANCE: the largest |logit[target-only token] - logit[speculative token]| still called a
# near-tie, as a fraction of the row's largest |logit|, keyed by the dtype the target decoded in.
# Measured on SmolLM2-135M-Instruct (CPU, 3 chat prompts x 96 greedy tokens, max|logit| 16..39):
# the gap between the two best logits moved by at most 1.0e-6 x max|logit| across a 16-token verify
# block, one-token decoding and a fresh forward in float32; in bfloat16 by up to 2.0e-2 between the
# two bf16 paths (whose argmax differed at 2-3 of 96 positions) and 2.6e-2 against f32 (~1 logit).
#  - float32 1e-5: 10x the measured movement. A wrong token passes as a tie only if it is that close
#    to the best one (a wrong token is typically logits away; the closest two best logits in that
#    sample were 3.4e-5 x max|logit| apart): in f32 a real divergence fails.
#  - bfloat16 5e-2: 2x the measured movement (GPU kernels, split-K matmuls and fused attention,
#    round differently from the CPU); ~2 logits for SmolLM2. A bug that emits a token that close to
#    the best one passes as a tie in bf16; the tie bound below and the f32 CPU tests catch it.
#  - float16 6.25e-3: the bf16 number scaled by fp16's 3 extra mantissa bits (not measured).
TIE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 6.25e-3}
# A correct bf16 run flips ~3% of positions; more than 1 + 1/8 of a response's tokens as near-ties
# is a systematic error, and the bound caps the reruns of the reference the check makes.
MAX_TIE_FRACTION = 1 / 8
# The arbiter recomputes in float32 from a copy of the weights (2x a bf16 target's memory). Past
# this (2.1B parameters), or when the copy would not fit in free GPU memory, it runs the target in
# its own dtype, whose rounding (the size of the tolerance) makes the tie rule about 2x looser.
F32_ARBITER_MAX_BYTES = 8 << 30


@dataclass
class Divergence:
  """A difference between the speculative and the target-only tokens of one response."""
  position: int                  # index into the new tokens
  speculative: int | None        # None: that output had already ended
  target: int | None
  margin: float | None = None    # arbiter logit[target] - logit[speculative] (> 0: target's wins)
  tolerance: float | None = None
  reason: str = ""               # why it is a mismatch; empty for a near-tie


@dataclass
class LosslessCheck:
  ties: list[Divergence]         # near-ties (within TIE_TOLERANCE), each followed to the end
  mismatch: Divergence | None    # the first real difference; None: lossless up to the ties


class TieArbiter:
  """The target's logits at one position, recomputed from scratch (no KV cache) in float32.

  It rounds like neither decoding path, so it can side with either. The float32 copy of a bf16 or
  fp16 target is made on the first difference only and kept for the arbiter's life."""

  def __init__(self, target: Target):
    self.target = target
    self.dtype = next(target.model.parameters()).dtype  # the dtype both decoding paths ran in
    self.model = None
    self.kind = None

  def _model(self):
    if self.model is not None:
      return self.model
    model = self.target.model
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    dev = self.target.device
    fits = nbytes <= F32_ARBITER_MAX_BYTES and (
        dev.type != "cuda" or torch.cuda.mem_get_info(dev)[0] > 2 * nbytes)  # copy + activations
    if self.dtype == torch.float32 or not fits:
      self.model, self.kind = model, f"the target in {str(self.dtype).removeprefix('torch.')}"
    else:
      # nn.Module.float, not the model's: transformers refuses `.float()` on a model it loaded
      # from GGUF (flagged "quantized" although its weights are dequantized, plain tensors).
      self.model = torch.nn.Module.float(copy.deepcopy(model))
      self.kind = "a float32 copy of the target"
    log.info("near-tie arbiter: %s", self.kind)
    return self.model

  def judge(self, ids: Sequence[int], speculative: int, target_token: int) -> tuple[float, float]:
    """-> (logit[target_token] - logit[speculative], tolerance) for the token after `ids`."""
    if self.dtype not in TIE_TOLERANCE:
      raise TargetError(f"no near-tie tolerance for a {self.dtype} target: add one to "
                        "bridge.spec_decode.TIE_TOLERANCE, measured as the comment there says")
    model = self._model()
    keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    kw = {"logits_to_keep": 1} if keep else {}  # [V] logits, not [T, V]
    with torch.inference_mode():
      ids_t = torch.as_tensor([list(ids)], device=self.target.device, dtype=torch.long)
      logits = model(input_ids=ids_t, use_cache=False, **kw).logits[0, -1].float()
    margin = float(logits[target_token] - logits[speculative])
    return margin, TIE_TOLERANCE[self.dtype] * float(logits.abs().max())


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def check_lossless(decoder: TargetDecoder, arbiter: TieArbiter, prompt_ids: Sequence[int],
                   speculative: Sequence[int], reference: Sequence[int], *, max_new_tokens: int,
                   eos_ids=()) -> LosslessCheck:
  """Greedy speculative tokens against the target-only greedy `reference` of the same prompt.

  At the first difference d: a near-tie of the target (arbiter) is recorded, and the reference is
  decoded again forced through the speculative token (prompt + speculative[:d+1]) up to its next
  difference; anything else, or too many near-ties, is the mismatch."""
  prompt_ids, spec, ref = list(prompt_ids), list(speculative), list(reference)
  max_ties = 1 + int(MAX_TIE_FRACTION * max_new_tokens)
  ties: list[Divergence] = []
  while (d := first_difference(spec, ref)) is not None:
    s, t = _at(spec, d), _at(ref, d)
    if s is None or t is None:
      return LosslessCheck(ties, Divergence(d, s, t, reason="one output ended before the other"))
    margin, tol = arbiter.judge(prompt_ids + spec[:d], s, t)
    div = Divergence(d, s, t, margin, tol)
    if abs(margin) > tol:
      div.reason = f"not a near-tie: |margin| {abs(margin):.3g} > tolerance {tol:.3g}"
      return LosslessCheck(ties, div)
    if len(ties) == max_ties:
      div.reason = (f"more than {max_ties} near-ties in {max_new_tokens} tokens: rounding flips "
                    "~3% of positions in bf16, this many is a systematic error")
      return LosslessCheck(ties, div)
    ties.append(div)
    forced = spec[:d + 1]
    done = _finish(forced, max_new_tokens, set(eos_ids))[1]  # the tie token was eos or the last
    rest = [] if done else target_generate(
        decoder, prompt_ids + forced, max_new_tokens=max_new_tokens - d - 1, eos_ids=eos_ids,
        until_differs=spec[d + 1:]).tokens
    ref = forced + rest
  return LosslessCheck(ties, None)


def _at(tokens: Sequence[int], i: int):
  return tokens[i] if i < len(tokens) else None
