"""Running a whole-layer scan whose body does not read as a run (loops.scan_run: an
iteration outputs a constant or a stacked weight as it is); every other loop walks its body
(execute_rolled.py), and its scan-op plumbing (`read_scan`, inputs and cotangents) is this
class's. A scan over layers whose stacked parameters are gathered one layer per iteration
(plan.py decides which; ir.py describes the loop step).

Forward is a `lax.scan` whose body all-gathers the current layer's slice of every stacked
bucket (or, with prefetch, the *next* layer's, carried into the next iteration; the first
layer is gathered before the loop and the last iteration is peeled off so that exactly L
gathers run), runs the original scan body, and saves only the iteration's input carry.
Gathered weights are never saved: backward is a reverse `lax.scan` that re-gathers each
layer (prefetching the previous one), recomputes the iteration from its saved carry under
`jax.vjp`, and reduce-scatters the layer's weight gradient into its row of the stacked
shard. Memory therefore grows with depth only by the saved carries (the activations at
layer boundaries), and the compiled program has one while loop per direction whose body
holds the per-iteration collectives.

Under hpZ each forward iteration also writes the layer's secondary shard into a stacked
[L, R, W] buffer that the backward scan re-gathers from, over the shard axes only.

This is the custom-vjp recipe of DESIGN.md written out by hand: the executor already owns
the backward pass, so it runs the per-iteration vjp itself. Ordering barriers tie each
gather to the iteration's carry (forward) or cotangent (backward), and the saved residual
is the pre-barrier carry (a barrier output would make the scan stack a copy of it).
"""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax import lax

from zjax._src.errors import ScheduleMismatchError
from zjax._src.layout import layout
from zjax._src.program import loops
from zjax._src.program import segments as seg_lib
from zjax._src.schedule import ir
from zjax._src.train import offload


