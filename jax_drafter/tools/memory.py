"""`python -m jax_drafter.tools.memory`: the compiled memory plan of the real train step, explained.

The step is compiled ahead of time from abstract shapes (no weights, no data, no target model):
XLA's memory plan is fixed at compile time, so the peak, the buffers alive at it and the Python
line that created each one can be printed before anything can run out of memory. Shape letters as
in config.py. Peak = arguments + outputs that do not reuse a donated input + temporaries.
`--train --config RUN.yaml --dump DIR` reports the first step of the real training run instead
(StepReport), with the measured peak next to the prediction.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

import jax

from jax_drafter import config as config_lib
from jax_drafter import step as step_lib
from jax_drafter.tools import plans, xla_dump
from jax_drafter.tools.plans import Plan

log = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass
class Buffer:
  size: int
  shape: str
  kind: str        # parameter / donated (in a donated argument's memory) / output / temp
  instruction: str
  opcode: str
  op_name: str
  source: str
  function: str
  note: str = ""   # what it is where XLA names no Python line: "argument ...", "XLA temporary: ..."

  @property
  def where(self) -> str:
    return f"{self.source} {self.function}".strip() or self.note

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


# The dense-mask attention (implementation "xla" or "reference") is this file's jnp; the Pallas
# kernel shows up as custom calls named after its pallas_calls instead.
DENSE_ATTENTION = "pallas_kernels/dflash_attention/reference.py"
# The kernels' names: a Triton call's `name = "dflash_fwd"`; a Mosaic GPU kernel's name sits in
# its serialized module, between escaped NUL bytes ("\00dflash_fwd\00"), so no \b before it.
_KERNEL_CALLS = re.compile(r"(?<![A-Za-z_])dflash_(?:fwd|bwd_dq|bwd_dkv)(?![A-Za-z0-9])")
# Checked with JAX 0.10.2 on a CPU machine (test_gpu_plan_cannot_be_compiled_on_a_cpu_machine):
# `jit(...).trace(...).lower(lowering_platforms=("cuda",))` works, but `.compile()` compiles
# for the local backend: a CPU plan for the dense path, and for the kernel "No FFI handler
# registered for __gpu$xla.gpu.triton on a platform Host". jax.experimental.topologies has no
# "cuda" topology without the CUDA plugin, so there is no device-less GPU compile either.
NO_GPU_PLAN_HERE = (
    "A GPU plan cannot be compiled without a GPU: JAX lowers the step for CUDA (Traced.lower "
    "with lowering_platforms) but compiles it for this machine's backend, where the kernel's "
    "Triton calls have no handler, and has no GPU topology to compile against.")


@dataclass
class Attention:
  """Which attention the compiled step holds, and what the dense path holds at the peak."""
  implementation: str      # as asked, or "xla (the default on cpu)"; "" when the caller did not say
  dense: bool              # the step holds the dense-mask path's ops (DENSE_ATTENTION)
  kernel: bool             # the step calls the Pallas kernel (dflash_fwd, dflash_bwd_*)
  peak_bytes: int = 0      # bytes of the dense path's buffers live at the peak
  peak_count: int = 0
  without_bytes: int = 0   # the most the schedule holds at once without the dense path's buffers
  score_bytes: int = 0     # one layer's f32 context scores [B, Q, Hq, S], from the plan's shapes
  score_shape: str = ""


@dataclass
class Report:
  title: str
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  host_temp_bytes: int
  flops: float
  arguments: dict[str, int]
  peak_buffers: list[Buffer] = field(default_factory=list)
  largest_buffers: list[Buffer] = field(default_factory=list)
  all_buffers: list[Buffer] = field(default_factory=list, repr=False)   # every value, largest first
  peak_instruction: Buffer | None = None
  backend: str = ""
  attention: Attention | None = None

  @property
  def peak_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def fixed_bytes(self) -> int:
    """What no remat policy or CE chunk can change: the arguments and fresh outputs."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes

  def as_dict(self) -> dict:
    d = {k: v for k, v in dataclasses.asdict(self).items() if k != "all_buffers"}
    d["predicted_peak_bytes"] = self.peak_bytes
    return d


