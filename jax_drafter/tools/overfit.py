"""The overfit gate: a drafter that memorised one conversation drafts it back at tau >= 15 of 16.

    python -m jax_drafter.tools.overfit [--config RUN.yaml] [section.key=value ...]
        [--conversation INDEX | --prompt TEXT] [--steps N] [--anchors N] [--max-new-tokens T]
        [--min-tau TAU] [--json F]

SpecForge's acceptance test of a training stack. The target writes its greedy answer to one prompt;
the drafter trains with the real train step (jax_drafter.step) on that one packed row until it has
memorised it; then real speculative decoding of the prompt (jax_drafter.evaluate) must accept nearly
every drafted token. That can only happen if training and inference agree on the attention mask,
the positions, the labels and the frozen LM head, so a pass proves they do; a fail prints where they
part: accuracy per block offset on the training row, the accepted-length histogram, and the verify
steps where acceptance stopped (drafted vs target token, and what the training forward predicts at
the same anchor).

The answer is the target's exact token ids, never its text encoded again: decoding and
re-encoding is not the identity (SmolLM2 writes "\\n\\n" as one token, 1116, which encodes back
as two 198s), and a drafter that memorised a re-encoded answer drafts every token after the split
one position late (tau 2.8 of 16 in tests/jax_drafter/tools/test_overfit.py).
The row is sized to the conversation (data.seq_len is not used); the drafter architecture and the
optimiser come from the run config, the schedule (steps, warmup, anchors) from the gate, which also
trains without the config's dropout (it memorises on purpose). The target runs in float32 unless
the config names its dtype (a target.dtype of "auto" becomes float32): in bfloat16, decoding's
KV-cached features differ from the training row's whole-row forward by ~1% (median, SmolLM2 layer
15), and a drafter that memorised one row's exact features fails on that difference alone (the
default config: tau 1.1 of 16, every miss drafted right when replayed on the row's own features),
which is not what the gate tests.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from bridge.target import eos_token_ids

from jax_drafter import data as data_lib
from jax_drafter import draft_vocab
from jax_drafter import objective
from jax_drafter import step as step_lib
from jax_drafter import target_init
from jax_drafter.config import (DrafterConfig, RunConfig, TrainSection, feature_layer_ids,
                                 resolve_drafter)

log = logging.getLogger(__name__)


class GateError(ValueError):
  """The gate cannot run as asked (prompt, answer, options): the message names the fix."""


def default_min_tau(block_size: int) -> float:
  """15 of 16: one drafted token in a block may miss; K-1 for smaller blocks (K-1 of K)."""
  return float(min(15, block_size - 1))


def load(cfg: RunConfig):
  """-> (target, resolved DrafterConfig) as the training run would build them (no dataset)."""
  from bridge import target as target_lib
  tc = cfg.target
  target = target_lib.load_target(tc.path, gguf_file=tc.gguf_file, dtype=tc.dtype, device=tc.device,
                                  trust_remote_code=tc.trust_remote_code)
  mask_id = (cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None
             else target_lib.choose_mask_token_id(target))
  dcfg = resolve_drafter(cfg.drafter, target.info, mask_id)
  target.check_layer_ids(dcfg.target_layer_ids)
  target_lib.check_mask_token_id(target, dcfg.mask_token_id)
  return target, dcfg


def choose_prompt(cfg: RunConfig, tokenizer, *, conversation: int | None = None,
                  prompt: str | None = None, max_tokens: int) -> tuple[list[int], str]:
  """-> (prompt ids under the chat template with the generation prompt, where it came from).

  A literal `prompt` is one user turn; `conversation` indexes the usable conversations of the
  config's data (file order); neither: the first usable one whose prompt fits in max_tokens."""
  from jax_drafter.evaluate import EvaluationError, encode, prompt_messages
  if prompt is not None:
    ids = encode(tokenizer, [{"role": "user", "content": prompt}])
    source = "--prompt"
  else:
    want = conversation if conversation is not None else 64
    convs = data_lib.load_conversations(cfg.data.path, max_conversations=want + 1)
    if conversation is not None and conversation >= len(convs):
      raise GateError(f"--conversation {conversation}: {cfg.data.path} has only {len(convs)} "
                      "usable conversations; pass a smaller index")
    picked = None
    for i in ([conversation] if conversation is not None else range(len(convs))):
      try:
        ids = encode(tokenizer, prompt_messages(convs[i]["messages"]))
      except EvaluationError as e:
        if conversation is not None:
          raise GateError(f"--conversation {i}: {e}; pick another index") from None
        continue
      if len(ids) <= max_tokens or conversation is not None:
        picked = i
        break
    if picked is None:
      raise GateError(f"none of the first {len(convs)} conversations of {cfg.data.path} has a user "
                      f"prompt of at most {max_tokens} tokens; pass --conversation or --prompt")
    source = f"conversation {picked} ({convs[picked]['id']}) of {cfg.data.path}"
  if len(ids) > max_tokens:
    raise GateError(f"the prompt has {len(ids)} tokens, more than the {max_tokens} that fit with "
                    "--max-new-tokens in the target's context; shorten it or lower "
                    "--max-new-tokens")
  return ids, source


