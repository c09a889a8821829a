"""`python -m jax_drafter.tools.memory`: the compiled memory plan of the real train step, explained.

The step is compiled ahead of time from abstract shapes (no weights, no data, no target model):
XLA's memory plan is fixed at compile time, so the peak, the buffers alive at it and the Python
line that created each one can be printed before anything can run out of memory. Shape letters as
in config.py. Peak = arguments + outputs that do not reuse a donated input + temporaries.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jax_drafter import config as config_lib
from jax_drafter import params as params_lib
from jax_drafter import presets
from jax_drafter import step as step_lib
from jax_drafter.tools import xla_dump

GiB = 1 << 30


@dataclass(frozen=True)
class TargetDims:
  """The target's dimensions, duck-typed as bridge.target.TargetInfo (no torch, no weights)."""
  num_layers: int
  hidden_size: int
  vocab_size: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  intermediate_size: int
  dtype: str = "bfloat16"           # of the target features, embedding and LM head
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 262144
  name: str = "preset"


def _from_drafter_preset(name: str, label: str, *, seq_len: int, anchors: int):
  """(TargetDims, run-config overrides) of a presets.py drafter, bf16, one row of seq_len."""
  d = presets.get(name)
  dims = TargetDims(d.num_target_layers, d.hidden_size, d.vocab_size, d.num_attention_heads,
                    d.num_key_value_heads, d.head_dim, d.intermediate_size,
                    rope_theta=d.rope_theta, rms_norm_eps=d.rms_norm_eps,
                    max_position_embeddings=d.max_position_embeddings, name=label)
  drafter = {f: getattr(d, f) for f in (
      "num_hidden_layers", "block_size", "layer_types", "sliding_window", "mask_token_id",
      "target_layer_ids", "intermediate_size", "num_attention_heads", "num_key_value_heads",
      "head_dim", "rope_theta", "rms_norm_eps")}
  drafter = {k: list(v) if isinstance(v, tuple) else v for k, v in drafter.items()}
  return dims, {"drafter": drafter, "target": {"dtype": "bfloat16"},
                "data": {"seq_len": seq_len, "batch_size": 1},
                "train": {"num_anchors": anchors, "compute_dtype": "bfloat16"}}


_SW = "sliding_attention"
PRESETS: dict[str, tuple[TargetDims, dict]] = {
    "tiny": (TargetDims(8, 64, 512, 4, 2, 16, 128, dtype="float32", name="tiny"), {
        "drafter": {"num_hidden_layers": 2, "layer_types": [_SW, "full_attention"],
                    "sliding_window": 32},
        "data": {"seq_len": 128, "batch_size": 2},
        "train": {"num_anchors": 8, "ce_chunk_size": 32}}),
    "smollm2-135m": (TargetDims(30, 576, 49152, 9, 3, 64, 1536, dtype="float32",
                                rope_theta=100000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=8192, name="SmolLM2-135M"), {}),
    # The real drafters: target dims and drafter fields come from jax_drafter.presets (the
    # benchmark's architectures), only the run shape is set here.
    "qwen3.6-27b": _from_drafter_preset("qwen3.6-27b", "Qwen3.6-27B", seq_len=8192, anchors=1024),
    "qwen3-8b": _from_drafter_preset("qwen3-8b", "Qwen3-8B", seq_len=8192, anchors=1024),
}


@dataclass(frozen=True)
class Plan:
  """Everything that fixes the compiled step's shapes."""
  cfg: config_lib.DrafterConfig
  train: config_lib.TrainSection
  batch_size: int
  seq_len: int
  feature_dtype: str = "bfloat16"
  attn_impl: dict | None = None
  name: str = ""

  def replace(self, *, seq_len=None, num_anchors=None, **train) -> "Plan":
    if num_anchors is not None:
      train["num_anchors"] = num_anchors
    return dataclasses.replace(self, seq_len=seq_len or self.seq_len,
                               train=dataclasses.replace(self.train, **train))

  def describe(self) -> str:
    t = self.train
    return (f"S={self.seq_len} N={t.num_anchors} B={self.batch_size} A={t.grad_accum} "
            f"remat={t.remat} ce_chunk={t.ce_chunk_size} V={self.cfg.vocab_size} "
            f"compute={t.compute_dtype} features={self.feature_dtype}")


