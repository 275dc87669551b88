"""What every loop step has in common: a scan over layers whose stacked parameters are
gathered one layer per iteration (plan.py decides which; ir.py describes the loop step).
`Loop` reads the loop steps and provides, per layer, the gathers (from this device's rows
of the stacked shards, or under hpZ from the layer's secondary shard), the hpZ secondary
stacks and the reduce-scatters; a scan op's inputs, outputs and cotangents are its too.
The iterations are walked by execute_rolled.py (`RolledLoop`, `ScanLoop`).

Gathered weights are never saved: backward re-gathers each layer, recomputes the iteration
from its saved carry under `jax.vjp`, and reduce-scatters the layer's weight gradient into
its row of the stacked shard. Memory therefore grows with depth only by the saved carries
(the activations at layer boundaries), and the compiled program has one while loop per
direction whose body holds the per-iteration collectives. Under hpZ each forward iteration
also writes the layer's secondary shard into a stacked [L, R, W] buffer that the backward
re-gathers from, over the shard axes only.
"""

import jax
import jax.numpy as jnp
from jax import lax

from zjax._src.layout import layout
from zjax._src.program import loops
from zjax._src.schedule import ir
from zjax._src.train import offload


class Loop:
  """One loop step's plumbing (subclasses walk its iterations: execute_rolled.py)."""

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

  def read_steps(self, forward_step, backward_step):
    """What the loop steps say: their bodies, the stacked buckets, those each iteration
    gathers for the next one, which are reduce-scattered."""
    self.bodies = {"forward": forward_step.body, "backward": backward_step.body}
    self.buckets = _gathered(forward_step.body)
    self.regathered = _gathered(backward_step.body)
    self.ahead = {
      phase: [st.bucket for st in body if st.op == "gather" and st.ahead]
      for phase, body in self.bodies.items()
    }
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

  # ---- one layer's collectives ----------------------------------------------------------
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

  # ---- helpers ---------------------------------------------------------------------------
  def _split(self, inputs):
    """(consts, carry, non-stacked xs) lists; stacked positions become None in xs."""
    values = [None if j in self.stacked_inputs else v for j, v in enumerate(inputs)]
    return (
      values[: self.num_consts],
      values[self.num_consts : self.first_xs],
      values[self.first_xs :],
    )

  def layer(self, i):
    """The layer iteration i visits (a reverse scan starts from the last)."""
    return self.length - 1 - i if self.reverse else i


def _gathered(body) -> list:
  """The buckets a loop body gathers, each once, in id order."""
  return sorted({st.bucket for st in body if st.op == "gather"})


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
