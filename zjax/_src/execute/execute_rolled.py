"""Running a loop step by walking its body (loop_parts.py): a rolled run of identical
layers (roll.py), or a scan (its body as a run: loops.scan_run).

Each iteration walks the body's steps: gather a bucket of this layer, compute a part,
release; backward recomputes the layer part by part under `jax.vjp` from the iteration's
saved carry, applies the parts' vjps in reverse (re-gathering where the body says) and
reduce-scatters each bucket's layer gradient into its row of the stacked shard. A body
without parts is one part, the whole layer. A gather the body issues ahead (ir.Step.ahead)
runs in the previous iteration, for the next layer (the first layer's before the loop, the
last iteration after it, so exactly one gather per layer runs).

A rolled run's body is the first layer's ops with their inputs rewired (roll.Run.sources),
and each per-layer parameter's layers are read from its stack in the sharded layout
(ParamEntry.stack), which the schedule must give in the run's layer order. A scan's
(`ScanLoop`) inputs, outputs and stacked shards are the scan op's.
"""

import jax.numpy as jnp
from jax import lax

from zjax._src.errors import ScheduleMismatchError
from zjax._src.execute.execute_loop import Loop, _is_float, _read, _write
from zjax._src.program import loop_parts, loops, roll
from zjax._src.schedule import ir
from zjax._src.train import offload


