"""Acceptance length tau by real DFlash speculative decoding: PyTorch target + JAX drafter.

    python -m jax_drafter.evaluate (--run-dir RUN [--step N | --best | --export] | --drafter-dir ZLAB_DIR)
        [--target-path DIR --gguf-file F] [--target-dtype D] [--prompts FILE.jsonl]
        [--num-prompts 16] [--max-new-tokens 128] [--block-size K] [--temperature 0] [--json REPORT]

--best: the run's `best/` drafter (the best validation tau, exported during training) with the
run's own settings (target, dtype, held-out split), as the checkpoints are evaluated. --export: the
same for the drafter the run exported at its end (`export/`, or train.export_dir): a run directory
holding only config.json and that export (no checkpoints) can still be evaluated on its held-out split.

tau (docs/DESIGN.md): each verify step accepts `acc` drafted tokens plus the target's bonus token;
tau = mean of acc + 1 over the verify steps of a response, averaged over responses; max = K.
At temperature 0 the speculative output must equal the target's own greedy output token for token
(lossless check). A difference where the target's two best logits tie within rounding noise (a bf16
verify block and one-token decoding round differently) is reported as a near-tie and the check goes
on past it (bridge.spec_decode.check_lossless); any other difference is a bug: the CLI exits 1.
Default prompts: the run's held-out conversations (never trained on), up to the first assistant turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys

# Before JAX initialises: never grab all GPU memory up front (the target shares the device).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import numpy as np

from bridge import spec_decode
from bridge.handoff import Handoff, import_frozen, padded_row_chunks
from bridge.target import Target, TargetError, check_mask_token_id, load_target
from jax_drafter import data as data_lib
from jax_drafter import draft_vocab, objective
from jax_drafter.config import ConfigError, DrafterConfig
from jax_drafter.inference import DrafterSession

log = logging.getLogger(__name__)

class EvaluationError(ValueError):
  """Bad evaluation input (checkpoint/target mismatch, prompts, options): a one-line fix."""


def check_compatible(cfg: DrafterConfig, target: Target) -> None:
  """The drafter must have been trained against this target's layers, width, vocabulary, mask."""
  info, name = target.info, target.name
  if cfg.num_target_layers != info.num_layers:
    raise EvaluationError(f"the drafter was trained on a target with {cfg.num_target_layers} layers "
                          f"(target_layer_ids {list(cfg.target_layer_ids)}), but {name} has "
                          f"{info.num_layers}; evaluate with the target it was trained on")
  target.check_layer_ids(cfg.target_layer_ids)
  if cfg.hidden_size != info.hidden_size:
    raise EvaluationError(f"drafter hidden_size={cfg.hidden_size} != target hidden size "
                          f"{info.hidden_size} ({name}); evaluate with the target it was trained on")
  if cfg.vocab_size != info.vocab_size:
    raise EvaluationError(f"drafter vocab_size={cfg.vocab_size} != target vocabulary "
                          f"{info.vocab_size} ({name}); evaluate with the target it was trained on")
  try:
    check_mask_token_id(target, cfg.mask_token_id)
  except TargetError as e:
    raise EvaluationError(f"the drafter's mask token does not fit {name}: {e}") from None


def prompt_messages(messages: list[dict]) -> list[dict]:
  """A conversation up to (not including) its first assistant turn; must end with a user turn."""
  out = []
  for m in messages:
    if m["role"] == "assistant":
      break
    out.append(m)
  if not out or out[-1]["role"] != "user":
    raise EvaluationError("a prompt must end with a user turn before the first assistant turn")
  return out


def load_prompts(path: str) -> list[list[dict]]:
  """JSONL: one {"prompt": str} or {"messages": [{role, content}]} / ShareGPT {"conversations":
  [{from, value}]} per line; conversations are cut before their first assistant turn."""
  if not os.path.isfile(path):
    raise EvaluationError(f"--prompts {path}: file not found")
  prompts = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
        if isinstance(rec.get("prompt"), str):
          msgs = [{"role": "user", "content": rec["prompt"]}]
        else:
          turns = rec.get("messages", rec.get("conversations"))
          msgs = [{"role": data_lib.ROLES[str(t.get("role", t.get("from"))).lower()],
                   "content": t.get("content", t.get("value"))} for t in turns]
        prompts.append(prompt_messages(msgs))
      except (json.JSONDecodeError, AttributeError, KeyError, TypeError, EvaluationError) as e:
        raise EvaluationError(f"{path} line {n}: not a prompt record ({type(e).__name__}: {e}); "
                              'write {"prompt": "..."} or {"messages": [{"role": "user", '
                              '"content": "..."}]} per line') from None
  if not prompts:
    raise EvaluationError(f"--prompts {path} holds no prompts (empty file)")
  return prompts


