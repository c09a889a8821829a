"""Time the default run's train step on this machine and list where it goes, op by op.

The step of `configs/smollm2.yaml` (or --config), random weights and features of SmolLM2-135M's
shapes, no target: the median of --steps timed steps, then a JAX profiler trace of 3 steps
(perfetto JSON, no TensorBoard needed) summed by XLA op, largest first.

  PYTHONPATH=.:scripts python scripts/cpu_step_profile.py [--config configs/smollm2.yaml] [--steps 8] [--top 15]
      [section.key=value ...]        e.g. train.compute_dtype=float32 drafter.draft_vocab_size=8192

--compare-plain-matmul times the step against the same step with `jax_drafter.model.matmul` as
plain `jnp.matmul` (what XLA:CPU upcasts to float32 dots in bfloat16), in one process, in
alternating rounds of --steps steps (steps of separate processes on a shared 2-core machine
differ by 20% and more), and prints both medians instead of the profile.

--compare-overrides "A" ["B" ...] times the step of the config (with the positional overrides)
against the same step with each extra set of overrides (space-separated section.key=value, e.g.
"train.num_anchors=64 train.dropout=0.2"), in one process and alternating rounds as above: what a
change of recipe costs a step on this machine. Give the positional overrides before it (or
after another option): the sets take every argument that follows.
"""

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

from bench_generation import smollm2_config   # scripts/ is on the path when run as a script
from bridge.target import info_from_config
from jax_drafter import model
from jax_drafter import step as step_lib
from jax_drafter.config import load_config, resolve_drafter
from jax_drafter.draft_vocab import with_draft_vocab
from jax_drafter.trainer import _attn_impl
from pallas_kernels.timing import timed_steps, traced_steps

SMOLLM2 = info_from_config(smollm2_config(), vocab_size=49152, tokenizer_size=49152,
                           name="smollm2-shaped")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="configs/smollm2.yaml")
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--top", type=int, default=15)
  ap.add_argument("--compare-plain-matmul", action="store_true")
  ap.add_argument("--compare-overrides", nargs="+", metavar="OVERRIDES",
                  help="time the step against the step with each of these sets of overrides")
  ap.add_argument("--rounds", type=int, default=6,
                  help="with --compare-plain-matmul or --compare-overrides")
  ap.add_argument("overrides", nargs="*", help="section.key=value, as for jax_drafter.train")
  a = ap.parse_args()
  cfg = load_config(a.config, a.overrides)
  t = cfg.train
  V, D = SMOLLM2.vocab_size, SMOLLM2.hidden_size
  d = resolve_drafter(cfg.drafter, SMOLLM2, mask_token_id=V - 1)
  B, S, F = cfg.data.batch_size, cfg.data.seq_len, D * len(d.target_layer_ids)
  rng = np.random.default_rng(0)
  mask = rng.integers(0, 2, (1, B, S)).astype(np.int32)
  mask[..., :8] = 0
  batch = {"input_ids": rng.integers(0, V - 152, (1, B, S)).astype(np.int32), "loss_mask": mask,
           "doc_id": np.zeros((1, B, S), np.int32),
           "position_ids": np.tile(np.arange(S, dtype=np.int32), (1, B, 1)),
           "features": jnp.asarray(rng.standard_normal((1, B, S, F)).astype(np.float32))}
  head = jnp.asarray(rng.standard_normal((V, D)).astype(np.float32) * 0.02)
  frozen = step_lib.frozen_in_compute_dtype({"embed": head, "lm_head": head}, t.compute_dtype)
  if d.draft_vocab_size:   # drafter.draft_vocab_size=N: the first N ids (a run ranks them by count)
    frozen = with_draft_vocab(frozen, np.arange(d.draft_vocab_size, dtype=np.int32))
  if a.compare_plain_matmul:
    return compare_plain_matmul(d, t, batch, frozen, a)
  if a.compare_overrides:
    return compare_overrides(cfg, d, batch, frozen, a)
  fn, state = _build_step(d, t)
  # Two untimed calls: the first compiles, and on XLA:CPU the second is still seconds slower
  # (no retrace: JAX_EXPLAIN_CACHE_MISSES shows one).
  state, times = timed_steps(fn, state, batch, frozen, steps=a.steps, warmup=2)
  print(f"{a.config} {' '.join(a.overrides)}: {B} x {S} tokens, {t.num_anchors} anchors a row, block {d.block_size}, "
        f"{d.num_hidden_layers} layer(s), compute {t.compute_dtype}: "
        f"step {1e3 * np.median(times):.1f} ms (median of {a.steps})")
  state, trace, _ = traced_steps(fn, state, batch, frozen, steps=3)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and "dur" in e and not e["name"].startswith(("ThunkExecutor", "$")):
      total[e["name"]] += e["dur"]
  print("ms a step   XLA op (the dots run as XNNPACK 'ynn' fusions on recent XLA:CPU)")
  for name, us in total.most_common(a.top):
    print(f"{us / 3e3:9.2f}   {name[:100]}")


