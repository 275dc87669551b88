"""Loops over layers: which parameters a scan consumes one layer slice per iteration.

A parameter is *stacked* when it is sharded, all its uses are one top-level `scan` op, and it
enters that scan only as scanned-over input (xs) whose leading axis is the trip count,
directly or through a dtype cast. Each iteration then reads exactly one layer slice, so the
schedule can gather one layer at a time inside the loop instead of the whole stack before it
(`nn.scan(..., variable_axes={"params": 0})` and a hand-written `lax.scan` over stacked
weights both look like this). Anything else a loop reads (a weight shared by every
iteration, as in `fori_loop` applying one layer K times) is gathered once before the loop.
"""

from zjax._src.program import FlatProgram
from zjax._src.trace import param_views

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
    first_xs = op.eqn.params["num_consts"] + op.eqn.params["num_carry"]
    positions = [j for j, a in enumerate(op.inputs)
                 if isinstance(a, int) and p.index in views.get(a, ())]
    if positions and all(j >= first_xs and chains.get(op.inputs[j]) is not None
                         for j in positions):
      out[p.index] = op_index
  return out


def _view_ops(program, views, num_params) -> dict[int, tuple]:
  """View id -> its layout ops from the parameter, for views that keep the shape only."""
  chains = {program.input_ids[i]: () for i in range(num_params)}
  for op in program.ops:
    srcs = [a for a in op.inputs if isinstance(a, int)]
    if op.primitive in _SHAPE_KEEPING and len(srcs) == 1 and srcs[0] in chains:
      chains.update((o, chains[srcs[0]] + (op,)) for o in op.outputs if o in views)
  return chains


def loop_inputs(eqn) -> tuple[int, int]:
  """(number of consts, number of carries) of a scan equation; the rest are xs."""
  return eqn.params["num_consts"], eqn.params["num_carry"]