def held_out_prompts(run_config: dict, num: int, **kw) -> list[list[dict]]:
  """The first `num` usable held-out conversations of a run (the training split), as prompts."""
  d = run_config["data"]
  if not d.get("held_out"):
    raise EvaluationError("this run kept no held-out conversations (data.held_out=0); pass "
                          "--prompts FILE.jsonl with prompts it was not trained on")
  convs = data_lib.load_conversations(d["path"], max_conversations=d.get("max_conversations"))
  _, held = data_lib.split_held_out(convs, d["held_out"], d.get("seed", 0))
  return prompts_from_conversations(held, num, **kw)


def prompts_from_conversations(conversations: list[dict], num: int, *, tokenizer=None,
                               max_prompt_tokens: int | None = None) -> list[list[dict]]:
  """Up to `num` prompts (each conversation cut before its first assistant turn), in order.

  With `tokenizer` and `max_prompt_tokens`, longer prompts are skipped (ShareGPT has user turns of
  tens of thousands of tokens; one of them must not abort an evaluation at the end of training).
  The training loop passes `Dataset.held_out` here."""
  out, skipped = [], 0
  for c in conversations:
    if len(out) == num:
      break
    try:
      prompt = prompt_messages(c["messages"])
    except EvaluationError:
      continue  # e.g. a conversation that opens with a system turn only
    if max_prompt_tokens is not None and len(encode(tokenizer, prompt)) > max_prompt_tokens:
      skipped += 1
      continue
    out.append(prompt)
  if skipped:
    log.warning("skipped %d held-out prompts longer than %d tokens", skipped, max_prompt_tokens)
  return out


def encode(tokenizer, prompt) -> list[int]:
  """Messages -> ids under the chat template with the generation prompt; a list of ids passes."""
  if prompt and isinstance(prompt[0], (int, np.integer)):
    return [int(t) for t in prompt]
  text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
  return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class _JaxProposer:
  """spec_decode.Proposer over a DrafterSession: target features cross to JAX through DLPack.

  fuse=True: a verify step's accepted features are held until the next proposal and appended in
  the same compiled call (DrafterSession.extend_and_propose): one JAX dispatch and one wait a step
  instead of two. The torch tensor stays alive (and unwritten: no verify runs in between) until
  that call's results are read."""

  def __init__(self, session: DrafterSession, max_len: int, seed: int, device=None, *,
               fuse: bool = True, room: int | None = None):
    """max_len: positions any sequence reaches. room: when given, each sequence's context cache
    is sized for its prompt + room positions instead (at most max_len): a dense attention over
    fewer padded keys a step."""
    self.session, self.max_len, self.device, self.fuse = session, max_len, device, fuse
    self.room = room
    self.key = jax.random.key(seed)
    self.steps = 0
    self._pending = None   # (features of the last verify block, accepted + 1) not yet appended

  def _with(self, feats, use):
    """use(*the tensors of `feats` as JAX arrays): their DLPack imports, then one wait before
    torch may reuse them (the calls in between are dispatched back to back)."""
    h = Handoff()
    # device: the drafter's; a target on another GPU gets one explicit copy (as in training).
    out = use(*(h.put(f, name="target features", device=self.device) for f in feats))
    h.release_after(self.session.cache)  # torch may reuse the buffers only after JAX read them
    return out

  def _positions(self, prompt_len: int) -> int:
    return self.max_len if self.room is None else min(prompt_len + self.room, self.max_len)

  def size_for(self, prompt_len: int) -> int:
    """Rows of the drafter's context cache for a prompt of prompt_len tokens."""
    return self.session.positions_for(self._positions(prompt_len))

  def start(self, feats):
    """The prompt's features in chunks of the session's prefill_chunk rows, the last one padded
    here, on the torch side: JAX sees one shape whatever the prompt's length (a padding or slicing
    op in JAX would compile for each new length: ~80 ms a prompt on an H200)."""
    self._pending = None
    T, C = feats.shape[0], self.session.prefill_chunk
    self.session.reset(self._positions(T))

    def extend_all(*chunks):
      for i, x in enumerate(chunks):
        self.session.extend(x, min(C, T - i * C))
    self._with(padded_row_chunks(feats, C), extend_all)

  def extend(self, feats, count):
    if self.fuse and feats.shape[0] == self.session.block_size:
      self._pending = (feats, count)
    else:
      self._with([feats], lambda x: self.session.extend(x, count))

  def propose(self, last_token, temperature):
    self.steps += 1
    greedy = self.session.temperature <= 0  # the key is unused: skip one dispatch per step
    key = self.key if greedy else jax.random.fold_in(self.key, self.steps)
    if self._pending is None:
      return self.session.propose(last_token, key)
    (feats, count), self._pending = self._pending, None
    return self._with([feats],
                      lambda x: self.session.extend_and_propose(x, count, last_token, key))


