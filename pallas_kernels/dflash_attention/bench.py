"""Benchmark of the DFlash attention kernel on the GPU, side by side with its alternatives.

  python -m pallas_kernels.dflash_attention.bench [--shapes 8192x1024,...] [--tune]
  python -m bridge.twin.bench_attention [the same options] [--no-torch]   # + the flex rows

Qwen3.6-27B drafter shapes: Hq 32, Hkv 8, D 128, block 16, bf16, one row, one document; sliding
(window 2048) and full layers. Reports median fwd and fwd+bwd times after warm-up, useful TFLOP/s
(visible keys only: 4*D FLOPs per query row, head and visible key forward; fwd+bwd counts 3.5x
the forward, the flash-attention convention of 2.5x for the backward's five matmuls), and memory.
Memory for JAX is the compiled executable's arguments + outputs + temporaries (XLA's plan, exact
for one call); "ideal" is inputs + outputs (+ gradients). Alternatives in the same run:
  xla    the dense-mask reference under XLA (materialises [Q, S] scores; only where it fits),
  cudnn  jax.nn.dot_product_attention(implementation="cudnn"), dense causal self-attention over
         T = N*16 tokens with the same heads (a ceiling: the best fused attention on this GPU),
  mosaic (--mosaic) our Mosaic GPU kernels (mosaic_gpu.py): "mosaic-fwd" its forward with the
         Triton backward, "mosaic" its forward, dQ and dK/dV kernels,
  mgpu   (--mgpu) JAX's Mosaic GPU flash attention for Hopper on dense non-causal attention of
         the same sizes (no mask: its backward has none yet): the ceiling of a Mosaic GPU kernel
         with the same forward / dQ / dK-dV structure,
  flex   torch flex_attention compiled on the identical mask (bridge.twin.torch_attention), block mask
         built once outside the timed region; "flex+mask" is the bridge's whole call. These rows
         come from bridge.twin.bench_attention, which runs this benchmark with them: the kernel
         imports nothing of the project above it.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.dflash_attention import api
from pallas_kernels.dflash_attention import config as config_lib
from pallas_kernels.dflash_attention import reference
from pallas_kernels.dflash_attention import triton as dflash_triton
from pallas_kernels.timing import median_seconds

HQ, HKV, HEAD_DIM, BLOCK, WINDOW = 32, 8, 128, 16, 2048
SHAPES = ((8192, 1024), (32768, 2048), (65536, 2048))
GIB = 1024 ** 3


@dataclasses.dataclass
class Row:
  impl: str
  layer: str
  shape: str
  fwd_ms: float | None = None
  fwd_tflops: float | None = None
  step_ms: float | None = None
  step_tflops: float | None = None
  mem_gib: float | None = None
  note: str = ""

  def line(self):
    f = lambda x, p: "-" if x is None else f"{x:.{p}f}"
    return (f"{self.impl:16s} {self.layer:8s} {self.shape:12s} {f(self.fwd_ms, 2):>9s} "
            f"{f(self.fwd_tflops, 0):>6s} {f(self.step_ms, 2):>9s} {f(self.step_tflops, 0):>6s} "
            f"{f(self.mem_gib, 2):>8s}  {self.note}")


HEADER = (f"{'impl':16s} {'layer':8s} {'S/N':12s} {'fwd ms':>9s} {'TF/s':>6s} {'fwd+bwd':>9s} "
          f"{'TF/s':>6s} {'mem GiB':>8s}  note")


def make_problem(S: int, N: int, seed: int = 0, *, heads=(HQ, HKV), head_dim: int = HEAD_DIM):
  """One row, one document, N distinct sorted anchors, random bf16 q/k/v (never zeros)."""
  rng = np.random.default_rng(seed)
  anchors = np.sort(rng.choice(np.arange(1, S), N, replace=False))[None].astype(np.int32)
  doc_start = np.zeros_like(anchors)
  valid = np.ones_like(anchors, bool)
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  Q = N * BLOCK
  (hq, hkv), d = heads, head_dim
  shapes = ((1, Q, hq, d), (1, S, hkv, d), (1, S, hkv, d), (1, Q, hkv, d), (1, Q, hkv, d))
  xs = tuple(jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(keys, shapes))
  return xs, (anchors, doc_start, valid)


def jax_memory_gib(jitted, *args) -> float:
  m = jitted.lower(*args).compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes) / GIB


def _fwd_and_step(attn):
  """Jitted forward, and jitted forward + vjp (random cotangent) returning all gradients."""
  fwd = jax.jit(attn)

  @jax.jit
  def step(ct, *xs):
    out, vjp = jax.vjp(attn, *xs)
    return out, vjp(ct)
  return fwd, step


def bench_jax(impl: str, name: str, xs, idx, *, window, flops_fwd, shape, reps, cfg=None,
              interpret=False):
  anchors, doc_start, valid = (jnp.asarray(v) for v in idx)
  if impl == "triton":
    attn = lambda *x: dflash_triton.dflash_attention_triton(
        *x, anchors, doc_start, valid, block_size=BLOCK, window=window, config=cfg,
        interpret=interpret)
  else:
    attn = lambda *x: api.dflash_attention(*x, anchors, doc_start, valid, block_size=BLOCK,
                                           window=window, implementation=impl)
  return bench_jax_fn(attn, xs, flops_fwd, Row(name, "full" if window is None else f"w{window}",
                                                shape), reps)


def _random_qkv(seed: int, queries: int, keys: int, heads, head_dim: int, dtype):
  """One row of random q [1, queries, Hq, D] and k, v [1, keys, Hkv, D]."""
  (hq, hkv), d = heads, head_dim
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(kq, (1, queries, hq, d), dtype),
          jax.random.normal(kk, (1, keys, hkv, d), dtype),
          jax.random.normal(kv, (1, keys, hkv, d), dtype))


def bench_cudnn(S: int, N: int, reps: int, *, heads=(HQ, HKV), head_dim: int = HEAD_DIM):
  T = N * BLOCK
  hq, d = heads[0], head_dim
  q, k, v = _random_qkv(2, T, T, heads, head_dim, jnp.bfloat16)
  attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation="cudnn")
  flops = 4 * d * hq * T * (T + 1) / 2
  return bench_jax_fn(attn, (q, k, v), flops, Row("cudnn-causal", f"T={T}", f"{S}x{N}"), reps)


def bench_mgpu(S: int, N: int, reps: int, *, heads=(HQ, HKV), head_dim: int = HEAD_DIM):
  """JAX's own Mosaic GPU (Hopper: wgmma, TMA) flash attention, jax.experimental.pallas.ops.gpu.
  attention_mgpu, on dense non-causal attention of the N*16 block queries over all S keys with
  the same heads: what the Mosaic GPU route of the issue reaches with the same forward, dQ and
  dK/dV kernel structure (its backward has no causal mask yet, so no mask at all here)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
  T = N * BLOCK
  hq, d = heads[0], head_dim
  # float16: its backward writes float16 whatever the inputs (bf16 failed in jax 0.11.2: "src
  # had type bfloat16 and dst had type float16"); the tensor cores run both at one rate.
  q, k, v = _random_qkv(3, T, S, heads, head_dim, jnp.float16)
  cfg = mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, block_q_dkv=64,
                          block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
  attn = lambda q, k, v: mgpu.attention(q, k, v, cfg)
  return bench_jax_fn(attn, (q, k, v), 4 * d * hq * T * S,
                      Row("mgpu-dense", "nomask", f"{S}x{N}"), reps)


