"""Cross-framework parity: the Flax drafter vs the PyTorch reference drafter on the same batch.

  python -m jax_drafter.tools.parity [--config tiny-parity|27b-8k|RUN.yaml] [--device cpu|gpu]
      [--dtype float32|bfloat16] [--seed S | --run-dir RUN [--step N] | --zlab DIR]
      [--jax-attention auto|reference|xla|triton] [--torch-attention eager|sdpa|flex]
      [--steps K] [--json REPORT] [--perturb]

--config names a run of jax_drafter.presets (27b-8k: the Qwen3.6-27B drafter) or a run config.
One set of weights (from a seed, a run's checkpoint or a z-lab directory), one batch (target
features, packed rows of two documents, anchors incl. invalid blocks, labels) given to both.
Prints per-layer hidden states, final hidden, logits on a sample, loss, accuracy, tau estimate and
every parameter gradient with max-abs and relative error, PASS/FAIL against TOLERANCES; then K
training steps on that batch side by side: the real jitted train step (step.make_train_step, its
anchors, optimizer and non-finite guard) vs torch.optim.AdamW with the same schedule, clipping and
weight-decay mask on the same anchors. Exit status 1 on any FAIL. torch and JAX meet only through
bridge/ (weights via numpy, tensors via bridge.handoff). Both sides trained for hundreds of steps on
real data, with tau at the end: jax_drafter.tools.learn_parity.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import numpy as np

from jax_drafter import presets

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # torch shares the GPU

# Relative error = ||jax - torch||_2 / ||torch||_2 over the whole tensor (max-abs is reported too);
# a tensor passes if rel <= tol, or max_abs <= atol (tensors that are ~0 on both sides).
# "metric" is an absolute tolerance on accuracy / tau estimate.
# float32: the two sides differ only in summation order and fusion (f32 eps 1.2e-7); after a few
#   layers of matmuls, RMSNorm and softmax this is ~1e-6 relative, so 1e-5 for activations and the
#   loss. Gradients sum over all block tokens and pass backward through the norms and the softmax:
#   1e-4. Argmax flips need a near-tie within ~1e-6: accuracy must match to 1e-6. Adam divides by
#   sqrt(v), which turns 1e-4 gradient noise on tiny coordinates into O(lr) steps: a K-step loss
#   curve is held to 1e-3 relative.
# bfloat16 (GPU, compute dtype bf16, f32 master weights and softmax statistics): bf16 eps is 2^-8
#   = 3.9e-3 and both sides round every matmul output, but at different points (flex_attention vs
#   the XLA/Pallas attention, fused vs unfused RMSNorm). Independent roundings add up to a few eps
#   relative after L layers: 3e-2 for activations and logits, 1e-2 for the loss (an average over
#   many tokens), 6e-2 for gradients (products of two rounded tensors, summed); a handful of argmax
#   flips on near-ties: 2e-2 accuracy, 5e-2 tau; loss curves 2e-2.
TOLERANCES = {
    "float32": dict(hidden=1e-5, logits=1e-5, loss=1e-5, grad=1e-4, metric=1e-6, train=1e-3,
                    atol=1e-7),
    "bfloat16": dict(hidden=3e-2, logits=3e-2, loss=1e-2, grad=6e-2, metric=2e-2, tau=5e-2,
                     train=2e-2, atol=1e-4),
}

PERTURBED = "layers.0.mlp.down_proj.weight"


_T0 = [time.time()]


def _progress(msg: str) -> None:
  """Phase timestamps on stderr: a run cut off by a time limit still shows where it was."""
  print(f"[parity {time.time() - _T0[0]:7.1f}s] {msg}", file=sys.stderr, flush=True)


def parse(argv):
  ap = argparse.ArgumentParser(prog="python -m jax_drafter.tools.parity", description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="tiny-parity",
                  help=f"{' | '.join(presets.RUNS)} | a run config YAML")
  ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
  ap.add_argument("--dtype", default="float32", choices=tuple(TOLERANCES))
  w = ap.add_mutually_exclusive_group()
  w.add_argument("--seed", type=int, default=0, help="random weights and batch from this seed")
  w.add_argument("--run-dir", help="weights from this training run's checkpoint")
  w.add_argument("--zlab", help="weights from a z-lab DFlash directory")
  ap.add_argument("--step", type=int, default=None, help="checkpoint step with --run-dir")
  ap.add_argument("--jax-attention", default="auto", choices=("auto", "reference", "xla", "triton"),
                  help="auto (default): what training uses on --device (xla on cpu, the Pallas "
                  "kernel on gpu); reference: the f32 dense-mask oracle")
  ap.add_argument("--torch-attention", default="eager", choices=("eager", "sdpa", "flex"))
  ap.add_argument("--steps", type=int, default=5, help="training steps to compare (0: none)")
  ap.add_argument("--batch", type=int), ap.add_argument("--seq-len", type=int)
  ap.add_argument("--num-anchors", type=int)
  ap.add_argument("--json", help="write the report here")
  ap.add_argument("--perturb", action="store_true",
                  help=f"scale {PERTURBED} by 1.1 on the torch side only: parity must FAIL")
  return ap.parse_args(argv)


def resolve(args):
  """-> (DrafterConfig or None (then taken from the weights), TrainSection, batch, seq_len)."""
  from jax_drafter.config import ConfigError, TrainSection, load_config
  if args.config in presets.RUNS:
    r = presets.RUNS[args.config]
    cfg, B, S, N = presets.get(r.arch), r.batch, r.seq_len, r.anchors
    t = TrainSection(steps=20, learning_rate=1e-3, warmup_steps=2, num_anchors=N,
                     ce_chunk_size=r.ce_chunk or TrainSection.ce_chunk_size,
                     compute_dtype=args.dtype)
  else:
    run = load_config(args.config)
    t, cfg = run.train, None
    B, S, N = run.data.batch_size, run.data.seq_len, t.num_anchors
    if not (args.run_dir or args.zlab):
      raise ConfigError(f"{args.config}: a run config does not fix the drafter's shapes on its own "
                        "(they come from the target); pass --run-dir or --zlab with it")
  # The schedule keeps the run's horizon (t.steps): --steps only says how many steps to compare.
  # Dropout is off: the PyTorch reference drafter has none, and parity compares the step's
  # arithmetic on one batch (learn_parity, which takes overrides, refuses it instead).
  if t.dropout:
    _progress(f"train.dropout={t.dropout} of {args.config} is off here: the PyTorch reference "
              "drafter has no dropout")
  t = dataclasses.replace(t, compute_dtype=args.dtype, num_anchors=args.num_anchors or N,
                          dropout=0.0)
  return cfg, t, args.batch or B, args.seq_len or S


def main(argv=None) -> int:
  args = parse(argv)
  import jax                                                           # JAX before torch's CUDA
  import jax.numpy as jnp
  import torch
  from flax import nnx

  from bridge.twin import reference_drafter as ref
  from bridge.handoff import Handoff
  from bridge.twin.weights import load_flat_into
  from jax_drafter import objective, step
  from jax_drafter.params import abstract_model, to_flat
  from jax_drafter.tools import plans

  _T0[0] = time.time()
  tol = TOLERANCES[args.dtype]
  if args.torch_attention == "flex" and args.device == "cpu":
    print("error: torch's flex_attention has no backward on CPU; use --torch-attention eager|sdpa "
          "on CPU, flex with --device gpu", file=sys.stderr)
    return 2
  cfg, t, B, S = resolve(args)
  if args.run_dir:
    from jax_drafter.checkpoint import load_params
    cfg, graphdef, params, _ = load_params(args.run_dir, args.step)
  elif args.zlab:
    from jax_drafter.export import read_zlab
    cfg, graphdef, params = read_zlab(args.zlab)
  else:
    graphdef, params = nnx.split(step.Drafter(cfg, rngs=nnx.Rngs(args.seed)), nnx.Param)
  jcd = step.DTYPE[args.dtype]
  graphdef, _ = abstract_model(cfg, jcd)          # same params, this run's compute dtype
  dev = torch.device("cuda" if args.device == "gpu" else "cpu")
  tcd = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
  jax_dev = jax.devices("gpu" if args.device == "gpu" else "cpu")[0]
  if args.jax_attention == "auto":
    args.jax_attention = "triton" if args.device == "gpu" else "xla"
  attn = {"implementation": args.jax_attention}
  if args.jax_attention == "triton" and args.device == "cpu":
    attn["interpret"] = True

  _progress("weights ready (JAX)")
  # One batch, drawn once, imported into JAX through the DLPack handoff (zero-copy on the GPU).
  N = t.num_anchors
  micro_t, frozen_t = plans.packed_batch(cfg, B, S, N, args.seed, tcd, dev)
  hand = Handoff()
  put = lambda x, n: hand.put(x.contiguous(), name=n, allow_copy=args.device == "cpu")
  with jax.default_device(jax_dev):
    micro_j = {k: put(v, k) for k, v in micro_t.items()}
    frozen_j = {k: put(v, k) for k, v in frozen_t.items()}
    params = jax.device_put(params, jax_dev)
    batch_j = {k: v[None] for k, v in micro_j.items()}   # the train step's [A=1, B, ...] layout

  _progress("batch drawn and imported into JAX")
  model = ref.build_reference(cfg, device=dev, compute_dtype=tcd, attention=args.torch_attention)
  flat = {k: np.asarray(v) for k, v in to_flat(params).items()}
  if args.perturb:
    flat[PERTURBED] = flat[PERTURBED] * 1.1
  load_flat_into(model, flat, source="flax params")
  del flat
  _progress("weights copied into the PyTorch reference")

  jax_grads, jax_layers, train_step, anchors_fn = compiled_fns(graphdef, cfg, t,
                                                               tuple(sorted(attn.items())))
  # The trajectory is the real train step; the torch side gets the anchors that step samples.
  rng = np.asarray(jax.random.key_data(jax.random.key(args.seed)))

  def anchors_for(i):
    a, v = anchors_fn(rng, i, batch_j["loss_mask"], batch_j["doc_id"], N)
    a, v = np.array(a[0]), np.array(v[0])
    return (jnp.asarray(a), jnp.asarray(v)), (torch.from_numpy(a).to(dev), torch.from_numpy(v).to(dev))

  @jax.jit
  def err(a, b):
    d = a.astype(jnp.float32) - b.astype(jnp.float32)
    return jnp.max(jnp.abs(d)), jnp.linalg.norm(d.ravel()), jnp.linalg.norm(b.astype(jnp.float32).ravel())

  rows = []

  def compare(name, a_jax, b_torch, kind, transpose=False):
    b_torch = b_torch.detach().float().contiguous()
    if args.device == "cpu":   # small tensors: numpy is cheaper than compiling `err` per shape
      a, b = np.asarray(a_jax, np.float64), b_torch.numpy().astype(np.float64)
      a = a.T if transpose else a
      res = (np.abs(a - b).max(), np.linalg.norm((a - b).ravel()), np.linalg.norm(b.ravel()))
    else:                      # on the GPU: torch's tensor goes to JAX zero-copy, errors on device
      h2 = Handoff()
      res = err(a_jax.T if transpose else a_jax, h2.put(b_torch, name=name))
      h2.release_after(res)
    mx, dn, bn = (float(x) for x in res)
    rel = dn / max(bn, 1e-30)
    lim = tol.get(kind, tol["metric"])
    ok = mx <= lim if kind in ("metric", "tau") else (rel <= lim or mx <= tol["atol"])
    rows.append(dict(name=name, max_abs=mx, rel=rel, tol=lim, ok=bool(ok)))

  topt = torch_adamw(model, t)
  # Committed like the step's outputs, so that steps 1.. reuse the program compiled for step 0.
  state = jax.device_put(step.TrainState(jnp.zeros((), jnp.int32), params,
                                         step.make_optimizer(t).init(params), rng), jax_dev)
  del params                                        # donated with the state at the first step
  curve = []
  with jax.default_matmul_precision("highest" if args.dtype == "float32" else None), ref.no_tf32():
    for i in range(max(args.steps, 1)):
      aj, at = anchors_for(i)
      if i == 0:   # gradients and layer outputs on the initial weights, for the table
        outs_j = jax_layers(state.params, aj, micro_j, frozen_j)
        loss_j, sums_j, h_j, g_j = jax_grads(state.params, aj, micro_j, frozen_j)
        jax.block_until_ready(loss_j)
        _progress("step 0: JAX gradients done")
      sums_t, (_, h_t, outs_t) = ref.micro_sums(model, micro_t, frozen_t, *at,
                                                gamma=t.loss_decay_gamma,
                                                chunk_size=t.ce_chunk_size, return_aux=True)
      loss_t = sums_t["wce"] / sums_t["w"].clamp(min=1e-9)
      topt.zero_grad(set_to_none=True)
      loss_t.backward()
      _progress(f"step {i}: torch done")
      if i == 0:   # the full table on the initial weights
        for li, (oj, ot) in enumerate(zip(outs_j, outs_t, strict=True)):
          compare(f"hidden.layer{li}", oj, ot, "hidden")
        compare("hidden.final", h_j, h_t, "hidden")
        T = min(64, h_j.shape[1])
        lg_j = jnp.matmul(h_j[0, :T].astype(jcd), frozen_j["lm_head"].astype(jcd).T,
                          preferred_element_type=jnp.float32)
        lg_t = h_t[0, :T].to(tcd).float() @ frozen_t["lm_head"].to(tcd).float().T
        compare(f"logits[row0,:{T}]", lg_j, lg_t, "logits")
        compare("loss", loss_j, loss_t, "loss")
        mj, mt = objective.metrics_from_sums(sums_j), ref.metrics_from_sums(sums_t)
        compare("accuracy", mj["accuracy"], mt["accuracy"], "metric")
        compare("tau_estimate", mj["tau_estimate"], mt["tau_estimate"], "tau")
        grads_t = {k: q.grad for k, q in model.named_parameters()}
        for k, gj in to_flat(g_j).items():
          if grads_t[k] is None:
            rows.append(dict(name=f"grad.{k}", max_abs=float("nan"), rel=float("nan"),
                             tol=tol["grad"], ok=False))
          else:
            compare(f"grad.{k}", gj, grads_t[k], "grad", transpose=gj.ndim == 2)
        del grads_t, g_j, outs_j   # before the step: its own gradients need the memory
      if not args.steps:
        break
      state, metrics = train_step(state, batch_j, frozen_j)
      loss_j = float(metrics["loss"])
      _progress(f"step {i}: JAX train step done")
      torch_update(model, topt, t, torch_lr(t, i))
      curve.append((loss_j, float(loss_t.detach())))

  for i, (lj, lt) in enumerate(curve):
    rel = abs(lj - lt) / max(abs(lt), 1e-30)
    rows.append(dict(name=f"train.loss[step {i}]", max_abs=abs(lj - lt), rel=rel, tol=tol["train"],
                     ok=bool(rel <= tol["train"])))
  ok = all(r["ok"] for r in rows)
  print_report(args, cfg, B, S, N, rows, curve, ok)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "config": cfg.to_zlab(), "batch": B, "seq_len": S,
                 "num_anchors": N, "tolerances": tol, "rows": rows,
                 "train_curve": [{"jax": a, "torch": b} for a, b in curve], "pass": ok}, f, indent=2)
  hand.release_after()
  return 0 if ok else 1


@functools.cache
def compiled_fns(graphdef, cfg, t, attn_items):
  """(jax_grads, jax_layers, train_step, anchors), jitted; cached on the static arguments so that
  repeated in-process runs (the tests) with the same shapes reuse the compiled programs.

  train_step is the real one (step.make_train_step + jit_train_step: anchors sampled inside from
  fold_in(rng, step), step.make_optimizer, the non-finite guard); `anchors` repeats its sampling
  for the torch side (step_anchors)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jax_drafter import objective, step
  attn = dict(attn_items)
  jcd = step.DTYPE[t.compute_dtype]

  def jax_loss(p, anchors, micro, frozen):
    sums, (_, h, _, _) = step.micro_sums(graphdef, p, micro, frozen, None, cfg=cfg, t=t,
                                         attn_impl=attn, return_aux=True, anchors=anchors)
    return sums.wce / jnp.maximum(sums.w, 1e-9), (sums, h)

  # Batch and frozen arrays are DLPack imports that torch owns: never donated.
  @jax.jit
  def jax_grads(p, anchors, micro, frozen):
    (loss, (sums, h)), g = jax.value_and_grad(jax_loss, has_aux=True)(p, anchors, micro, frozen)
    return loss, sums, h, g

  @jax.jit
  def jax_layers(p, anchors, micro, frozen):
    blocks = objective.build_blocks(*anchors, micro["input_ids"], micro["loss_mask"],
                                    micro["doc_id"], micro["position_ids"],
                                    block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                    gamma=t.loss_decay_gamma)
    emb = jnp.take(frozen["embed"], blocks.noise_ids, axis=0).astype(jcd)
    _, outs = nnx.merge(graphdef, p)(emb, micro["features"].astype(jcd), micro["position_ids"],
                                     blocks.positions, blocks.anchors, blocks.doc_start,
                                     blocks.block_valid, attn_impl=attn, return_layers=True)
    return outs

  # The state (params and optimizer state, ~28 GB at 27B-drafter shapes) is donated.
  train_step = step.jit_train_step(step.make_train_step(graphdef, cfg, t, step.make_optimizer(t),
                                                        attn))
  return jax_grads, jax_layers, train_step, jax.jit(step_anchors, static_argnums=(4,))