DECODERS = ("auto", "static", "dynamic")


def _decoder(target: Target, cfg: DrafterConfig, kind: str, *, max_len: int, room: int):
  """The target's decoder for evaluation (see evaluate_tau's `decoder`). max_len: every position
  a verify step can reach (the longest prompt + new tokens + a block); room: the positions a
  sequence takes past its prompt (new tokens + a block): static caches are sized per prompt."""
  from bridge.generation import supports_static_decoding
  if kind not in DECODERS:
    raise EvaluationError(f"decoder={kind!r} must be one of {', '.join(DECODERS)}")
  if kind == "auto":
    kind = ("static" if target.device.type == "cuda" and supports_static_decoding(target.model)
            else "dynamic")
  if kind == "static":
    return spec_decode.BucketedStaticDecoder(target, cfg.target_layer_ids, room=room,
                                             max_len=max_len)
  return spec_decode.TargetDecoder(target, cfg.target_layer_ids)


def evaluate_tau(target: Target, cfg: DrafterConfig, graphdef, params, prompts, *,
                 max_new_tokens: int, block_size: int | None = None, temperature: float = 0.0,
                 seed: int = 0, progress: bool = True, proposer=None,
                 frozen: dict | None = None, reference_cache: dict | None = None,
                 reference: str = "batched", speed_prompts: int = 4,
                 decoder: str = "auto", draft_vocab=None) -> dict:
  """Speculative decoding of every prompt (list of messages ending with a user turn, or token ids)
  plus the target alone on the same prompts. -> report dict (see `summarize`).

  `frozen` ({"embed", "lm_head"} JAX arrays, e.g. the training loop's) avoids importing the
  target's embedding and LM head again.
  `draft_vocab`: the drafter's reduced draft vocabulary (int32 ids, draft_vocab.py), or None for
  the whole vocabulary (or the one `frozen["draft_ids"]` carries).
  `proposer` replaces the JAX drafter (tests use an oracle); it must follow spec_decode.Proposer.
  `reference_cache`: target-only generations by (prompt ids, max_new_tokens, temperature, seed),
  filled and reused: a frozen target's reference never changes, so repeated evaluations (the
  training loop's) decode it once. One dict per target. Cached rows report the first timing.
  `reference`: how the target-only greedy outputs are made. "decode": one token per forward with
  the same cache code as the verify steps, every prompt timed (the speed baseline). "batched":
  the first `speed_prompts` prompts as "decode" (timed: the baseline tokens/s), all others in
  length-sorted batches by bridge.generation (seconds instead of minutes; untimed). Sampling
  (temperature > 0) always decodes.
  `decoder`: how the target decodes, for speculative and target-only decoding alike. "static":
  over a preallocated KV cache, each verify length replayed as a CUDA graph on a GPU
  (spec_decode.StaticTargetDecoder): the same tokens, one launch per step (a verify step of 16
  tokens on SmolLM2-135M on an H200: 3.9 ms against 58 ms eager with a dynamic cache).
  "dynamic": transformers' DynamicCache, eager (any target). "auto": static on a GPU for a
  target with full-attention layers only, otherwise dynamic.
  """
  if reference not in ("batched", "decode"):
    raise EvaluationError(f"reference={reference!r} must be 'batched' or 'decode'")
  K = block_size or cfg.block_size
  if not 2 <= K <= cfg.block_size:
    raise EvaluationError(f"block size {K} must be in [2, {cfg.block_size}]: the drafter was "
                          f"trained with block_size={cfg.block_size}")
  if max_new_tokens < 1:
    raise EvaluationError(f"{max_new_tokens=} must be >= 1")
  if not prompts:
    raise EvaluationError("no prompts to evaluate")
  check_compatible(cfg, target)
  ids = [encode(target.tokenizer, p) for p in prompts]
  limit = target.info.max_position_embeddings
  for i, p in enumerate(ids):
    if not p:
      raise EvaluationError(f"prompt {i} is empty after tokenisation")
    if len(p) + max_new_tokens + K > limit:
      raise EvaluationError(f"prompt {i} has {len(p)} tokens: with max_new_tokens={max_new_tokens} "
                            f"and block size {K} it needs {len(p) + max_new_tokens + K} positions, "
                            f"more than the target's context of {limit}; shorten it or lower "
                            "--max-new-tokens")
  # Positions a sequence takes past its prompt: its new tokens and a verify block, or the
  # warm-up's 2K + 2 tokens (below) where an evaluation asks for fewer.
  warm_up_tokens = 2 * K + 2
  room = max(max_new_tokens, warm_up_tokens) + K
  decoder = _decoder(target, cfg, decoder, max_len=max(map(len, ids)) + room, room=room)
  eos = spec_decode.eos_token_ids(target)
  keep = Handoff()  # the frozen embedding / LM head stay imported for the whole evaluation
  if proposer is None:
    devices = jax.tree.leaves(params)[0].devices()
    device = next(iter(devices)) if len(devices) == 1 else None
    if frozen is None:
      frozen = import_frozen(target.embedding, target.lm_head, keep, device=device)
    if draft_vocab is None:
      draft_vocab = frozen.get("draft_ids")
    session = DrafterSession(cfg, graphdef, params, frozen["embed"], frozen["lm_head"],
                             block_size=K, temperature=temperature, draft_ids=draft_vocab)
    proposer = _JaxProposer(session, max(map(len, ids)) + room, seed, device, room=room)
  kw = dict(eos_ids=eos, temperature=temperature)
  cache = {} if reference_cache is None else reference_cache
  keys = [(tuple(p), max_new_tokens, float(temperature), seed + i) for i, p in enumerate(ids)]
  # Warm-up (untimed), once per cache size the prompts use (the target's static cache and the
  # drafter's context are sized per prompt): compiles the drafter's jitted calls (the prompt's
  # chunk, the first proposal, and the fused append + proposal of every later step: 2K + 2 new
  # tokens take at least two verify steps; no end-of-turn stops it early) and captures the
  # target's CUDA graphs of each size.
  sizes = {}
  for p in ids:
    sizes.setdefault(tuple(getattr(x, "size_for", lambda n: None)(len(p))
                           for x in (decoder, proposer)), p)
  for p in sizes.values():
    spec_decode.speculative_generate(decoder, proposer, p, max_new_tokens=warm_up_tokens,
                                     block_size=K, seed=seed, temperature=temperature)
    if any(k not in cache for k in keys):
      spec_decode.target_generate(decoder, p, max_new_tokens=2, seed=seed, **kw)
  earlier = {k for k in keys if k in cache}  # decoded by an earlier evaluation
  if reference == "batched" and temperature <= 0:
    _batched_references(target, ids, keys, cache, eos, max_new_tokens, skip=speed_prompts)
  arbiter = spec_decode.TieArbiter(target)  # copies the target to f32 only on a first difference
  rows = []
  it = ids
  if progress:
    from tqdm import tqdm
    it = tqdm(ids, desc="speculative decoding", unit="prompt")
  for i, p in enumerate(it):
    spec = spec_decode.speculative_generate(
        decoder, proposer, p, max_new_tokens=max_new_tokens, block_size=K,
        seed=seed + i, **kw)
    cached = keys[i] in earlier
    if keys[i] not in cache:
      cache[keys[i]] = spec_decode.target_generate(decoder, p, max_new_tokens=max_new_tokens,
                                                   seed=seed + i, **kw)
    ref = cache[keys[i]]
    check = None
    if temperature <= 0:
      check = spec_decode.check_lossless(decoder, arbiter, p, spec.tokens, ref.tokens,
                                         max_new_tokens=max_new_tokens, eos_ids=eos)
    rows.append({"prompt": i, "prompt_key": prompt_key(p), "prompt_tokens": len(p),
                 "new_tokens": len(spec.tokens),
                 "verify_steps": len(spec.accepted), "accepted": spec.accepted,
                 "tau": float(np.mean(spec.accepted) + 1) if spec.accepted else None,
                 "speculative_seconds": spec.seconds, "target_seconds": ref.seconds,
                 "target_cached": cached, "target_new_tokens": len(ref.tokens),
                 "first_difference": spec_decode.first_difference(spec.tokens, ref.tokens),
                 "lossless": None if check is None else check.mismatch is None,
                 "ties": [] if check is None else [_divergence(i, t) for t in check.ties],
                 "mismatch": _divergence(i, check.mismatch) if check and check.mismatch else None,
                 "speculative_text_head": _decode(target.tokenizer, spec.tokens[:8])})
    if progress:
      taus = [r["tau"] for r in rows if r["tau"] is not None]
      it.set_postfix(tau=f"{np.mean(taus):.2f}" if taus else "-")
  return summarize(rows, block_size=K, max_new_tokens=max_new_tokens, temperature=temperature,
                   target_name=target.name, arbiter=arbiter.kind, decoder=decoder.kind)


