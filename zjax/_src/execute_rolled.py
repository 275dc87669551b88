"""Running a rolled run of identical layers (roll.py) as a loop step.

The machinery is the scan loop's (execute_loop.py): one layer's gathers, compute and
reduce-scatters per iteration, backward recomputing each iteration from its saved carry.
What differs is where the loop's pieces come from: the body is the first layer's ops with
their inputs rewired (roll.Run.sources), and each per-layer parameter's layers are read from
its stack in the sharded layout (ParamEntry.stack), which the schedule must give in the
run's layer order.
"""

import jax.numpy as jnp

from zjax._src import offload
from zjax._src import segments as seg_lib
from zjax._src.errors import ScheduleMismatchError
from zjax._src.execute_loop import Loop


class RolledLoop(Loop):

  def __init__(self, dp, segment: int, run, forward_step, backward_step):
    self.dp, self.segment, self.run = dp, segment, run
    self.length, self.reverse = run.length, False
    self.num_consts, self.num_carry = len(run.consts), len(run.carry_in)
    self.first_xs = self.num_consts + self.num_carry
    self.read_steps(forward_step, backward_step)
    self.stacked_inputs, self.layer_slices = {}, {}
    self.template = dp.program.ops[run.start:run.start + run.block]
    for layers in run.stacked:
      stored = dp.s.storage[dp.storage_of[layers[0]]].members
      if stored != tuple(layers):
        paths = lambda ids: [dp.s.params[i].path for i in ids[:3]]
        raise ScheduleMismatchError(
            f"Segment {segment} rolls the layers {paths(layers)}..., but the schedule "
            f"stores {dp.s.params[layers[0]].path} in a stack of {paths(stored)}...: the "
            f"schedule does not match this program. Recompile the schedule.")
    gathered = {i for b in self.buckets for i in dp.members[b]}
    # stacked position -> layer-0 parameter (gathered per iteration), or -> xs position
    # (persistent per-layer parameters: stacked whole, sliced by the scan)
    self.gathered = {p: layers[0] for p, layers in enumerate(run.stacked)
                     if layers[0] in gathered}
    self.replicated = [p for p in range(len(run.stacked)) if p not in self.gathered]
    self.inputs = list(run.consts) + list(run.carry_in)
    self.outputs = list(run.outputs)

  def input_values(self, state) -> list:
    """consts, initial carries (zeros for one only carried out), per-layer scalars, then
    the stacked persistent per-layer parameters."""
    consts = [state.input_value(a) for a in self.run.consts]
    carry = [state.input_value(a) if a is not None else
             jnp.zeros(self.dp.program.avals[o].shape, self.dp.program.avals[o].dtype)
             for a, o in zip(self.run.carry_in, self.run.outputs)]
    xs = [jnp.asarray(v) for v in self.run.xs]
    xs += [offload.on_device(state.stack_of(i0)).astype(self.dp.compute_dtype(i0))
           for i0 in (self.run.stacked[p][0] for p in self.replicated)]
    return consts + carry + xs

  def stacked_shards(self, state) -> dict:
    """layer 0's index -> the stacked shard [L, c] as stored (see Loop.stacked_shards)."""
    return {i0: state.stack_of(i0) for b in self.buckets for i0 in self.dp.members[b]}

  def input_cotangents(self, ct_inputs) -> list:
    return [(a, ct) for a, ct in zip(self.inputs, ct_inputs[:self.first_xs])
            if a is not None and ct is not None]

  def stacked_param_cotangents(self, ct_inputs) -> list:
    first_stack = self.first_xs + len(self.run.xs)
    return [(self.run.stacked[p][0], ct) for p, ct in zip(self.replicated,
                                                          ct_inputs[first_stack:])
            if ct is not None]

  def body(self, layers: dict, inputs: list):
    """The first layer's ops on this iteration's values -> (carry out, no ys)."""
    consts = inputs[:self.num_consts]
    carry = inputs[self.num_consts:self.first_xs]
    xs = inputs[self.first_xs:]
    values = []
    for op, sources in zip(self.template, self.run.sources):
      args = [self._read(src, layers, consts, carry, xs, values) for src in sources]
      values.append(seg_lib.apply_op(op, args))
    return [values[j][o] for j, o in self.run.carry_out], []

  def _read(self, src, layers, consts, carry, xs, values):
    kind, where = src[0], src[1]
    if kind == "lit":
      return where
    if kind == "local":
      return values[where][src[2]]
    if kind == "const":
      return consts[where]
    if kind == "carry":
      return carry[where]
    if kind == "xs":
      return xs[where]
    if where in self.gathered:  # "layer": this layer's parameter
      return layers[self.gathered[where]]
    return xs[len(self.run.xs) + self.replicated.index(where)]