def step_anchors(rng_data, step: int, loss_mask_AxBxS, doc_id_AxBxS, num_anchors: int):
  """The anchors the train step samples at optimizer step `step`: [A, B, N] anchors and validity.

  Repeats step.make_train_step's derivation (key = fold_in(wrap(rng), step), micro-batch i uses
  fold_in(key, i)) with the same objective.sample_anchors, so that the real step runs unchanged
  and torch sees the same anchors. If the two ever drift apart, the losses differ from the first
  step on and parity fails.
  """
  import jax
  import jax.numpy as jnp
  from jax_drafter import objective
  key = jax.random.fold_in(jax.random.wrap_key_data(rng_data), step)
  out = [objective.sample_anchors(jax.random.fold_in(key, i), loss_mask_AxBxS[i], doc_id_AxBxS[i],
                                  num_anchors) for i in range(loss_mask_AxBxS.shape[0])]
  return jnp.stack([a for a, _ in out]), jnp.stack([v for _, v in out])


def torch_adamw(model, t):
  """torch.optim.AdamW as step.make_optimizer: same betas/eps, no weight decay on 1-D weights;
  the learning rate is set each step from the optax schedule's values."""
  import torch
  ps = list(model.parameters())
  return torch.optim.AdamW([{"params": [q for q in ps if q.ndim > 1], "weight_decay": t.weight_decay},
                            {"params": [q for q in ps if q.ndim <= 1], "weight_decay": 0.0}],
                           lr=0.0, betas=(t.b1, t.b2), eps=1e-8)