def prompt_key(ids) -> str:
  """A short key of a prompt's token ids: two reports' rows of the same prompt share it
  (jax_drafter.tools.compare pairs them by it)."""
  return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def _batched_references(target: Target, ids, keys, cache, eos, max_new_tokens, *, skip: int):
  """Greedy target outputs of prompts skip.. (not yet cached) in batches; seconds None (untimed)."""
  from bridge import generation
  todo = [i for i in range(skip, len(ids)) if keys[i] not in cache]
  if not todo:
    return
  pad = getattr(target.tokenizer, "pad_token_id", None)
  if pad is None:  # any id: padded positions are masked out of every live row
    pad = min(eos) if eos else 0
  for k, new in generation.generate_many(target.model, [ids[i] for i in todo],
                                         max_new_tokens=max_new_tokens, stop_ids=set(eos),
                                         pad_id=pad):
    cache[keys[todo[k]]] = spec_decode.Generation(new, seconds=None)


def _divergence(prompt: int, d: spec_decode.Divergence) -> dict:
  return {"prompt": prompt, **dataclasses.asdict(d)}


def _decode(tokenizer, tokens) -> str:
  try:
    return tokenizer.decode(tokens)
  except Exception:  # a stand-in tokenizer without decode: the report stays usable
    return ""