class RolledLoop(Loop):
  def __init__(self, dp, segment: int, run, forward_step, backward_step):
    self.dp, self.segment, self.run = dp, segment, run
    self.length, self.reverse = run.length, False
    self.num_consts, self.num_carry = len(run.consts), len(run.carry_in)
    self.first_xs = self.num_consts + self.num_carry
    self.read_steps(forward_step, backward_step)
    self.stacked_inputs = {}
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
    self.parts = self._checked_runner(forward_step)

  def _runner(self, whole=False) -> loop_parts.PartRunner:
    members = {b: self.dp.members[b] for b in self.buckets}
    bucket_of = {i: b for b, ids in members.items() for i in ids}
    return loop_parts.part_runner(
      self.dp.program, self.run, members, self.dp.s.params, bucket_of, whole
    )

  def _checked_runner(self, forward_step) -> loop_parts.PartRunner:
    """The runner of the layer's parts as the schedule cuts them (none: one part, the whole
    layer); refused if this program cuts them otherwise, or if a backward step reads
    weights whose bucket is not gathered there (the recompute or vjp would read zeros)."""
    dp, run = self.dp, self.run
    runner = self._runner(whole=not forward_step.parts)
    found = [(run.op_offset + p.start, run.op_offset + p.end) for p in runner.parts]
    stored = [(p.start, p.end) for p in forward_step.parts]
    if stored and found != stored:
      raise ScheduleMismatchError(
        f"Segment {self.segment}'s loop cuts its layer into parts at ops {stored}, but this "
        f"program's layer cuts at {found}. Recompile the schedule."
      )
    for part, io in zip(forward_step.parts, runner.parts):  # what the validator checked
      reads = tuple(sorted({runner.bucket_of[q] for q in io.positions}))
      if tuple(sorted(part.buckets)) != reads:
        raise ScheduleMismatchError(
          f"Segment {self.segment}'s loop part {part.id} lists buckets {list(part.buckets)}, "
          f"but its ops read buckets {list(reads)}. Recompile the schedule."
        )
    body = self.bodies["backward"]
    missing = () if _holds_all(body, self.buckets) else loop_parts.unused_gathers(runner, body)[1]
    if missing:
      op, part, q = sorted(missing)[0]
      what = f"part {part}" if stored else "the layer"
      raise ScheduleMismatchError(
        f"Segment {self.segment}'s backward loop body does not gather "
        f"{dp.s.params[runner.gathered[q]].path} before the {op} of {what}, which reads it. "
        f"Gather its bucket before that step (or recompile the schedule)."
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

  # ---- the iterations: the body's steps walked (loop_parts.py) ----------------------------
  def forward(self, shards: dict, inputs: list, anchor):
    consts, carry, xs = self._split(inputs)
    saved = [jnp.zeros((self.length,) + jnp.shape(c), jnp.result_type(c)) for c in carry]
    ys = [  # a scan's stacked outputs (a rolled run has none)
      jnp.zeros(self.dp.program.avals[o].shape, self.dp.program.avals[o].dtype)
      for o in self.outputs[self.num_carry :]
    ]
    stacks = self.secondary_stacks(shards)  # hpZ: every layer's secondary shards
    body = self.bodies["forward"]

    def ahead(i, tie, state):  # iteration i's prefetched buckets; hpZ: their secondaries
      carry, saved, ys, stacks = state
      layer = self.layer(i)
      ready, kept = self._prefetched(_read(shards, layer), tie, "forward")
      return ready, (carry, saved, ys, _write_some(stacks, layer, kept))

    def iteration(i, ready, state):
      carry, saved, ys, stacks = state
      layer = self.layer(i)  # (a reverse scan visits the last layer first)
      ctx, kept = self._context(consts, carry, _read(xs, layer)), {}
      gather = self._gatherer(_read(shards, layer), "forward", kept)
      loop_parts.walk_forward(
        self.parts, body, ctx, _or_ready(ready, gather), carry if carry else anchor
      )
      outs = [ctx[key] for key in self.parts.out_keys]
      new_carry, y = outs[: self.num_carry], outs[self.num_carry :]
      saved, ys = _write(saved, i, carry), _write(ys, layer, y)
      return new_carry, saved, ys, _write_some(stacks, layer, kept)

    first_tie = anchor if anchor is not None else carry
    carry, saved, ys, stacks = self._iterate(
      iteration, ahead, (carry, saved, ys, stacks), first_tie, "forward"
    )
    return carry + ys, (consts, saved, xs, stacks)

  def backward(self, shards: dict, residuals, ct_outs: list, anchor):
    consts, saved, xs, stacks = residuals
    keys = self.parts.out_keys  # the carries', then a scan's ys
    ct_ys = ct_outs[self.num_carry :]
    ct_consts = [jnp.zeros_like(c) if _is_float(c) else None for c in consts]
    ct_xs = [jnp.zeros_like(x) if _is_float(x) else None for x in xs]
    grads = {i: jnp.zeros(shards[i].shape, self.dp.reduce_dtype(i)) for i in self.trained}
    body = self.bodies["backward"]

    def ahead(i, tie, state):  # iteration i's prefetched buckets (hpZ: from its secondaries)
      layer = self.layer(i)
      ready, _ = self._prefetched(_read(shards, layer), tie, "backward", _read(stacks, layer))
      return ready, state

    def iteration(i, ready, state):
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

      def scatter(b, layer_grads):  # (per_gather: a bucket gathered twice scatters twice)
        for param, chunk in self.scatter_layer(layer_grads, buckets=[b]).items():
          chunks[param] = chunks[param] + chunk if param in chunks else chunk

      cts = loop_parts.walk_backward(
        self.parts,
        body,
        ctx,
        cts,
        _or_ready(ready, gather),
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
      return ct_carry, ct_consts, ct_xs, _write(grads, layer, chunks)

    ct_carry = [c if _is_float(c) else None for c in ct_outs[: self.num_carry]]
    first_tie = anchor if anchor is not None else ct_carry
    ct_carry, ct_consts, ct_xs, grads = self._iterate(
      iteration, ahead, (ct_carry, ct_consts, ct_xs, grads), first_tie, "backward"
    )
    return list(ct_consts) + list(ct_carry) + list(ct_xs), grads

  def _iterate(self, iteration, ahead, state, first_tie, phase: str):
    """The loop over the layers (backward: from the last iteration), as a `lax.scan` of
    iteration(i, ready, state) -> state. Where the loop prefetches (`self.ahead`), each
    iteration first gathers the next one's (ahead(i, tie, state) -> (ready, state), tied to the
    iteration's first state value: its carry or cotangent); the first iteration's are
    gathered before the loop and the last iteration runs after it, so exactly one gather
    per layer runs."""
    n, backward = self.length, phase == "backward"
    if not self.ahead[phase]:
      step = lambda state, i: (iteration(i, {}, state), None)  # noqa: E731
      return lax.scan(step, state, jnp.arange(n), reverse=backward)[0]
    first, last, next_of = (n - 1, 0, -1) if backward else (0, n - 1, 1)

    def step(carried, i):
      ready, state = carried
      upcoming, state = ahead(i + next_of, state[0], state)
      return (upcoming, iteration(i, ready, state)), None

    ready, state = ahead(first, first_tie, state)
    indices = jnp.arange(1, n) if backward else jnp.arange(n - 1)
    (ready, state), _ = lax.scan(step, (ready, state), indices, reverse=backward)
    return iteration(last, ready, state)

  def _prefetched(self, rows: dict, tie, phase: str, secondaries=None):
    """-> (bucket -> {param index: this layer's value} of the buckets the previous
    iteration gathers, bucket -> the layer's hpZ secondary kept), under one barrier tied to
    `tie`."""
    buckets = self.ahead[phase]
    layers, kept = self.gather_layer(rows, tie, phase, secondaries, buckets)
    ready = {b: {i: layers[i] for i in self.dp.members[b]} for b in buckets}
    return ready, kept

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

  def _context(self, consts, carry, x) -> dict:
    ctx = {("const", k): v for k, v in enumerate(consts)}
    ctx.update((("carry", k), v) for k, v in enumerate(carry))
    ctx.update((("xs", k), v) for k, v in enumerate(x))
    return ctx


def _holds_all(body, buckets) -> bool:
  """Whether every bucket is gathered before the body's first compute and none released
  before its last: no step can read a weight that is not gathered (nothing to trace)."""
  computes = [k for k, st in enumerate(body) if st.op in ("compute", ir.RECOMPUTE_OP)]
  if not computes:
    return True
  before = {st.bucket for st in body[: computes[0]] if st.op == "gather"}
  released = any(st.op == "release" for st in body[: computes[-1]])
  return before >= set(buckets) and not released


def _or_ready(ready: dict, gather):
  """gather(bucket, tie), whose first call for a bucket the previous iteration gathered
  ahead is answered from `ready`."""
  waiting = dict(ready)
  return lambda b, tie: waiting.pop(b) if b in waiting else gather(b, tie)


def _write_some(stacks: dict, index, rows: dict) -> dict:
  """`stacks` with row `index` of those in `rows` replaced."""
  return {**stacks, **_write({b: stacks[b] for b in rows}, index, rows)}


def _ct(cts, key, like):
  """The cotangent a context value received, or zeros like it."""
  return cts[key].astype(jnp.result_type(like)) if key in cts else jnp.zeros_like(like)


class ScanLoop(RolledLoop):
  """A scan walked as a run (loops.scan_run), whole layer or part by part; its inputs,
  outputs, stacked shards and their cotangents are the scan op's (Loop's)."""

  input_values = Loop.input_values
  stacked_shards = Loop.stacked_shards
  input_cotangents = Loop.input_cotangents
  stacked_param_cotangents = Loop.stacked_param_cotangents

  def __init__(self, dp, segment: int, op, forward_step, backward_step):
    self.read_scan(dp, segment, op, forward_step, backward_step)
    stacked = {i for b in self.buckets for i in dp.members[b]}
    start = dp.s.segments[segment].start
    self.run = loops.scan_run(dp.program, start, stacked, len(dp.s.params))
    self.gathered = {p: rows[0] for p, rows in enumerate(self.run.stacked)}
    self.replicated = []
    self.template = roll.template_ops(dp.program, self.run)
    self.parts = self._checked_runner(forward_step)