def target_dims_from_dir(path: str) -> TargetDims:
  """TargetDims from a Hugging Face model directory's config.json (no weights read)."""
  with open(os.path.join(path, "config.json")) as f:
    c = json.load(f)
  c = c.get("text_config", c)
  rope = c.get("rope_parameters") or {}
  heads = c["num_attention_heads"]
  return TargetDims(c["num_hidden_layers"], c["hidden_size"], c["vocab_size"], heads,
                    c.get("num_key_value_heads") or heads,
                    c.get("head_dim") or c["hidden_size"] // heads, c["intermediate_size"],
                    dtype="bfloat16" if "bfloat16" in str(c.get("torch_dtype", "")) else "float32",
                    rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                    name=os.path.basename(os.path.normpath(path)))


def build_plan(config: str, overrides: list[str] = (), target: str | None = None) -> Plan:
  """A preset name or a run-config YAML (+ `section.key=value` overrides) -> Plan."""
  if config in PRESETS:
    dims, data = PRESETS[config]
    data = json.loads(json.dumps(data))
    for ov in overrides:
      (section, key), value = config_lib.parse_override(ov)
      data.setdefault(section, {})[key] = value
    run = config_lib.build_config(data, where=f"preset {config}")
  elif os.path.exists(config):
    run = config_lib.load_config(config, list(overrides))
    dims = None
  else:
    raise config_lib.ConfigError(f"--config {config!r} is neither a file nor a preset "
                                 f"({', '.join(PRESETS)})")
  if target is not None:
    dims = PRESETS[target][0] if target in PRESETS else target_dims_from_dir(target)
  elif dims is None:
    path = run.target.path
    if path and os.path.exists(os.path.join(path, "config.json")):
      dims = target_dims_from_dir(path)
    elif path is None:
      dims = PRESETS["smollm2-135m"][0]
    else:
      raise config_lib.ConfigError(f"target.path={path!r} has no config.json here; pass "
                                   f"--target PRESET_OR_DIR ({', '.join(PRESETS)})")
  cfg = config_lib.resolve_drafter(run.drafter, dims, mask_token_id=dims.vocab_size - 1)
  return Plan(cfg, run.train, run.data.batch_size, run.data.seq_len,
              feature_dtype=run.target.dtype, attn_impl=_attn(run.train.attention),
              name=f"{dims.name} drafter")


def _attn(impl: str | None) -> dict | None:
  return {"implementation": impl} if impl else None


# ---- abstract inputs and compilation ----

def _nbytes(tree) -> int:
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def abstract_inputs(plan: Plan):
  """(jitted step, (state, batch, frozen) as ShapeDtypeStructs, argument bytes by category)."""
  cfg, t = plan.cfg, plan.train
  opt = step_lib.make_optimizer(t)
  graphdef, params = params_lib.abstract_model(cfg, step_lib.DTYPE[t.compute_dtype])
  state = jax.eval_shape(lambda p: step_lib.TrainState(
      jnp.zeros((), jnp.int32), p, opt.init(p), jax.random.key_data(jax.random.key(0))), params)
  sds = jax.ShapeDtypeStruct
  A, B, S = t.grad_accum, plan.batch_size, plan.seq_len
  fdt = jnp.dtype(plan.feature_dtype)
  batch = {k: sds((A, B, S), jnp.int32) for k in ("input_ids", "loss_mask", "doc_id", "position_ids")}
  batch["features"] = sds((A, B, S, len(cfg.target_layer_ids) * cfg.hidden_size), fdt)
  frozen = {"embed": sds((cfg.vocab_size, cfg.hidden_size), fdt),
            "lm_head": sds((cfg.vocab_size, cfg.hidden_size), fdt)}
  jitted = step_lib.jit_train_step(step_lib.make_train_step(graphdef, cfg, t, opt, plan.attn_impl))
  return jitted, (state, batch, frozen), categories(state, batch, frozen)


def categories(state, batch, frozen) -> dict[str, int]:
  return {"parameters": _nbytes(state.params), "optimizer state": _nbytes(state.opt_state),
          "frozen embed + LM head": _nbytes(frozen), "batch": _nbytes(batch),
          "step + rng": _nbytes((state.step, state.rng))}


@dataclass
class Buffer:
  size: int
  shape: str
  kind: str        # parameter / output / temp
  instruction: str
  opcode: str
  op_name: str
  source: str
  function: str

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


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


def _flops(compiled) -> float:
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return float((ca or {}).get("flops", 0.0))


def _dump_options(dump_dir: str, fast: bool) -> dict:
  opts = {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True}
  if fast and jax.default_backend() == "cpu":
    opts["xla_backend_optimization_level"] = 0   # 2x faster CPU compile, same memory plan
  return opts


