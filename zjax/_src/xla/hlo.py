"""Analysis of a compiled program: its collectives (from the optimised HLO text) and its
per-device memory (from `memory_analysis()`). Used by tests, `zjax inspect` and benchmarks.

`compile_for_analysis` compiles a lowered program as a GPU orders it (on CPU: with the
optimization barriers kept, for that compile only, see xla_options.py): the program the
schedule's predictions are about. The CPU executes XLA's own compile of the same lowering,
where CSE may merge a backward re-gather into the forward gather (`lowered.compile()`).

Bytes of a collective are those of its full buffer: the output of an all-gather, the input
of a reduce-scatter (output times group size), the operand of an all-reduce — the same
convention as `Schedule.report()`. Async pairs (`-start`/`-done`) count once, at the start.
A collective inside a while body appears once in the text: `summarize` counts it once (what
the text holds), `executed` once per iteration (what runs), from the loop's known trip count.
"""

import dataclasses
import itertools
import re

import jax
import numpy as np

from zjax._src.xla import xla_options

_ITEMSIZE = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
}
_KINDS = {
  "all-gather": "all_gather",
  "all-gather-start": "all_gather",
  "reduce-scatter": "reduce_scatter",
  "reduce-scatter-start": "reduce_scatter",
  "all-reduce": "all_reduce",
  "all-reduce-start": "all_reduce",
  "all-to-all": "all_to_all",
  "all-to-all-start": "all_to_all",
  "collective-permute": "collective_permute",
  "collective-permute-start": "collective_permute",
}
# Ops that do work on a GPU's streams (what a prefetch can overlap): fusions, library calls
# (cuBLAS, cuDNN), and the unfused heavy ops.
_COMPUTE_OPS = frozenset(
  {
    "fusion",
    "custom-call",
    "dot",
    "convolution",
    "reduce",
    "sort",
    "scatter",
    "gather",
    "reduce-window",
    "select-and-scatter",
  }
)
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>[a-z\-]+)\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_GROUPS_ALL = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA_FULL = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# jaxlib >= 0.11: groups as mesh axes, e.g. mesh['fsdp'=4,'tensor'=2] {'fsdp'}; a sub-axis
# is 'fsdp':(pre)size, the middle factor of pre x size x rest (Shardy's notation).
_GROUPS_MESH = re.compile(
  r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?"
  r"\s*\{([^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_WHILE_BODY = re.compile(r"\swhile\(.*\bbody=%?([\w.\-]+)")
_CALLED = re.compile(
  r"\b(body|condition|calls|to_apply|branch_computations|true_computation|"
  r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BRANCHES = re.compile(
  r"\sconditional\(.*?(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+),"
  r"\s*false_computation=%?([\w.\-]+))"
)


class AnalysisProgram:
  """A program compiled for analysis only (`compile_for_analysis`): the compiled object's
  `as_text`, `memory_analysis` and `cost_analysis`, and no way to run it."""

  def __init__(self, compiled, platform: str):
    self._compiled, self.platform = compiled, platform
    self.barriers_kept = platform == "cpu"  # (elsewhere XLA's own pipeline decides)

  def as_text(self) -> str:
    return self._compiled.as_text()

  def memory_analysis(self):
    return self._compiled.memory_analysis()

  def cost_analysis(self):
    return self._compiled.cost_analysis()

  def __call__(self, *args, **kwargs):
    raise TypeError(
      "This program was compiled for analysis (zjax.hlo.compile_for_analysis: "
      "on CPU with its optimization barriers kept, which XLA's CPU runtime does "
      "not execute safely). Call the jitted function itself to run it."
    )


def compile_for_analysis(lowered) -> AnalysisProgram:
  """`lowered` (from `jitted.lower(*args)`) compiled as a GPU orders it, for analysis.

  On CPU the optimization barriers that pin the schedule's order are kept for this one
  compile (XLA's CPU pipeline would remove them), so memory and collectives are those of
  the program the schedule describes; on GPUs it is the compile of the program zjax runs
  (collective combiners off, `xla_options.GPU_OPTIONS`); elsewhere the ordinary compile. The result
  analyses (`as_text`, `memory_analysis`, `cost_analysis`, `summarize`) but never runs.

  Example:
    >>> program = compile_for_analysis(step.lower(sharded, batch))   # doctest: +SKIP
    >>> executed(program.as_text())["all_gather_count"]               # doctest: +SKIP
  """
  platform = _platform(lowered)
  options = xla_options.analysis_options(platform)
  compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
  return AnalysisProgram(compiled, platform)


def _platform(lowered) -> str:
  backend = getattr(lowered, "_lowering", None)
  backend = getattr(backend, "compile_args", {}).get("backend") if backend else None
  return getattr(backend, "platform", None) or jax.default_backend()


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program's HLO text (`collectives`)."""

  kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, collective_permute
  bytes: int  # full-buffer bytes (see module docstring)
  shape: str
  computation: str  # the HLO computation it sits in (e.g. a while body)
  groups: tuple = ()  # replica groups (device index tuples); () = every device


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of an optimised HLO module, in text order. An asynchronous one (a GPU's
  `all-gather-start` ... `all-gather-done`) counts once, at its start."""
  found, computation = [], ""
  wrapped = _async_wrapped(hlo_text)
  for line in hlo_text.splitlines():
    if _is_header(line):
      computation = _header_name(line)
      continue
    m = _INSTRUCTION.match(line)
    if not m or m.group("op") not in _KINDS or computation in wrapped:
      continue
    kind = _KINDS[m.group("op")]
    found.append(
      Collective(
        kind,
        _collective_bytes(kind, m.group("op"), m.group("shape"), line),
        m.group("shape"),
        computation,
        replica_groups(line),
      )
    )
  return found


def _is_header(line: str) -> bool:
  return bool(line) and not line[0].isspace() and "{" in line


def _header_name(line: str) -> str:
  return line.split()[0 if not line.startswith("ENTRY") else 1].lstrip("%")


def _async_wrapped(hlo_text: str) -> set[str]:
  """Computations that an asynchronous collective's start calls (the collective it wraps is
  counted at the start)."""
  names = set()
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m and m.group("op").endswith("-start") and m.group("op") in _KINDS:
      for key, value in _CALLED.findall(line):
        if key == "calls":
          names.update(_names(value))
  return names


def _names(value: str) -> list[str]:
  return [n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip()]


def multiplicities(hlo_text: str) -> dict[str, int | None]:
  """Computation name -> how many times it runs in one run of the entry computation: a while
  body once per iteration of every loop around it, anything called (fusions, async
  wrappers, branches, calls) as often as its callers (a branch counted as if taken). None
  where a loop around it has a trip count XLA does not know."""
  calls, order, entry, computation = {}, [], None, ""
  for line in hlo_text.splitlines():
    if _is_header(line):
      computation = _header_name(line)
      order.append(computation)
      if line.startswith("ENTRY"):
        entry = computation
      continue
    for key, value in _CALLED.findall(line):
      factor = 1
      if key == "body":
        trip = _TRIP_COUNT.search(line)
        factor = int(trip.group(1)) if trip else None
      for name in _names(value):
        calls.setdefault(computation, []).append((name, factor))
  times = {entry: 1} if entry else {}
  for caller in reversed(order):  # HLO text defines a computation before its callers
    if caller not in times:
      continue
    for callee, factor in calls.get(caller, ()):
      here = None if times[caller] is None or factor is None else times[caller] * factor
      before = times.get(callee, 0)
      times[callee] = None if here is None or before is None else before + here
  return times


_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
  """An asynchronous collective (`all-gather-start` ... `all-gather-done`) of a scheduled
  program, with the compute scheduled between its start and its done (`async_collectives`)."""

  kind: str
  bytes: int  # full buffer, as `Collective.bytes`
  computation: str
  groups: tuple
  compute_between: int  # compute ops (fusions, library calls, ...) between start and done


def async_collectives(hlo_text: str) -> list[AsyncCollective]:
  """Every start/done pair of a compiled, scheduled module (a GPU's; XLA's CPU emits none),
  with how many compute ops the schedule places between the start and the done: one or
  more means the transfer can overlap computation (a prefetch that works). A scheduled
  module lists each computation's instructions in execution order."""
  found, pending, computation, compute = [], {}, "", 0
  wrapped = _async_wrapped(hlo_text)
  for line in hlo_text.splitlines():
    if _is_header(line):
      computation, pending, compute = _header_name(line), {}, 0
      continue
    m, name = _INSTRUCTION.match(line), _NAME.match(line)
    if not m or not name or computation in wrapped:
      continue
    op = m.group("op")
    if op in _KINDS and op.endswith("-start"):
      kind = _KINDS[op]
      pending[name.group(1)] = (
        kind,
        _collective_bytes(kind, op, m.group("shape"), line),
        replica_groups(line),
        compute,
      )
    elif op.endswith("-done"):
      for start in list(pending):
        if re.search(r"(?<![\w.\-])%?" + re.escape(start) + r"(?![\w.\-])", m.group("rest")):
          kind, size, groups, before = pending.pop(start)
          found.append(AsyncCollective(kind, size, computation, groups, compute - before))
          break
    elif op in _COMPUTE_OPS:
      compute += 1
  return found


def barrier_count(hlo_text: str) -> int:
  """Optimization barriers in an HLO module's text (`opt-barrier`), or in a lowered
  program's StableHLO (`optimization_barrier`)."""
  return len(re.findall(r"\sopt-barrier\(|\bstablehlo\.optimization_barrier\b", hlo_text))


def while_loops(hlo_text: str) -> dict[str, int | None]:
  """Body computation name -> trip count (None when XLA does not know it) of every while."""
  loops = {}
  for line in hlo_text.splitlines():
    m = _WHILE_BODY.search(line)
    if m:
      trip = _TRIP_COUNT.search(line)
      loops[m.group(1)] = int(trip.group(1)) if trip else None
  return loops


def conditional_branches(hlo_text: str) -> set[str]:
  """Names of the branch computations of every conditional."""
  names = set()
  for line in hlo_text.splitlines():
    m = _BRANCHES.search(line)
    if m:
      listed = m.group(1).split(",") if m.group(1) else [m.group(2), m.group(3)]
      names.update(n.strip().lstrip("%") for n in listed)
  return names


def executions(hlo_text: str, unknown_trips_once: bool = False) -> list:
  """(collective, times it runs) for every collective: once per iteration of every while
  loop around it (`multiplicities`). A trip count XLA does not know is an error, or with
  `unknown_trips_once` counts once."""
  times_of = multiplicities(hlo_text)
  out = []
  for c in collectives(hlo_text):
    times = times_of.get(c.computation, 1)
    if times is None:
      if not unknown_trips_once:
        raise ValueError(
          f"A {c.kind} sits in computation {c.computation}, inside a while "
          f"loop whose trip count XLA does not know; how often it runs is "
          f"undefined."
        )
      times = 1
    out.append((c, times))
  return out


def executed(hlo_text: str) -> dict:
  """Counts and bytes per collective kind as executed: a collective in a while body once
  per iteration (its loop's trip count must be known)."""
  out = {}
  for c, times in executions(hlo_text):
    out[f"{c.kind}_count"] = out.get(f"{c.kind}_count", 0) + times
    out[f"{c.kind}_bytes"] = out.get(f"{c.kind}_bytes", 0) + times * c.bytes
  return out


def replica_groups(line: str) -> tuple:
  """The device groups of a collective instruction, list, iota or mesh-axes form; for a
  collective-permute, the devices its source-target pairs connect; () when absent or empty
  (every device)."""
  m = _PAIRS.search(line)
  if m:
    return _connected(re.findall(r"\{(\d+),(\d+)\}", m.group(1)))
  m = _GROUPS_MESH.search(line)
  if m:
    return _mesh_axes_groups(m)
  m = _GROUPS_IOTA_FULL.search(line)
  if m:
    count, size = int(m.group(1)), int(m.group(2))
    ids = _iota(m.group(3), m.group(4))
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(count, size))
  m = _GROUPS_ALL.search(line)
  if not m or not m.group(1):
    return ()
  return tuple(
    tuple(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", m.group(1))
  )


def _connected(pairs) -> tuple:
  """The groups of devices that (source, target) pairs connect, each sorted."""
  parent: dict = {}

  def root(d):
    while parent.setdefault(d, d) != d:
      d = parent[d]
    return d

  for a, b in pairs:
    parent[root(int(a))] = root(int(b))
  groups: dict = {}
  for d in list(parent):
    groups.setdefault(root(d), []).append(d)
  return tuple(sorted(tuple(sorted(g)) for g in groups.values()))


def _iota(dims: str, permutation: str | None) -> np.ndarray:
  """Device ids of an iota list `<=[dims]T(permutation)`, flattened."""
  shape = [int(d) for d in dims.split(",")]
  ids = np.arange(int(np.prod(shape))).reshape(shape)
  if permutation:
    ids = ids.transpose([int(p) for p in permutation.split(",")])
  return ids.reshape(-1)


def _mesh_axes_groups(m) -> tuple:
  """Groups of a mesh-axes replica group: the devices that differ only along the named axes
  (or sub-axes)."""
  axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
  total = int(np.prod([n for _, n in axes]))
  ids = _iota(m.group(2), m.group(3)) if m.group(2) else np.arange(total)
  chosen = {
    name: (pre, size)
    for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", m.group(4))
  }
  shape, grouped = [], []
  for name, n in axes:
    pre, size = chosen.get(name, ("", ""))
    if pre:  # a sub-axis: n = pre x size x rest, grouped along size
      shape += [int(pre), int(size), n // (int(pre) * int(size))]
      grouped += [False, True, False]
    else:
      shape.append(n)
      grouped.append(name in chosen)
  order = [i for i, g in enumerate(grouped) if not g] + [i for i, g in enumerate(grouped) if g]
  size = int(np.prod([shape[i] for i, g in enumerate(grouped) if g]))
  rows = ids.reshape(shape).transpose(order).reshape(-1, size)
  return tuple(tuple(int(i) for i in row) for row in rows)


def axes_of_groups(groups, mesh_shape: dict) -> str:
  """The mesh axes a collective spans, from its replica groups: "+"-joined names (mesh
  order) of the axes whose device groups these are, e.g. "fsdp" or "data+fsdp". Device
  numbers are positions in the mesh's flattened device array (SPMD partition ids). Groups
  that are parts of such groups (GSPMD resharding between partial replications, e.g. pairs
  strided inside one axis) are named by the fewest axes whose groups hold them, with
  " (part)" appended: "fsdp (part)"."""
  names, dims = list(mesh_shape), [int(n) for n in mesh_shape.values()]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  found = {frozenset(g) for g in groups} if groups else {frozenset(ids.flat)}
  covering = None
  for r in range(1, len(names) + 1):
    for subset in itertools.combinations(range(len(names)), r):
      rest = [a for a in range(len(names)) if a not in subset]
      size = int(np.prod([dims[a] for a in subset]))
      rows = {frozenset(row) for row in ids.transpose(rest + list(subset)).reshape(-1, size)}
      key = "+".join(names[a] for a in subset)
      if rows == found:
        return key
      if covering is None and all(any(g <= row for row in rows) for g in found):
        covering = key + " (part)"
  if covering is None:
    raise ValueError(
      f"Replica groups {groups} are not the device groups of any set of the mesh axes {mesh_shape}."
    )
  return covering


def executed_by_axis(hlo_text: str, mesh_shape: dict) -> dict:
  """Executed bytes per collective kind and mesh axes: {"all_gather": {"fsdp": bytes, ...}}
  (a collective in a while body once per iteration, as in `executed`)."""
  out: dict = {}
  for c, times in executions(hlo_text):
    per_axis = out.setdefault(c.kind, {})
    key = axes_of_groups(c.groups, mesh_shape)
    per_axis[key] = per_axis.get(key, 0) + times * c.bytes
  return out


def bytes_over(by_axis: dict, axis: str, over: bool = True, kinds=None) -> int:
  """Total bytes of an `executed_by_axis` result whose collectives span `axis` (or, with
  over=False, do not), of every kind or of `kinds`."""
  return sum(
    v
    for kind, per_axis in by_axis.items()
    if kinds is None or kind in kinds
    for key, v in per_axis.items()
    if (axis in key.split(" ")[0].split("+")) == over
  )


def summarize(compiled) -> dict:
  """Counts and bytes per collective kind, as executed (a while body's once per iteration;
  once where XLA does not know the trip count), and per-device memory, of a compiled
  program (an `AnalysisProgram`, or any `lowered.compile()`).

  Example:
    >>> summary = summarize(compile_for_analysis(jax.jit(f).lower(x)))  # doctest: +SKIP
    >>> summary["all_gather_count"], summary["temp_bytes"]      # doctest: +SKIP
  """
  out = {}
  runs = executions(compiled.as_text(), unknown_trips_once=True)
  for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute"):
    found = [(c.bytes, times) for c, times in runs if c.kind == kind]
    out[f"{kind}_count"] = sum(times for _, times in found)
    out[f"{kind}_bytes"] = sum(size * times for size, times in found)
    out[f"max_{kind}_bytes"] = max((size for size, _ in found), default=0)
  memory = compiled.memory_analysis()
  out.update(
    temp_bytes=int(memory.temp_size_in_bytes),
    argument_bytes=int(memory.argument_size_in_bytes),
    output_bytes=int(memory.output_size_in_bytes),
    alias_bytes=int(memory.alias_size_in_bytes),
  )
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  out["flops"] = float((cost or {}).get("flops", 0.0))
  return out


def _collective_bytes(kind, op, shape, line) -> int:
  if op.endswith("-start") and op != "all-reduce-start":
    shape = _start_output(shape)  # (operands, outputs, context...): the outputs
  total = sum(_arrays(shape))
  if kind == "reduce_scatter":
    total *= _group_size(line)
  return total


def _start_output(shape: str) -> str:
  """The second top-level element of an async start's tuple shape (its outputs)."""
  shape = shape.strip()
  if not shape.startswith("("):
    return shape
  parts, depth, begin = [], 0, 1
  for i, ch in enumerate(shape[1:-1], start=1):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(shape[begin:i])
      begin = i + 1
  parts.append(shape[begin:-1])
  return parts[1] if len(parts) > 1 else parts[0]


def _arrays(shape: str) -> list[int]:
  sizes = []
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in _ITEMSIZE:
      continue
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    sizes.append(count * _ITEMSIZE[dtype])
  return sizes


def _group_size(line: str) -> int:
  groups = replica_groups(line)
  return len(groups[0]) if groups else 1
