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

from zjax._src import xla_options

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
             "f8e4m3fn": 1, "f8e5m2": 1}
_KINDS = {"all-gather": "all_gather", "all-gather-start": "all_gather",
          "reduce-scatter": "reduce_scatter", "all-reduce": "all_reduce",
          "all-reduce-start": "all_reduce", "all-to-all": "all_to_all",
          "collective-permute": "collective_permute",
          "collective-permute-start": "collective_permute"}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>[a-z\-]+)\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]+)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_ALL = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA_FULL = re.compile(
    r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_WHILE_BODY = re.compile(r"\swhile\(.*\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BRANCHES = re.compile(
    r"\sconditional\(.*?(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+),"
    r"\s*false_computation=%?([\w.\-]+))")


class AnalysisProgram:
  """A program compiled for analysis only (`compile_for_analysis`): the compiled object's
  `as_text`, `memory_analysis` and `cost_analysis`, and no way to run it."""

  def __init__(self, compiled, platform: str):
    self._compiled, self.platform = compiled, platform
    self.barriers_kept = bool(xla_options.analysis_options(platform))

  def as_text(self) -> str:
    return self._compiled.as_text()

  def memory_analysis(self):
    return self._compiled.memory_analysis()

  def cost_analysis(self):
    return self._compiled.cost_analysis()

  def __call__(self, *args, **kwargs):
    raise TypeError("This program was compiled for analysis (zjax.hlo.compile_for_analysis: "
                    "on CPU with its optimization barriers kept, which XLA's CPU runtime does "
                    "not execute safely). Call the jitted function itself to run it.")


def compile_for_analysis(lowered) -> AnalysisProgram:
  """`lowered` (from `jitted.lower(*args)`) compiled as a GPU orders it, for analysis.

  On CPU the optimization barriers that pin the schedule's order are kept for this one
  compile (XLA's CPU pipeline would remove them), so memory and collectives are those of
  the program the schedule describes; elsewhere it is the ordinary compile. The result
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
  """Every collective of an optimised HLO module, in text order."""
  found, computation = [], ""
  for line in hlo_text.splitlines():
    if line and not line[0].isspace() and "{" in line:
      computation = line.split()[0 if not line.startswith("ENTRY") else 1].lstrip("%")
      continue
    m = _INSTRUCTION.match(line)
    if not m or m.group("op") not in _KINDS:
      continue
    kind = _KINDS[m.group("op")]
    found.append(Collective(kind, _collective_bytes(kind, m.group("op"), m.group("shape"), line),
                            m.group("shape"), computation, replica_groups(line)))
  return found


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
  """(collective, times it runs) for every collective: a while body's once per iteration.
  A trip count XLA does not know is an error, or with `unknown_trips_once` counts once."""
  loops = while_loops(hlo_text)
  out = []
  for c in collectives(hlo_text):
    times = loops.get(c.computation, 1)
    if times is None:
      if not unknown_trips_once:
        raise ValueError(f"A {c.kind} sits in while body {c.computation}, whose trip count "
                         f"XLA does not know; how often it runs is undefined.")
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
  """The device groups of a collective instruction, list or iota form; () when absent or
  empty (every device)."""
  m = _GROUPS_IOTA_FULL.search(line)
  if m:
    count, size = int(m.group(1)), int(m.group(2))
    dims = [int(d) for d in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(p) for p in m.group(4).split(",")])
    return tuple(tuple(int(i) for i in row) for row in ids.reshape(count, size))
  m = _GROUPS_ALL.search(line)
  if not m or not m.group(1):
    return ()
  return tuple(tuple(int(i) for i in g.split(",") if i)
               for g in re.findall(r"\{([\d,]*)\}", m.group(1)))


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
    raise ValueError(f"Replica groups {groups} are not the device groups of any set of the "
                     f"mesh axes {mesh_shape}.")
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
  return sum(v for kind, per_axis in by_axis.items() if kinds is None or kind in kinds
             for key, v in per_axis.items()
             if (axis in key.split(" ")[0].split("+")) == over)


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
  for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all",
               "collective_permute"):
    found = [(c.bytes, times) for c, times in runs if c.kind == kind]
    out[f"{kind}_count"] = sum(times for _, times in found)
    out[f"{kind}_bytes"] = sum(size * times for size, times in found)
    out[f"max_{kind}_bytes"] = max((size for size, _ in found), default=0)
  memory = compiled.memory_analysis()
  out.update(temp_bytes=int(memory.temp_size_in_bytes),
             argument_bytes=int(memory.argument_size_in_bytes),
             output_bytes=int(memory.output_size_in_bytes),
             alias_bytes=int(memory.alias_size_in_bytes))
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  out["flops"] = float((cost or {}).get("flops", 0.0))
  return out


def _collective_bytes(kind, op, shape, line) -> int:
  arrays = _arrays(shape)
  if op.endswith("-start") and len(arrays) > 1:
    arrays = arrays[len(arrays) // 2:]  # (operands..., outputs...): count the outputs
  total = sum(arrays)
  if kind == "reduce_scatter":
    total *= _group_size(line)
  return total


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
  m = _GROUPS_LIST.search(line)
  if m:
    return len(m.group(1).split(","))
  m = _GROUPS_IOTA.search(line)
  return int(m.group(2)) if m else 1
