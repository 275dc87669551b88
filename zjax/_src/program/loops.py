"""Loops over layers: which parameters a scan consumes one layer slice per iteration.

A parameter is *stacked* when it is sharded, all its uses are one top-level `scan` op, its
leading axis is the trip count, and each iteration provably reads exactly the slice of its
own layer, either
  * as scanned-over input (xs), directly or through a dtype cast
    (`nn.scan(..., variable_axes={"params": 0})`, a hand-written `lax.scan` over weights), or
  * as a scan const read only by `W[i]` (a `dynamic_slice` of one row) where `i` is the
    iteration's layer: a counter carried from 0 in steps of 1 (`fori_loop(0, L, ...)`) or
    the xs of `jnp.arange(L)`; jnp's negative-index normalisation is seen through.
The schedule then gathers one layer at a time inside the loop instead of the whole stack
before it. Anything else a loop reads (a weight shared by every iteration, as in
`fori_loop` applying one layer K times) is gathered once before the loop.
"""

import dataclasses

import jax
import jax.extend.core as jex
import numpy as np
from jax import lax
from jax._src.interpreters import partial_eval as pe  # JAX's own DCE (as segments.py)

from zjax._src.program import loop_parts, roll
from zjax._src.program.program import FlatOp, FlatProgram, flatten_program, join_scope
from zjax._src.program.trace import param_views
from zjax._src.schedule import ir

# Views that keep the shape (and therefore the layer axis) of the parameter.
_SHAPE_KEEPING = frozenset({"convert_element_type", "copy", "copy_p"})


def stacked_params(program: FlatProgram, params, candidates: set[int]) -> dict[int, int]:
  """Parameter index -> the scan op (index) that consumes it one layer per iteration, for
  each of `candidates` (sharded parameter indices) that qualifies (module docstring)."""
  views = param_views(program, len(params))
  chains = _view_ops(program, views, len(params))
  out = {}
  for p in params:
    ops = {u.op for u in p.uses}
    if p.index not in candidates or len(ops) != 1 or p.size == 0:
      continue
    (op_index,) = ops
    op = program.ops[op_index]
    if op.primitive != "scan" or not p.shape or p.shape[0] != op.eqn.params["length"]:
      continue
    positions = input_positions(op, p.index, views)
    if positions and all(
      chains.get(op.inputs[j]) is not None and reads_one_layer(program, op, j) for j in positions
    ):
      out[p.index] = op_index
  return out


def input_positions(op, param: int, views) -> list[int]:
  """The positions of `op`'s inputs that are views of parameter `param` (trace.param_views)."""
  return [j for j, a in enumerate(op.inputs) if isinstance(a, int) and param in views.get(a, ())]


def reads_one_layer(program, op, position) -> bool:
  """Whether every iteration of scan `op` reads only its own layer of input `position`."""
  num_consts, num_carry = loop_inputs(op.eqn)
  if position >= num_consts + num_carry:
    return True  # xs: the scan itself slices it
  return position < num_consts and layer_slices(program, op, position) is not None


def layer_slices(program, op, position):
  """Indices (in the scan body) of the `dynamic_slice` equations that read const `position`
  one layer per iteration, or None if the const is read any other way."""
  eqn = op.eqn
  body = eqn.params["jaxpr"].jaxpr
  const = body.invars[position]
  if const in body.outvars:
    return None
  values = _iteration_values(program, op)
  slices = []
  for k, inner in enumerate(body.eqns):
    _propagate(inner, values)
    if const not in inner.invars:
      continue
    if not _is_layer_slice(inner, const, values):
      return None
    slices.append(k)
  return slices or None


_ITER = "iteration"  # the abstract value "this iteration's layer index"


def _iteration_values(program, op) -> dict:
  """Body variables known to equal this iteration's layer index."""
  eqn = op.eqn
  body = eqn.params["jaxpr"].jaxpr
  num_consts, num_carry = loop_inputs(eqn)
  values = {}
  producers = {v: e for e in body.eqns for v in e.outvars}
  for k in range(num_carry):  # a counter carried from 0 in steps of 1, forward
    inner, outer = body.invars[num_consts + k], eqn.invars[num_consts + k]
    step = producers.get(body.outvars[k])
    if (
      not eqn.params["reverse"]
      and isinstance(outer, jex.Literal)
      and outer.val == 0
      and step is not None
      and step.primitive.name == "add"
      and _is_counter_step(step.invars, inner)
    ):
      values[inner] = _ITER
  top = {o: p for p in program.ops for o in p.outputs}
  for k, inner in enumerate(body.invars[num_consts + num_carry :]):  # xs = arange(L)
    source = op.inputs[num_consts + num_carry + k]
    producer = top.get(source) if isinstance(source, int) else None
    if (
      producer is not None
      and producer.primitive == "iota"
      and producer.eqn.params["dimension"] == 0
      and tuple(producer.eqn.params["shape"]) == (eqn.params["length"],)
    ):
      values[inner] = _ITER
  return values


