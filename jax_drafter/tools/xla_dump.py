"""Read XLA's own text dumps of a compiled module: who owns the memory at the peak, and why.

XLA writes these with `xla_dump_to` + `xla_dump_hlo_as_text` (as per-compile options, so nothing
global changes): `*after_optimizations.txt` (the scheduled HLO with op metadata and, on JAX >= 0.9,
the stack-frame tables that `stack_frame_id` points into), `*-buffer-assignment.txt` (every value
with its size, offset and shape) and `*-live-range.txt` (the schedule, each value's live range and
a "Live ranges at T (peak)" section). `memory_analysis()`'s serialized buffer assignment carries no
heap-simulator trace on CPU, and no names, so the text dumps are the one source that works on both
JAX 0.10.2 (CPU) and 0.11.2 (GPU).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

_DUMP_KINDS = {
    "hlo": "after_optimizations.txt",
    "buffer_assignment": "after_optimizations-buffer-assignment.txt",
    "live_range": "after_optimizations-live-range.txt",
    "memory_usage": "after_optimizations-memory-usage-report.txt",
}
PROJECT_DIRS = ("jax_drafter", "pallas_kernels", "bridge")


@dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  op_name: str = ""
  source: str = ""        # "objective.py:114" (innermost frame; project frames preferred)
  function: str = ""      # the Python function of that frame


@dataclass
class Value:
  name: str               # instruction name plus tuple index if any: "while.91{1}"
  size: int
  shape: str
  allocation: str         # "parameter", "output", "temp", "constant", "thread-local"


@dataclass
class LiveRange:
  sequence: list[str] = field(default_factory=list)     # instruction names in schedule order
  ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
  peak_time: int | None = None
  peak_values: list[tuple[str, int]] = field(default_factory=list)


def find_dump_files(dump_dir: str) -> dict[str, str]:
  """The dump files of the largest jitted module in `dump_dir` (autotuning may add small ones)."""
  hlos = glob.glob(os.path.join(dump_dir, "*" + _DUMP_KINDS["hlo"]))
  if not hlos:
    raise FileNotFoundError(f"no *after_optimizations.txt in {dump_dir}: XLA wrote no HLO dump")
  hlo = max(hlos, key=os.path.getsize)
  stem = hlo[: -len(_DUMP_KINDS["hlo"])]
  out = {}
  for kind, suffix in _DUMP_KINDS.items():
    if os.path.exists(stem + suffix):
      out[kind] = stem + suffix
  return out


def _section(text: str, title: str) -> list[str]:
  m = re.search(rf"^{title}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
  return m.group(1).splitlines() if m else []


def _frames(text: str):
  """stack_frame_id -> (file, line, function) of that frame (the innermost one of the op)."""
  files = {int(i): s.strip('"') for i, s in (l.split(" ", 1) for l in _section(text, "FileNames"))}
  funcs = {int(i): s.strip('"') for i, s in (l.split(" ", 1) for l in _section(text, "FunctionNames"))}
  locs = {}
  for line in _section(text, "FileLocations"):
    i, rest = line.split(" ", 1)
    d = dict(re.findall(r"(\w+)=(\d+)", rest))
    locs[int(i)] = (files.get(int(d.get("file_name_id", 0)), "?"), int(d.get("line", 0)),
                    funcs.get(int(d.get("function_name_id", 0)), "?"))
  frames = {}
  for line in _section(text, "StackFrames"):
    i, rest = line.split(" ", 1)
    d = dict(re.findall(r"(\w+)=(\d+)", rest))
    frames[int(i)] = locs.get(int(d.get("file_location_id", 0)), ("?", 0, "?"))
  return frames


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")


def _split_shape(rest: str) -> tuple[str, str]:
  """'f32[2,3]{1,0} fusion(%a), ...' -> ('f32[2,3]{1,0}', 'fusion(...)...'), tuples included."""
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return rest[: i + 1], rest[i + 1:].lstrip()
  shape, _, tail = rest.partition(" ")
  return shape, tail


def short_path(path: str) -> str:
  for d in PROJECT_DIRS:
    k = path.rfind(f"/{d}/")
    if k >= 0:
      return path[k + 1:]
  return os.path.basename(path)


def parse_hlo(text: str) -> dict[str, Instr]:
  """Instruction name -> shape, opcode, op_name and the Python line that created it."""
  frames = _frames(text)
  out = {}
  for line in text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    name, rest = m.groups()
    shape, tail = _split_shape(rest)
    op = re.match(r"([a-z][\w\-]*)\(", tail)
    ins = Instr(name, shape, op.group(1) if op else "?")
    md = re.search(r"metadata=\{(.*?)\}(?:,|$)", tail)
    if md:
      meta = md.group(1)
      if (v := re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)):
        ins.op_name = v.group(1)
      if (f := re.search(r'source_file="([^"]*)"', meta)):
        ln = re.search(r"source_line=(\d+)", meta)
        ins.source = f"{short_path(f.group(1))}:{ln.group(1) if ln else '?'}"
      if (s := re.search(r"stack_frame_id=(\d+)", meta)) and int(s.group(1)) in frames:
        file, ln, fn = frames[int(s.group(1))]
        ins.source, ins.function = f"{short_path(file)}:{ln}", fn
    out[name] = ins
  return out


_VALUE = re.compile(r"^\s*value: <\d+ ([^ >]+)(?: \(phi\))? @\d+> \(size=(\d+),offset=\d+\): (.*)$")


def parse_buffer_assignment(text: str) -> dict[str, Value]:
  """Value name -> size, shape and the kind of allocation it lives in."""
  out, kind = {}, "temp"
  for line in text.splitlines():
    if line.startswith("allocation "):
      head = line.split(":", 1)[1] if ":" in line else line
      kind = ("parameter" if " parameter " in line else "constant" if "constant" in head
              else "thread-local" if "thread-local" in head
              else "output" if "output shape" in head or "maybe-live-out" in head else "temp")
      continue
    m = _VALUE.match(line)
    if m:
      name, size, shape = m.group(1), int(m.group(2)), m.group(3).strip()
      if name not in out or out[name].size < size:
        out[name] = Value(name, size, shape, kind)
  return out


def parse_live_range(text: str) -> LiveRange:
  lr = LiveRange()
  mode = None
  for line in text.splitlines():
    s = line.strip()
    if s == "InstructionSequence:":
      mode = "seq"
    elif s == "BufferLiveRange:":
      mode = "ranges"
    elif (m := re.match(r"Live ranges at (\d+) \(peak\):", s)):
      mode, lr.peak_time = "peak", int(m.group(1))
    elif s.startswith("Stack trace breakdown") or not s:
      mode = None if s else mode
    elif mode == "seq" and (m := re.match(r"(\d+):(\S+)", s)):
      lr.sequence.append(m.group(2))
    elif mode == "ranges" and (m := re.match(r"(\S+):(\d+)-(\d+)$", s)):
      lr.ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    elif mode == "peak" and (m := re.match(r"(\S+): (\d+) bytes", s)):
      lr.peak_values.append((m.group(1), int(m.group(2))))
  if lr.peak_time is None and lr.ranges:
    lr.peak_time, lr.peak_values = None, []   # filled by peak_from_ranges when sizes are known
  return lr


def peak_from_ranges(lr: LiveRange, values: dict[str, Value]) -> None:
  """Fallback when XLA printed no peak section: sweep the live ranges with the value sizes."""
  events = {}
  for name, (a, b) in lr.ranges.items():
    v = values.get(name) or values.get(name.removesuffix("{}"))
    if v is None or v.allocation in ("constant", "thread-local"):
      continue
    events.setdefault(a, []).append(v.size)
    events.setdefault(b + 1, []).append(-v.size)
  cur, best, best_t = 0, -1, 0
  for t in sorted(events):
    cur += sum(events[t])
    if cur > best:
      best, best_t = cur, t
  lr.peak_time = best_t
  lr.peak_values = sorted(((n, (values.get(n) or values[n.removesuffix("{}")]).size)
                           for n, (a, b) in lr.ranges.items()
                           if a <= best_t <= b and (n in values or n.removesuffix("{}") in values)),
                          key=lambda x: -x[1])
