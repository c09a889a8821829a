"""Where one speculative-decoding step's time goes on a GPU: the drafter's proposal (JAX), the
target's verify forward (the static-cache decoder in CUDA graphs, as `jax_drafter.evaluate` runs
it), acceptance, the cache crop and the hand-off of the accepted positions' features to the
drafter (DLPack + the drafter's context extension), against one token of the target alone.

A target of SmolLM2-135M's shapes and a drafter of configs/smollm2-h200.yaml's shapes, both with
random weights in bf16 (the costs do not depend on the weights; a random drafter's drafts are
rejected, so every step makes one token and the context grows by one position a step).

  python scripts/bench_spec_step.py [--prompt-len 200] [--new 128] [--prompts 4] [--vary N]
                                    [--max-len N] [--json F]

Both caches are sized per prompt as `evaluate` sizes them (the target's in powers of two from 256
positions); --max-len sizes them for N positions whatever the prompt (as evaluate did before).

Reports medians over all steps of --prompts prompts: each phase timed alone (synchronised before
and after, so their sum exceeds the unsynchronised step), the whole step as `evaluate` runs it
(speculative_generate, no extra synchronisation), and the target's own decode step; for the
drafter's two ways of taking a step's features: "fused" (evaluate's default: appended in the next
proposal's compiled call) and "separate" (appended in a call of their own, then the proposal),
and for the prompt's features appended in chunks of 256 rows (the default) or of one block
("prompt in blocks", as before: a 1000-token prompt took 63 calls). The fused call is split into
its dispatch and the wait for the device; the DLPack imports of the features are timed apart.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import torch
from flax import nnx

from bench_generation import VocabOnlyTokenizer, smollm2_shaped_model  # scripts/ is on the path
from bridge import spec_decode
from bridge.handoff import Handoff, import_frozen
from bridge.target import Target
from jax_drafter.config import load_config, resolve_drafter
from jax_drafter.evaluate import _JaxProposer
from jax_drafter.inference import DrafterSession
from jax_drafter.model import Drafter


def _sync():
  if torch.cuda.is_available():
    torch.cuda.synchronize()


class _Timer:
  """Synchronised wall time of each call, by phase name."""

  def __init__(self):
    self.ms = {}

  def __call__(self, phase, fn, /, *a, **kw):
    _sync()
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    jax.block_until_ready([x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)])
    _sync()
    self.ms.setdefault(phase, []).append(1e3 * (time.perf_counter() - t0))
    return out


class _TimedDecoder:
  def __init__(self, dec, timer):
    self.dec, self.t = dec, timer

  def __getattr__(self, k):
    return getattr(self.dec, k)

  def prefill(self, ids, **kw):
    return self.t("prefill (target, eager; per prompt)", self.dec.prefill, ids, **kw)

  def verify(self, ids, **kw):
    return self.t("verify (target, K tokens)", self.dec.verify, ids, **kw)

  def crop(self, n):
    return self.t("crop", self.dec.crop, n)


class _TimedProposer:
  def __init__(self, p, timer):
    self.p, self.t = p, timer

  def start(self, feats):
    return self.t("start (prompt hand-off + drafter context; per prompt)", self.p.start, feats)

  def extend(self, feats, count):
    return self.t("extend (hand-off + drafter context)", self.p.extend, feats, count)

  def propose(self, last, temperature):
    return self.t("propose (drafter)", self.p.propose, last, temperature)


def _split_fused_call(session, timer):
  """Times the fused call's dispatch (until the jitted call returns) apart from the wait for its
  results on the device; the rest of "propose" is the DLPack import, reading the draft back to the
  host and Python."""
  call = session.__dict__.setdefault("_untimed_extend_propose", session._extend_propose)

  def timed(*args):
    t0 = time.perf_counter()
    out = call(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    timer.ms.setdefault("  of which dispatching the fused call", []).append(1e3 * (t1 - t0))
    timer.ms.setdefault("  of which waiting for it on the device", []).append(
        1e3 * (time.perf_counter() - t1))
    return out
  session._extend_propose = timed


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompt-len", type=int, default=200)
  ap.add_argument("--new", type=int, default=128)
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--max-len", type=int, default=None,
                  help="size both caches for this many positions, for every prompt (as evaluate "
                       "did until 5901c37: its longest prompt + new tokens + a block); default: "
                       "sized per prompt, as evaluate does now")
  ap.add_argument("--vary", type=int, default=0,
                  help="prompt i gets prompt-len + i x VARY tokens (every prompt a new length, as "
                       "in an evaluation; default: all the same length)")
  ap.add_argument("--json")
  a = ap.parse_args()

  # On a CPU (a smoke run of the script's logic): the same shapes in float32, eager.
  model = (smollm2_shaped_model() if torch.cuda.is_available()
           else smollm2_shaped_model("cpu", torch.float32))
  target = Target(model, VocabOnlyTokenizer(), "smollm2-shaped")
  cfg = load_config("configs/smollm2-h200.yaml")
  dcfg = resolve_drafter(cfg.drafter, target.info, mask_token_id=49151)
  K = dcfg.block_size
  graphdef, params = nnx.split(Drafter(dcfg, rngs=nnx.Rngs(0), compute_dtype=jnp.bfloat16),
                               nnx.Param)
  keep = Handoff()
  frozen = import_frozen(target.embedding, target.lm_head, keep)
  session = DrafterSession(dcfg, graphdef, params, frozen["embed"], frozen["lm_head"],
                           block_size=K)
  room = max(a.new, 2 * K + 2) + K   # the new tokens or the warm-up's, and a verify block
  max_len = a.max_len or a.prompt_len + a.prompts * a.vary + room
  by_block = DrafterSession(dcfg, graphdef, params, frozen["embed"], frozen["lm_head"],
                            block_size=K, prefill_chunk=K)
  per_prompt = None if a.max_len else room   # the drafter's context sized per prompt, or not
  proposers = {"fused": _JaxProposer(session, max_len, seed=0, room=per_prompt),  # evaluate's
               "separate": _JaxProposer(session, max_len, seed=0, fuse=False, room=per_prompt),
               "fused, prompt in blocks": _JaxProposer(by_block, max_len, seed=0, room=per_prompt)}
  decoder = (spec_decode.StaticTargetDecoder(target, dcfg.target_layer_ids, max_len=max_len)
             if a.max_len else
             spec_decode.BucketedStaticDecoder(target, dcfg.target_layer_ids, room=room,
                                               max_len=max_len))
  g = torch.Generator().manual_seed(1)
  prompts = [torch.randint(3, 49000, (a.prompt_len + i * a.vary,), generator=g).tolist()
             for i in range(a.prompts + 1)]
  kw = dict(max_new_tokens=a.new, block_size=K, eos_ids=())

  for p in prompts:               # warm-up: compiles and captures each cache size the prompts use
    for proposer in proposers.values():
      spec_decode.speculative_generate(decoder, proposer, p, **dict(kw, max_new_tokens=2 * K + 2))
    spec_decode.target_generate(decoder, p, max_new_tokens=8)
  whole, target_tok = {name: [] for name in proposers}, []
  prompt_ms, target_prompt_ms = {name: [] for name in proposers}, []
  for p in prompts[1:]:
    for name, proposer in proposers.items():
      gen = spec_decode.speculative_generate(decoder, proposer, p, **kw)
      whole[name].append(1e3 * gen.seconds / len(gen.accepted))
      prompt_ms[name].append(1e3 * gen.seconds)
    ref = spec_decode.target_generate(decoder, p, max_new_tokens=a.new)
    target_tok.append(1e3 * ref.seconds / len(ref.tokens))
    target_prompt_ms.append(1e3 * ref.seconds)

  phases = {}
  accept, put = spec_decode.accept, Handoff.put
  try:
    for name, proposer in proposers.items():
      timer = phases[name] = _Timer()
      spec_decode.accept = lambda *x, t=timer, **y: t("accept", accept, *x, **y)
      Handoff.put = lambda *x, t=timer, **y: t("  of which the features' DLPack import", put, *x, **y)
      _split_fused_call(proposer.session, timer)
      for p in prompts[1:]:
        spec_decode.speculative_generate(_TimedDecoder(decoder, timer),
                                         _TimedProposer(proposer, timer), p, **kw)
  finally:
    spec_decode.accept, Handoff.put = accept, put
    for proposer in proposers.values():
      s = proposer.session
      s._extend_propose = s.__dict__.pop("_untimed_extend_propose", s._extend_propose)

  out = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
         "torch": torch.__version__, "jax": jax.__version__,
         "prompt_len": a.prompt_len, "vary": a.vary, "new": a.new, "max_len": max_len, "prompts": a.prompts, "block": K,
         "drafter_layers": dcfg.num_hidden_layers,
         "step_ms (speculative_generate, per verify step, incl. prefill)":
             {name: statistics.median(v) for name, v in whole.items()},
         "target_token_ms (target alone, per token, incl. prefill)": statistics.median(target_tok),
         "prompt_ms (a whole prompt's decoding)": {
             **{name: statistics.median(v) for name, v in prompt_ms.items()},
             "target alone": statistics.median(target_prompt_ms)},
         # fused: "extend" only stashes the features; "propose" appends them and proposes
         "phases_ms (each synchronised, median)": {
             name: {k: statistics.median(v) for k, v in t.ms.items()} for name, t in phases.items()}}
  print(json.dumps(out, indent=1))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