def traced_flops(fn, *args) -> float:
  """The matmul FLOPs of one call fn(*args), counted on its jaxpr: each dot_general (2 x output
  elements x contracted size); a scan's body times its length (the CE's chunk loop); remat's
  recomputation included; a while loop's body once (its trip count is unknown), a cond's
  largest branch, a Pallas kernel by its cost estimate (0 without one). Elementwise work is not
  counted. XLA's own counts fall short of this: the compiled module's leaves out what a GPU runs
  as custom calls (cuBLAS's GEMMs: 3.65 TFLOP for a 251 TFLOP step), and both count a loop's
  body once."""
  from jax.extend import core as jcore

  def count(jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
      name, p = eqn.primitive.name, eqn.params
      if name == "dot_general":
        (lc, _), _ = p["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = math.prod(lhs[i] for i in lc)
        total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
        continue
      if name == "pallas_call":
        ce = p.get("cost_estimate")
        total += float(ce.flops) if ce is not None else 0.0
        continue
      subs = []
      for v in p.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
          if isinstance(x, jcore.ClosedJaxpr):
            subs.append(x.jaxpr)
          elif isinstance(x, jcore.Jaxpr):
            subs.append(x)
      if name == "cond":
        total += max((count(j) for j in subs), default=0.0)
      elif name == "while":
        total += count(p["body_jaxpr"].jaxpr)
      else:
        total += sum(count(j) for j in subs) * (p["length"] if name == "scan" else 1)
    return total

  return count(jax.make_jaxpr(fn)(*args).jaxpr)


def _dump_options(dump_dir: str, fast: bool) -> dict:
  opts = {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True}
  if fast and jax.default_backend() == "cpu":
    opts["xla_backend_optimization_level"] = 0   # 2x faster CPU compile, same memory plan
  return opts


def _buffer(name: str, size: int, values, instrs) -> Buffer:
  base = name.split("{")[0]
  ins = instrs.get(base) or xla_dump.Instr(base, "", "", note="XLA temporary")
  # A tuple's own value is named "x{}" in the buffer assignment, an array's plain "x".
  v = values.get(name) or values.get(name.removesuffix("{}")) or values.get(base)
  shape = re.sub(r"\{[\d,]*\}$", "", v.shape if v else ins.shape)
  kind = v.allocation if v else "n/a"
  if kind == "parameter" and not ins.argument:
    kind = "donated"   # XLA reuses a donated argument's memory for it: no bytes of its own
  return Buffer(size, shape, kind, ins.name, ins.opcode, ins.op_name, ins.source, ins.function,
                ins.note)


def _attention(plan: Plan | None, hlo_text: str, instrs, peak: list[Buffer], lr,
               values) -> Attention:
  """The attention the step was compiled with, read from the HLO; with a plan, also the size of
  one layer's dense f32 context scores, the tensor the Pallas kernel never builds."""
  impl = ""
  if plan is not None:
    from pallas_kernels.dflash_attention import api
    asked = (plan.attn_impl or {}).get("implementation")
    impl = asked or (f"{api.default_implementation(plan.cfg.head_dim)} (the default on "
                     f"{jax.default_backend()})")
  dense = lambda name: DENSE_ATTENTION in getattr(instrs.get(name.split("{")[0]), "where", "")
  dense_bufs = [b for b in peak if DENSE_ATTENTION in b.where]
  att = Attention(impl, any(DENSE_ATTENTION in i.where for i in instrs.values()),
                  bool(_KERNEL_CALLS.search(hlo_text)), sum(b.size for b in dense_bufs),
                  len(dense_bufs))
  if att.dense:
    att.without_bytes, _ = xla_dump.live_peak(lr, values, skip=dense)
  if plan is not None:
    B, Q, Hq, S = (plan.batch_size, plan.train.num_anchors * plan.cfg.block_size,
                   plan.cfg.num_attention_heads, plan.seq_len)
    att.score_bytes, att.score_shape = 4 * B * Q * Hq * S, f"[B={B}, Q={Q}, Hq={Hq}, S={S}]"
  return att


@contextlib.contextmanager
def _fresh_compile():
  """A persistent-cache hit would skip XLA and write no dump files: compile for real.

  JAX memoises whether the cache is in use after the first compile, so the flag alone is not
  enough; reset_cache() (internal, present in 0.10 and 0.11) makes it re-read the flag.
  """
  from jax._src import compilation_cache
  reset = getattr(compilation_cache, "reset_cache", lambda: None)
  old = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  reset()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", old)
    reset()


def compile_and_analyze(jitted, args: tuple, arguments: dict[str, int], *, title: str,
                        dump_dir: str | None = None,
                        fast: bool = True, top: int = 12, plan: Plan | None = None):
  """Lower jitted(*args) and compile it with XLA's text dumps on, read them -> (Report, compiled).

  plan: the shapes `args` were built from, when known: the report then names the attention
  implementation asked for and the size of the dense path's score tensor."""
  tmp = tempfile.mkdtemp(prefix="xla_mem_")
  try:
    with _fresh_compile():
      compiled = jitted.lower(*args).compile(compiler_options=_dump_options(tmp, fast))
    ma = compiled.memory_analysis()
    files = xla_dump.find_dump_files(tmp)
    hlo_text = open(files["hlo"]).read()
    instrs = xla_dump.parse_hlo(hlo_text)
    values = xla_dump.parse_buffer_assignment(open(files["buffer_assignment"]).read())
    lr = xla_dump.parse_live_range(open(files["live_range"]).read())
    if not lr.peak_values:
      xla_dump.peak_from_ranges(lr, values)
    rep = Report(title, ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                 ma.temp_size_in_bytes, getattr(ma, "host_temp_size_in_bytes", 0),
                 traced_flops(jitted, *args),
                 arguments, backend=jax.default_backend())
    at_peak = [_buffer(n, s, values, instrs)
               for n, s in sorted(lr.peak_values, key=lambda x: -x[1])]
    rep.peak_buffers = at_peak[:top]
    rep.attention = _attention(plan, hlo_text, instrs, at_peak, lr, values)
    big = sorted((v for v in values.values() if v.allocation not in ("constant", "thread-local")),
                 key=lambda v: -v.size)
    rep.all_buffers = [_buffer(v.name, v.size, values, instrs) for v in big]
    rep.largest_buffers = rep.all_buffers[:top]
    if lr.peak_time is not None and lr.peak_time < len(lr.sequence):
      rep.peak_instruction = _buffer(lr.sequence[lr.peak_time], 0, values, instrs)
    if dump_dir:
      os.makedirs(dump_dir, exist_ok=True)
      for kind, path in files.items():
        shutil.copy(path, os.path.join(dump_dir, os.path.basename(path)))
      mem = {k: getattr(ma, k) for k in dir(ma) if k.endswith("_in_bytes")}
      mem.update(predicted_peak_bytes=rep.peak_bytes, flops=rep.flops)
      with open(os.path.join(dump_dir, "memory_analysis.json"), "w") as f:
        json.dump(mem, f, indent=1)
      with open(os.path.join(dump_dir, "report.txt"), "w") as f:
        f.write(format_report(rep) + "\n")
    return rep, compiled
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def analyze(plan: Plan, *, dump_dir: str | None = None, top: int = 12) -> Report:
  jitted, args, cats = plans.abstract_inputs(plan)
  rep, _ = compile_and_analyze(jitted, args, cats, title=f"{plan.name}: {plan.describe()}",
                               dump_dir=dump_dir, top=top, plan=plan)
  return rep


# ---- printing ----

def gib(n: float) -> str:
  return f"{n / GiB:8.3f}"


def human(n: float) -> str:
  for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= scale:
      return f"{n / scale:7.2f} {unit}"
  return f"{n:7.0f} B  "


def _row(b: Buffer) -> str:
  op = "/".join(b.op_name.rsplit("/", 2)[-2:])   # innermost scopes: "transpose(jvp(..))/dot_general"
  op = f"  [{op}]" if op and op not in b.where else ""
  return f"  {human(b.size)}  {b.shape:<24} {b.kind:<9} {b.instruction:<30} {b.where}{op}"


def _attention_lines(r: Report) -> list[str]:
  """What attention the plan holds; for the dense path, its share of the peak and where the GPU's
  plan differs (docs/DESIGN.md section 5: the Pallas kernel never materialises [Q, S+Q] scores)."""
  a = r.attention
  if a is None:
    return []
  impl = f"implementation={a.implementation}: " if a.implementation else ""
  if a.kernel and not a.dense:
    return [f"Attention: {impl}the Pallas kernel (dflash_fwd, dflash_bwd_dq, dflash_bwd_dkv); it "
            f"visits [Q, S] score tiles on chip and holds none in memory."]
  if not a.dense:
    return [f"Attention: {impl}no dflash_attention ops found in the compiled step."]
  lines = [f"Attention: {impl}the dense-mask path ({DENSE_ATTENTION}), which materialises f32 "
           f"scores [Q, S+Q] per layer"
           + (" (the Pallas kernel ran the forward)" if a.kernel else "")]
  if a.score_bytes:
    lines.append(f"  one layer's f32 context scores {a.score_shape} are "
                 f"{human(a.score_bytes).strip()}; the step keeps several per layer (scores, "
                 f"probabilities, their gradients)")
  share = 100 * a.peak_bytes / max(r.peak_bytes, 1)
  lines.append(f"  {a.peak_count} buffers of the dense path are live at the peak: "
               f"{human(a.peak_bytes).strip()}, {share:.1f}% of the predicted peak")
  if a.without_bytes:
    lines.append(f"  without them the most this schedule holds at once is "
                 f"{human(a.without_bytes).strip()} (every other buffer as planned here)")
  if r.backend == "gpu":
    lines.append("  On a GPU the dense path runs when train.attention asks for it, or when the "
                 "Pallas kernel does not take these shapes (query heads per KV head and head_dim "
                 "powers of two, head_dim >= 16).")
  else:
    lines += ["  On a GPU the default is a Pallas kernel (implementation=mosaic on H100/H200 at "
              "head sizes 64-128, else triton), which holds none of these buffers: for the "
              "GPU's plan, run this command on the GPU machine.",
              "  " + NO_GPU_PLAN_HERE]
  return lines


def format_report(r: Report) -> str:
  lines = [r.title, f"  backend {r.backend}; sizes in GiB (2^30 bytes)",
           f"  {gib(r.argument_bytes)}  arguments"]
  lines += [f"  {gib(v)}    {k}" for k, v in r.arguments.items()]
  lines += [f"  {gib(r.output_bytes - r.alias_bytes)}  outputs not reusing a donated input "
            f"({gib(r.alias_bytes).strip()} GiB of outputs do)",
            f"  {gib(r.temp_bytes)}  temporaries"
            + (f" (+{gib(r.host_temp_bytes).strip()} GiB on host)" if r.host_temp_bytes else ""),
            f"  {gib(r.peak_bytes)}  predicted peak",
            f"  {r.flops / 1e12:8.3f}  TFLOP per step (matmuls, counted on the step's jaxpr; Pallas "
            f"kernels not)"]
  lines += _attention_lines(r)
  if r.peak_buffers or r.largest_buffers:
    lines.append("Buffers: size, shape, kind (parameter: an argument; donated: held in a donated "
                 "argument's memory, no bytes of its own; temp; output), XLA name, Python source")
  if r.peak_buffers:
    at = r.peak_instruction
    lines.append("Largest buffers live at the peak"
                 + (f", reached at {at.instruction} ({at.where}):" if at else ":"))
    lines += [_row(b) for b in r.peak_buffers]
  if r.largest_buffers:
    lines.append("Largest single buffers anywhere in the step:")
    lines += [_row(b) for b in r.largest_buffers]
  return "\n".join(lines)


def _key(b: Buffer) -> str:
  """The same buffer across compiles: its line and op; without a line, what XLA says it is
  (instruction names are numbered per compile)."""
  if not b.source:   # paths shortened to file names, as for the lines
    return re.sub(r"[\w./]+/([\w.]+\.py)", r"\1", b.note.replace("argument ", "arg "))
  return f"{os.path.basename(b.source)} {b.op_name.split('/')[-1] or b.opcode}"


def scaling(plan: Plan, base: Report | None = None, top: int = 10) -> str:
  """The same step with 2x S and with 2x N: which buffers grow linearly, which quadratically."""
  base = base or analyze(plan)
  t = plan.train
  r_s = analyze(plan.replace(seq_len=2 * plan.seq_len))
  r_n = analyze(plan.replace(num_anchors=2 * t.num_anchors))
  sizes = {}
  for i, r in enumerate((base, r_s, r_n)):
    for b in r.largest_buffers + r.peak_buffers:
      k = _key(b)
      sizes.setdefault(k, [0, 0, 0])[i] = max(sizes.get(k, [0, 0, 0])[i], b.size)
  head = f"  {'':<48} {'base':>11} {'2x S':>11} {'2x N':>11}"
  row = lambda k, a, s, n: f"  {k[:48]:<48} {human(a)} {human(s)} {human(n)}"
  lines = [f"How it scales: base S={plan.seq_len} N={t.num_anchors}; 2x S; 2x N", head,
           row("predicted peak", base.peak_bytes, r_s.peak_bytes, r_n.peak_bytes),
           row("temporaries", base.temp_bytes, r_s.temp_bytes, r_n.temp_bytes),
           "  largest buffers by creating line and op (max over buffers of that line):"]
  for k, (a, s, n) in sorted(sizes.items(), key=lambda kv: -max(kv[1]))[:top]:
    grow = lambda x: "-" if not a or not x else f"x{x / a:.1f}"
    lines.append(row(k, a, s, n) + f"   S:{grow(s)} N:{grow(n)}")
  lines.append("  (x2 = linear in that dimension, x4 = quadratic, x1 = does not depend on it; "
               "- = not among that compile's largest buffers)")
  return "\n".join(lines)


# ---- budget ----

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
  m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
  if not m or m.group(2).lower() not in _UNITS:
    raise ValueError(f"budget {text!r}: write a size like 96GiB, 80GB or 1.5TiB")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def offload_supported() -> bool:
  return any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories())


@dataclass
class Fit:
  fits: bool
  message: str
  plan: Plan | None = None
  report: Report | None = None
  extra_flops: float = 0.0
  tried: list[tuple[str, int, float, int]] = field(default_factory=list)  # remat, chunk, peak

  def overrides(self) -> str:
    t = self.plan.train
    return f"train.remat={t.remat} train.ce_chunk_size={t.ce_chunk_size}"


def fit_to_budget(plan: Plan, budget: int, base: Report | None = None, log=print) -> Fit:
  """Cheapest (fewest recomputed FLOPs) remat policy x CE chunk whose predicted peak fits."""
  base = base or analyze(plan)
  if base.peak_bytes <= budget:
    return Fit(True, f"fits: predicted peak {gib(base.peak_bytes).strip()} GiB <= budget "
                     f"{gib(budget).strip()} GiB", plan, base)
  if base.fixed_bytes > budget:
    parts = ", ".join(f"{k} {human(v).strip()}" for k, v in base.arguments.items())
    return Fit(False, f"cannot fit: the step's arguments alone need {human(base.fixed_bytes).strip()}"
                      f" > budget {human(budget).strip()} ({parts}). Remat and CE chunking "
                      f"only change temporaries; shrink the model, the vocabulary or the batch "
                      f"(data.batch_size, data.seq_len), or shard the optimizer state.", None, base)
  t = plan.train
  chunks = sorted({c for c in (t.ce_chunk_size, t.ce_chunk_size // 2, t.ce_chunk_size // 4,
                               t.ce_chunk_size // 8) if c >= 16}, reverse=True)
  policies = ["none", "offload", "layer", "full"] if offload_supported() else ["none", "layer", "full"]
  fit, tried, flops0 = None, [], None
  for pol in policies:
    for c in chunks:
      if (pol, c) == (t.remat, t.ce_chunk_size):
        r = base
      else:
        r = analyze(plan.replace(remat=pol, ce_chunk_size=c))
      flops0 = r.flops if flops0 is None and pol == "none" else flops0
      tried.append((pol, c, r.flops, r.peak_bytes))
      log(f"  tried train.remat={pol:<7} train.ce_chunk_size={c:<6} peak {gib(r.peak_bytes)} GiB")
      if r.peak_bytes <= budget:
        fit = (pol, c, r)
        break
      if len(tried) > 1 and tried[-2][0] == pol and tried[-2][3] - r.peak_bytes < r.peak_bytes / 200:
        break   # halving the CE chunk again no longer lowers the peak (< 0.5%) under this policy
    if fit:
      break
  if not fit:
    best = min(tried, key=lambda x: x[3])
    return Fit(False, f"cannot fit: the lowest predicted peak is {gib(best[3]).strip()} GiB "
                      f"(train.remat={best[0]} train.ce_chunk_size={best[1]}) > budget "
                      f"{gib(budget).strip()} GiB; the arguments alone are "
                      f"{gib(base.fixed_bytes).strip()} GiB. Reduce data.seq_len, "
                      f"train.num_anchors or data.batch_size.", None, base, tried=tried)
  pol, c, r = fit
  extra = r.flops - (flops0 if flops0 is not None else r.flops)
  chosen = plan.replace(remat=pol, ce_chunk_size=c)
  return Fit(True, f"fits with train.remat={pol} train.ce_chunk_size={c}: predicted peak "
                   f"{gib(r.peak_bytes).strip()} GiB <= {gib(budget).strip()} GiB; recomputation "
                   f"{extra / 1e12:+.3f} TFLOP per step ({100 * extra / max(r.flops - extra, 1):+.1f}%)",
             chosen, r, extra, tried)


# ---- one real step ----

def measured_peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def run_step(plan: Plan, dump_dir: str | None = None) -> tuple[Report, dict]:
  """Compile the plan's step for real inputs, run it once, measure the backend's peak."""
  graphdef, state, batch, frozen = plans.random_inputs(plan)
  opt = step_lib.make_optimizer(plan.train)
  jitted = step_lib.jit_train_step(step_lib.make_train_step(graphdef, plan.cfg, plan.train, opt,
                                                            plan.attn_impl))
  jax.block_until_ready((state, batch, frozen))
  before = measured_peak_bytes()
  rep, compiled = compile_and_analyze(jitted, (state, batch, frozen),
                                      plans.categories(state, batch, frozen),
                                      title=f"{plan.name}: {plan.describe()}", dump_dir=dump_dir,
                                      fast=False, plan=plan)
  new_state, metrics = compiled(state, batch, frozen)
  jax.block_until_ready((new_state, metrics))
  out = {"predicted_peak_bytes": rep.peak_bytes, "measured_peak_bytes": measured_peak_bytes(),
         "peak_before_step_bytes": before, "loss": float(metrics["loss"])}
  if dump_dir:
    jax.profiler.save_device_memory_profile(os.path.join(dump_dir, "device_memory.prof"))
  return rep, out


class StepReport:
  """The memory plan of a real training run's first step, and its measured peak.

  `trainer.train(cfg, first_step=StepReport(DIR))`, or on the command line `--train --config
  RUN.yaml --dump DIR`. Before the step runs, its jitted function is lowered with the real
  arguments' shapes and shardings (nothing is executed or donated) and XLA's dumps,
  memory_analysis.json and report.txt are written to DIR; once it is dispatched, the backend's
  measured peak is logged next to the prediction. `result`: {"predicted_peak_bytes",
  "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "arguments", "peak_buffers",
  "report_path", "measured_peak_bytes"}.
  """

  def __init__(self, out_dir: str):
    self.out_dir = out_dir
    self.result: dict | None = None

  def before(self, jitted_step, state, batch, frozen) -> None:
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    args = jax.tree.map(spec, (state, batch, frozen))
    rep, _ = compile_and_analyze(jitted_step, args, plans.categories(*args),
                                 title="train step", dump_dir=self.out_dir, fast=False)
    self.result = {"predicted_peak_bytes": rep.peak_bytes, "argument_bytes": rep.argument_bytes,
                   "output_bytes": rep.output_bytes, "alias_bytes": rep.alias_bytes,
                   "temp_bytes": rep.temp_bytes, "arguments": rep.arguments,
                   "peak_buffers": [b.as_dict() for b in rep.peak_buffers],
                   "report_path": os.path.join(self.out_dir, "report.txt")}

  def after(self, metrics) -> None:
    jax.block_until_ready(metrics)
    measured = self.result["measured_peak_bytes"] = measured_peak_bytes()
    log.info("memory at step 1: predicted peak %s GiB, measured %s",
             gib(self.result["predicted_peak_bytes"]).strip(),
             "n/a on this backend" if measured is None else f"{gib(measured).strip()} GiB")


# ---- CLI ----

def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jax_drafter.tools.memory", description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True,
                 help=f"run-config YAML or a preset: {', '.join(plans.NAMES)}")
  p.add_argument("--target", help="target dims for a YAML config: an architecture preset or a HF "
                 "model directory")
  p.add_argument("--seq-len", type=int)
  p.add_argument("--anchors", type=int)
  p.add_argument("--batch", type=int)
  p.add_argument("--remat", choices=config_lib.REMAT_POLICIES)
  p.add_argument("--ce-chunk", type=int)
  p.add_argument("--grad-accum", type=int)
  p.add_argument("--attention", help="dflash_attention implementation (default: best available)")
  p.add_argument("--budget", help="device memory budget, e.g. 96GiB: find a configuration that fits")
  p.add_argument("--dump", help="write XLA's HLO, buffer assignment, live ranges and JSON here")
  p.add_argument("--run", action="store_true", help="also run one real step and measure the peak")
  p.add_argument("--no-scaling", action="store_true", help="skip the 2x S / 2x N reports")
  p.add_argument("--train", action="store_true",
                 help="start the training run of --config (a run-config YAML; jax_drafter.train) "
                 "and write the memory plan of its first step to --dump, with predicted vs "
                 "measured peak logged at step 1")
  p.add_argument("overrides", nargs="*", help="section.key=value run-config overrides")
  a = p.parse_args(argv)
  flags = {"data.seq_len": a.seq_len, "train.num_anchors": a.anchors, "data.batch_size": a.batch,
           "train.remat": a.remat, "train.ce_chunk_size": a.ce_chunk,
           "train.grad_accum": a.grad_accum, "train.attention": a.attention}
  ovs = list(a.overrides) + [f"{k}={v}" for k, v in flags.items() if v is not None]
  if a.train:
    if a.config in plans.NAMES or not a.dump or a.target or a.budget or a.run:
      p.error("--train takes a run-config YAML and --dump DIR (not --target, --budget or --run)")
    from jax_drafter import train as train_cli   # its import sets the environment JAX needs
    return train_cli.main(["--config", a.config, *ovs], first_step=StepReport(a.dump))
  plan = plans.build_plan(a.config, ovs, a.target)
  base = None
  if not (a.run and a.no_scaling and not a.budget):   # else the real run's compile reports
    base = analyze(plan, dump_dir=a.dump)
    print(format_report(base), flush=True)
  if base is not None and not a.no_scaling:
    print()
    print(scaling(plan, base), flush=True)
  if a.budget:
    print(f"\nBudget {a.budget}:")
    fit = fit_to_budget(plan, parse_size(a.budget), base)
    print(fit.message)
    if fit.fits and fit.plan is not plan:
      print(f"  use: {fit.overrides()}")
    if fit.fits:
      plan = fit.plan
  if a.run:
    rep, out = run_step(plan, dump_dir=a.dump)
    if base is None:
      print(format_report(rep))
    meas = out["measured_peak_bytes"]
    print(f"\nOne real step ({plan.describe()}): loss {out['loss']:.4f}")
    print(f"  predicted peak {gib(rep.peak_bytes)} GiB   measured peak "
          + (f"{gib(meas)} GiB ({100 * (meas - rep.peak_bytes) / rep.peak_bytes:+.1f}%)" if meas
             else "n/a (this backend reports no memory_stats)"))
    if a.dump:
      with open(os.path.join(a.dump, "measured.json"), "w") as f:
        json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