def _buffer(name: str, size: int, values, instrs) -> Buffer:
  base = name.split("{")[0]
  ins = instrs.get(base) or xla_dump.Instr(base, "?", "?")
  v = values.get(name.removesuffix("{}")) or values.get(base)
  shape = re.sub(r"\{[\d,]*\}$", "", v.shape if v else ins.shape)
  return Buffer(size, shape, v.allocation if v else "?", ins.name, ins.opcode, ins.op_name,
                ins.source, ins.function)


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


def compile_and_analyze(lowered, arguments: dict[str, int], *, title: str, dump_dir: str | None = None,
                        fast: bool = True, top: int = 12):
  """Compile `lowered` with XLA's text dumps on, read them -> (Report, compiled)."""
  tmp = tempfile.mkdtemp(prefix="xla_mem_")
  try:
    with _fresh_compile():
      compiled = lowered.compile(compiler_options=_dump_options(tmp, fast))
    ma = compiled.memory_analysis()
    files = xla_dump.find_dump_files(tmp)
    hlo_text = open(files["hlo"]).read()
    instrs = xla_dump.parse_hlo(hlo_text)
    values = xla_dump.parse_buffer_assignment(open(files["buffer_assignment"]).read())
    lr = xla_dump.parse_live_range(open(files["live_range"]).read())
    if not lr.peak_values:
      xla_dump.peak_from_ranges(lr, values)
    rep = Report(title, ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                 ma.temp_size_in_bytes, getattr(ma, "host_temp_size_in_bytes", 0), _flops(compiled),
                 arguments, backend=jax.default_backend())
    rep.peak_buffers = [_buffer(n, s, values, instrs)
                        for n, s in sorted(lr.peak_values, key=lambda x: -x[1])[:top]]
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
  jitted, args, cats = abstract_inputs(plan)
  rep, _ = compile_and_analyze(jitted.lower(*args), cats, title=f"{plan.name}: {plan.describe()}",
                               dump_dir=dump_dir, top=top)
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
  where = f"{b.source} {b.function}".strip() or ("(argument)" if b.kind == "parameter" else "?")
  op = b.op_name.replace("\\'", "'").rsplit("/", 2)
  op = "/".join(op[-2:]) if len(op) > 1 else op[0]
  return f"  {human(b.size)}  {b.shape:<24} {b.kind:<9} {b.instruction:<30} {where}  [{op}]"


def format_report(r: Report) -> str:
  lines = [r.title, f"  backend {r.backend}; sizes in GiB (2^30 bytes)",
           f"  {gib(r.argument_bytes)}  arguments"]
  lines += [f"  {gib(v)}    {k}" for k, v in r.arguments.items()]
  lines += [f"  {gib(r.output_bytes - r.alias_bytes)}  outputs not reusing a donated input "
            f"({gib(r.alias_bytes).strip()} GiB of outputs do)",
            f"  {gib(r.temp_bytes)}  temporaries"
            + (f" (+{gib(r.host_temp_bytes).strip()} GiB on host)" if r.host_temp_bytes else ""),
            f"  {gib(r.peak_bytes)}  predicted peak",
            f"  {r.flops / 1e12:8.3f}  TFLOP per step (XLA cost analysis)"]
  if r.peak_buffers:
    at = r.peak_instruction
    lines.append("Largest buffers live at the peak" + (
        f" (reached at {at.instruction}, {at.source} {at.function}):" if at else ":"))
    lines += [_row(b) for b in r.peak_buffers]
  if r.largest_buffers:
    lines.append("Largest single buffers anywhere in the step:")
    lines += [_row(b) for b in r.largest_buffers]
  return "\n".join(lines)


def _key(b: Buffer) -> str:
  op = b.op_name.replace("\\'", "'").split("/")[-1] if b.op_name else b.instruction
  return f"{os.path.basename(b.source) or b.instruction} {op}"


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
  head = f"  {'':<40} {'base':>11} {'2x S':>11} {'2x N':>11}"
  row = lambda k, a, s, n: f"  {k[:40]:<40} {human(a)} {human(s)} {human(n)}"
  lines = [f"How it scales: base S={plan.seq_len} N={t.num_anchors}; 2x S; 2x N", head,
           row("predicted peak", base.peak_bytes, r_s.peak_bytes, r_n.peak_bytes),
           row("temporaries", base.temp_bytes, r_s.temp_bytes, r_n.temp_bytes),
           "  largest buffers by creating line and op (max over buffers of that line):"]
  for k, (a, s, n) in sorted(sizes.items(), key=lambda kv: -max(kv[1]))[:top]:
    grow = lambda x: "?" if not a or not x else f"x{x / a:.1f}"
    lines.append(row(k, a, s, n) + f"   S:{grow(s)} N:{grow(n)}")
  lines.append("  (x2 = linear in that dimension, x4 = quadratic, x1 = does not depend on it)")
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

