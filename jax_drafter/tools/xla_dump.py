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
  # Where XLA names no source line: "argument frozen['embed']", "XLA temporary: convert of ...".
  note: str = ""
  operands: list[str] = field(default_factory=list, repr=False)
  calls: list[str] = field(default_factory=list, repr=False)     # fused / called computations
  computation: str = field(default="", repr=False)
  argument: bool = False  # a parameter of the entry computation: an argument of the jitted function

  @property
  def where(self) -> str:
    """The Python line and function that made this value, else what XLA says it is."""
    return f"{self.source} {self.function}".strip() or self.note


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
    if int(d.get("file_name_id", -1)) in files:
      locs[int(i)] = (files[int(d["file_name_id"])], int(d.get("line", 0)),
                      funcs.get(int(d.get("function_name_id", -1)), ""))
  frames = {}
  for line in _section(text, "StackFrames"):
    i, rest = line.split(" ", 1)
    d = dict(re.findall(r"(\w+)=(\d+)", rest))
    if int(d.get("file_location_id", -1)) in locs:   # a frame XLA cannot place names no line
      frames[int(i)] = locs[int(d["file_location_id"])]
  return frames


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%([\w.\-]+)"
                    r"|branch_computations=\{([^}]*)\}")


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


def _operands(tail: str) -> list[str]:
  """'%a' names inside the opcode's own parentheses: 'fusion(%a, %b), kind=..' -> [a, b]."""
  depth = 0
  for i, ch in enumerate(tail):
    depth += ch == "("
    depth -= ch == ")"
    if ch == ")" and depth == 0:
      return re.findall(r"%([\w.\-]+)", tail[:i])
  return []


def short_path(path: str) -> str:
  for d in PROJECT_DIRS:
    k = path.rfind(f"/{d}/")
    if k >= 0:
      return path[k + 1:]
  return os.path.basename(path)


def parse_hlo(text: str) -> dict[str, Instr]:
  """Instruction name -> shape, opcode, op_name and the Python line that created it.

  Every instruction gets a `where`: its own metadata's line; else (a fusion that XLA's CPU
  passes, e.g. the XNNPACK and layout fusions, built without metadata) the line of the op
  nearest the root of its fused computation that kept one; else a note saying what it is: an
  argument by name, or an XLA temporary with the op and the value it was made from.
  """
  frames = _frames(text)
  out, computations, entry, comp = {}, {}, "", ""
  for line in text.splitlines():
    if not line.startswith(" ") and (c := _COMPUTATION.match(line)):
      comp = c.group(2)
      entry = comp if c.group(1) else entry
      computations[comp] = []
      continue
    m = _INSTR.match(line)
    if not m or not line.startswith(" "):
      continue
    name, rest = m.groups()
    shape, tail = _split_shape(rest)
    op = re.match(r"([a-z][\w\-]*)\(", tail)
    ins = Instr(name, shape, op.group(1) if op else "", operands=_operands(tail), computation=comp)
    for one, many in _CALLS.findall(tail):
      ins.calls += [one] if one else re.findall(r"%([\w.\-]+)", many)
    md = re.search(r"metadata=\{(.*?)\}(?:,|$)", tail)
    if md:
      meta = md.group(1)
      if (v := re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)):
        ins.op_name = v.group(1).replace("\\'", "'").replace('\\"', '"')
      if (f := re.search(r'source_file="([^"]*)"', meta)):
        ln = re.search(r"source_line=(\d+)", meta)
        ins.source = short_path(f.group(1)) + (f":{ln.group(1)}" if ln else "")
      if (s := re.search(r"stack_frame_id=(\d+)", meta)) and int(s.group(1)) in frames:
        file, ln, fn = frames[int(s.group(1))]
        ins.source, ins.function = f"{short_path(file)}:{ln}", fn
    out[name] = ins
    computations.setdefault(comp, []).append(name)
  for ins in out.values():
    _from_callee(ins, out, computations, set())
  callers, users = {}, {}
  for ins in out.values():
    for c in ins.calls:
      callers.setdefault(c, ins)
    for o in ins.operands:
      users.setdefault(o, []).append(ins.name)
  for ins in out.values():
    ins.argument = ins.opcode == "parameter" and ins.computation == entry
    if ins.opcode == "parameter" and not ins.source:
      caller = callers.get(ins.computation)
      ins.note = (f"argument {ins.op_name}".strip() if ins.argument else
                  f"state of the {caller.opcode} at {caller.where}" if caller and caller.source else
                  f"parameter of {ins.computation}")
  for ins in out.values():
    if not ins.where:
      ins.note = _temporary(ins, out, computations, users)
  return out