# Mosaic GPU tile variants (`--mosaic-tiles a,b`): SMEM per kernel at head size 128 from the
# lowering (one-warpgroup forward / dQ): wg1 85 / 102 KiB (two CTAs per SM), keys128 149 / 166,
# stages3 117 / 134 (one CTA per SM). The default's forward is warp-specialised (one CTA per SM).
def _mosaic_variants():
  from pallas_kernels.dflash_attention.mosaic_gpu import MosaicConfig
  one = dict(fwd_warpgroups=1)          # the variants measured against the one-warpgroup forward
  return {"default": MosaicConfig(),
          "keys128": MosaicConfig(fwd_keys=128, dq_keys=128, **one),
          "stages3": MosaicConfig(fwd_stages=3, dq_stages=3, dkv_stages=3, **one),
          "dkv3": MosaicConfig(dkv_stages=3, **one),
          "keys128s3": MosaicConfig(fwd_keys=128, fwd_stages=3, dq_keys=128, dkv_stages=3, **one),
          # warp-specialised forward and dQ (ws with 128 keys: 229 KiB, over an SM's 227)
          "ws": MosaicConfig(fwd_warpgroups=2, dq_warpgroups=2),
          "ws3": MosaicConfig(fwd_warpgroups=2, dq_warpgroups=2, fwd_stages=3),
          # the one-warpgroup forward (the default's forward is warp-specialised)
          "wg1": MosaicConfig(fwd_warpgroups=1)}


