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
  residual policy keeps matmul outputs only, segments.py; the vjp then reads the table).
Bytes are the all-reduce's operand on one device (the per-device batch of the data axes,
whole over the tensor axis). With sequence parallelism Megatron swaps each all-reduce for
an all-gather plus a reduce-scatter of the same bytes. Not counted: the scalar per-row
reductions of a vocabulary-parallel softmax, recomputation, and whatever else GSPMD
decides (it may reshard elsewhere too)."""

import numpy as np

from zjax._src import ir
from zjax._src.trace import LAYOUT_PRIMITIVES


def megatron_estimate(trace, entries, segments=(), recomputed_lookups=()
                      ) -> list[tuple[str, str, int]]:
  """[(kind, phase, bytes)] of the tensor axis's collectives in one step (per micro-batch),
  from the traced program and the schedule's parameter entries (their tensor dims); empty
  without tensor-parallel parameters. `segments` and `recomputed_lookups` (per segment, the
  parameters its vjp's gathers read; plan._with_backward_buckets) find recomputed lookups."""
  program = trace.program
  split = {program.input_ids[i]: e.tensor_dim for i, e in enumerate(entries)
           if e.tensor_dim is not None}
  if not split:
    return []
  origin = {program.input_ids[i]: i for i in range(len(entries))}  # view -> its parameter
  segment_of = {n: k for k, seg in enumerate(segments) for n in range(seg.start, seg.end)}
  # values that depend on trained parameters (a frozen one's have no gradient)
  differentiable = {program.input_ids[i] for i, e in enumerate(entries) if ir.has_gradient(e)}
  out, reduced_inputs = [], set()
  for n, op in enumerate(program.ops):
    values = [v if isinstance(v, int) else None for v in op.inputs]
    if differentiable.intersection(values):
      differentiable.update(op.outputs)
    if op.primitive in LAYOUT_PRIMITIVES and values and values[0] in origin:
      origin.update((o, origin[values[0]]) for o in op.outputs)
      if values[0] in split:
        dim = _view_dim(op, split[values[0]], program.avals[values[0]].shape)
        if dim is not None:
          split[op.outputs[0]] = dim
      continue
    if op.primitive == "gather" and values[0] in split and split[values[0]] == 0:
      out.append(("all_reduce", "forward", _bytes(program, op.outputs[0])))
      if n in segment_of and origin[values[0]] in recomputed_lookups[segment_of[n]]:
        out.append(("all_reduce", "backward", _bytes(program, op.outputs[0])))
    if op.primitive != "dot_general":
      continue
    for pos in (0, 1):
      if values[pos] not in split:
        continue
      if split[values[pos]] in op.eqn.params["dimension_numbers"][0][pos]:  # row-parallel
        out.append(("all_reduce", "forward", _bytes(program, op.outputs[0])))
        continue
      other = values[1 - pos]
      if other in differentiable and other not in origin and other not in reduced_inputs:
        reduced_inputs.add(other)  # column-parallel: the input's gradient, in backward
        out.append(("all_reduce", "backward", _bytes(program, other)))
  return out


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


def _bytes(program, value) -> int:
  aval = program.avals[value]
  return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
