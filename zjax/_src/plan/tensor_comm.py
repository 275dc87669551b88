"""A Megatron-style estimate of the collectives over the tensor axis. They are GSPMD's
(zjax leaves the tensor axis to it), so they are not in the schedule; this estimate puts
them into the communication model, labelled as such. Measured ones: `zjax.hlo.executed_by_axis`.

The rule is Megatron's (Shoeybi et al. 2019, "f" and "g"), applied to each matmul of the
traced program that reads a tensor-parallel parameter:
- row-parallel (the parameter's tensor dimension is contracted): the output is a partial
  sum on each device, all-reduced in forward;
- column-parallel (the tensor dimension stays in the output): the input's gradient is a
  partial sum, all-reduced in backward, once per distinct input (q, k and v of one input
  share it), if the input depends on the parameters (a batch has no gradient);
- an embedding lookup (gather) from a table split over its rows: the output is all-reduced
  in forward, and again in backward where the segment's vjp recomputes the lookup (zjax's
  residual policy keeps matmul outputs only, segments.py; the vjp then reads the table);
- a rolled layer's backward iteration recomputes its forward from the saved carry, as far
  as its vjp needs (JAX's dead-code elimination decides): a forward all-reduce of an op
  that the traced backward iteration executes again is counted again, in backward.
Bytes are the all-reduce's operand on one device (the per-device batch of the data axes,
whole over the tensor axis). With sequence parallelism Megatron swaps each all-reduce for
an all-gather plus a reduce-scatter of the same bytes. Not counted: the scalar per-row
reductions of a vocabulary-parallel softmax, and whatever else GSPMD decides (it may
reshard elsewhere too)."""

import collections

import jax.extend.core as jex
import numpy as np

from zjax._src.program import loop_parts, loops
from zjax._src.program.trace import LAYOUT_PRIMITIVES
from zjax._src.schedule import ir


def megatron_estimate(
  trace, entries, segments=(), recomputed_lookups=(), rolled=None
) -> list[tuple[str, str, int]]:
  """[(kind, phase, bytes)] of the tensor axis's collectives in one step (per micro-batch),
  from the traced program and the schedule's parameter entries (their tensor dims); empty
  without tensor-parallel parameters. `segments` and `recomputed_lookups` (per segment, the
  parameters its vjp's gathers read; plan._with_backward_buckets) find recomputed lookups;
  `rolled` (a rolled run's first op -> (roll.Run, the op signatures its backward iteration
  executes, loop_parts.backward_op_signatures)) the ops a rolled layer recomputes. A scan
  (nn.scan) counts its body's collectives once per iteration, with what its backward
  iteration recomputes."""
  program = trace.program
  # a scanned parameter's tensor dim counts from its layer's dims; the program's value is
  # the whole stack
  split = {
    program.input_ids[i]: e.tensor_dim + e.stacked
    for i, e in enumerate(entries)
    if e.tensor_dim is not None
  }
  if not split:
    return []
  origin = {program.input_ids[i]: i for i in range(len(entries))}  # view -> its parameter
  segment_of = {n: k for k, seg in enumerate(segments) for n in range(seg.start, seg.end)}
  rolled_ops, recomputed_at = _recomputed_in_rolled_layers(program, rolled or {})

  def again(n, node):
    if node.primitive == "gather" and n not in rolled_ops:
      return n in segment_of and origin[node.inputs[0]] in recomputed_lookups[segment_of[n]]
    return n in recomputed_at

  nodes = [
    _Node(op.primitive, op.eqn, [v if isinstance(v, int) else None for v in op.inputs], op.outputs)
    for op in program.ops
  ]
  # values that depend on trained parameters (a frozen one's have no gradient)
  differentiable = {program.input_ids[i] for i, e in enumerate(entries) if ir.has_gradient(e)}
  return _Walk(lambda v: program.avals[v], split, origin, differentiable, again).run(nodes)


_Node = collections.namedtuple("_Node", "primitive eqn inputs outputs")


