"""Per-device memory of a training step predicted from its traced program, not compiled:
the activation model `zjax.autoconfig` plans with.

zjax runs each device's work as one shard_map body. This walks that body's jaxpr in program
order and keeps the peak of the bytes alive, with the few rules that make a jaxpr's values
look like the buffers XLA allocates for them:

- **Live ranges.** A value lives from its equation to its last use. A nested program (a
  loop body, a rematerialized backward, a custom derivative) adds its own peak beyond its
  inputs and results (which its caller counts) while its equation runs; a loop's new carry
  is the body's own (its caller holds one buffer per carry, and XLA copies a carry whose
  new value is made while the old one is still read). Calls (`jit`) are inlined first
  (`inlined`), as XLA does.
- **Fusion.** An element-wise result read by exactly one element-wise op or reduction is
  computed inside its reader and never stored.
- **Aliases.** An optimization barrier's and a checkpoint name's results are their inputs'
  buffers, not copies.
- **Reuse.** The result of an op that can work in place (element-wise, an update of a
  slice, a loop, a collective) takes the buffer of an input of its size that dies there.
- **Outputs hold temporaries first.** XLA places temporary values in output buffers that
  are not yet written (the gradient buffers hold the forward's activations), so the step's
  temp is what its peak needs beyond the outputs.
- **Transposed operands.** A matmul whose operand is not in [batch, free, contracting]
  order (the right operand: [batch, contracting, free]) reads a transposed copy of it.

Measured against the analysis compile (docs/results.md, "An activation model";
`python examples/activation_liveness.py`): arguments exact, outputs but for the compiled
result table (8 bytes a result), the gradient step's footprint 0.64-1.36x on the suite's
models and two GPTs; the trainer's whole step (zjax.autoconfig's memory model,
autoconfig/step_cost.py) 0.71-1.43x (docs/autoconfig.md). Not modeled: XLA's own order,
its collective buffers, the gathered weights it keeps longer than program order does.
"""

import collections
import dataclasses

import jax
import jax.extend.core as jex
import numpy as np

from zjax._src.program.trace import sub_jaxprs
from zjax._src.schedule import ir

# Ops XLA fuses into their reader (and that fuse their own producers).
ELEMENTWISE = frozenset(
  """abs add and atan2 broadcast_in_dim ceil clamp convert_element_type copy copy_p cos div
  eq erf erf_inv exp exp2 expand_dims expm1 floor ge gt integer_pow iota is_finite le log
  log1p logistic lt max min mul ne neg nextafter not or pow reduce_precision rem reshape
  round rsqrt select_n sign sin sqrt square squeeze stop_gradient sub tanh""".split()
)
REDUCTIONS = frozenset("argmax argmin reduce_max reduce_min reduce_prod reduce_sum".split())
FUSING_READERS = ELEMENTWISE | REDUCTIONS | {"transpose"}
ALIASES = frozenset({"optimization_barrier", "name"})
IN_PLACE = ELEMENTWISE | frozenset(
  "dynamic_update_slice scatter scatter-add scatter_add while scan psum all_to_all".split()
)


@dataclasses.dataclass(frozen=True)
class Footprint:
  """Predicted bytes on one device while the step runs: `arguments` (its shards and
  batch), `outputs` (its results, the gradient shards), `temp` (everything else at the
  peak). `total` is what must fit in the device's memory, as XLA's
  arguments + outputs + temp - aliased with nothing donated."""

  arguments: int
  outputs: int
  temp: int

  @property
  def total(self) -> int:
    return self.arguments + self.outputs + self.temp


def step_footprint(step, *args) -> Footprint:
  """The per-device footprint of `step(*args)` (a `zjax.value_and_grad` step, or any
  function whose work is one shard_map), from its trace alone. `args` may be
  ShapeDtypeStructs with shardings; nothing is compiled or allocated."""
  return body_footprint(device_program(jax.make_jaxpr(step)(*args).jaxpr))


def body_footprint(body) -> Footprint:
  """The footprint of a device program (the shard_map body `device_program` finds)."""
  body = inlined(body)
  arguments = set(body.invars)
  outputs = [v for v in dict.fromkeys(_vars(body.outvars)) if v not in arguments]
  output_bytes = sum(device_bytes(v.aval) for v in outputs)
  peak = peak_bytes(body, frozenset(arguments))
  return Footprint(
    arguments=sum(device_bytes(v.aval) for v in body.invars),
    outputs=output_bytes,
    temp=max(peak - output_bytes, 0),
  )


def device_program(jaxpr) -> jex.Jaxpr:
  """The one shard_map body of a traced step."""
  found = []

  def visit(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "shard_map":
        found.append(getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"]))
        continue
      for _, sub, _ in sub_jaxprs(eqn):
        visit(getattr(sub, "jaxpr", sub))

  visit(jaxpr)
  if len(found) != 1:
    raise ValueError(
      f"The step holds {len(found)} shard_map programs; step_footprint predicts a step "
      f"that runs as one (zjax.value_and_grad's)."
    )
  return found[0]


def peak_bytes(jaxpr, excluded=frozenset()) -> int:
  """Peak bytes alive while `jaxpr` runs in program order (`excluded`: values that are
  not counted, e.g. the step's arguments). The rules: the module docstring."""
  root = _alias_roots(jaxpr)
  size = _sizes(jaxpr, excluded)
  last = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for v in _vars(eqn.invars):
      last[root.get(v, v)] = k
  for v in _vars(jaxpr.outvars):
    last[root.get(v, v)] = len(jaxpr.eqns)
  live = {v: size(v) for v in (*jaxpr.invars, *jaxpr.constvars) if v in last}
  total = peak = sum(live.values())
  for k, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name in ALIASES:
      continue
    inputs = dict.fromkeys(root.get(v, v) for v in _vars(eqn.invars))
    reusable = eqn.primitive.name in IN_PLACE
    dying = [live[v] for v in inputs if reusable and last.get(v) == k and v in live]
    new = 0
    for v in _vars(eqn.outvars):
      b = size(v)
      if b and b in dying:
        dying.remove(b)
      else:
        new += b
    peak = max(peak, total + _transient(eqn) + new)
    for v in inputs:
      if last.get(v) == k and v in live:
        total -= live.pop(v)
    for v in _vars(eqn.outvars):
      if last.get(v, -1) > k:
        live[v] = size(v)
        total += live[v]
  return peak


INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})


