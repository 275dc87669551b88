"""Automatic layer rolling: find runs of identical layers in an unrolled program.

A model written with a Python `for` over blocks traces to L copies of the same ops, each
reading its own layer's parameters. A *run* is L >= 2 consecutive blocks of B ops that are
the same program: op for op the same primitive, parameters, shapes and dtypes, wired the
same way inside the block, and connected as a loop:
  * every value a block reads from outside itself is either read by every block (a loop
    const: a batch value, a weight shared by all layers) or, from block 1 on, the previous
    block's output at one fixed position (a loop carry; block 0 reads its initial value);
  * a parameter is read by one block only and its counterparts in the other blocks have
    its shape, dtype, persistence and frozen flag (a per-layer weight, stacked in the
    loop), or it is the same parameter in every block (a const);
  * scalar constants may differ per layer (Flax folds a hash of the module name into its
    dropout key): they become a per-iteration input; so may the offsets of a static slice
    (`head_mask[i]` in layer i, as Hugging Face's BERT writes it): the loop runs it as a
    dynamic slice at the iteration's offsets;
  * nothing outside the run reads a value of a block other than the last, and what it
    reads of the last one is carried out of the loop.
The planner runs such a run as one loop step (one layer's gathers, compute and
reduce-scatters per iteration); storage stays per leaf. `find_runs` also says why runs
that almost repeat were not rolled.
"""

import dataclasses
import hashlib
import re

import jax
import jax.extend.core as jex
import numpy as np
from jax import lax

from zjax._src.program.program import FlatProgram


@dataclasses.dataclass(frozen=True)
class ParamFacts:
  """What rolling needs to know about one parameter leaf."""

  path: str
  uses: tuple[int, ...]  # op numbers
  # (shape, dtype, persistent, frozen, tensor dim, zero gradient): layers must agree on it
  kind: tuple


def param_facts(
  params, persistent, frozen, tensor_dims=None, zero_gradient=None
) -> list[ParamFacts]:
  """Facts of traced parameters (trace.ParamInfo) or schedule entries (ir.ParamEntry):
  `persistent`, `frozen` and `zero_gradient` are index sets, and `tensor_dims` the
  dimension each parameter splits over the tensor axis (None: none), or all None to read
  the entries' own fields."""
  out = []
  for i, p in enumerate(params):
    dtype = p.dtype if isinstance(p.dtype, str) else p.dtype.name
    is_persistent = p.persistent if persistent is None else i in persistent
    is_frozen = p.frozen if frozen is None else i in frozen
    tensor_dim = (
      getattr(p, "tensor_dim", None)
      if persistent is None
      else None
      if tensor_dims is None
      else tensor_dims[i]
    )
    uses = tuple(u if isinstance(u, int) else u.op for u in p.uses)
    is_zero = (
      getattr(p, "zero_gradient", False) if persistent is None else i in (zero_gradient or ())
    )
    out.append(
      ParamFacts(
        p.path, uses, (tuple(p.shape), dtype, is_persistent, is_frozen, tensor_dim, is_zero)
      )
    )
  return out


@dataclasses.dataclass(frozen=True)
class Run:
  """L blocks of B ops, ops [start, start + B * L), wired as a loop (module docstring).

  Sources say where each input of each template (block 0) op comes from:
  ("lit", value) | ("local", op, output) | ("const", k) | ("carry", k) |
  ("layer", p) (stacked parameter p's layer) | ("xs", k) (a per-layer scalar).
  """

  start: int
  block: int
  length: int
  sources: tuple  # per template op: a source per input
  consts: tuple[int, ...]  # value ids read by every block
  carry_in: tuple  # per carry: block 0's value id, or None (zeros: only carried out)
  carry_out: tuple[tuple[int, int], ...]  # per carry: (template op, output) producing it
  outputs: tuple[int, ...]  # per carry: the last block's value id (the run's result)
  stacked: tuple[tuple[int, ...], ...]  # per stacked position: parameter index per layer
  xs: tuple  # per-layer scalars: numpy arrays of shape [L]
  # template ops that are static slices at per-layer offsets: run as dynamic slices, their
  # sources extended by one start per dim (("xs", k) or ("lit", offset))
  dynamic_slices: tuple[int, ...] = ()
  # A scan's body as a run (loops.scan_run): the body flattened (its ops are the template,
  # numbered from 0), each iteration's outputs (carries, then the stacked ys) as context
  # keys (("local", op, output), or an input passed straight through, e.g. each layer's
  # input stacked: ("const" | "carry" | "xs", k); carry_out is then empty), and `xs` holding
  # the scan's xs value ids (None at a stacked parameter's position). None / () for a run
  # of the program's own ops.
  body: FlatProgram | None = None
  out_keys: tuple = ()

  @property
  def end(self) -> int:
    return self.start + self.block * self.length

  @property
  def op_offset(self) -> int:
    """The program op number of template op 0 (a scan's body ops are numbered apart: 0)."""
    return 0 if self.body is not None else self.start