def summarize(rows: list[dict], *, block_size: int, max_new_tokens: int, temperature: float,
              target_name: str, arbiter: str | None = None, decoder: str | None = None) -> dict:
  """Per-prompt rows -> the report: tau, histogram of tokens per verify step, speed, lossless.

  A row's "ties" and "mismatch" come from spec_decode.check_lossless (as dicts with "prompt");
  `arbiter` says what recomputed the logits at the differences (None: there were none);
  `decoder` how the target decoded (speed figures depend on it)."""
  taus = [r["tau"] for r in rows if r["tau"] is not None]
  hist = np.zeros(block_size + 1, np.int64)
  for r in rows:
    for a in r["accepted"]:
      hist[a + 1] += 1
  spec_s = sum(r["speculative_seconds"] for r in rows)
  timed = [r for r in rows if r["target_seconds"] is not None]  # batched references are untimed
  ref_s = sum(r["target_seconds"] for r in timed)
  spec_tps = sum(r["new_tokens"] for r in rows) / spec_s if spec_s else None
  ref_tps = sum(r["target_new_tokens"] for r in timed) / ref_s if ref_s else None
  # The speed-up compares the same prompts: speculative decoding of the prompts the target alone
  # was timed on (prompt lengths and answer lengths move tokens/s a lot).
  spec_timed_s = sum(r["speculative_seconds"] for r in timed)
  spec_timed_tps = (sum(r["new_tokens"] for r in timed) / spec_timed_s if spec_timed_s else None)
  checked = temperature <= 0
  mismatches = [r["mismatch"] for r in rows if r["mismatch"]]
  return {
      "tau": float(np.mean(taus)) if taus else None,
      # Its standard error over the prompts (responses differ far more than verify steps of one
      # response do): two drafters evaluated on the same prompts compare prompt by prompt.
      "tau_stderr": objective.stderr(taus),
      # All verify steps pooled (tokens over steps): short responses weigh less than in the mean
      # over responses above, which is the figure z-lab's DFlash benchmark prints.
      "tau_pooled": (float(hist @ np.arange(block_size + 1)) / int(hist.sum())
                     if hist.sum() else None),
      "max_tau": block_size, "block_size": block_size, "max_new_tokens": max_new_tokens,
      "temperature": temperature, "num_prompts": len(rows), "target": target_name,
      "verify_steps": int(hist.sum()),
      # Key n: verify steps that produced n tokens (n - 1 accepted drafts + the bonus token).
      "accept_length_histogram": {str(n): int(hist[n]) for n in range(1, block_size + 1)},
      # Cached target-only rows carry the timing of the evaluation that decoded them.
      "tokens_per_second": {"speculative": spec_tps, "target_only": ref_tps,
                            "speculative_on_timed_prompts": spec_timed_tps,
                            "speedup": (spec_timed_tps / ref_tps
                                        if spec_timed_tps and ref_tps else None),
                            "target_only_cached": sum(bool(r.get("target_cached")) for r in rows),
                            "target_only_timed_prompts": len(timed), "decoder": decoder},
      "lossless": {"checked": checked, "passed": (not mismatches) if checked else None,
                   "ties": [t for r in rows for t in r["ties"]], "mismatches": mismatches,
                   "arbiter": arbiter},
      "per_prompt": rows,
  }