def target_answer(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
  """The target's greedy answer as the exact ids it generated (stop token kept)."""
  from bridge.generation import generate_batch
  stop = eos_token_ids(target.model, target.tokenizer, required=True)
  return generate_batch(target.model, [prompt_ids], max_new_tokens=max_new_tokens, stop_ids=stop,
                        pad_id=_pad_id(target))[0]


def _pad_id(target) -> int:
  pad = target.tokenizer.pad_token_id
  return int(pad) if pad is not None else min(eos_token_ids(target.model, target.tokenizer))


def perfect_accepted(answer_len: int, block_size: int) -> list[int]:
  """Accepted drafts per verify step of a drafter that drafts every answer token right and nothing
  past the answer (past its stop token or its max_new_tokens cut, the row has no labels).

  The first answer token comes from the prefill; each verify step then accepts up to K-1 drafts."""
  accepted, pos = [], 1
  while pos < answer_len:
    acc = min(block_size - 1, answer_len - pos)
    accepted.append(acc)
    pos += acc + 1
  return accepted


def build_row(prompt_ids, answer_ids, pad_id: int) -> dict[str, np.ndarray]:
  """One packed row {key: int32[1, S]} (data.pack_documents): loss on the answer, stop included.

  S leaves at least one padding token (its own document, -1), so a block that runs past the answer
  crosses a document boundary as it does in real packed rows; S is a multiple of 16 so that close
  lengths share one compiled step."""
  ids = np.asarray(list(prompt_ids) + list(answer_ids), np.int32)
  mask = np.zeros(len(ids), np.int32)
  mask[len(prompt_ids):] = 1
  seq_len = -(-(len(ids) + 1) // 16) * 16
  rows, _ = data_lib.pack_documents([(ids, mask)], seq_len, pad_id=pad_id)
  return rows


def _offset_accuracy(blocks, pred_BxQ, block_size: int) -> list[float | None]:
  """Accuracy of block offsets k = 1..K-1 over the supervised positions (None where none is)."""
  K = block_size
  on = np.asarray(blocks.weights).reshape(-1, K) > 0
  hit = (np.asarray(pred_BxQ) == np.asarray(blocks.labels)).reshape(-1, K) & on
  return [float(hit[:, k].sum() / on[:, k].sum()) if on[:, k].any() else None for k in range(1, K)]


def run_gate(target, dcfg: DrafterConfig, train: TrainSection, prompt_ids: list[int], *,
             steps: int, max_new_tokens: int, min_tau: float | None = None,
             num_anchors: int | None = None, answer_ids: list[int] | None = None,
             source: str = "prompt") -> dict:
  """Train on the target's answer to `prompt_ids`, then decode speculatively. -> report dict
  (`passed`, `tau`, the diagnostics). num_anchors None: every anchor candidate every step.
  answer_ids: train on these instead of the target's own answer (tests: a re-encoded answer)."""
  from bridge.handoff import Handoff, import_frozen
  from jax_drafter.evaluate import evaluate_tau
  K = dcfg.block_size
  min_tau = default_min_tau(K) if min_tau is None else float(min_tau)
  if steps < 1:
    raise GateError(f"--steps {steps} must be >= 1")
  t0 = time.time()
  if answer_ids is None:
    answer_ids = target_answer(target, prompt_ids, max_new_tokens)
  answer_ids = [int(a) for a in answer_ids[:max_new_tokens]]
  best = perfect_accepted(len(answer_ids), K)
  best_tau = float(np.mean(best) + 1) if best else None
  if best_tau is None or best_tau < min_tau:
    # Only the tail decides this: the last verify step drafts past the answer's end.
    raise GateError(
        f"the answer has {len(answer_ids)} tokens, so even a drafter that drafts every one of them "
        f"right reaches tau {best_tau} < --min-tau {min_tau} (its last verify step runs past the "
        f"answer); pass --max-new-tokens that is a multiple of {K} (or one more) below "
        f"{len(answer_ids)}, another prompt, or a lower --min-tau")
  rows = build_row(prompt_ids, answer_ids, _pad_id(target))
  S = rows["input_ids"].shape[1]
  candidates = np.nonzero(np.asarray(
      objective.anchor_candidates(rows["loss_mask"], rows["doc_id"]))[0])[0]
  cand = len(candidates)
  N = min(num_anchors or cand, S)
  # Dropout is off: the gate memorises one row on purpose, and a regulariser against memorising
  # would only make it take longer (the config's dropout is for generalising to other prompts).
  t = dataclasses.replace(train, steps=steps, num_anchors=N, grad_accum=1, eval_every=0,
                          eval_prompts=0, warmup_steps=min(train.warmup_steps, steps // 10),
                          dropout=0.0)
  log.info("overfit gate: %s: %d prompt + %d answer tokens in a row of %d; %d anchor candidates, "
           "%d anchors a step, %d steps at lr %.1e (answer generated in %.1f s)", source,
           len(prompt_ids), len(answer_ids), S, cand, N, steps, t.learning_rate, time.time() - t0)

  keep = Handoff()  # the frozen weights and the row's features stay imported for the whole gate
  vocab = None
  if dcfg.draft_vocab_size is not None:   # chosen from this row, as a run chooses from its rows
    vocab = draft_vocab.choose(rows, dcfg.vocab_size, dcfg.draft_vocab_size,
                               pad_doc_id=data_lib.PAD_DOC_ID)
    log.info("draft vocabulary: %d tokens, %.1f%% of the answer's", len(vocab),
             100 * draft_vocab.coverage(vocab, rows))
  frozen = draft_vocab.with_draft_vocab(import_frozen(target.embedding, target.lm_head, keep),
                                        vocab)
  batch = {k: jnp.asarray(v[None]) for k, v in rows.items()}  # [A=1, B=1, S]
  batch["features"] = keep.put(target.stacked_features([rows], feature_layer_ids(dcfg, t)),
                               name="target features")
  optimizer = step_lib.make_optimizer(t)
  graphdef, state = step_lib.init_state(dcfg, t, optimizer)
  state = target_init.start(state, dcfg, t, target, optimizer)
  attn_impl = {"implementation": t.attention} if t.attention else {}
  step_fn = step_lib.jit_train_step(
      step_lib.make_train_step(graphdef, dcfg, t, optimizer, attn_impl))
  t1 = time.time()
  history = []
  for i in range(steps):
    state, metrics = step_fn(state, batch, frozen)
    if (i + 1) % t.log_every == 0 or i + 1 == steps or i == 0:
      m = {k: float(v) for k, v in jax.device_get(metrics).items()}
      if not m["finite"]:
        raise GateError(f"loss or gradients became NaN/Inf at step {i + 1} (loss {m['loss']}); "
                        "lower train.learning_rate")
      history.append({"step": i + 1, **m})
      log.info("step %d/%d loss %.4f acc %.3f tau~ %.2f lr %.2e", i + 1, steps, m["loss"],
               m["accuracy"], m["tau_estimate"], m["lr"])
  train_s = time.time() - t1
  if int(state.step) != steps:  # a non-finite step leaves the state as it was and is not counted
    raise GateError(f"{steps - int(state.step)} of {steps} steps had NaN/Inf loss or gradients and "
                    "were skipped; lower train.learning_rate")

  # Every candidate anchor once, with the trained parameters: what the row has been memorised as.
  micro = {k: v[0] for k, v in batch.items()}
  fixed = (jnp.asarray(candidates[None], jnp.int32), jnp.ones((1, cand), bool))
  sums, (blocks, _, _, pred) = step_lib.micro_sums(
      graphdef, state.params, micro, frozen, None, cfg=dcfg, t=t, attn_impl=attn_impl,
      return_aux=True, anchors=fixed)
  row_metrics = {k: float(v) for k, v in objective.metrics_from_sums(sums).items()}

  t2 = time.time()
  report = evaluate_tau(target, dcfg, graphdef, state.params, [prompt_ids],
                        max_new_tokens=max_new_tokens, progress=False, frozen=frozen)
  accepted = report["per_prompt"][0]["accepted"]
  passed = bool(report["tau"] is not None and report["tau"] >= min_tau
                and report["lossless"]["passed"])
  out = {
      "passed": passed, "tau": report["tau"], "min_tau": min_tau, "perfect_tau": best_tau,
      "block_size": K, "lossless": report["lossless"]["passed"], "source": source,
      "prompt_tokens": len(prompt_ids), "answer_tokens": len(answer_ids), "seq_len": S,
      "anchor_candidates": cand, "num_anchors": N, "steps": steps,
      "learning_rate": t.learning_rate, "warmup_steps": t.warmup_steps,
      "answer_ids": answer_ids, "answer_text": target.tokenizer.decode(answer_ids),
      "train_history": history, "row_metrics": row_metrics,
      "offset_accuracy": _offset_accuracy(blocks, pred, K),
      "accepted": accepted, "accept_length_histogram": report["accept_length_histogram"],
      "seconds": {"train": train_s, "evaluate": time.time() - t2, "total": time.time() - t0},
  }
  if not passed:
    out["misses"] = _misses(target, dcfg, graphdef, state.params, frozen, prompt_ids, answer_ids,
                            accepted, max_new_tokens, blocks, pred)
  keep.release_after(state.params)
  return out


def _misses(target, dcfg, graphdef, params, frozen, prompt_ids, answer_ids, accepted,
            max_new_tokens, blocks, pred, limit: int = 5) -> list[dict]:
  """The first verify steps whose acceptance stopped inside the output: where, what the drafter
  drafted there (replayed on the target's own output), what the target wanted, what the drafter
  was trained to draft there, and what the training forward predicts at the same anchor."""
  from bridge import spec_decode
  from bridge.handoff import Handoff
  from jax_drafter.inference import DrafterSession
  K, P = dcfg.block_size, len(prompt_ids)
  decoder = spec_decode.TargetDecoder(target)
  # The target's greedy output by the same code as the evaluation's lossless reference: the verify
  # steps walk over it (it equals answer_ids unless the answer is not the target's own).
  ref = spec_decode.target_generate(decoder, prompt_ids, max_new_tokens=max_new_tokens,
                                    eos_ids=spec_decode.eos_token_ids(target)).tokens
  rows = build_row(prompt_ids, ref, _pad_id(target))
  h = Handoff()
  feats = h.put(target.features(rows["input_ids"], rows["position_ids"], rows["doc_id"],
                                dcfg.target_layer_ids)[0], name="target features")
  session = DrafterSession(dcfg, graphdef, params, frozen["embed"], frozen["lm_head"],
                           draft_ids=frozen.get("draft_ids"))
  anchor_at = {int(a): n for n, a in enumerate(np.asarray(blocks.anchors)[0])}
  pred = np.asarray(pred).reshape(-1, K)
  decode = lambda i: target.tokenizer.decode([i]) if i is not None else None
  out, pos = [], 1
  for step, acc in enumerate(accepted):
    miss = pos + acc
    if acc < K - 1 and miss < len(ref) and len(out) < limit:
      session.reset(P + len(ref))
      session.extend(feats[:P + pos - 1])           # context: the prompt and ref[:pos - 1]
      drafted, _ = session.propose(ref[pos - 1])    # the block anchored on ref[pos - 1]
      n = anchor_at.get(P + pos - 1)
      trained = answer_ids[miss] if miss < len(answer_ids) else None
      train_pred = int(pred[n, acc + 1]) if n is not None else None
      out.append({"verify_step": step, "answer_position": miss, "accepted": acc,
                  "drafted": int(drafted[acc]), "target": int(ref[miss]), "trained_label": trained,
                  "train_forward": train_pred, "drafted_text": decode(int(drafted[acc])),
                  "target_text": decode(int(ref[miss])), "trained_label_text": decode(trained),
                  "train_forward_text": decode(train_pred)})
    pos += acc + 1
  h.release_after(session.cache)
  return out


def overfit(cfg: RunConfig, *, steps: int, max_new_tokens: int, conversation: int | None = None,
            prompt: str | None = None, min_tau: float | None = None,
            num_anchors: int | None = None) -> dict:
  """Load the target, pick the prompt, run the gate. -> report dict (see run_gate)."""
  jax.devices()  # initialise JAX before torch touches CUDA (docs/DESIGN.md, devices)
  target, dcfg = load(cfg)
  room = target.info.max_position_embeddings - max_new_tokens - dcfg.block_size
  prompt_ids, source = choose_prompt(cfg, target.tokenizer, conversation=conversation,
                                     prompt=prompt, max_tokens=min(room, 1024))
  return run_gate(target, dcfg, cfg.train, prompt_ids, steps=steps, max_new_tokens=max_new_tokens,
                  min_tau=min_tau, num_anchors=num_anchors, source=source)


def format_report(r: dict) -> str:
  hist = " ".join(f"{k}:{v}" for k, v in r["accept_length_histogram"].items() if v)
  tau = "n/a" if r["tau"] is None else f"{r['tau']:.3f}"
  lines = [f"overfit gate {'PASS' if r['passed'] else 'FAIL'}: tau {tau} of {r['block_size']} "
           f"(need >= {r['min_tau']:g}; a perfect drafter reaches {r['perfect_tau']:.3f}), "
           f"lossless {r['lossless']}; {r['steps']} steps on {r['answer_tokens']} answer tokens "
           f"in {r['seconds']['total']:.0f} s",
           f"tokens per verify step (histogram): {hist}"]
  if r["passed"]:
    return "\n".join(lines)
  acc = " ".join(f"{k}:{'-' if a is None else f'{a:.2f}'}"
                 for k, a in enumerate(r["offset_accuracy"], 1))
  lines.append(f"accuracy per block offset on the training row (k:acc): {acc}")
  m = r["row_metrics"]
  lines.append(f"training row, every anchor: loss {m['loss']:.4f}, accuracy {m['accuracy']:.3f}, "
               f"tau estimate {m['tau_estimate']:.2f}")
  for x in r.get("misses", []):
    lines.append(
        f"verify step {x['verify_step']}: stopped after {x['accepted']} drafts at answer token "
        f"{x['answer_position']}: drafted {x['drafted']} {x['drafted_text']!r}, target "
        f"{x['target']} {x['target_text']!r}; trained label {x['trained_label']} "
        f"{x['trained_label_text']!r}, training forward {x['train_forward']} "
        f"{x['train_forward_text']!r}")
  return "\n".join(lines)


def _parse(argv):
  import argparse
  p = argparse.ArgumentParser(prog="python -m jax_drafter.tools.overfit",
                              description=__doc__.split("\n")[0])
  p.add_argument("--config", default=None, help="YAML run config (default: configs/smollm2.yaml)")
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="override config values, e.g. train.learning_rate=2e-3")
  src = p.add_mutually_exclusive_group()
  src.add_argument("--conversation", type=int, help="index of a usable conversation of data.path")
  src.add_argument("--prompt", help="a literal user prompt instead of a conversation")
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--anchors", type=int, default=None,
                 help="anchors per step (default: every anchor candidate of the answer)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--min-tau", type=float, default=None, help="default: min(15, block_size - 1)")
  p.add_argument("--json", help="write the report here")
  return p.parse_args(argv)


def main(argv=None) -> int:
  import json
  import sys
  from jax_drafter.config import ConfigError, load_config
  import os
  # Before JAX initialises: never grab all GPU memory up front (the target shares the machine).
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  from jax_drafter.train import DEFAULT_CONFIG
  from jax_drafter.cli import keep_large_allocations, setup_logging
  keep_large_allocations()
  setup_logging()
  args = _parse(argv)
  try:
    # "auto" runs the gate's target in float32 (why: the module docstring)
    cfg = load_config(args.config or DEFAULT_CONFIG, args.overrides, auto_target_dtype="float32")
    report = overfit(cfg, steps=args.steps, max_new_tokens=args.max_new_tokens,
                     conversation=args.conversation, prompt=args.prompt, min_tau=args.min_tau,
                     num_anchors=args.anchors)
  except (GateError, ConfigError, data_lib.DataError, ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(format_report(report))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=2)
  return 0 if report["passed"] else 1


if __name__ == "__main__":
  raise SystemExit(main())
