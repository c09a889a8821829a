"""The target half of DFlash speculative decoding (PyTorch) and the target-only baseline.

One sequence at a time. Positions: the prompt holds positions 0..T-1; generated token i sits at
position T + i. The target's KV cache (`DynamicCache`) always holds exactly the tokens whose
target states are final; a verify step appends the block, then is cropped to the accepted length.

The drafter side is duck-typed (`Proposer` below): `speculative_generate` never imports JAX, so an
oracle proposer in a test and the JAX drafter (jax_drafter/evaluate.py) plug in the same way.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from bridge.target import Target, TargetError
from bridge.target import eos_token_ids as target_eos_ids


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

  @torch.inference_mode()
  def _forward(self, ids: Sequence[int], *, capture: bool, last_only: bool):
    """-> (logits f32 [T or 1, V], features [T, F] or None) of `ids` appended to the cache."""
    dev = self.target.device
    start = self.length
    ids_t = torch.as_tensor([list(ids)], device=dev, dtype=torch.long)
    pos = torch.arange(start, start + len(ids), device=dev)[None]
    captured: dict[int, torch.Tensor] = {}

    def hook(index):
      def fn(module, args, output):
        captured[index] = output[0] if isinstance(output, tuple) else output
      return fn

    layers = self.target.layers
    handles = ([layers[i].register_forward_hook(hook(i)) for i in sorted(set(self.layer_ids))]
               if capture else [])
    try:
      # The DynamicCache is updated in place.
      kw = {self._cache_kw: self.cache}
      if self._keep_kw:
        kw["logits_to_keep"] = 1 if last_only else 0  # 0 = all positions
      out = self.target.model(input_ids=ids_t, position_ids=pos, use_cache=True, **kw)
    finally:
      for h in handles:
        h.remove()
    logits = out.logits[0, -1:].float() if last_only else out.logits[0].float()
    feats = None
    if capture:
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
                    eos_ids=(), temperature: float = 0.0, seed: int = 0) -> Generation:
  """The target alone, one token per forward, with the same cache code (speed and lossless oracle)."""
  t0 = time.perf_counter()
  generator = _generator(decoder, seed)
  eos_ids = set(eos_ids)
  logits, _ = decoder.prefill(prompt_ids, capture=False)
  out, done = _finish([sample(logits, temperature, generator)], max_new_tokens, eos_ids)
  while not done:
    logits, _ = decoder.verify(out[-1:], capture=False)
    out, done = _finish(out + [sample(logits[-1], temperature, generator)], max_new_tokens, eos_ids)
  return Generation(out, seconds=time.perf_counter() - t0)


def eos_token_ids(target: Target) -> set[int]:
  """The target's end-of-sequence ids (bridge.target.eos_token_ids)."""
  return target_eos_ids(target.model, target.tokenizer)