def _build_step(d, t):
  """The jitted train step of drafter config d and train section t, and its initial state."""
  opt = step_lib.make_optimizer(t)
  graphdef, state = step_lib.init_state(d, t, opt)
  return step_lib.jit_train_step(step_lib.make_train_step(graphdef, d, t, opt, _attn_impl(t))), state


def _compiled(d, t, batch, frozen):
  """[step, state, []] after two untimed calls (the first compiles; see main)."""
  fn, state = _build_step(d, t)
  state, _ = timed_steps(fn, state, batch, frozen, steps=1, warmup=2)
  return [fn, state, []]


def _alternate(rows: dict, batch, frozen, a) -> None:
  """Times the compiled steps of `rows` (name -> _compiled(...)) in a.rounds alternating rounds
  of a.steps steps each, then prints each one's median, its ratio to the first row's and its
  quartiles over all rounds."""
  for _ in range(a.rounds):
    for row in rows.values():
      row[1], times = timed_steps(row[0], row[1], batch, frozen, steps=a.steps, warmup=0)
      row[2].extend(times)
  base = None
  for name, (_, _, times) in rows.items():
    ms = 1e3 * np.asarray(times)
    base = base or np.median(ms)
    print(f"{name:>40}: step {np.median(ms):.1f} ms ({np.median(ms) / base:.2f}x; quartiles "
          f"{np.percentile(ms, 25):.1f}-{np.percentile(ms, 75):.1f}, {len(ms)} steps in "
          f"{a.rounds} alternating rounds)")


def compare_plain_matmul(d, t, batch, frozen, a):
  """The step built with model.matmul = jnp.matmul against the step as it is."""
  ours, rows = model.matmul, {}
  try:
    for name, mm in (("jnp.matmul", jnp.matmul), ("model.matmul", ours)):
      model.matmul = mm   # read when the step is traced, which the first call does
      rows[name] = _compiled(d, t, batch, frozen)
  finally:
    model.matmul = ours
  _alternate(rows, batch, frozen, a)


def compare_overrides(cfg, d, batch, frozen, a):
  """The configured step against the step of each --compare-overrides set. The arms share the
  batch and the frozen weights: a set may change the anchors, dropout or the drafter's depth,
  not the rows, the target features, the draft vocabulary or the compute dtype."""
  shared = lambda c, dc: (c.data.batch_size, c.data.seq_len, len(dc.target_layer_ids),
                          c.drafter.draft_vocab_size, c.train.compute_dtype)
  rows = {"(the config)": _compiled(d, cfg.train, batch, frozen)}
  for extra in a.compare_overrides:
    c = load_config(a.config, list(a.overrides) + extra.split())
    dc = resolve_drafter(c.drafter, SMOLLM2, mask_token_id=SMOLLM2.vocab_size - 1)
    if shared(c, dc) != shared(cfg, d):
      raise SystemExit(f"--compare-overrides {extra!r}: the rows, the target features, the draft "
                       "vocabulary and the compute dtype must stay those of the config "
                       "(data.batch_size, data.seq_len, the target layers, "
                       "drafter.draft_vocab_size, train.compute_dtype: the arms share one batch "
                       "and one set of frozen weights)")
    rows[extra] = _compiled(dc, c.train, batch, frozen)
  _alternate(rows, batch, frozen, a)


if __name__ == "__main__":
  main()
