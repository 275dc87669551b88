"""Running a rolled run of identical layers (roll.py) as a loop step, and any loop whose
layer is cut into parts.

The machinery is the scan loop's (execute_loop.py): one layer's gathers, compute and
reduce-scatters per iteration, backward recomputing each iteration from its saved carry.
What differs is where the loop's pieces come from: the body is the first layer's ops with
their inputs rewired (roll.Run.sources), and each per-layer parameter's layers are read from
its stack in the sharded layout (ParamEntry.stack), which the schedule must give in the
run's layer order.

A loop whose body the schedule cuts into parts walks the body's steps (loop_parts.py): a
rolled run's, or a scan's (`PartedScan`: its body as a run, loops.scan_run; its inputs,
outputs and stacked shards are the scan op's, as for a whole-layer scan).
"""

import jax.numpy as jnp
from jax import lax

from zjax._src.errors import ScheduleMismatchError
from zjax._src.execute.execute_loop import Loop, _is_float, _read, _write
from zjax._src.program import loop_parts, loops, roll
from zjax._src.program import segments as seg_lib
from zjax._src.train import offload


class RolledLoop(Loop):
  def __init__(self, dp, segment: int, run, forward_step, backward_step):
    self.dp, self.segment, self.run = dp, segment, run
    self.length, self.reverse = run.length, False
    self.num_consts, self.num_carry = len(run.consts), len(run.carry_in)
    self.first_xs = self.num_consts + self.num_carry
    self.read_steps(forward_step, backward_step)
    self.stacked_inputs, self.layer_slices = {}, {}
    self.template = roll.template_ops(dp.program, run)
    for layers in run.stacked:
      stored = dp.s.storage[dp.storage_of[layers[0]]].members
      if stored != tuple(layers):
        paths = lambda ids: [dp.s.params[i].path for i in ids[:3]]
        raise ScheduleMismatchError(
          f"Segment {segment} rolls the layers {paths(layers)}..., but the schedule "
          f"stores {dp.s.params[layers[0]].path} in a stack of {paths(stored)}...: the "
          f"schedule does not match this program. Recompile the schedule."
        )
    gathered = {i for b in self.buckets for i in dp.members[b]}
    # stacked position -> layer-0 parameter (gathered per iteration), or -> xs position
    # (persistent per-layer parameters: stacked whole, sliced by the scan)
    self.gathered = {p: layers[0] for p, layers in enumerate(run.stacked) if layers[0] in gathered}
    self.replicated = [p for p in range(len(run.stacked)) if p not in self.gathered]
    self.inputs = list(run.consts) + list(run.carry_in)
    self.outputs = list(run.outputs)
    self.parts = forward_step.parts and self._parts(forward_step, backward_step)
    if not self.parts and set(self.regathered) != set(self.buckets):
      self._check_unread(backward_step)

  def read_steps(self, forward_step, backward_step):
    super().read_steps(forward_step, backward_step)
    if forward_step.parts:  # gathers inside the iteration, none ahead of it
      self.buckets = sorted({st.bucket for st in forward_step.body if st.op == "gather"})
      self.prefetch = {"forward": False, "backward": False}
      self.bodies = {"forward": forward_step.body, "backward": backward_step.body}

  def _runner(self) -> loop_parts.PartRunner:
    members = {b: self.dp.members[b] for b in self.buckets}
    bucket_of = {i: b for b, ids in members.items() for i in ids}
    return loop_parts.part_runner(self.dp.program, self.run, members, self.dp.s.params, bucket_of)

  def _check_unread(self, backward_step):
    """A whole-layer backward body that leaves buckets out: only ones whose values the
    iteration's backward does not use (else the recompute would read zeros)."""
    runner = self._runner()
    _, missing = loop_parts.unused_gathers(
      runner, loop_parts.whole_layer_backward(runner, self.regathered)
    )
    if missing:
      path = self.dp.s.params[runner.gathered[sorted(missing)[0][2]]].path
      raise ScheduleMismatchError(
        f"Segment {self.segment}'s backward loop body does not re-gather {path}, but the "
        f"backward iteration reads it. Add its bucket's gather (or recompile the schedule)."
      )

  def _parts(self, forward_step, backward_step) -> loop_parts.PartRunner:
    """The layer's parts as the schedule cuts them; refused if this program cuts them
    otherwise, or if the backward body lacks a gather whose values it uses."""
    dp, run = self.dp, self.run
    runner = self._runner()
    found = [(run.op_offset + p.start, run.op_offset + p.end) for p in runner.parts]
    stored = [(p.start, p.end) for p in forward_step.parts]
    if found != stored:
      raise ScheduleMismatchError(
        f"Segment {self.segment}'s loop cuts its layer into parts at ops {stored}, but this "
        f"program's layer cuts at {found}. Recompile the schedule."
      )
    _, missing = loop_parts.unused_gathers(runner, backward_step.body)
    if missing:
      op, part, q = sorted(missing)[0]
      raise ScheduleMismatchError(
        f"Segment {self.segment}'s backward loop body: {op} of part {part} reads "
        f"{dp.s.params[runner.gathered[q]].path}, which is not gathered there. Gather its "
        f"bucket before that step (or recompile the schedule)."
      )
    return runner

  def input_values(self, state) -> list:
    """consts, initial carries (zeros for one only carried out), per-layer scalars, then
    the stacked persistent per-layer parameters."""
    consts = [state.input_value(a) for a in self.run.consts]
    carry = [
      state.input_value(a)
      if a is not None
      else jnp.zeros(self.dp.program.avals[o].shape, self.dp.program.avals[o].dtype)
      for a, o in zip(self.run.carry_in, self.run.outputs)
    ]
    xs = [jnp.asarray(v) for v in self.run.xs]
    xs += [
      offload.on_device(state.stack_of(i0)).astype(self.dp.compute_dtype(i0))
      for i0 in (self.run.stacked[p][0] for p in self.replicated)
    ]
    return consts + carry + xs

  def stacked_shards(self, state) -> dict:
    """layer 0's index -> the stacked shard [L, c] as stored (see Loop.stacked_shards)."""
    return {i0: state.stack_of(i0) for b in self.buckets for i0 in self.dp.members[b]}

  def input_cotangents(self, ct_inputs) -> list:
    return [
      (a, ct)
      for a, ct in zip(self.inputs, ct_inputs[: self.first_xs])
      if a is not None and ct is not None
    ]

  def stacked_param_cotangents(self, ct_inputs) -> list:
    first_stack = self.first_xs + len(self.run.xs)
    return [
      (self.run.stacked[p][0], ct)
      for p, ct in zip(self.replicated, ct_inputs[first_stack:])
      if ct is not None
    ]

  # ---- a layer cut into parts (loop_parts.py) ------------------------------------------
  def forward(self, shards: dict, inputs: list, anchor):
    if not self.parts:
      return super().forward(shards, inputs, anchor)
    consts, carry, xs = self._split(inputs)
    saved = [jnp.zeros((self.length,) + jnp.shape(c), jnp.result_type(c)) for c in carry]
    ys = [  # a scan's stacked outputs (a rolled run has none)
      jnp.zeros(self.dp.program.avals[o].shape, self.dp.program.avals[o].dtype)
      for o in self.outputs[self.num_carry :]
    ]
    stacks = self.secondary_stacks(shards)  # hpZ: every layer's secondary shards

    def step(state, i):
      carry, saved, ys, stacks = state
      layer = self.layer(i)  # (a reverse scan visits the last layer first)
      ctx, kept = self._context(consts, carry, _read(xs, layer)), {}
      loop_parts.walk_forward(
        self.parts,
        self.bodies["forward"],
        ctx,
        self._gatherer(_read(shards, layer), "forward", kept),
        carry if carry else anchor,
      )
      outs = [ctx[key] for key in self.parts.out_keys]
      new_carry, y = outs[: self.num_carry], outs[self.num_carry :]
      saved, ys = _write(saved, i, carry), _write(ys, layer, y)
      return (new_carry, saved, ys, _write(stacks, layer, kept)), None

    (carry, saved, ys, stacks), _ = lax.scan(
      step, (carry, saved, ys, stacks), jnp.arange(self.length)
    )
    return carry + ys, (consts, saved, xs, stacks)

  def backward(self, shards: dict, residuals, ct_outs: list, anchor):
    if not self.parts:
      return super().backward(shards, residuals, ct_outs, anchor)
    consts, saved, xs, stacks = residuals
    keys = self.parts.out_keys  # the carries', then a scan's ys
    ct_ys = ct_outs[self.num_carry :]
    ct_consts = [jnp.zeros_like(c) if _is_float(c) else None for c in consts]
    ct_xs = [jnp.zeros_like(x) if _is_float(x) else None for x in xs]
    grads = {i: jnp.zeros(shards[i].shape, self.dp.reduce_dtype(i)) for i in self.trained}

    def step(state, i):
      ct_carry, ct_consts, ct_xs, grads = state
      layer = self.layer(i)
      carry, x = _read(saved, i), _read(xs, layer)
      ctx = self._context(consts, carry, x)
      cts = {}
      for k, c in zip(keys, list(ct_carry) + _read(ct_ys, layer)):
        if c is not None:  # (a value both carried and stacked out gets both)
          cts[k] = c if k not in cts else cts[k] + c
      gather = self._gatherer(_read(shards, layer), "backward", _read(stacks, layer))
      chunks = {}

      def scatter(b, layer_grads):
        chunks.update(self.scatter_layer(layer_grads, buckets=[b]))

      cts = loop_parts.walk_backward(
        self.parts,
        self.bodies["backward"],
        ctx,
        cts,
        gather,
        scatter,
        next(iter(cts.values()), anchor),
      )
      ct_carry = [_ct(cts, ("carry", k), c) if _is_float(c) else None for k, c in enumerate(carry)]
      ct_consts = [
        a if a is None else a + _ct(cts, ("const", k), a) for k, a in enumerate(ct_consts)
      ]
      ct_x = [None if a is None else _ct(cts, ("xs", k), a[0]) for k, a in enumerate(ct_xs)]
      ct_xs = [
        a if a is None else lax.dynamic_update_index_in_dim(a, c.astype(a.dtype), layer, 0)
        for a, c in zip(ct_xs, ct_x)
      ]
      return (ct_carry, ct_consts, ct_xs, _write(grads, layer, chunks)), None

    ct_carry = [c if _is_float(c) else None for c in ct_outs[: self.num_carry]]
    state = (ct_carry, ct_consts, ct_xs, grads)
    (ct_carry, ct_consts, ct_xs, grads), _ = lax.scan(
      step, state, jnp.arange(self.length), reverse=True
    )
    return list(ct_consts) + list(ct_carry) + list(ct_xs), grads

  def _gatherer(self, rows: dict, phase: str, secondaries: dict):
    """gather(bucket, tie) -> the layer's values of the bucket, for one iteration of a
    layer cut into parts. Each gather of a bucket reads the bucket's rows through the
    barrier of that bucket's previous gather, so two gathers of one bucket in one iteration
    (released between, as max_reuse_distance=0 plans) read different values: XLA cannot
    merge them, even where its algebraic simplifier drops a tie that nothing else reads (a
    recomputed output that the backward does not use) and the two barriers become alike.
    hpZ (`secondaries`: bucket -> this layer's secondary shard): a forward gather of a
    bucket the body keeps adds its secondary (the first in the iteration); a backward
    gather reads the secondary instead of the rows, chained the same way."""
    from_secondary = phase == "backward" and self.dp.secondary_partition

    def gather(b, tie):
      if from_secondary:
        mine, _ = lax.optimization_barrier(({b: secondaries[b]}, tie))
        secondaries.update(mine)
        return self.gather_tied(rows, phase, mine, buckets=[b])[0]
      mine, _ = lax.optimization_barrier(({i: rows[i] for i in self.dp.members[b]}, tie))
      rows.update(mine)
      values, kept = self.gather_tied(mine, phase, buckets=[b])
      for bucket, secondary in kept.items():
        secondaries.setdefault(bucket, secondary)
      return values

    return gather

  def _differentiated(self, values, first) -> list[bool]:
    """Which consts (`first` 0) or xs (`first` first_xs: per-layer values, then the
    persistent per-layer parameters) the backward differentiates: floats among
    loop_parts.differentiable_inputs."""
    kind = "const" if first == 0 else "xs"
    keys = loop_parts.differentiable_inputs(
      self.run, self.replicated, self.dp.s.params, self.dp.needs_gradient
    )
    return [_is_float(v) and (kind, k) in keys for k, v in enumerate(values)]

  def _context(self, consts, carry, x) -> dict:
    ctx = {("const", k): v for k, v in enumerate(consts)}
    ctx.update((("carry", k), v) for k, v in enumerate(carry))
    ctx.update((("xs", k), v) for k, v in enumerate(x))
    return ctx

  def body(self, layers: dict, inputs: list):
    """The first layer's ops on this iteration's values -> (carry out, no ys)."""
    consts = inputs[: self.num_consts]
    carry = inputs[self.num_consts : self.first_xs]
    xs = inputs[self.first_xs :]
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
      i = self.gathered[where]
      if i not in layers:  # not re-gathered in backward: unread (the planner's analysis)
        entry = self.dp.s.params[i]
        return jnp.zeros(entry.layer_shape, self.dp.compute_dtype(i))
      return layers[i]
    return xs[len(self.run.xs) + self.replicated.index(where)]