def _divergence_text(d: dict) -> str:
  margin = ("" if d["margin"] is None
            else f", margin {d['margin']:.3g} (tolerance {d['tolerance']:.3g})")
  return (f"prompt {d['prompt']} new token {d['position']}: speculative {d['speculative']}, "
          f"target {d['target']}{margin}")


def format_report(r: dict) -> str:
  tau = "n/a" if r["tau"] is None else f"{r['tau']:.3f}"
  if r.get("tau_stderr") is not None:
    tau += f" ± {r['tau_stderr']:.3f} (standard error over prompts)"
  tps = r["tokens_per_second"]
  fmt = lambda x, spec="{:.1f}": "n/a" if x is None else spec.format(x)
  hist = " ".join(f"{k}:{v}" for k, v in r["accept_length_histogram"].items() if v)
  cached, timed = tps.get("target_only_cached", 0), tps.get("target_only_timed_prompts")
  cached = (f" (target only: timed on {timed} of {r['num_prompts']} prompts"
            + (f", {cached} references from an earlier evaluation" if cached else "") + ")"
            if cached or (timed is not None and timed < r["num_prompts"]) else "")
  on_timed = ("" if timed is None or timed == r["num_prompts"] else
              f" ({fmt(tps.get('speculative_on_timed_prompts'))} on the {timed} prompts the "
              "target alone was timed on, which the speed-up compares)")
  ll = r["lossless"]
  if not ll["checked"]:
    lossless = "not checked (temperature > 0)"
  elif ll["passed"]:
    lossless = "passed"
  else:
    m = ll["mismatches"][0]
    lossless = (f"FAILED on {len(ll['mismatches'])} of {r['num_prompts']} prompts; first: "
                f"{_divergence_text(m)}: {m['reason']}")
  pooled = ("" if r.get("tau_pooled") is None
            else f"; {r['tau_pooled']:.3f} over all verify steps pooled")
  lines = [f"tau = {tau} (max {r['max_tau']}) over {r['num_prompts']} prompts, "
           f"{r['verify_steps']} verify steps{pooled}"
           + (f"; the drafter computed in {r['compute_dtype']}" if r.get("compute_dtype") else ""),
           f"tokens per verify step (histogram): {hist}",
           f"tokens/s: speculative {fmt(tps['speculative'])}{on_timed}, target only "
           f"{fmt(tps['target_only'])}, speedup {fmt(tps['speedup'], '{:.2f}x')}{cached}"
           + (f"; the target decoded {tps['decoder']}" if tps.get("decoder") else ""),
           f"lossless (speculative == target greedy): {lossless}"]
  ties = ll.get("ties") or []
  if ties:
    lines.append(f"  {len(ties)} near-ties of the target's two best logits, within rounding noise "
                 f"(not errors; logits by {ll['arbiter']}):")
    lines += [f"    {_divergence_text(t)}" for t in ties[:8]]
    if len(ties) > 8:
      lines.append(f"    ... and {len(ties) - 8} more (see the JSON report)")
  return "\n".join(lines)


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m jax_drafter.evaluate", description=__doc__.split("\n")[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--run-dir", help="training run directory (with checkpoints/)")
  src.add_argument("--drafter-dir", help="exported z-lab drafter directory")
  p.add_argument("--step", type=int, help="checkpoint step (default: latest)")
  p.add_argument("--best", action="store_true",
                 help="with --run-dir: the run's best/ drafter (best validation tau) instead of a "
                      "checkpoint, with the run's settings")
  p.add_argument("--export", action="store_true",
                 help="with --run-dir: the drafter the run exported at its end (export/, or "
                      "train.export_dir) instead of a checkpoint, with the run's settings")
  p.add_argument("--target-path", help="HF target directory (default: the run's target)")
  p.add_argument("--gguf-file", help="GGUF file inside --target-path")
  p.add_argument("--device", default=None, help="target device (default: the run's, or auto)")
  p.add_argument("--target-dtype", choices=("float32", "bfloat16"),
                 help="the target's dtype (default: the run's, or float32)")
  p.add_argument("--prompts", help="JSONL prompts (default: the run's held-out conversations)")
  p.add_argument("--num-prompts", type=int, default=16)
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--block-size", type=int, help="default: the trained block size")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--reference", choices=("batched", "decode"), default="batched",
                 help="target-only outputs for the lossless check: batched (fast; the first "
                      "--speed-prompts prompts are decoded one token at a time for the tokens/s "
                      "baseline) or decode (every prompt one token at a time)")
  p.add_argument("--speed-prompts", type=int, default=4)
  p.add_argument("--decoder", choices=DECODERS, default="auto",
                 help="how the target decodes: static = a preallocated KV cache (a transformers "
                      "StaticCache) with each verify step replayed as a CUDA graph on a GPU, the "
                      "same tokens with one launch per step (full-attention targets); dynamic = "
                      "transformers' DynamicCache, eager (any target); auto (default) = static on "
                      "a GPU where the target allows it, otherwise dynamic")
  p.add_argument("--compute-dtype", choices=("run", "float32", "bfloat16"), default="run",
                 help="the dtype the drafter computes in: run (default) = the training run's "
                      "train.compute_dtype (what its own evaluations decoded with; float32 for a "
                      "--drafter-dir), or float32 / bfloat16")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", help="write the report here")
  args = p.parse_args(argv)
  if args.step is not None and not args.run_dir:
    p.error("--step needs --run-dir")
  if args.best and not args.run_dir:
    p.error("--best needs --run-dir (a drafter directory is given with --drafter-dir alone)")
  if args.export and not args.run_dir:
    p.error("--export needs --run-dir (a drafter directory is given with --drafter-dir alone)")
  if sum((args.best, args.export, args.step is not None)) > 1:
    p.error("--best, --export and --step choose different drafters: give one of them")
  if args.gguf_file and not args.target_path:
    p.error("--gguf-file needs --target-path")
  return args