def _is_counter_step(invars, counter) -> bool:
  literals = [v for v in invars if isinstance(v, jex.Literal)]
  return counter in invars and len(literals) == 1 and literals[0].val == 1


def _value(atom, values):
  if isinstance(atom, jex.Literal):
    return ("const", np.asarray(atom.val).item()) if np.ndim(atom.val) == 0 else None
  return values.get(atom)


def _propagate(eqn, values):
  """Abstract interpretation of scalar index arithmetic (what jnp indexing emits)."""
  name, ins = eqn.primitive.name, [_value(v, values) for v in eqn.invars]
  out = None
  if (
    name == "convert_element_type"
    and ins[0] is not None
    and np.issubdtype(np.dtype(eqn.params["new_dtype"]), np.integer)
  ):
    out = ins[0]
  elif name == "lt" and ins[0] == _ITER and ins[1] == ("const", 0):
    out = ("const", False)  # a layer index is never negative
  elif name in ("lt", "add") and all(isinstance(v, tuple) for v in ins):
    a, b = ins[0][1], ins[1][1]
    out = ("const", a < b if name == "lt" else a + b)
  elif name == "select_n" and isinstance(ins[0], tuple):
    out = ins[1 + int(ins[0][1])]
  if out is not None:
    values[eqn.outvars[0]] = out


def _is_layer_slice(eqn, const, values) -> bool:
  if eqn.primitive.name != "dynamic_slice" or eqn.invars[0] is not const or const in eqn.invars[1:]:
    return False
  starts = [_value(v, values) for v in eqn.invars[1:]]
  shape = tuple(const.aval.shape)
  return (
    tuple(eqn.params["slice_sizes"]) == (1,) + shape[1:]
    and starts[0] == _ITER
    and all(s == ("const", 0) for s in starts[1:])
  )


def _view_ops(program, views, num_params) -> dict[int, tuple]:
  """View id -> its layout ops from the parameter, for views that keep the shape only."""
  chains = {program.input_ids[i]: () for i in range(num_params)}
  for op in program.ops:
    srcs = [a for a in op.inputs if isinstance(a, int)]
    if op.primitive in _SHAPE_KEEPING and len(srcs) == 1 and srcs[0] in chains:
      chains.update((o, chains[srcs[0]] + (op,)) for o in op.outputs if o in views)
  return chains


def scan_run(program: FlatProgram, op_index: int, stacked, num_params: int):
  """The scan op at `op_index`, whose stacked parameters are `stacked` (indices), as a
  roll.Run over its flattened body, so that its layer can be walked (loop_parts.py: whole
  or cut into parts) as a rolled layer is. Each stacked xs input becomes a ("layer", p)
  source, and each W[i] of a stacked const a reshape of that layer; a cast of the stack
  before the scan becomes per-layer casts at the head of the body (weight views all, as a
  rolled layer's are); a constant or a weight that an iteration outputs as it is, an op
  of its own. The direction is the executor's (a reverse scan visits the last layer first)."""
  op = program.ops[op_index]
  eqn = op.eqn
  num_consts, num_carry = loop_inputs(eqn)
  first_xs = num_consts + num_carry
  views = param_views(program, num_params)
  chains = _view_ops(program, views, num_params)
  head, head_sources, layer_of, rows = [], [], {}, []
  slice_of = {}  # a W[i] of a stacked const (its equation) -> the layer's source
  for i in sorted(stacked):
    for j in input_positions(op, i, views):
      source = ("layer", len(rows))
      for view in chains[op.inputs[j]]:  # the stack's casts, one layer at a time
        head.append(_per_layer(view, program.avals))
        head_sources.append((source,))
        source = ("local", len(head) - 1, 0)
      rows.append((i,))
      if j >= first_xs:
        layer_of[j] = source
        continue
      for k in layer_slices(program, op, j) or ():  # (a const: read only as W[i])
        slice_of[id(eqn.params["jaxpr"].jaxpr.eqns[k])] = source
  body = flatten_program(eqn.params["jaxpr"])
  made = {
    o: (len(head) + j, k) for j, bop in enumerate(body.ops) for k, o in enumerate(bop.outputs)
  }
  body_consts = dict(zip(body.const_ids, body.consts))
  role = {}
  for k, vid in enumerate(body.input_ids):
    a = op.inputs[k]
    if k < num_consts:
      role[vid] = ("lit", a.val) if isinstance(a, jex.Literal) else ("const", k)
    elif k < first_xs:
      role[vid] = ("carry", k - num_consts)
    else:
      role[vid] = layer_of.get(k, ("xs", k - first_xs))

  def source(a):
    if isinstance(a, jex.Literal):
      return ("lit", a.val)
    if a in body_consts:
      return ("lit", body_consts[a])
    return ("local", *made[a]) if a in made else role[a]

  ops, op_sources = list(head), list(head_sources)
  for b in body.ops:
    if id(b.eqn) in slice_of:  # W[i]: the gathered layer, its sliced axis kept (a view)
      ops.append(_expanded_layer(b))
      op_sources.append((slice_of[id(b.eqn)],))
    else:
      ops.append(b)
      op_sources.append(tuple(source(a) for a in b.inputs))
  ops = [dataclasses.replace(b, module=join_scope(op.module, b.module)) for b in ops]
  weight_views = loop_parts.weight_views(ops, op_sources, range(len(rows)))
  outs = []
  for a in body.output_ids:
    key = ("lit", a.val) if isinstance(a, jex.Literal) else source(a)
    if key[0] not in ("local", "const", "carry", "xs") or key[1:] in weight_views:
      # a constant or a stacked weight (or a view of one) output as it is: an op of the
      # body makes it (a view is applied where a part reads it, never kept)
      aval = a.aval if isinstance(a, jex.Literal) else body.avals[a]
      copy, one = _identity(aval, op.module)
      ops.append(copy)
      op_sources.append((key, ("lit", one)))
      key = ("local", len(ops) - 1, 0)
    outs.append(key)
  return roll.Run(
    start=op_index,
    block=len(ops),
    length=eqn.params["length"],
    sources=tuple(op_sources),
    consts=tuple(None if isinstance(a, jex.Literal) else a for a in op.inputs[:num_consts]),
    carry_in=tuple(op.inputs[num_consts:first_xs]),
    carry_out=(),
    outputs=tuple(op.outputs[:num_carry]),
    stacked=tuple(rows),
    xs=tuple(None if k in layer_of else op.inputs[k] for k in range(first_xs, len(op.inputs))),
    body=dataclasses.replace(body, ops=tuple(ops)),
    out_keys=tuple(outs),
  )