def bench_mosaic(xs, idx, *, window, flops_fwd, shape, reps, backward="triton", interpret=False,
                 tiles="default"):
  """Our Mosaic GPU kernels (mosaic_gpu.py): the forward with the Triton backward
  ("mosaic-fwd") or with the Mosaic GPU dQ and dK/dV kernels ("mosaic"), timed only after its
  output and (for "mosaic") every gradient matched the Triton kernel's within bf16 tolerance."""
  from pallas_kernels.dflash_attention import mosaic_gpu
  anchors, doc_start, valid = (jnp.asarray(v) for v in idx)
  kw = dict(block_size=BLOCK, window=window)
  attn = lambda *x: mosaic_gpu.dflash_attention_mosaic(*x, anchors, doc_start, valid, **kw,
                                                       backward=backward, interpret=interpret,
                                                       tiles=_mosaic_variants()[tiles])
  tri = lambda *x: dflash_triton.dflash_attention_triton(*x, anchors, doc_start, valid, **kw,
                                                         interpret=interpret)
  name = "mosaic-fwd" if backward == "triton" else "mosaic"
  row = Row(name if tiles == "default" else f"{name}:{tiles}",
            "full" if window is None else f"w{window}", shape)
  ct = jax.random.normal(jax.random.PRNGKey(1), xs[0].shape, xs[0].dtype)
  names = ("out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk")[:6 if backward == "mosaic" else 1]

  def outputs(f):
    def run(*x):
      out, vjp = jax.vjp(f, *x)
      return (out, *vjp(ct))[:len(names)]
    return jax.jit(run)(*xs)
  worst = ""
  try:
    got, want = outputs(attn), outputs(tri)
    for name, a, b in zip(names, got, want):
      a, b = a.astype(jnp.float32), b.astype(jnp.float32)
      err = float(jnp.max(jnp.abs(a - b)))
      bound = 3e-2 * max(1.0, float(jnp.max(jnp.abs(b))))  # bf16 outputs
      if not err <= bound:      # a wrong kernel gets no speed figure (NaN included)
        row.note = f"WRONG: max |{name} - triton {name}| {err:.3g} > {bound:.3g}; not timed"
        return row
      worst += f" {name} {err:.2g}"
  except Exception as e:  # noqa: BLE001 (a prototype's failure is a result)
    row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return row
  row = bench_jax_fn(attn, xs, flops_fwd, row, reps)
  row.note = (row.note + " " if row.note else "") + f"max |x - triton x|:{worst}"
  return row


def bench_jax_fn(attn, xs, flops_fwd, row, reps):
  fwd, step = _fwd_and_step(attn)
  ct = jax.random.normal(jax.random.PRNGKey(1), xs[0].shape, xs[0].dtype)
  try:
    row.mem_gib = jax_memory_gib(step, ct, *xs)
    t = median_seconds(lambda: fwd(*xs), reps=reps)
    row.fwd_ms, row.fwd_tflops = t * 1e3, flops_fwd / t / 1e12
    t = median_seconds(lambda: step(ct, *xs), reps=reps)
    row.step_ms, row.step_tflops = t * 1e3, 3.5 * flops_fwd / t / 1e12
  except Exception as e:  # noqa: BLE001
    row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
  return row