def _from_callee(ins: Instr, instrs: dict, computations: dict, seen: set) -> None:
  """A fusion without metadata takes the source of the op nearest its root that has one
  (fused computations list operands before users, so the last such op is nearest the root)."""
  if ins.source or not ins.calls or ins.name in seen:
    return
  seen.add(ins.name)
  for comp in ins.calls:
    for name in reversed(computations.get(comp, [])):
      inner = instrs[name]
      _from_callee(inner, instrs, computations, seen)
      if inner.source:
        ins.source, ins.function = inner.source, inner.function
        ins.op_name = ins.op_name or inner.op_name
        return


# Ops that only move, retype or reshape a value: it is named after the value it copies. Any other
# op that lost its metadata (on CPU, the XNNPACK dot fusions) is named after the code that reads it.
_LAYOUT_OPS = ("bitcast", "copy", "reshape", "parameter")
_COPY_OPS = _LAYOUT_OPS + ("convert", "transpose", "broadcast", "slice", "dynamic-slice", "pad",
                           "concatenate", "gather", "tuple", "get-tuple-element")


def _nearest(start: list[str], step, instrs: dict) -> str:
  """Breadth first from `start` along `step` (operands or users): the first value with a Python
  line or an argument name, a few hops at most."""
  todo, seen = list(start), set()
  while todo and len(seen) < 32:
    o = instrs.get(todo.pop(0))
    if o is None or o.name in seen:
      continue
    seen.add(o.name)
    if o.source or o.argument:
      return o.where
    todo += step(o)
  return ""


def _temporary(ins: Instr, instrs: dict, computations: dict, users: dict) -> str:
  """'XLA temporary: convert of argument batch['features']', 'XLA temporary: dot read at
  reference.py:91 ...': the op that computes the value, past the layout ops at a fusion's root,
  and the nearest value with a name in the direction that says what it is."""
  ops = [instrs[n].opcode for c in ins.calls[:1] for n in reversed(computations.get(c, []))]
  what = next((o for o in ops or [ins.opcode] if o not in _LAYOUT_OPS), "copy")
  back = lambda: _nearest(ins.operands, lambda o: o.operands, instrs)
  fwd = lambda: _nearest(users.get(ins.name, []), lambda o: users.get(o.name, []), instrs)
  if what in _COPY_OPS:
    src, how = back(), "of"
    src, how = (src, how) if src else (fwd(), "read at")
  else:
    src, how = fwd(), "read at"
    src, how = (src, how) if src else (back(), "of")
  return f"XLA temporary: {what} {how} {src}" if src else f"XLA temporary: {what}"


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


def live_peak(lr: LiveRange, values: dict[str, Value], skip=lambda name: False) -> tuple[int, int]:
  """(bytes, time): the most that the values of the schedule, less those `skip` names, hold at
  once (a sweep of the live ranges with the value sizes)."""
  events = {}
  for name, (a, b) in lr.ranges.items():
    v = values.get(name) or values.get(name.removesuffix("{}"))
    if v is None or v.allocation in ("constant", "thread-local") or skip(name):
      continue
    events.setdefault(a, []).append(v.size)
    events.setdefault(b + 1, []).append(-v.size)
  cur, best, best_t = 0, 0, 0
  for t in sorted(events):
    cur += sum(events[t])
    if cur > best:
      best, best_t = cur, t
  return best, best_t


def peak_from_ranges(lr: LiveRange, values: dict[str, Value]) -> None:
  """Fallback when XLA printed no peak section: the sweep's peak and the values live then."""
  _, lr.peak_time = live_peak(lr, values)
  lr.peak_values = sorted(((n, (values.get(n) or values[n.removesuffix("{}")]).size)
                           for n, (a, b) in lr.ranges.items()
                           if a <= lr.peak_time <= b
                           and (n in values or n.removesuffix("{}") in values)),
                          key=lambda x: -x[1])