@dataclasses.dataclass(frozen=True)
class Rolling:
  runs: tuple[Run, ...]
  notes: tuple[str, ...]  # what was rolled and why other repeats were not


def find_runs(program: FlatProgram, params: list[ParamFacts], excluded=frozenset()) -> Rolling:
  """Non-overlapping runs that cover the most ops (ops in `excluded` never join one)."""
  finder = _Finder(program, params, excluded)
  candidates, rejected = finder.candidates()
  chosen, covered = [], set()
  for run in sorted(candidates, key=lambda r: (-r.block * r.length, r.block, r.start)):
    ops = set(range(run.start, run.end))
    if not ops & covered:
      chosen.append(run)
      covered |= ops
  chosen.sort(key=lambda r: r.start)
  notes = [
    f"rolled ops [{r.start}, {r.end}): {r.length} layers of {r.block} ops "
    f"({layer_names(params, r)})"
    for r in chosen
  ]
  notes += _why_not_notes(finder, rejected, covered)
  notes += [note for run in chosen for note in finder.neighbours(run, covered)]
  return Rolling(tuple(chosen), tuple(notes) or (finder.near_miss() or "no repeated layers",))


def _why_not_notes(finder, rejected, covered) -> list[str]:
  """One line per candidate run that did not roll (candidates over the same layers, as
  different block lengths or alignments, are one): its layers and the first reason."""
  first_reason = {}
  for (start, end), (why, block) in sorted(rejected.items()):
    if why and not set(range(start, end)) <= covered:
      first_reason.setdefault(finder.span_names(start, end, block), why)
  notes = [f"not rolled: {names}: {why}" for names, why in first_reason.items()]
  more = len(notes) - _MAX_REASONS
  return notes[:_MAX_REASONS] + ([f"... and {more} more candidate runs"] if more > 0 else [])


def analyze_run(
  program: FlatProgram, params: list[ParamFacts], start: int, block: int, length: int
) -> Run:
  """The run at ops [start, start + block * length) (as planned); ValueError if the ops
  there are not such a run (the program changed since planning)."""
  run, why, _ = _Finder(program, params, frozenset()).analyze(start, block, length)
  if run is None or run.length != length:
    raise ValueError(
      f"ops [{start}, {start + block * length}) are not {length} identical layers: {why}"
    )
  return run


def template_ops(program: FlatProgram, run: Run) -> list:
  """The ops one iteration of `run` applies (block 0's, with each static slice at per-layer
  offsets made a dynamic slice that reads its starts after its operand, as its sources
  say)."""
  if run.body is not None:
    return list(run.body.ops)
  ops = list(program.ops[run.start : run.start + run.block])
  for j in run.dynamic_slices:
    op, eqn = ops[j], ops[j].eqn
    sizes = _slice_sizes(eqn.params)
    starts = [jex.Var(jax.core.ShapedArray((), np.int32)) for _ in sizes]
    eqn = eqn.replace(
      primitive=lax.dynamic_slice_p, invars=[eqn.invars[0], *starts], params={"slice_sizes": sizes}
    )
    ops[j] = dataclasses.replace(op, eqn=eqn, inputs=op.inputs + (None,) * len(sizes))
  return ops


def layer_names(params, run) -> str:
  """The first and last layer, named by the common path prefix of their parameters (a
  scan's layers: the prefix of its stacked parameters)."""
  if run.body is not None:
    return f"the scan over {_common_prefix([params[rows[0]].path for rows in run.stacked])}"

  def prefix(layer):
    return _common_prefix([params[layers[layer]].path for layers in run.stacked])

  first, last = prefix(0), prefix(run.length - 1)
  if first == last:  # layers that do not start at a module: name a parameter of each
    first, last = (params[run.stacked[0][layer]].path for layer in (0, run.length - 1))
  return f"{first} .. {last}"