class _Walk:
  """Megatron's rule over a list of ops (the program's, or a scan body's): values are
  program value ids or jaxpr variables; `split` maps a value to its dimension split over
  the tensor axis, `origin` a parameter's views to it; again(n, node) says whether op n's
  forward collective runs again in backward (recomputed)."""

  def __init__(self, aval_of, split, origin, differentiable, again):
    self.aval_of, self.split, self.origin = aval_of, split, origin
    self.differentiable, self.again = differentiable, again

  def run(self, nodes) -> list:
    out, reduced_inputs = [], set()
    for n, node in enumerate(nodes):
      values = node.inputs
      if self.differentiable.intersection(v for v in values if v is not None):
        self.differentiable.update(node.outputs)
      if node.primitive in LAYOUT_PRIMITIVES and values and values[0] in self.origin:
        self._view(node)
        continue
      if node.primitive == "scan":
        out += self._scan(node)
        continue
      forward = self._forward_reduction(node)
      if forward is not None:
        out.append(("all_reduce", "forward", forward))
        if self.again(n, node):
          out.append(("all_reduce", "backward", forward))
        continue
      if node.primitive != "dot_general":
        continue
      for pos in (0, 1):
        other = values[1 - pos]
        if (
          values[pos] in self.split
          and other in self.differentiable
          and other not in self.origin
          and other not in reduced_inputs
        ):
          reduced_inputs.add(other)  # column-parallel: the input's gradient, in backward
          out.append(("all_reduce", "backward", self._bytes(other)))
    return out

  def _view(self, node):
    source = node.inputs[0]
    self.origin.update((o, self.origin[source]) for o in node.outputs)
    if source in self.split:
      dim = _view_dim(node, self.split[source], self.aval_of(source).shape)
      if dim is not None:
        self.split[node.outputs[0]] = dim

  def _forward_reduction(self, node) -> int | None:
    """Bytes of the forward all-reduce of a lookup from a row-split table or of a
    row-parallel matmul (its split dimension contracted); None for any other op."""
    values = node.inputs
    if node.primitive == "gather" and values[0] in self.split and self.split[values[0]] == 0:
      return self._bytes(node.outputs[0])
    if node.primitive == "dot_general":
      contracted = node.eqn.params["dimension_numbers"][0]
      if any(
        values[pos] in self.split and self.split[values[pos]] in contracted[pos] for pos in (0, 1)
      ):
        return self._bytes(node.outputs[0])
    return None

  def _scan(self, node) -> list:
    """A scan's body, walked with the scan's split values mapped in (its xs lose their
    leading, scanned axis), once per iteration."""
    eqn = node.eqn
    body = eqn.params["jaxpr"].jaxpr
    first_xs = eqn.params["num_consts"] + eqn.params["num_carry"]
    split, origin, differentiable = {}, {}, set()
    for k, (outer, var) in enumerate(zip(node.inputs, body.invars)):
      if outer is None:
        continue
      if outer in self.split and self.split[outer] - (k >= first_xs) >= 0:
        split[var] = self.split[outer] - (k >= first_xs)
      if outer in self.origin:
        origin[var] = self.origin[outer]
      if outer in self.differentiable:
        differentiable.add(var)
    carries = range(eqn.params["num_consts"], first_xs)
    signatures = _scan_backward_signatures(
      eqn,
      [
        k in carries or (outer is not None and outer in self.differentiable)
        for k, outer in enumerate(node.inputs)
      ],
    )
    nodes = [
      _Node(
        e.primitive.name,
        e,
        [v if isinstance(v, jex.Var) else None for v in e.invars],
        list(e.outvars),
      )
      for e in body.eqns
    ]
    inner = _Walk(
      lambda v: v.aval,
      split,
      origin,
      differentiable,
      lambda n, node: loop_parts.op_signature(node.eqn) in signatures,
    )
    return [(kind, phase, size * eqn.params["length"]) for kind, phase, size in inner.run(nodes)]

  def _bytes(self, value) -> int:
    return ir.aval_bytes(self.aval_of(value))


def _scan_backward_signatures(eqn, differentiated) -> set:
  """The op signatures (loop_parts.op_signature) that one backward iteration of a scan
  executes: the loop's backward recomputes the iteration from its saved carry, as far as
  the body's vjp (in the float inputs `differentiated` marks, as execute_rolled.py takes
  it) needs it (JAX's dead-code elimination)."""
  floats = [
    ir.is_float(v.aval.dtype) and d
    for v, d in zip(eqn.params["jaxpr"].jaxpr.invars, differentiated)
  ]
  jaxpr, _ = loops.iteration_vjp(eqn, floats)
  return loop_parts.op_signatures(jaxpr)


def _recomputed_in_rolled_layers(program, rolled) -> tuple[set[int], set[int]]:
  """(the ops of rolled layers, those of them their layer's backward iteration executes
  again: same primitive, operand shapes and dimension numbers as an op it runs)."""
  ops, again = set(), set()
  for start, (run, signatures) in rolled.items():
    for n in range(start, start + run.block * run.length):
      ops.add(n)
      if loop_parts.op_signature(program.ops[n].eqn) in signatures:
        again.add(n)
  return ops, again


def _view_dim(op, dim, shape) -> int | None:
  """Where a layout op (trace.LAYOUT_PRIMITIVES: transpose, reshape, dtype and rank
  changes) puts the dimension `dim` of its operand of `shape`; None if it splits or
  merges that dimension with another."""
  name, params = op.primitive, op.eqn.params
  if name == "transpose":
    return tuple(params["permutation"]).index(dim)
  if name == "squeeze":
    dropped = params["dimensions"]
    return None if dim in dropped else dim - sum(d < dim for d in dropped)
  if name == "expand_dims":
    for d in sorted(params["dimensions"]):
      dim += d <= dim
    return dim
  if name == "reshape":
    return _reshaped_dim(shape, dim, params["new_sizes"])
  return dim  # convert_element_type, copy: the same shape


def _reshaped_dim(shape, dim, new_shape) -> int | None:
  """The dimension of `new_shape` that holds `dim` of `shape` (a heads split or merge): the
  first one of more than one element past the elements before `dim`."""
  before = int(np.prod(shape[:dim], dtype=np.int64))
  prefix = 1
  for k, n in enumerate(new_shape):
    if n > 1 and before < prefix * n:
      return k
    prefix *= n
  return None