class Loop:
  """One loop segment: its scan equation and how each of its inputs is provided."""

  def __init__(self, dp, segment: int, op, forward_step, backward_step):
    self.read_scan(dp, segment, op, forward_step, backward_step)
    self.body_jaxpr = op.eqn.params["jaxpr"]
    # stacked consts read as W[i]: body equation index -> input position
    self.layer_slices = {
      k: j
      for j in self.stacked_inputs
      if j < self.num_consts
      for k in loops.layer_slices(dp.program, op, j)
    }
    if set(self.regathered) != set(self.buckets):
      self._check_unread()

  def read_scan(self, dp, segment, op, forward_step, backward_step):
    """The scan op's inputs, outputs and trip count, the loop steps, and which inputs are
    the stacked parameters (read one layer per iteration)."""
    self.dp, self.segment, self.op = dp, segment, op
    self.inputs, self.outputs = list(op.inputs), list(op.outputs)
    self.length, self.reverse = op.eqn.params["length"], op.eqn.params["reverse"]
    self.num_consts, self.num_carry = loops.loop_inputs(op.eqn)
    self.first_xs = self.num_consts + self.num_carry
    self.read_steps(forward_step, backward_step)
    stacked = {i for b in self.buckets for i in dp.members[b]}
    self.stacked_inputs = {}  # input position -> (param index, shape-keeping layout ops)
    for j, a in enumerate(op.inputs):
      if isinstance(a, int) and a in dp.chains and dp.chains[a][0] in stacked:
        self.stacked_inputs[j] = dp.chains[a]

  def _check_unread(self):
    """A backward body that leaves stacked buckets out: only ones whose values the
    iteration's backward does not read (else it would read the zeros standing in)."""
    left_out = {i for b in self.buckets if b not in self.regathered for i in self.dp.members[b]}
    trained = {j: i in self.trained for j, (i, _) in self.stacked_inputs.items()}
    unread = loops.backward_unread(self.op, trained)
    for j, (i, _) in sorted(self.stacked_inputs.items()):
      if i in left_out and j not in unread:
        raise ScheduleMismatchError(
          f"Segment {self.segment}'s backward loop body does not re-gather "
          f"{self.dp.s.params[i].path}, but the backward iteration reads it. Add its "
          f"bucket's gather (or recompile the schedule)."
        )

  def read_steps(self, forward_step, backward_step):
    """What the loop steps say: the stacked buckets, prefetch, which are reduce-scattered."""
    self.buckets = [st.bucket for st in forward_step.body if st.op == "gather"]
    self.regathered = [st.bucket for st in backward_step.body if st.op == "gather"]
    self.prefetch = {"forward": _prefetches(forward_step), "backward": _prefetches(backward_step)}
    self.scattered = {st.bucket for st in backward_step.body if st.op == "reduce_scatter"}
    # hpZ: buckets whose per-layer secondary shards forward keeps for backward's re-gathers
    self.secondary = [st.bucket for st in forward_step.body if st.op == "keep_secondary"]
    self.trained = [i for b in self.buckets if b in self.scattered for i in self.dp.members[b]]

  # ---- the loop's inputs and outputs in the executor's state ---------------------------
  def input_values(self, state) -> list:
    """The op's input values (stacked positions None: the loop gathers them per layer)."""
    return [
      None if j in self.stacked_inputs else state.input_value(a) for j, a in enumerate(self.inputs)
    ]

  def stacked_shards(self, state) -> dict:
    """param index -> this device's stacked shard [L, c] as stored (offload_params: in host
    memory; each layer's row is moved to the device and cast when it is gathered)."""
    return {i: state.shards[i] for b in self.buckets for i in self.dp.members[b]}

  def backward_consts(self, state, consts) -> list:
    """The loop's consts for its backward: a weight that every iteration reads is read from
    the state again (gathered there as the schedule's backward says, as a segment's
    backward reads its weights), not kept from the forward (the residuals would hold the
    forward's gathered copy, and the re-gather would be dead code)."""
    return [
      state.view_or_placeholder(a)
      if isinstance(a, int) and a in self.dp.chains and j not in self.stacked_inputs
      else c
      for j, (a, c) in enumerate(zip(self.inputs[: self.num_consts], consts))
    ]

  def input_cotangents(self, ct_inputs) -> list:
    """(value id, cotangent) of every input that received one."""
    return [
      (a, ct) for a, ct in zip(self.inputs, ct_inputs) if ct is not None and isinstance(a, int)
    ]

  def stacked_param_cotangents(self, ct_inputs) -> list:
    """(layer 0's parameter index, stacked cotangent) of per-layer parameters the loop
    reads whole (a rolled run's persistent ones); none for a scan."""
    return []

  # ---- one iteration -------------------------------------------------------------------
  def body(self, layers: dict, inputs: list):
    """The scan body on one iteration's values; `layers`: param index -> gathered layer
    slice, standing in for the stacked xs slices. -> (carry out, ys)."""
    args = list(inputs)
    for j, (param, chain) in self.stacked_inputs.items():
      args[j] = seg_lib.apply_chain(
        chain, layers[param] if param in layers else self._unread_layer(param)
      )
    if self.layer_slices:
      outs = self._run_body_with_layer_slices(args)
    else:
      outs = jex.jaxpr_as_fun(self.body_jaxpr)(*args)
    return list(outs[: self.num_carry]), list(outs[self.num_carry :])

  def _unread_layer(self, i):
    """Stands in for a layer not re-gathered in backward (unread: dead code, as XLA sees)."""
    return jnp.zeros(self.dp.s.params[i].layer_shape, self.dp.compute_dtype(i))

  def _run_body_with_layer_slices(self, args):
    """The body, with each `W[i]` of a stacked const answered by the gathered layer."""
    jaxpr = self.body_jaxpr.jaxpr
    env = dict(zip(jaxpr.constvars, self.body_jaxpr.consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
    for k, eqn in enumerate(jaxpr.eqns):
      if k in self.layer_slices:
        outs = [args[self.layer_slices[k]][None]]
      else:
        with eqn.ctx.manager:
          outs = eqn.primitive.bind(
            *[read(v) for v in eqn.invars], **eqn.primitive.get_bind_params(eqn.params)
          )
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  def gather_layer(
    self, shard_rows: dict, tie, phase: str = "forward", secondary=None, buckets=None
  ):
    """-> (param index -> its layer slice, bucket -> the layer's hpZ secondary shard),
    from this device's rows of the stacked shards (backward under hpZ: from `secondary`,
    bucket -> the layer's secondary shard, over the shard axes only); every stacked bucket,
    or those in `buckets`."""
    if phase == "backward" and self.dp.secondary_partition:
      secondary, _ = lax.optimization_barrier((secondary, tie))
    else:
      shard_rows, _ = lax.optimization_barrier((shard_rows, tie))
    return self.gather_tied(shard_rows, phase, secondary, buckets)

  def gather_tied(self, shard_rows: dict, phase: str = "forward", secondary=None, buckets=None):
    """`gather_layer` on rows (or secondary shards) already tied to what they follow."""
    from_secondary = phase == "backward" and self.dp.secondary_partition
    layers, kept = {}, {}
    for b in self.buckets if buckets is None else buckets:
      members = self.dp.members[b]
      entries = [layout.layer_entry(self.dp.s.params[i]) for i in members]
      if from_secondary:
        chunks = [
          jax.ShapeDtypeStruct(shard_rows[i].shape, self.dp.compute_dtype(i)) for i in members
        ]  # (for unpacking; nothing moves from the host)
        values = self.dp.comm[b].regather(secondary[b], chunks, entries)
      else:  # offload_params: the layer's rows come from the host here
        chunks = [
          offload.on_device(shard_rows[i]).astype(self.dp.compute_dtype(i)) for i in members
        ]
        values, wire = self.dp.comm[b].gather(phase, chunks, entries, keep_wire=b in self.secondary)
        if b in self.secondary:
          kept[b] = self.dp.comm[b].secondary(wire, entries)
      layers.update(zip(members, values))
    return layers, kept

  def secondary_stacks(self, shards: dict) -> dict:
    """bucket -> zeros for every layer's secondary shard [L, (T,) R, W] (W: the wire
    length; under tensor parallelism one per tensor rank)."""
    out = {}
    for b in self.secondary:
      members = self.dp.members[b]
      rows = [jax.ShapeDtypeStruct(shards[i].shape[1:], self.dp.compute_dtype(i)) for i in members]
      entries = [layout.layer_entry(self.dp.s.params[i]) for i in members]
      out[b] = self.dp.comm[b].secondary_stack(self.length, rows, entries)
    return out

  def scatter_layer(self, layer_grads: dict, buckets=None) -> dict:
    """param index -> this device's chunk of the layer's gradient (mean over devices), of
    every reduce-scattered stacked bucket or those in `buckets` (missing gradients: zeros)."""
    out = {}
    for b in self.buckets if buckets is None else buckets:
      if b not in self.scattered:
        continue
      members = self.dp.members[b]
      entries = [layout.layer_entry(self.dp.s.params[i]) for i in members]
      grads = [
        layer_grads[i].astype(self.dp.reduce_dtype(i))
        if i in layer_grads
        else jnp.zeros(e.shape, self.dp.reduce_dtype(i))
        for i, e in zip(members, entries)
      ]
      out.update(zip(members, self.dp.comm[b].scatter(grads, entries)))
    return out

  # ---- forward ---------------------------------------------------------------------------
  def forward(self, shards: dict, inputs: list, anchor):
    """-> (op outputs, residuals). `shards`: param index -> local stacked shard [L, c] in
    the compute dtype; `inputs`: the op's input values (stacked positions ignored)."""
    consts, carry, xs = self._split(inputs)
    length, tie = self.length, anchor if anchor is not None else carry
    ys_avals = [self.dp.program.avals[o] for o in self.outputs[self.num_carry :]]
    ys = [jnp.zeros(a.shape, a.dtype) for a in ys_avals]
    saved = [jnp.zeros((length,) + jnp.shape(c), jnp.result_type(c)) for c in carry]
    kept = self.secondary_stacks(shards)  # hpZ: every layer's secondary shards

    def gather(j, tie, kept):  # layer j's weights; hpZ: its secondary written at once
      layers, secondary = self.gather_layer(_read(shards, self.layer(j)), tie)
      return layers, _write(kept, self.layer(j), secondary)

    def iteration(i, layers, carry, saved, ys):
      new_carry, y = self.body(layers, consts + carry + _read(xs, self.layer(i)))
      return new_carry, _write(saved, i, carry), _write(ys, self.layer(i), y)

    if self.prefetch["forward"]:
      first, kept = gather(0, tie, kept)

      def step(state, i):
        carry, layers, saved, ys, kept = state
        upcoming, kept = gather(i + 1, carry, kept)
        carry, saved, ys = iteration(i, layers, carry, saved, ys)
        return (carry, upcoming, saved, ys, kept), None

      (carry, last, saved, ys, kept), _ = lax.scan(
        step, (carry, first, saved, ys, kept), jnp.arange(length - 1)
      )
      carry, saved, ys = iteration(length - 1, last, carry, saved, ys)
    else:

      def step(state, i):
        carry, saved, ys, kept = state
        layers, kept = gather(i, carry, kept)
        carry, saved, ys = iteration(i, layers, carry, saved, ys)
        return (carry, saved, ys, kept), None

      (carry, saved, ys, kept), _ = lax.scan(step, (carry, saved, ys, kept), jnp.arange(length))
    return carry + ys, (consts, saved, xs, kept)

  # ---- backward --------------------------------------------------------------------------
  def backward(self, shards: dict, residuals, ct_outs: list, anchor):
    """-> (cotangents of the op's inputs (None where not differentiated), param index ->
    local gradient chunks [L, c] of the trained stacked parameters). `ct_outs`: one per op
    output, None for non-float outputs."""
    consts, saved, xs, kept = residuals
    length = self.length

    def gather(i, tie):  # layer i's weights: from the stacked shards, or hpZ's secondary
      layers, _ = self.gather_layer(
        _read(shards, self.layer(i)), tie, "backward", _read(kept, self.layer(i)), self.regathered
      )
      return layers

    ct_carry, ct_ys = ct_outs[: self.num_carry], ct_outs[self.num_carry :]
    tie = anchor if anchor is not None else ct_carry
    # differentiated: the carries (floats), and the consts and xs that depend on trained
    # parameters (others may feed ops JAX cannot transpose, e.g. a while_loop)
    const_d, xs_d = self._differentiated(consts, 0), self._differentiated(xs, self.first_xs)
    ct_consts = [jnp.zeros_like(c) if d else None for c, d in zip(consts, const_d)]
    ct_xs = [jnp.zeros_like(x) if d else None for x, d in zip(xs, xs_d)]
    grads = {i: jnp.zeros(shards[i].shape, self.dp.reduce_dtype(i)) for i in self.trained}

    def iteration(i, layers, ct_carry, ct_consts, ct_xs, grads):
      layer = self.layer(i)
      carry, x, ct_y = _read(saved, i), _read(xs, layer), _read(ct_ys, layer)
      diff = (
        {j: layers[j] for j in self.trained},
        _floats(consts, const_d),
        _floats(carry),
        _floats(x, xs_d),
      )

      def f(layer_d, consts_d, carry_d, x_d):
        new_carry, y = self.body(
          {**layers, **layer_d},
          _merge(consts, consts_d, const_d) + _merge(carry, carry_d) + _merge(x, x_d, xs_d),
        )
        return _floats(new_carry), _floats(y)

      _, vjp_fn = jax.vjp(f, *diff)
      ct_layer, ct_c, ct_carry_in, ct_x = vjp_fn((_floats(ct_carry), _floats(ct_y)))
      ct_consts = [
        a if a is None else a + b for a, b in zip(ct_consts, _merge_none(consts, ct_c, const_d))
      ]
      ct_xs = _write(ct_xs, layer, _merge_none(x, ct_x, xs_d))
      grads = _write(grads, layer, self.scatter_layer(ct_layer))
      return _merge_none(carry, ct_carry_in), ct_consts, ct_xs, grads

    state = (ct_carry, ct_consts, ct_xs, grads)
    if self.prefetch["backward"]:

      def step(carried, i):
        layers, state = carried
        upcoming = gather(i - 1, state[0])
        return (upcoming, iteration(i, layers, *state)), None

      last = gather(length - 1, tie)
      (first, state), _ = lax.scan(step, (last, state), jnp.arange(1, length), reverse=True)
      state = iteration(0, first, *state)
    else:

      def step(state, i):
        layers = gather(i, state[0])
        return iteration(i, layers, *state), None

      state, _ = lax.scan(step, state, jnp.arange(length), reverse=True)
    ct_carry, ct_consts, ct_xs, grads = state
    ct_inputs = list(ct_consts) + list(ct_carry) + list(ct_xs)
    return self._restore_positions(ct_inputs), grads

  # ---- helpers ---------------------------------------------------------------------------
  def _split(self, inputs):
    """(consts, carry, non-stacked xs) lists; stacked positions become None in xs."""
    values = [None if j in self.stacked_inputs else v for j, v in enumerate(inputs)]
    return (
      values[: self.num_consts],
      values[self.num_consts : self.first_xs],
      values[self.first_xs :],
    )

  def _differentiated(self, values, first) -> list[bool]:
    """Which of `values` (the op's inputs from position `first` on) the backward
    differentiates: floats that depend on trained parameters (the segment's own analysis)."""
    io = self.dp.segments[self.segment]
    acts = {a for a, d in zip(io.act_inputs, self.dp.diff_acts[self.segment]) if d}
    params = self.dp.chains
    out = []
    for v, a in zip(values, self.inputs[first:]):
      trained = (
        isinstance(a, int) and a in params and ir.has_gradient(self.dp.s.params[params[a][0]])
      )
      out.append(_is_float(v) and (trained or (isinstance(a, int) and a in acts)))
    return out

  def _restore_positions(self, ct_inputs):
    return [None if j in self.stacked_inputs else ct for j, ct in enumerate(ct_inputs)]

  def layer(self, i):
    """The layer iteration i visits (a reverse scan starts from the last)."""
    return self.length - 1 - i if self.reverse else i


def _prefetches(step) -> bool:
  return any(st.prefetch for st in step.body if st.op == "gather")


def _read(tree, index):
  """Row `index` of every stacked array (no copy of the stack)."""
  return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, 0, keepdims=False), tree)


def _write(tree, index, rows):
  """Every stacked array with row `index` replaced (in place inside XLA's loops)."""
  return jax.tree.map(
    lambda x, r: lax.dynamic_update_index_in_dim(x, r.astype(x.dtype), index, 0), tree, rows
  )


def _is_float(x) -> bool:
  return x is not None and ir.is_float(x.dtype)


def _floats(values, mask=None) -> list:
  """The floating-point entries of `values` (or those `mask` marks)."""
  mask = [_is_float(v) for v in values] if mask is None else mask
  return [v for v, m in zip(values, mask) if m]


def _merge(values, float_values, mask=None) -> list:
  """`values` with its floating-point entries (or those `mask` marks) replaced, in order,
  by `float_values`."""
  mask = [_is_float(v) for v in values] if mask is None else mask
  it = iter(float_values)
  return [next(it) if m else v for v, m in zip(values, mask)]


def _merge_none(values, float_values, mask=None) -> list:
  """Cotangents aligned with `values`: float entries (or those `mask` marks) from
  `float_values`, others None."""
  mask = [_is_float(v) for v in values] if mask is None else mask
  it = iter(float_values)
  return [next(it) if m else None for v, m in zip(values, mask)]