def _ct(cts, key, like):
  """The cotangent a context value received, or zeros like it."""
  return cts[key].astype(jnp.result_type(like)) if key in cts else jnp.zeros_like(like)


class PartedScan(RolledLoop):
  """A scan whose layer the schedule cuts into parts: its body as a run (loops.scan_run)
  walked part by part; its inputs, outputs, stacked shards and their cotangents are the
  scan op's, as a whole-layer scan's (Loop) are."""

  input_values = Loop.input_values
  stacked_shards = Loop.stacked_shards
  input_cotangents = Loop.input_cotangents
  stacked_param_cotangents = Loop.stacked_param_cotangents

  def __init__(self, dp, segment: int, op, forward_step, backward_step):
    self.read_scan(dp, segment, op, forward_step, backward_step)
    stacked = {i for b in self.buckets for i in dp.members[b]}
    start = dp.s.segments[segment].start
    self.run, why = loops.scan_run(dp.program, start, stacked, len(dp.s.params))
    if self.run is None:
      raise ScheduleMismatchError(
        f"Segment {segment}'s loop cuts its scan's layer into parts, but {why}. Recompile "
        f"the schedule."
      )
    self.layer_slices = {}
    self.gathered = {p: rows[0] for p, rows in enumerate(self.run.stacked)}
    self.replicated = []
    self.template = roll.template_ops(dp.program, self.run)
    self.parts = self._parts(forward_step, backward_step)