# Tile variants measured against the default (`--tune a,b`, on the first shape and layer). The
# sweeps behind config.H200 are recorded in config.py; these are the distinct neighbours.
_B = config_lib.H200
TUNE_VARIANTS = {
    "h200": _B,
    "smem100k": config_lib.SMEM_100KB,
    "fwd128k": dataclasses.replace(_B, fwd_keys=128, fwd_stages=2),
    "fwd64x128": dataclasses.replace(_B, fwd_keys=128, fwd_rows=64),
    "fwd256x64": dataclasses.replace(_B, fwd_rows=256, fwd_stages=2),
    "fwdw4": dataclasses.replace(_B, fwd_warps=4),
    "dq64k": dataclasses.replace(_B, dq_keys=64, dq_stages=2),
    "dq64ks3": dataclasses.replace(_B, dq_keys=64, dq_stages=3),
    "dqw4": dataclasses.replace(_B, dq_warps=4),
    "dq64x64": dataclasses.replace(_B, dq_rows=64, dq_warps=4),
    "dkv128w4": dataclasses.replace(_B, dkv_warps=4),
    "dkv64s2": dataclasses.replace(_B, dkv_stages=2),
    "dkv128x64": dataclasses.replace(_B, dkv_rows=128, dkv_keys=64),
    "dkv64x64w4": dataclasses.replace(_B, dkv_keys=64, dkv_warps=4),
    "fwds4": dataclasses.replace(_B, fwd_stages=4),
    "fwd128x32": dataclasses.replace(_B, fwd_keys=32),
    "dqs4": dataclasses.replace(_B, dq_stages=4),
    "dq128x16": dataclasses.replace(_B, dq_keys=16),
    "dkvs4": dataclasses.replace(_B, dkv_stages=4),
}


def kernel_parts(xs, idx, *, window, flops_fwd, reps, cfg=None, interpret=False):
  """Median ms of each Pallas kernel alone (forward, dQ + block dK/dV, context dK/dV) on the
  forward's residuals and a random cotangent, with the backward's own operands
  (triton._bwd_arrays): where the fwd+bwd time goes. -> {name: ms}."""
  T = dflash_triton
  anchors, doc_start, valid = (jnp.asarray(v) for v in idx)
  q, kc = xs[0], xs[1]
  st = T.make_static(block_size=BLOCK, window=window, scale=q.shape[-1] ** -0.5,
                     head_dim=q.shape[-1], dtype=q.dtype, interpret=interpret, config=cfg)
  plan = T._plan(st, q.shape, kc.shape)
  # Every array is an argument (closed-over arrays would become constants of the executable).
  fwd = jax.jit(lambda xs, idx: T._forward(*xs, *idx, st))
  idx = (anchors, doc_start, valid)
  _, out_p, lse = fwd(xs, idx)
  ct = jax.random.normal(jax.random.PRNGKey(1), q.shape, q.dtype)
  arrays = jax.jit(lambda res, ct: T._bwd_arrays(st, plan, res, ct))(
      (*xs, *idx, out_p, lse), ct)
  parts = {
      "fwd": (fwd, (xs, idx)),
      "dq": (jax.jit(lambda a: T._dq_kernel_call(st, plan, a)), (arrays,)),
      "dkv": (jax.jit(lambda a: T._dkv_kernel_call(st, plan, a)), (arrays,)),
  }
  return {name: median_seconds(lambda f=f, a=a: f(*a), reps=reps) * 1e3
          for name, (f, a) in parts.items()}