def torch_lr(t, i: int) -> float:
  """The learning rate of update i (0-based), written out for torch: linear warmup over
  train.warmup_steps with the first update at peak / warmup_steps, then cosine to min_lr_ratio *
  peak at train.steps (step.lr_schedule: optax's warmup-cosine at i + 1). Independent of
  step.learning_rate, so that a change to the JAX schedule shows up as a parity failure instead of
  reaching both sides."""
  import math
  peak, W, j = t.learning_rate, t.warmup_steps, i + 1
  if j < W:
    return peak * j / W
  D = max(t.steps, W + 1) - W
  cosine = 0.5 * (1 + math.cos(math.pi * min(j - W, D) / D))
  return peak * ((1 - t.min_lr_ratio) * cosine + t.min_lr_ratio)


def torch_update(model, topt, t, lr: float) -> float:
  """optax.clip_by_global_norm then the AdamW step at `lr`. -> the gradient norm before clipping."""
  import torch
  ps = list(model.parameters())
  with torch.no_grad():
    norm = torch.sqrt(sum(torch.sum(q.grad.float() ** 2) for q in ps))
    if norm >= t.grad_clip:   # optax.clip_by_global_norm: g / norm * max_norm
      for q in ps:
        q.grad.div_(norm).mul_(t.grad_clip)
  for group in topt.param_groups:
    group["lr"] = lr
  topt.step()
  return float(norm)


def print_report(args, cfg, B, S, N, rows, curve, ok):
  print(f"parity: {args.config} dtype={args.dtype} device={args.device} jax-attention="
        f"{args.jax_attention} torch-attention={args.torch_attention} B={B} S={S} N={N} "
        f"K={cfg.block_size} layers={list(cfg.layer_types)}" + ("  [PERTURBED]" if args.perturb else ""))
  print(f"{'quantity':58s} {'max_abs':>10s} {'rel_err':>10s} {'tol':>8s}  result")
  for r in rows:
    print(f"{r['name']:58s} {r['max_abs']:10.3e} {r['rel']:10.3e} {r['tol']:8.1e}  "
          f"{'PASS' if r['ok'] else 'FAIL'}")
  if curve:
    print("training loss   step   jax (train step)    torch (torch.optim.AdamW)")
    for i, (a, b) in enumerate(curve):
      print(f"{'':16s}{i:4d}   {a:18.7f}   {b:18.7f}")
  nfail = sum(not r["ok"] for r in rows)
  print(f"parity: {'PASS' if ok else 'FAIL'} ({len(rows) - nfail}/{len(rows)} checks passed)")


if __name__ == "__main__":
  sys.exit(main())