def _exported_of_run(run_dir: str, which: str):
  """(cfg, graphdef, params, draft vocabulary or None, run_config) of a drafter the run exported (`which`: "best", the best
  validation tau, or "export", the end of training), with the settings RUN/config.json records."""
  conf = os.path.join(run_dir, "config.json")
  try:
    with open(conf) as f:
      run_config = json.load(f).get("run_config") or {}
  except (OSError, json.JSONDecodeError, AttributeError) as e:
    raise EvaluationError(f"{conf}: cannot read the run's settings ({type(e).__name__}: {e}); "
                          f"evaluate the drafter with --drafter-dir and --prompts instead") from None
  if which == "best":
    where = os.path.join(run_dir, "best")
    missing = ("it is written at the first validation (train.val_every with data.validation > 0); "
               "evaluate a checkpoint instead (--step N, default the latest)")
  else:
    where = (run_config.get("train") or {}).get("export_dir") or os.path.join(run_dir, "export")
    missing = ("it is written when training ends (not with --no-export); evaluate a checkpoint "
               "instead (--step N, default the latest)")
  if not os.path.isdir(where):
    raise EvaluationError(f"{run_dir} has no {which}/ drafter ({where}): {missing}")
  from jax_drafter.export import read_zlab
  cfg, graphdef, params = read_zlab(where)
  return cfg, graphdef, params, draft_vocab.read(where, cfg), run_config