def _common_prefix(paths) -> str:
  """The longest common prefix of parameter paths that ends at a key (else the first)."""
  common = paths[0]
  for path in paths[1:]:
    while not path.startswith(common):
      common = common[: common.rindex("[")] if "[" in common else ""
  return common or paths[0]


_MAX_REASONS = 4  # candidate runs that did not roll, a line each, kept per schedule
_PERIOD_LOOKBACK = 4  # same-signature weight uses per layer that periods look past


class _Finder:
  def __init__(self, program, params, excluded):
    self.program, self.params, self.excluded = program, params, excluded
    self.ops = program.ops
    self.defined_at = {}  # value id -> (op number, output position)
    for k, op in enumerate(self.ops):
      for o, v in enumerate(op.outputs):
        self.defined_at[v] = (k, o)
    self.readers: dict[int, list[int]] = {}  # value id -> op numbers (len(ops): result)
    for k, op in enumerate(self.ops):
      for a in op.inputs:
        if isinstance(a, int):
          self.readers.setdefault(a, []).append(k)
    for a in program.output_ids:
      if isinstance(a, int):
        self.readers.setdefault(a, []).append(len(self.ops))
    self.param_of = {program.input_ids[i]: i for i in range(len(params))}
    self.sigs = _signatures(self.ops)
    for k in excluded:  # an excluded op matches nothing
      self.sigs[k] = -1 - k
    self.consts = dict(zip(program.const_ids, program.consts))

  def where(self, k) -> str:
    """Op k in the model's terms: its number and, where traced, its module."""
    if k >= len(self.ops):
      return "the program's result"
    module = self.ops[k].module
    return f"op {k} in {module}" if module else f"op {k}"

  def neighbours(self, run, covered) -> list[str]:
    """Notes on layers just before or after a run that look like its layers (the same
    parameter names up to numbers) but were not rolled with it: their ops differ."""
    pattern = {_numberless(self.params[layers[0]].path) for layers in run.stacked}
    out = []
    for lo in (run.start - run.block, run.end):
      ops = [k for k in range(max(lo, 0), min(lo + run.block, len(self.ops))) if k not in covered]
      paths = sorted(
        {
          self.params[self.param_of[a]].path
          for k in ops
          for a in self.ops[k].inputs
          if isinstance(a, int) and a in self.param_of
        }
      )
      similar = [p for p in paths if _numberless(p) in pattern]
      if similar:
        out.append(
          f"not rolled with {layer_names(self.params, run)}: the layer of "
          f"{similar[0]} runs other ops or shapes{self._first_difference(run, lo)}"
        )
    return out

  def _first_difference(self, run, lo) -> str:
    """Where a neighbouring layer starts to differ from the run's first layer, walking from
    the side that touches the run (a layer before it is compared from its end)."""
    before = lo < run.start
    for j in range(run.block):
      k, t = (
        (run.start - 1 - j, run.start + run.block - 1 - j)
        if before
        else (run.end + j, run.start + j)
      )
      if not 0 <= k < len(self.ops):
        return ""
      if self.sigs[k] != self.sigs[t]:
        mine, theirs = self.ops[k].primitive, self.ops[t].primitive
        if mine == theirs:
          return f" ({self.where(k)}: {mine} on other shapes than {self.where(t)})"
        return f" ({self.where(k)}: {mine}, where the rolled layers run {self.where(t)}: {theirs})"
    return ""

  def near_miss(self) -> str:
    """Layers that repeat but for one op in each: the first such op, in the model's terms
    ('' if there are none). Such layers form no candidate run (module docstring)."""
    sigs = np.asarray(self.sigs)
    for block in sorted(self._periods(), reverse=True):
      if 2 * block > len(sigs):
        continue
      same = sigs[:-block] == sigs[block:]  # op k is op k + block's computation
      total = np.concatenate([[0], np.cumsum(same)])
      window = total[block:] - total[:-block]  # matches in [k, k + block)
      for k in np.flatnonzero(window == block - 1):
        if k + 2 * block <= len(sigs) and self._looks_like_layers(int(k), block):
          m = int(k + np.flatnonzero(~same[k : k + block])[0])
          return (
            f"not rolled: {self.span_names(int(k), int(k) + 2 * block, block)}: "
            f"{self.where(m)} ({self.ops[m].primitive}) and {self.where(m + block)} "
            f"({self.ops[m + block].primitive}) in the next layer differ (other ops, "
            f"shapes or parameters); every other op repeats"
          )
    return ""

  # ---- where runs may be ---------------------------------------------------------------
  def candidates(self):
    runs, rejected = [], {}
    for block in self._periods():
      for lo, hi in self._stretches(block):
        for run, why, span in self._runs_in(lo, hi, block):
          if run is not None:
            runs.append(run)
          elif why and self._looks_like_layers(span[0], block):
            rejected[span] = (why, block)
    return runs, rejected

  def span_names(self, start, end, block) -> str:
    """The candidate layers [start, end) (blocks of `block` ops) by their first and last
    block's parameters: the common path prefix of each (as layer_names)."""

    def prefix(lo):
      paths = sorted(
        {
          self.params[self.param_of[a]].path
          for op in self.ops[lo : lo + block]
          for a in op.inputs
          if isinstance(a, int) and a in self.param_of
        }
      )
      return _common_prefix(paths) if paths else self.where(lo)

    count = (end - start) // block
    return f"{prefix(start)} .. {prefix(end - block)} ({count} candidate layers)"

  def _looks_like_layers(self, start, block) -> bool:
    """Whether blocks 0 and 1 of a candidate read parameters of the same names up to
    numbers (block_0/fc vs block_1/fc): layers to a user. A repeat inside one layer (the
    q, k and v projections) is not, and why it does not roll says nothing useful."""

    def names(lo):
      return {
        _numberless(self.params[self.param_of[a]].path)
        for op in self.ops[lo : lo + block]
        for a in op.inputs
        if isinstance(a, int) and a in self.param_of
      }

    return bool(names(start) & names(start + block))

  def _periods(self) -> list[int]:
    """Candidate block lengths: distances between consecutive ops of the same signature
    that read a parameter (in an unrolled model, the same weight use in the next layer)."""
    recent, periods = {}, set()  # signature -> its last few positions
    for k, op in enumerate(self.ops):
      if any(isinstance(a, int) and a in self.param_of for a in op.inputs):
        seen = recent.setdefault(self.sigs[k], [])
        periods.update(k - j for j in seen)  # a layer may use one weight shape twice
        seen[:] = (seen + [k])[-_PERIOD_LOOKBACK:]
    return sorted(periods)

  def _stretches(self, block):
    """Maximal op ranges [lo, hi) in which op k has op k + block's signature, for at least
    two blocks."""
    n, k = len(self.ops), 0
    while k + block < n:
      lo = k
      while k + block < n and self.sigs[k] == self.sigs[k + block]:
        k += 1
      if k - lo >= block:
        yield lo, k + block
      k += 1

  def _runs_in(self, lo, hi, block):
    """(run or None, why not, op span) over [lo, hi), at the block alignment that yields
    runs and best matches module boundaries (a few alignments are tried)."""
    phases = sorted(
      range(block),
      key=lambda p: (-((hi - lo - p) // block), -self._boundaries(lo + p, block, hi), p),
    )
    tried = []
    for phase in phases[:4]:
      start, found = lo + phase, []
      while (hi - start) // block >= 2:
        count = (hi - start) // block
        run, why, joined = self.analyze(start, block, count)
        found.append((run, why, (start, start + block * count)))
        start = run.end if run is not None else start + block * max(joined, 1)
      if any(run is not None for run, _, _ in found):
        return found
      tried.append(found)
    return tried[0] if tried else []  # why the best alignment does not roll

  def _boundaries(self, start, block, hi) -> int:
    """How strongly blocks starting at `start` begin where a module begins: the fewer
    name-stack components an op shares with the one before it, the stronger the boundary
    (GPT/block_0 -> GPT/block_1/ln1 beats GPT/block_0/mlp -> GPT/block_0)."""
    score = 0
    for k in range(max(start, 1), hi - block + 1, block):
      before, here = self.ops[k - 1].module.split("/"), self.ops[k].module.split("/")
      shared = 0
      while shared < min(len(before), len(here)) and before[shared] == here[shared]:
        shared += 1
      score -= len(here) + 1 if before == here else shared
    return score

  # ---- is it a run? --------------------------------------------------------------------
  def analyze(self, start, block, count):
    """(run over the longest valid prefix of the `count` blocks (None if < 2), why the
    next block could not join, how many blocks joined)."""
    wiring = _Wiring(self, start, block)
    joined, why = 1, ""
    for layer in range(1, count):
      why = wiring.join(layer)
      if why:
        break
      joined += 1
    while joined >= 2:
      closing = wiring.close(joined)
      if isinstance(closing, Run):
        return closing, why, joined
      why, joined = closing, joined - 1
    return None, why, joined


class _Wiring:
  """The loop structure of blocks [start + l * block) built up layer by layer."""

  def __init__(self, finder: _Finder, start: int, block: int):
    self.f, self.start, self.block = finder, start, block
    self.template = finder.ops[start : start + block]
    self.sources = [[None] * len(op.inputs) for op in self.template]
    self.consts, self.carries, self.stacked, self.xs = {}, {}, {}, {}
    self.per_layer = []  # per layer: stacked position -> parameter index
    self.literals = []  # per layer: xs position -> scalar
    self.starts = []  # per layer: template op -> its static slice's offsets
    self._first_block()

  def _first_block(self):
    layer_params, literal_values = {}, {}
    for j, op in enumerate(self.template):
      for q, a in enumerate(op.inputs):
        self.sources[j][q] = self._first_source(j, q, a, layer_params)
        if isinstance(a, jex.Literal):
          literal_values[(j, q)] = _literal_value(a)
    self.per_layer.append(layer_params)
    self.literals.append(literal_values)
    self.starts.append(self._starts(self.start))

  def _starts(self, base) -> dict:
    return {
      j: _slice_starts(self.f.ops[base + j])
      for j, op in enumerate(self.template)
      if _offset_free(op)
    }

  def _first_source(self, j, q, a, layer_params):
    if isinstance(a, jex.Literal):
      return ("lit", a.val)
    local = self._local(a, 0)
    if local is not None:
      return ("local",) + local
    if a in self.f.param_of:
      i = self.f.param_of[a]
      layer_params.setdefault((j, q), i)
      return ("param", j, q)
    return ("outside", a)

  def _local(self, a, layer):
    """(template op, output) if value `a` is defined in block `layer`."""
    k, o = self.f.defined_at.get(a, (-1, 0))
    base = self.start + layer * self.block
    return (k - base, o) if base <= k < base + self.block else None

  def join(self, layer) -> str:
    """Match block `layer` against the loop so far; '' if it joins, else why not."""
    base = self.start + layer * self.block
    layer_params, literal_values = {}, {}
    for j, op in enumerate(self.template):
      other = self.f.ops[base + j]
      if self.f.sigs[base + j] != self.f.sigs[self.start + j]:
        return (
          f"{self.f.where(base + j)} ({other.primitive}) of layer {layer}: other ops "
          f"or shapes than {self.f.where(self.start + j)} in the first"
        )
      for q, (a, b) in enumerate(zip(op.inputs, other.inputs)):
        why = self._match(j, q, a, b, layer, layer_params, literal_values)
        if why:
          return f"{self.f.where(base + j)} ({other.primitive}) of layer {layer}: {why}"
    self.per_layer.append(layer_params)
    self.literals.append(literal_values)
    self.starts.append(self._starts(base))
    return ""

  def _match(self, j, q, a, b, layer, layer_params, literal_values) -> str:
    src = self.sources[j][q]
    if isinstance(a, jex.Literal) or isinstance(b, jex.Literal):
      if not (isinstance(a, jex.Literal) and isinstance(b, jex.Literal)):
        return "a constant in one layer is a value in another"
      literal_values[(j, q)] = _literal_value(b)
      return ""
    if src[0] == "local":
      return "" if self._local(b, layer) == src[1:] else "wired differently inside the layer"
    if src[0] == "param":
      return self._match_param(j, q, b, layer, layer_params)
    # block 0 read an outside value: a const (same value) or a carry (previous block's)
    previous = self._local(b, layer - 1)
    role = ("carry", previous) if previous is not None else ("const", b)
    if role[0] == "const" and b != src[1]:
      if not self._equal_consts(b, src[1]):
        return "reads a value from before the layers that the first layer does not read"
      role = ("const", src[1])  # its own copy of the first layer's table (e.g. RoPE's)
    known = self.consts.get((j, q)) or self.carries.get((j, q))
    if known is not None and known != role:
      return "reads another layer's value than the previous layer's"
    (self.carries if role[0] == "carry" else self.consts)[(j, q)] = role
    return ""

  def _equal_consts(self, a, b) -> bool:
    """Two constants of the program (captured arrays) with equal values."""
    consts = self.f.consts
    return (
      a in consts and b in consts and np.array_equal(np.asarray(consts[a]), np.asarray(consts[b]))
    )

  def _match_param(self, j, q, b, layer, layer_params) -> str:
    if b not in self.f.param_of:
      return "reads a computed value where the first layer reads a parameter"
    i, i0 = self.f.param_of[b], self.per_layer[0][(j, q)]
    facts, first = self.f.params[i], self.f.params[i0]
    if facts.kind != first.kind:
      return (
        f"its parameter {facts.path} differs from {first.path} in shape, dtype, "
        f"persistence, frozen flag, tensor-parallel split or gradient flow"
      )
    if i == i0:
      return ""  # shared by every layer so far: a const
    block = range(self.start + layer * self.block, self.start + (layer + 1) * self.block)
    if not all(u in block for u in facts.uses):
      return (
        f"its parameter {facts.path} is also read outside this layer (by another layer, or shared)"
      )
    layer_params[(j, q)] = i
    return ""

  def close(self, length):
    """The Run of the first `length` joined blocks, or why they do not form a loop."""
    end = self.start + self.block * length
    stacked, sources = self._parameters(length)
    if isinstance(stacked, str):
      return stacked
    carry_pos, carry_in = {}, []
    for (j, q), (_, pos) in sorted(self.carries.items()):
      if pos not in carry_pos:
        carry_pos[pos] = len(carry_in)
        carry_in.append(self.template[j].inputs[q])
      elif carry_in[carry_pos[pos]] != self.template[j].inputs[q]:
        return "two carried values start from different values"
    for layer in range(length):
      why = self._check_readers(layer, length, carry_pos, end, carry_in)
      if why:
        return why
    xs, xs_pos = [], {}
    for j, q in sorted(self.literals[0]):
      values = [self.literals[layer][(j, q)] for layer in range(length)]
      if any(not np.array_equal(v, values[0]) for v in values):
        if any(np.ndim(v) for v in values):
          return f"a constant array differs between layers ({self.f.where(self.start + j)})"
        xs_pos[(j, q)] = len(xs)
        xs.append(np.stack(values))
    dynamic = self._dynamic_slices(length, xs, sources)
    consts, const_pos = [], {}
    for j, op in enumerate(self.template):
      for q, a in enumerate(op.inputs):
        src = sources[j][q]
        if (j, q) in xs_pos:
          sources[j][q] = ("xs", xs_pos[(j, q)])
        elif src[0] == "outside" and (j, q) in self.carries:
          sources[j][q] = ("carry", carry_pos[self.carries[(j, q)][1]])
        elif src[0] in ("outside", "shared"):
          if a not in const_pos:
            const_pos[a] = len(consts)
            consts.append(a)
          sources[j][q] = ("const", const_pos[a])
    if not any(not self.f.params[layers[0]].kind[2] for layers in stacked):
      return "no sharded parameter per layer (nothing to gather in a loop)"
    carry_out = tuple(sorted(carry_pos, key=carry_pos.get))
    last = self.start + self.block * (length - 1)
    outputs = tuple(self.f.ops[last + j].outputs[o] for j, o in carry_out)
    return Run(
      self.start,
      self.block,
      length,
      tuple(tuple(s) for s in sources),
      tuple(consts),
      tuple(carry_in),
      carry_out,
      outputs,
      tuple(stacked),
      tuple(xs),
      dynamic,
    )

  def _dynamic_slices(self, length, xs, sources) -> tuple[int, ...]:
    """Template slices whose offsets differ between layers: each gets one start source per
    dim appended (a per-layer one in `xs` where the offsets differ); -> their ops."""
    dynamic = []
    for j in sorted(self.starts[0]):
      offsets = np.array([self.starts[layer][j] for layer in range(length)], np.int32)
      if (offsets == offsets[0]).all():
        continue
      for d in range(offsets.shape[1]):
        if (offsets[:, d] == offsets[0, d]).all():
          sources[j].append(("lit", np.int32(offsets[0, d])))
        else:
          sources[j].append(("xs", len(xs)))
          xs.append(offsets[:, d])
      dynamic.append(j)
    return tuple(dynamic)

  def _parameters(self, length):
    """(stacked positions' per-layer parameter indices, sources with params resolved)."""
    sources = [list(s) for s in self.sources]
    stacked, position = [], {}
    for (j, q), i0 in sorted(self.per_layer[0].items()):
      layers = tuple(self.per_layer[layer].get((j, q), i0) for layer in range(length))
      if len(set(layers)) == 1:
        sources[j][q] = ("shared", i0)
        continue
      if len(set(layers)) != length:
        return "a parameter is shared by some layers but not all", sources
      first_block = range(self.start, self.start + self.block)
      if not all(u in first_block for u in self.f.params[i0].uses):
        return (
          f"its parameter {self.f.params[i0].path} is also read outside the first "
          f"layer (by another layer, or shared)"
        ), sources
      if layers not in position:
        if any(i in position_layers for position_layers in position for i in layers):
          return "a layer reads another layer's parameter", sources
        position[layers] = len(stacked)
        stacked.append(layers)
      sources[j][q] = ("layer", position[layers])
    return stacked, sources

  def _check_readers(self, layer, length, carry_pos, end, carry_in) -> str:
    """Values of block `layer` are read inside it, by the next block (carries), or, for
    the last block, after the run (carried out)."""
    base = self.start + layer * self.block
    for j, op in enumerate(self.f.ops[base : base + self.block]):
      for o, v in enumerate(op.outputs):
        for reader in self.f.readers.get(v, ()):
          if base <= reader < base + self.block:
            continue
          next_block = base + self.block <= reader < base + 2 * self.block
          if layer < length - 1 and next_block and (j, o) in carry_pos:
            continue
          if layer == length - 1 and reader >= end:
            if (j, o) not in carry_pos:  # carried out only
              carry_pos[(j, o)] = len(carry_in)
              carry_in.append(None)
            continue
          return (
            f"a value of layer {layer} ({self.f.where(base + j)}) is read by "
            f"{self.f.where(reader)}, outside the next layer"
          )
    return ""


def _numberless(path: str) -> str:
  return re.sub(r"\d+", "#", path)


def _literal_value(literal):
  return np.asarray(literal.val, dtype=literal.aval.dtype)


def _signatures(ops) -> list[int]:
  """Per op: an id equal for ops that are the same computation on same-shaped values
  (scalar constants may differ: they can become per-layer inputs)."""
  ids: dict = {}
  out = []
  for op in ops:
    params = op.eqn.params
    if _offset_free(op):  # a slice's offsets may differ per layer: its sizes must not
      params = {"sizes": _slice_sizes(params)}
    key = (
      op.primitive,
      _params_key(params),
      tuple(_input_key(a) for a in op.eqn.invars),
      tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in op.eqn.outvars),
    )
    out.append(ids.setdefault(key, len(ids)))
  return out


def _offset_free(op) -> bool:
  """A static slice without strides: one a dynamic slice can run at other offsets."""
  strides = op.eqn.params.get("strides") if op.primitive == "slice" else None
  return op.primitive == "slice" and (strides is None or all(t == 1 for t in strides))


def _slice_sizes(params) -> tuple[int, ...]:
  return tuple(b - a for a, b in zip(params["start_indices"], params["limit_indices"]))


def _slice_starts(op):
  return tuple(op.eqn.params["start_indices"]) if _offset_free(op) else None


def _input_key(atom):
  aval = atom.aval
  if isinstance(atom, jex.Literal):
    return ("literal", str(aval.dtype), np.ndim(atom.val))
  return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", aval)))


def _params_key(params) -> str:
  """Equation parameters as text; sub-jaxprs print structurally (plus a digest of the
  arrays they capture), functions by identity (so that two custom_vjp calls with distinct
  rules never look the same)."""
  return repr(sorted((k, str(v), _captured_digest(v)) for k, v in params.items()))


def _captured_digest(value) -> str:
  """A digest of the constants captured by a (closed) jaxpr parameter, nested ones too."""
  digest = hashlib.sha1()
  stack = [value]
  while stack:
    v = stack.pop()
    if isinstance(v, jex.ClosedJaxpr):
      for c in v.consts:
        array = np.asarray(c)
        digest.update(str((array.dtype, array.shape)).encode() + array.tobytes())
      v = v.jaxpr
    if isinstance(v, jex.Jaxpr):
      for eqn in v.eqns:
        stack.extend(x for x in eqn.params.values() if isinstance(x, (jex.Jaxpr, jex.ClosedJaxpr)))
    elif isinstance(v, (tuple, list)):
      stack.extend(v)
  return digest.hexdigest()