def _identity(aval, module):
  """(an op x -> x * 1 (bool: x & True), the ones it reads): what an iteration outputs
  made by an op of its own."""
  spec = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
  (eqn,) = jax.make_jaxpr(lax.bitwise_and if aval.dtype == bool else lax.mul)(spec, spec).eqns
  return FlatOp(eqn, (None, None), (None,), module), np.ones(aval.shape, aval.dtype)


def _expanded_layer(op):
  """A W[i] (`op`: a dynamic_slice of one row, [1, ...]) as a reshape of the gathered layer
  [...] (a layout view of the weight, as the parts walker needs)."""
  out = op.eqn.outvars[0].aval
  layer = jax.ShapeDtypeStruct(out.shape[1:], out.dtype)
  (reshape,) = jax.make_jaxpr(lambda w: lax.reshape(w, out.shape))(layer).eqns
  return dataclasses.replace(op, eqn=reshape, inputs=(None,))


def _per_layer(view, avals):
  """A shape-keeping view op of a whole stack [L, ...], as applied to one layer [...]."""
  layer = lambda v: jax.core.ShapedArray(avals[v].shape[1:], avals[v].dtype)  # noqa: E731
  eqn = view.eqn.replace(
    invars=[jex.Var(layer(view.inputs[0]))], outvars=[jex.Var(layer(view.outputs[0]))]
  )
  return dataclasses.replace(view, eqn=eqn)


def loop_inputs(eqn) -> tuple[int, int]:
  """(number of consts, number of carries) of a scan equation; the rest are xs."""
  return eqn.params["num_consts"], eqn.params["num_carry"]


def iteration_vjp(eqn, differentiated) -> tuple:
  """One backward iteration of scan `eqn`: the vjp of its body in the inputs
  `differentiated` marks, given cotangents of its floating-point outputs, traced on abstract
  values with JAX's dead-code elimination applied -> (the pruned jaxpr, whether it reads
  each of its inputs: the body's inputs, then the cotangents)."""
  body = eqn.params["jaxpr"]
  outs = [ir.is_float(v.aval.dtype) for v in body.jaxpr.outvars]

  def backward(inputs, cts):
    def f(*diffed):
      it = iter(diffed)
      values = [next(it) if d else x for x, d in zip(inputs, differentiated)]
      return [o for o, keep in zip(jex.jaxpr_as_fun(body)(*values), outs) if keep]

    _, vjp_fn = jax.vjp(f, *[x for x, d in zip(inputs, differentiated) if d])
    return vjp_fn(cts)

  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  closed = jax.make_jaxpr(backward)(
    [spec(v.aval) for v in body.jaxpr.invars],
    [spec(v.aval) for v, keep in zip(body.jaxpr.outvars, outs) if keep],
  )
  return pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