def inlined(jaxpr) -> jex.Jaxpr:
  """`jaxpr` with its calls (`jit` inside jit, e.g. optax's helpers) replaced by their
  equations, with fresh values per call, as XLA inlines them: fusion and buffer reuse then
  apply across a call's boundary, and its values live as long as they are read, not as
  long as the call."""
  eqns = []

  def walk(j, env):
    for eqn in j.eqns:
      invars = [env.get(v, v) if isinstance(v, jex.Var) else v for v in eqn.invars]
      sub = eqn.params.get("jaxpr") if eqn.primitive.name in INLINED else None
      if sub is None or not hasattr(sub, "consts") or sub.consts:
        outvars = [jex.Var(v.aval) if isinstance(v, jex.Var) else v for v in eqn.outvars]
        env.update(zip(eqn.outvars, outvars))
        eqns.append(eqn.replace(invars=invars, outvars=outvars))
        continue
      inner = dict(zip(sub.jaxpr.invars, invars))
      walk(sub.jaxpr, inner)
      for outer, result in zip(eqn.outvars, sub.jaxpr.outvars):
        env[outer] = inner.get(result, result) if isinstance(result, jex.Var) else result

  env = {}
  walk(jaxpr, env)
  outvars = [env.get(v, v) if isinstance(v, jex.Var) else v for v in jaxpr.outvars]
  return jaxpr.replace(eqns=eqns, outvars=outvars)


def _transient(eqn) -> int:
  """Bytes an equation needs only while it runs: a nested program's own peak beyond its
  inputs, or a matmul's transposed operand copies."""
  nested = 0
  for _, sub, _ in sub_jaxprs(eqn):
    sub = getattr(sub, "jaxpr", sub)
    ends = dict.fromkeys([*sub.invars, *_vars(sub.outvars[_carries(eqn) :])])  # the caller's
    nested = max(nested, peak_bytes(sub) - sum(device_bytes(v.aval) for v in ends))
  return max(nested, _transposed_operand_bytes(eqn))


def _carries(eqn) -> int:
  """How many of a loop body's results are its carry. The caller holds one buffer per
  carry; while the body runs, a new carry made while the old one is still read needs a
  second (XLA copies it), so those results stay the body's own."""
  if eqn.primitive.name == "scan":
    return eqn.params["num_carry"]
  if eqn.primitive.name == "while":
    return len(eqn.outvars)
  return 0


def _transposed_operand_bytes(eqn) -> int:
  if eqn.primitive.name != "dot_general":
    return 0
  (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
  copies = 0
  for v, contracting, batch, is_lhs in (
    (eqn.invars[0], lhs_c, lhs_b, True),
    (eqn.invars[1], rhs_c, rhs_b, False),
  ):
    shape = v.aval.shape
    free = [d for d in range(len(shape)) if d not in contracting and d not in batch]
    order = [*batch, *(free + list(contracting) if is_lhs else list(contracting) + free)]
    moved = [d for d in order if shape[d] != 1]  # unit dims move for free
    if moved != [d for d in range(len(shape)) if shape[d] != 1]:
      copies += device_bytes(v.aval)
  return copies


def _alias_roots(jaxpr) -> dict:
  """Each alias result -> the value whose buffer it is."""
  root = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ALIASES:
      for i, o in zip(eqn.invars, eqn.outvars):
        if isinstance(i, jex.Var):
          root[o] = root.get(i, i)
  return root


def _sizes(jaxpr, excluded):
  """Bytes of each value's buffer: 0 for an excluded or fused one."""
  readers = collections.defaultdict(list)
  for eqn in jaxpr.eqns:
    for v in _vars(eqn.invars):
      readers[v].append(eqn.primitive.name)
  results = set(_vars(jaxpr.outvars))
  fused = {
    v
    for eqn in jaxpr.eqns
    if eqn.primitive.name in ELEMENTWISE
    for v in _vars(eqn.outvars)
    if v not in results and len(readers[v]) == 1 and readers[v][0] in FUSING_READERS
  }
  return lambda v: 0 if v in fused or v in excluded else device_bytes(v.aval)


def device_bytes(aval) -> int:
  """Bytes of one device's part of a value: its whole size inside a shard_map body, its
  shard where its type carries an explicit sharding (outside one, on an Explicit mesh)."""
  sharding = getattr(aval, "sharding", None)
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if not spec or mesh is None or not getattr(aval, "shape", ()):
    return ir.aval_bytes(aval)
  sizes = dict(mesh.shape)
  shape = list(aval.shape)
  for d, entry in enumerate(tuple(spec)[: len(shape)]):
    for axis in (entry,) if isinstance(entry, str) else (entry or ()):
      shape[d] = -(-shape[d] // sizes.get(axis, 1))
  itemsize = getattr(getattr(aval, "dtype", None), "itemsize", 0)
  return int(np.prod(shape, dtype=np.int64)) * itemsize


def _vars(atoms) -> list:
  return [v for v in atoms if isinstance(v, jex.Var)]