def main(argv=None, torch_rows=None):
  """torch_rows(xs, idx, *, window, flops_fwd, shape, reps) -> [Row]: the PyTorch alternatives of
  one problem, benchmarked after cuDNN (bridge.twin.bench_attention passes compiled flex)."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default=",".join(f"{s}x{n}" for s, n in SHAPES))
  p.add_argument("--layers", default="sliding,full")
  p.add_argument("--heads", default=f"{HQ}/{HKV}", help="query/KV heads, e.g. 9/3 (SmolLM2)")
  p.add_argument("--head-dim", type=int, default=HEAD_DIM)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows, where there are "
                 "any (bridge.twin.bench_attention)")
  p.add_argument("--no-baselines", action="store_true", help="only the Pallas kernel")
  p.add_argument("--tune", default="",
                 help="comma list of TUNE_VARIANTS (first shape and layer only)")
  p.add_argument("--config", default="default", help="default or a TUNE_VARIANTS name")
  p.add_argument("--mgpu", action="store_true",
                 help="also JAX's Mosaic GPU flash attention (Hopper) on dense attention of the "
                      "same sizes: the ceiling of the Mosaic GPU route")
  p.add_argument("--mosaic", action="store_true",
                 help="also our Mosaic GPU kernels (Hopper): the forward with the Triton "
                      "backward, and forward + Mosaic GPU backward")
  p.add_argument("--mosaic-tiles", default="default",
                 help="with --mosaic: comma list of Mosaic GPU tile variants for the all-Mosaic "
                      "rows (default, keys128, stages3, dkv3, keys128s3, ws, ws3, wg1; default: "
                      "the warp-specialised forward, ws: the warp-specialised forward and dQ, "
                      "wg1: the one-warpgroup forward); each variant's forward is also timed "
                      "under the Triton backward (mosaic-fwd rows)")
  p.add_argument("--parts", action="store_true",
                 help="also time each Pallas kernel alone (fwd, dq, dkv) on every problem")
  p.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
  p.add_argument("--budget-s", type=float, default=1e9,
                 help="skip the remaining baselines once this much wall time has passed")
  args = p.parse_args(argv)
  t0 = time.perf_counter()
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  cfg = None if args.config == "default" else TUNE_VARIANTS[args.config]
  heads = tuple(int(h) for h in args.heads.split("/"))
  hq, d = heads[0], args.head_dim
  shape_kw = dict(heads=heads, head_dim=d)
  rows, problems = [], []

  def emit(r):
    rows.append(r)
    print(r.line(), flush=True)

  print(HEADER, flush=True)
  # Phase 1: the Pallas kernel on every shape (and tuning variants on the first problem).
  for shape in args.shapes.split(","):
    S, N = (int(v) for v in shape.split("x"))
    xs, idx = make_problem(S, N, **shape_kw)
    ideal = sum(x.size * x.dtype.itemsize for x in xs) * 2 + xs[0].size * 2 * 2
    print(f"# {shape}: ideal fwd+bwd memory (inputs + grads + out + dout) {ideal / GIB:.2f} GiB",
          flush=True)
    for layer in args.layers.split(","):
      window = WINDOW if layer == "sliding" else None
      flops = 4 * d * hq * reference.visible_pairs(*idx, block_size=BLOCK, window=window)
      common = dict(window=window, flops_fwd=flops, shape=shape, reps=args.reps)
      problems.append((S, N, layer, xs, idx, common))
      tune = args.tune.split(",") if args.tune and len(problems) == 1 else []
      for name in tune:
        emit(bench_jax("triton", f"tune:{name}", xs, idx, cfg=TUNE_VARIANTS[name],
                       interpret=args.interpret, **common))
      emit(bench_jax("triton", "pallas", xs, idx, cfg=cfg, interpret=args.interpret, **common))
      if args.mosaic:
        for tiles in args.mosaic_tiles.split(","):
          # each variant's forward also under the Triton backward (the forward's time is there)
          for bwd in ("triton", "mosaic"):
            emit(bench_mosaic(xs, idx, window=window, flops_fwd=flops, shape=shape,
                              reps=args.reps, backward=bwd, interpret=args.interpret,
                              tiles=tiles))
      if args.parts:
        ms = kernel_parts(xs, idx, window=window, flops_fwd=flops, reps=args.reps, cfg=cfg,
                          interpret=args.interpret)
        print("#   kernels alone: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()),
              flush=True)
  if args.no_baselines or args.interpret:
    return
  # Phase 2: baselines, cheapest first; an allocation failure or the budget costs only the rest.
  over = lambda: time.perf_counter() - t0 > args.budget_s
  for S, N in dict.fromkeys((S, N) for S, N, *_ in problems):
    if not over():
      emit(bench_cudnn(S, N, args.reps, **shape_kw))
    if args.mgpu and not over():
      try:
        emit(bench_mgpu(S, N, args.reps, **shape_kw))
      except Exception as e:  # noqa: BLE001 (an import or API change is a result too)
        emit(Row("mgpu-dense", "nomask", f"{S}x{N}", note=f"{type(e).__name__}: {e}"[:100]))
  for S, N, layer, xs, idx, common in problems:
    if torch_rows is not None and not args.no_torch and not over():
      try:
        for r in torch_rows(xs, idx, **common):
          emit(r)
      except Exception as e:  # noqa: BLE001
        emit(Row("flex", layer, common["shape"], note=f"{type(e).__name__}: {e}"[:100]))
  for S, N, layer, xs, idx, common in problems:
    # Dense XLA reference: [Q, Hq, S] f32 scores, about five such tensors live in the backward.
    if 5 * N * BLOCK * hq * S * 4 > 120 * GIB:
      emit(Row("xla-ref", layer, common["shape"], note="skipped: dense [Q,Hq,S] scores too big"))
    elif not over():
      emit(bench_jax("xla", "xla-ref", xs, idx, **common))
  print("\n" + HEADER)
  for r in rows:
    print(r.line())


if __name__ == "__main__":
  main()
