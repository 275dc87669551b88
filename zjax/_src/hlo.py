"""Analysis of a compiled program: its collectives (from the optimised HLO text) and its
per-device memory (from `memory_analysis()`). Used by tests, `zjax inspect` and benchmarks.

Bytes of a collective are those of its full buffer: the output of an all-gather, the input
of a reduce-scatter (output times group size), the operand of an all-reduce — the same
convention as `Schedule.report()`. Async pairs (`-start`/`-done`) count once, at the start.
A collective inside a while body appears once in the text: `summarize` counts it once (what
the text holds), `executed` once per iteration (what runs), from the loop's known trip count.
"""

import dataclasses
import re

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
_WHILE_BODY = re.compile(r"\swhile\(.*\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BRANCHES = re.compile(
    r"\sconditional\(.*?(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+),"
    r"\s*false_computation=%?([\w.\-]+))")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, collective_permute
  bytes: int  # full-buffer bytes (see module docstring)
  shape: str
  computation: str  # the HLO computation it sits in (e.g. a while body)


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
                            m.group("shape"), computation))
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


def executed(hlo_text: str) -> dict:
  """Counts and bytes per collective kind as executed: a collective in a while body once
  per iteration (its loop's trip count must be known)."""
  loops = while_loops(hlo_text)
  out = {}
  for c in collectives(hlo_text):
    times = loops.get(c.computation, 1)
    if times is None:
      raise ValueError(f"A {c.kind} sits in while body {c.computation}, whose trip count XLA "
                       f"does not know; its executed count is undefined.")
    out[f"{c.kind}_count"] = out.get(f"{c.kind}_count", 0) + times
    out[f"{c.kind}_bytes"] = out.get(f"{c.kind}_bytes", 0) + times * c.bytes
  return out


def summarize(compiled) -> dict:
  """Counts and bytes per collective kind, and per-device memory, of a compiled program.

  Example:
    >>> summary = summarize(jax.jit(f).lower(x).compile())    # doctest: +SKIP
    >>> summary["all_gather_count"], summary["temp_bytes"]      # doctest: +SKIP
  """
  out = {}
  colls = collectives(compiled.as_text())
  for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all",
               "collective_permute"):
    sizes = [c.bytes for c in colls if c.kind == kind]
    out[f"{kind}_count"] = len(sizes)
    out[f"{kind}_bytes"] = sum(sizes)
    out[f"max_{kind}_bytes"] = max(sizes, default=0)
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