def _compute_dtype(choice: str, run_config: dict) -> str:
  """--compute-dtype -> "float32" or "bfloat16": "run" reads the run's train.compute_dtype (a
  run recorded "auto" before it was resolved: resolved here, on this machine)."""
  if choice != "run":
    return choice
  recorded = (run_config.get("train") or {}).get("compute_dtype", "float32")
  if recorded == "auto":
    from jax_drafter.config import resolve_compute_dtype, RunConfig, TrainSection
    return resolve_compute_dtype(RunConfig(train=TrainSection(compute_dtype="auto"))).train.compute_dtype
  return recorded


def _in_compute_dtype(cfg: DrafterConfig, params, dtype: str):
  """(graphdef, params) of the drafter computing in `dtype`; the weights stay float32 (as the
  training state keeps them), so a bfloat16 run decodes here as its own evaluations did."""
  from jax_drafter.params import from_flat, to_flat
  from jax_drafter.step import DTYPE
  return from_flat(cfg, to_flat(params), compute_dtype=DTYPE[dtype])


def main(argv=None) -> int:
  jax.devices()  # initialise JAX's backend before torch touches CUDA (import alone does not)
  from jax_drafter.cli import keep_large_allocations, setup_logging
  keep_large_allocations()
  setup_logging(timestamps=False)     # the report, not the libraries' INFO lines
  args = _parse(argv)
  try:
    if args.best or args.export:
      cfg, graphdef, params, vocab, run_config = _exported_of_run(
          args.run_dir, "best" if args.best else "export")
    elif args.run_dir:
      from jax_drafter.checkpoint import load_params
      cfg, graphdef, params, meta = load_params(args.run_dir, args.step)
      vocab = draft_vocab.from_meta(meta, cfg, source=f"{args.run_dir}/checkpoints")
      run_config = meta.get("run_config") or {}
    else:
      from jax_drafter.export import read_zlab
      cfg, graphdef, params = read_zlab(args.drafter_dir)
      vocab = draft_vocab.read(args.drafter_dir, cfg)
      run_config = {}
    compute_dtype = _compute_dtype(args.compute_dtype, run_config)
    graphdef, params = _in_compute_dtype(cfg, params, compute_dtype)
    tc = run_config.get("target") or {}
    path = args.target_path or tc.get("path")
    gguf = args.gguf_file if args.target_path else tc.get("gguf_file")
    dtype = args.target_dtype or tc.get("dtype", "float32")
    target = load_target(path, gguf_file=gguf, dtype=dtype,
                         device=args.device or tc.get("device", "auto"),
                         trust_remote_code=bool(tc.get("trust_remote_code", False)))
    check_compatible(cfg, target)  # before reading any prompt: the cheapest error first
    if args.prompts:
      prompts = load_prompts(args.prompts)[:args.num_prompts]
    elif run_config.get("data"):
      K = args.block_size or cfg.block_size
      prompts = held_out_prompts(
          run_config, args.num_prompts, tokenizer=target.tokenizer,
          max_prompt_tokens=target.info.max_position_embeddings - args.max_new_tokens - K)
    else:
      raise EvaluationError("an exported drafter directory does not record its training data, so the "
                            "held-out split is unknown: pass --prompts FILE.jsonl")
    if not prompts:
      raise EvaluationError("no usable held-out prompt (each needs a user turn before an assistant "
                            "turn); pass --prompts FILE.jsonl")
    report = evaluate_tau(target, cfg, graphdef, params, prompts,
                          max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                          temperature=args.temperature, seed=args.seed,
                          reference=args.reference, speed_prompts=args.speed_prompts,
                          decoder=args.decoder, draft_vocab=vocab)
    report["compute_dtype"] = compute_dtype
  except (EvaluationError, ConfigError, TargetError, data_lib.DataError, FileNotFoundError,
          ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(format_report(report))
  if report["lossless"]["passed"] is False:
    m = report["lossless"]["mismatches"][0]
    print(f"error: speculative decoding is not lossless: prompt {m['prompt']} differs from the "
          f"target's greedy output at new token {m['position']} ({m['reason']})", file=sys.stderr)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=2)
  return 1 if report["lossless"]["passed"] is False else 0


if __name__ == "__main__":
  sys.exit(main())