def random_inputs(plan: Plan, seed: int = 0):
  """Real state (random init), a random batch and random frozen weights of the plan's shapes."""
  cfg, t = plan.cfg, plan.train
  opt = step_lib.make_optimizer(t)
  graphdef, state = step_lib.init_state(cfg, t, opt)
  A, B, S = t.grad_accum, plan.batch_size, plan.seq_len
  k = jax.random.split(jax.random.key(seed), 4)
  fdt = jnp.dtype(plan.feature_dtype)
  batch = {"input_ids": jax.random.randint(k[0], (A, B, S), 0, cfg.vocab_size, jnp.int32),
           "loss_mask": jnp.ones((A, B, S), jnp.int32), "doc_id": jnp.zeros((A, B, S), jnp.int32),
           "position_ids": jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (A, B, S)),
           "features": jax.random.normal(k[1], (A, B, S, len(cfg.target_layer_ids) * cfg.hidden_size), fdt)}
  frozen = {"embed": (0.02 * jax.random.normal(k[2], (cfg.vocab_size, cfg.hidden_size), fdt)),
            "lm_head": (0.02 * jax.random.normal(k[3], (cfg.vocab_size, cfg.hidden_size), fdt))}
  return graphdef, state, batch, frozen


def measured_peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def run_step(plan: Plan, dump_dir: str | None = None) -> tuple[Report, dict]:
  """Compile the plan's step for real inputs, run it once, measure the backend's peak."""
  graphdef, state, batch, frozen = random_inputs(plan)
  opt = step_lib.make_optimizer(plan.train)
  jitted = step_lib.jit_train_step(step_lib.make_train_step(graphdef, plan.cfg, plan.train, opt,
                                                            plan.attn_impl))
  jax.block_until_ready((state, batch, frozen))
  before = measured_peak_bytes()
  rep, compiled = compile_and_analyze(jitted.lower(state, batch, frozen),
                                      categories(state, batch, frozen),
                                      title=f"{plan.name}: {plan.describe()}", dump_dir=dump_dir,
                                      fast=False)
  new_state, metrics = compiled(state, batch, frozen)
  jax.block_until_ready((new_state, metrics))
  out = {"predicted_peak_bytes": rep.peak_bytes, "measured_peak_bytes": measured_peak_bytes(),
         "peak_before_step_bytes": before, "loss": float(metrics["loss"])}
  if dump_dir:
    jax.profiler.save_device_memory_profile(os.path.join(dump_dir, "device_memory.prof"))
  return rep, out


def memory_report_for_step(jitted_step, state, batch, frozen, out_dir: str) -> dict:
  """For `train --memory-report DIR`: the memory plan of the step about to run, written to out_dir.

  Lowers `jitted_step` with the real arguments' shapes and shardings (nothing is executed or
  donated), writes XLA's dumps, memory_analysis.json and report.txt, and returns
  {"predicted_peak_bytes", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
   "arguments", "peak_buffers", "report_path"}.
  """
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
  args = jax.tree.map(spec, (state, batch, frozen))
  rep, _ = compile_and_analyze(jitted_step.lower(*args), categories(*args), title="train step",
                               dump_dir=out_dir, fast=False)
  return {"predicted_peak_bytes": rep.peak_bytes, "argument_bytes": rep.argument_bytes,
          "output_bytes": rep.output_bytes, "alias_bytes": rep.alias_bytes,
          "temp_bytes": rep.temp_bytes, "arguments": rep.arguments,
          "peak_buffers": [b.as_dict() for b in rep.peak_buffers],
          "report_path": os.path.join(out_dir, "report.txt")}


# ---- CLI ----

def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jax_drafter.tools.memory", description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, help=f"run-config YAML or a preset: {', '.join(PRESETS)}")
  p.add_argument("--target", help="target dims for a YAML config: a preset or a HF model directory")
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
  p.add_argument("overrides", nargs="*", help="section.key=value run-config overrides")
  a = p.parse_args(argv)
  flags = {"data.seq_len": a.seq_len, "train.num_anchors": a.anchors, "data.batch_size": a.batch,
           "train.remat": a.remat, "train.ce_chunk_size": a.ce_chunk,
           "train.grad_accum": a.grad_accum, "train.attention": a.attention}
  ovs = list(a.overrides) + [f"{k}={v}" for k, v in flags.items() if v is not None]
  plan = build_plan(a.config, ovs, a.target)
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
