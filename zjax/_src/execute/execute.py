"""The executor: one shard_map program per step that performs exactly the schedule's steps.

Forward: for each step, gather a bucket (one coalesced all_gather of the bucket's chunks),
compute a segment (the program's ops [start, end), under `jax.vjp`), or release a bucket
(drop the last reference). Backward: walk the backward steps, re-gather, apply each
segment's vjp, accumulate the bucket's full gradient, and reduce-scatter it (psum_scatter,
mean over devices) into its shard.

What backward keeps from forward is each segment's vjp residuals, with every residual that
*is* one of the gathered parameters replaced by a placeholder: backward fills it from the
re-gathered (or kept) bucket. Gathered parameters therefore never live from forward to
backward unless the schedule says so (kept across the turn).

Ordering is pinned with optimization barriers: a gather's input shard is tied to the
activation (or cotangent) produced just before the step that issues it, and its result to
the inputs of the compute that needs it. So XLA neither hoists every gather to the start nor
merges a backward re-gather with the forward gather (their operands differ). GPUs keep the
barriers through scheduling; XLA's CPU pipeline removes them from the programs the CPU
runs, and analysis keeps them in a compile of its own (xla_options.py).
"""

from typing import Any, Callable

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from zjax._src.errors import ScheduleMismatchError, ZjaxError, batch_leaf
from zjax._src.execute import bucket_comm
from zjax._src.execute.execute_rolled import RolledLoop, ScanLoop
from zjax._src.layout import layout
from zjax._src.program import roll
from zjax._src.program import segments as seg_lib
from zjax._src.program.trace import trace_for_schedule
from zjax._src.schedule import ir
from zjax._src.schedule.schedule import program_hash
from zjax._src.train import offload
from zjax._src.xla import xla_options


def value_and_grad(loss_fn: Callable, schedule, *, mesh) -> Callable:
  """A jitted `(sharded_params, batch) -> (loss, sharded_grads)` that runs `schedule`.

  The batch's leading dimension (the global batch) is split over the devices; 0-d batch
  leaves (a scalar, a PRNG key) are replicated. For a loss that is a mean over the batch,
  `unshard(sharded_grads)` equals `jax.value_and_grad(loss_fn)(params, batch)`. Gradients
  of non-float and frozen parameters are zeros (they are not differentiated).

  With non-parameter state (a schedule compiled with `extra=`), call it as
  `(sharded_params, batch, extra) -> ((loss, new_extra), sharded_grads)`: `extra` is
  replicated and not differentiated, and `new_extra`'s floats are averaged over devices.

  Example:
    >>> step = zjax.value_and_grad(loss_fn, schedule, mesh=mesh)     # doctest: +SKIP
    >>> loss, grads = step(zjax.shard(params, schedule, mesh), batch) # doctest: +SKIP
    >>> zjax.hlo.compile_for_analysis(step.lower(sharded, batch))     # doctest: +SKIP
  """
  layout.check_mesh(schedule, mesh)
  from zjax.distributed import check_same_schedule  # multi-process: fail, do not hang

  check_same_schedule(schedule)
  runner = _Runner(loss_fn, schedule, mesh)
  return xla_options.jit(runner.step)


class _Runner:
  """Builds (once per batch shape) and calls the shard_map'ed device program."""

  def __init__(self, loss_fn, schedule, mesh):
    self.loss_fn, self.schedule, self.mesh = loss_fn, schedule, mesh
    self.n = schedule.num_devices
    self.data_axes = schedule.roles.data_axes  # the batch is split over all of them
    self.data_parallel = schedule.data_parallel_size

  def step(self, sharded_params, batch, extra=None):
    specs = layout.manual_specs(self.schedule)  # what the shard_map (data axes) sees
    leaves = layout.stored_leaves(sharded_params, self.schedule, "sharded_params")
    treedef = jax.tree_util.tree_structure(sharded_params)
    batch_specs = self._batch_specs(batch)
    program = self._device_program(sharded_params, batch, extra)
    leaves = [
      layout.place(x, self.mesh, s) for x, s in zip(leaves, layout.storage_specs(self.schedule))
    ]
    batch = jax.tree.map(lambda x, s: layout.place(x, self.mesh, s), batch, batch_specs)
    extra_specs = jax.tree.map(lambda _: P(), extra)
    extra = jax.tree.map(lambda x: layout.place(x, self.mesh, P()), extra)
    # tensor parallelism: manual over the data axes only, the tensor axis left to GSPMD
    manual = {"axis_names": set(self.data_axes)} if self.schedule.roles.tensor_axes else {}
    run = jax.shard_map(
      program.run,
      mesh=self.mesh,
      in_specs=(specs, batch_specs, extra_specs),
      out_specs=((P(), extra_specs), specs),
      check_vma=False,
      **manual,
    )
    (loss, new_extra), grads = run(leaves, batch, extra)
    grads = jax.tree_util.tree_unflatten(treedef, grads)
    return (loss, grads) if extra is None else ((loss, new_extra), grads)

  def _batch_specs(self, batch):
    def spec(path, x):
      name = batch_leaf(path)
      if np.ndim(x) == 0:
        return P()
      if is_key(x):
        raise ZjaxError(
          f"{name} is an array of PRNG keys of shape {tuple(x.shape)}; zjax "
          f"splits batch leaves over the devices and folds each device's position into "
          f"0-d keys (ZeroConfig.fold_rng_keys). Pass one key, jax.random.key(seed), and "
          f"draw per-example randomness inside the loss."
        )
      if x.shape[0] % self.data_parallel:
        hint = (
          " If it is a raw PRNG key (jax.random.PRNGKey), pass a typed 0-d key, "
          "jax.random.key(seed), instead."
          if x.shape == (2,) and x.dtype == np.uint32
          else ""
        )
        raise ZjaxError(
          f"{name} has leading (global batch) dimension "
          f"{x.shape[0]}, not divisible by the {self.data_parallel} devices of "
          f"the data axes {self.data_axes}. Use a global batch that is a "
          f"multiple of {self.data_parallel}.{hint}"
        )
      return P(layout.spec_entry(self.data_axes))

    return jax.tree_util.tree_map_with_path(spec, batch)

  def _device_program(self, sharded_params, batch, extra) -> "_DeviceProgram":
    """Trace the loss as the schedule was planned; it must match the schedule."""
    params = [jax.ShapeDtypeStruct(p.shape, jnp.dtype(p.dtype)) for p in self.schedule.params]
    trace = trace_for_schedule(
      self.loss_fn,
      layout.natural_like(sharded_params, self.schedule, params),
      batch,
      self.schedule.config,
      self.schedule.axis_sizes,
      extra,
      mesh=self.mesh,
    )
    _check_trace_matches(trace, self.schedule)
    return _DeviceProgram(self.schedule, trace.program)


def _check_trace_matches(trace, schedule):
  for p, entry in zip(trace.params, schedule.params):
    if p.path != entry.path or tuple(u.op for u in p.uses) != entry.uses:
      raise ScheduleMismatchError(
        f"On one device's share of the batch, parameter {p.path} is used at ops "
        f"{[u.op for u in p.uses]}, but the schedule says {list(entry.uses)}: the loss "
        f"function's program depends on the batch size, or the schedule belongs to another "
        f"model. Recompile the schedule for this loss function."
      )
  if program_hash(o.primitive for o in trace.ops) != schedule.program_hash:
    raise ScheduleMismatchError(
      "The loss function's program (on one device's share of the batch) differs from the "
      "schedule's. Recompile the schedule for this loss function."
    )


class _DeviceProgram:
  """One device's view of the step: local shards in, loss and local gradient shards out."""

  def __init__(self, schedule, program):
    self.s, self.program = schedule, program
    config = schedule.config
    self.n, self.data_axes = schedule.num_devices, schedule.roles.data_axes
    self.secondary_partition = config.secondary_partition  # hpZ
    analysis = seg_lib.analyze(
      program,
      schedule.segments,
      [ir.has_gradient(p) for p in schedule.params],
      [p.persistent for p in schedule.params],
    )
    self.chains, self.segments = analysis.chains, analysis.ios
    self.diff_params, self.diff_acts = analysis.diff_params, analysis.diff_acts
    self.replicated = analysis.replicated
    index = {p.path: i for i, p in enumerate(schedule.params)}
    self.members = [[index[path] for path in b.params] for b in schedule.buckets]
    region = bucket_comm.region_of(schedule)  # every bucket's collectives, chosen once
    self.comm = [
      bucket_comm.BucketComm(schedule, b, m[0], region) for b, m in enumerate(self.members)
    ]
    # parameter index -> the storage leaf holding it (a rolled stack: its layer 0's index)
    self.storage_of = {i: k for k, leaf in enumerate(schedule.storage) for i in leaf.members}
    self.consts = dict(zip(program.const_ids, program.consts))
    self.needs_gradient = seg_lib.needs_gradient(
      program, [ir.has_gradient(p) for p in schedule.params]
    )
    # persistent gradients are averaged as soon as they are complete, so that their full
    # buffers do not all wait for the end of the step: segment -> storage leaves
    self.grad_done_at = {
      k: sorted({self.storage_of[i] for i in members})
      for k, members in ir.persistent_reductions(schedule.params, schedule.segments).items()
    }
    backward_loops = {st.segment: st for st in schedule.backward if st.op == ir.LOOP_OP}
    self.loops = {
      st.segment: self._loop(st, backward_loops[st.segment])
      for st in schedule.forward
      if st.op == ir.LOOP_OP
    }

  def _loop(self, forward_step, backward_step):
    """The loop of a loop step: a scan over stacked parameters, or a rolled run."""
    k = forward_step.segment
    seg = self.s.segments[k]
    if not any(self.s.buckets[b].layers for b in seg.buckets):  # a scan
      return ScanLoop(self, k, self.segments[k].ops[0], forward_step, backward_step)
    length = forward_step.length
    facts = roll.param_facts(self.s.params, None, None)
    try:
      run = roll.analyze_run(
        self.program, facts, seg.start, (seg.end - seg.start) // length, length
      )
    except ValueError as e:
      raise ScheduleMismatchError(
        f"Segment {k} of the schedule is a rolled loop, but {e}. "
        f"Recompile the schedule for this loss function."
      ) from None
    return RolledLoop(self, k, run, forward_step, backward_step)

  def compute_dtype(self, i):
    return ir.gather_dtype(self.s.params[i].dtype, self.s.config.compute_dtype)

  def reduce_dtype(self, i):
    return ir.reduce_dtype(self.s.params[i].dtype, self.s.config)

  def wire_dtype(self, i):
    return ir.reduce_wire_dtype(self.s.params[i].dtype, self.s.config, self.s.platform)

  def run(self, shard_leaves, batch, extra):
    """-> ((mean loss, new extra averaged over devices), local gradient shards)."""
    if self.s.config.fold_rng_keys:  # device d draws from fold_in(key, d), on any N
      device = lax.axis_index(self.data_axes)  # row-major over (replicas..., shards)
      batch = jax.tree.map(lambda x: jax.random.fold_in(x, device) if is_key(x) else x, batch)
    state = _State(self, shard_leaves, jax.tree.leaves(batch) + jax.tree.leaves(extra))
    for step in self.s.forward:
      state.run_step(step, "forward")
    loss_id, *extra_ids = self.program.output_ids
    loss = state.read(loss_id)
    new_extra = jax.tree.unflatten(jax.tree.structure(extra), [state.read(i) for i in extra_ids])
    state.start_backward(loss_id, loss)
    for step in self.s.backward:
      state.run_step(step, "backward")
    return (state.mean_over_devices(loss), state.average_extra(new_extra)), state.gradients()


def is_key(x) -> bool:
  """A typed PRNG key (array), as made by jax.random.key."""
  return jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


class _State:
  """Values alive on one device while the schedule runs."""

  def __init__(self, dp: _DeviceProgram, shard_leaves, batch_leaves):
    self.dp = dp
    self.stored = list(shard_leaves)  # this device's part of each storage leaf
    # parameter index -> its local shard (or whole value, if persistent); rolled layers are
    # read from their stacks by the loop (stack_of)
    # (offload_params: persistent leaves come to the device at once, sharded ones by gather)
    self.shards = {
      leaf.members[0]: offload.on_device(x) if leaf.entry.persistent else x
      for leaf, x in zip(dp.s.storage, shard_leaves)
      if not leaf.rolled
    }
    self.env: dict[int, Any] = dict(dp.consts)
    num_params = len(dp.s.params)
    self.env.update(zip(dp.program.input_ids[num_params:], batch_leaves))
    self.gathered: dict[int, Any] = {}  # param index -> natural-shape full value
    self.wires: dict[int, Any] = {}  # hpZ: bucket -> its last forward gather's wire buffer
    self.secondary: dict[int, Any] = {}  # hpZ: bucket -> this device's secondary shard
    self.anchor = batch_leaves[0] if batch_leaves else None
    self.vjps: dict[int, tuple] = {}
    self.cts: dict[int, Any] = {}
    self.full_grads: dict[int, Any] = {}  # param index -> accumulated full gradient
    # rolled stacks of persistent parameters: storage index -> stacked full gradient
    self.stacked_grads: dict[int, Any] = {}
    self.shard_grads: dict[int, Any] = {}  # storage index -> local gradient shard
    self.averaged: dict[int, Any] = {}  # storage index -> averaged persistent gradient

  def stack_of(self, i):
    """This device's part of the rolled stack holding parameter i (all its layers)."""
    return self.stored[self.dp.storage_of[i]]

  # ---- values --------------------------------------------------------------------------
  def read(self, atom):
    return atom.val if isinstance(atom, jex.Literal) else self.env[atom]

  def base_value(self, i):
    """Parameter i in the compute dtype (gathered ones were cast before the gather)."""
    entry = self.dp.s.params[i]
    if entry.persistent:
      return self.shards[i].astype(self.dp.compute_dtype(i))
    return self.gathered[i]

  def view(self, vid):
    param, chain = self.dp.chains[vid]
    return seg_lib.apply_chain(chain, self.base_value(param))

  def view_or_placeholder(self, vid):
    """In backward, a view of a bucket that is not gathered is one the vjp provably does not
    read (the schedule's backward_buckets); a zero placeholder stands in and is dead code."""
    param, _ = self.dp.chains[vid]
    if self.dp.s.params[param].persistent or param in self.gathered:
      return self.view(vid)
    aval = self.dp.program.avals[vid]
    return jnp.zeros(aval.shape, aval.dtype)

  # ---- collectives ----------------------------------------------------------------------
  def gather(self, b, phase: str):
    members = self.dp.members[b]
    entries = [self.dp.s.params[i] for i in members]
    chunks = [self.shards[i] for i in members]
    if phase == "backward" and self.dp.secondary_partition:  # hpZ: from the secondary
      secondary = self.secondary[b]
      if self.anchor is not None:
        secondary, _ = lax.optimization_barrier((secondary, self.anchor))
      chunks = [
        jax.ShapeDtypeStruct(x.shape, self.dp.compute_dtype(i))  # (for unpacking)
        for i, x in zip(members, chunks)
      ]
      self.gathered.update(zip(members, self.dp.comm[b].regather(secondary, chunks, entries)))
      return
    if self.anchor is not None:
      chunks, _ = lax.optimization_barrier((chunks, self.anchor))
    # offload_params: each shard comes from the host here, where the schedule gathers
    chunks = [
      offload.on_device(x).astype(self.dp.compute_dtype(i)) for i, x in zip(members, chunks)
    ]
    values, wire = self.dp.comm[b].gather(
      phase, chunks, entries, keep_wire=self.dp.secondary_partition
    )
    if self.dp.secondary_partition:
      self.wires[b] = wire
    self.gathered.update(zip(members, values))

  def keep_secondary(self, b):
    entries = [self.dp.s.params[i] for i in self.dp.members[b]]
    secondary = self.dp.comm[b].secondary(self.wires[b], entries)
    # sliced before the bucket's parameters are used: else XLA may slice just before the
    # backward re-gather and keep the whole gathered wire alive through the forward pass
    members = [i for i in self.dp.members[b] if i in self.gathered]
    self.secondary[b], values = lax.optimization_barrier(
      (secondary, [self.gathered[i] for i in members])
    )
    self.gathered.update(zip(members, values))

  def drop_secondary(self, b):
    del self.secondary[b]

  def release(self, b):
    self.wires.pop(b, None)
    for i in self.dp.members[b]:
      self.gathered.pop(i, None)

  def reduce_scatter(self, b):
    members = self.dp.members[b]
    entries = [self.dp.s.params[i] for i in members]
    grads = [self.full_grads.pop(i, None) for i in members]
    grads = [
      jnp.zeros(e.shape, self.dp.reduce_dtype(i))
      if g is None
      else g.astype(self.dp.reduce_dtype(i))
      for i, g, e in zip(members, grads, entries)
    ]
    for i, chunk in zip(members, self.dp.comm[b].scatter(grads, entries)):
      self.add_shard_grad(self.dp.storage_of[i], chunk)

  def add_shard_grad(self, k, chunk):
    """Add to the local gradient shard of storage leaf k."""
    self.shard_grads[k] = chunk if k not in self.shard_grads else self.shard_grads[k] + chunk

  def run_step(self, step, phase: str):
    if step.op == "gather":
      self.gather(step.bucket, phase)
    elif step.op == "release":
      self.release(step.bucket)
    elif step.op == "keep_secondary":
      self.keep_secondary(step.bucket)
    elif step.op == "drop_secondary":
      self.drop_secondary(step.bucket)
    elif step.op == "reduce_scatter":
      self.reduce_scatter(step.bucket)
    elif step.op == ir.LOOP_OP:
      (self.forward_loop if phase == "forward" else self.backward_loop)(step.segment)
    elif phase == "forward":
      self.forward_compute(step.segment)
    else:
      self.backward_compute(step.segment)

  # ---- forward ---------------------------------------------------------------------------

  def forward_compute(self, k):
    io = self.dp.segments[k]
    params = [self.view(v) for v in io.param_inputs]
    acts = [self.read(a) for a in io.act_inputs]
    params, acts = lax.optimization_barrier((params, acts)) if params else (params, acts)
    outs, vjp_fn = seg_lib.segment_vjp(
      io, params, acts, self.dp.diff_params[k], self.dp.diff_acts[k], self.dp.replicated[k]
    )
    self.vjps[k] = seg_lib.strip_params(vjp_fn, params)
    self.env.update(zip(io.outputs, outs))
    if outs:
      self.anchor = outs[-1]

  # ---- loops (see execute_loop.py, execute_rolled.py) -----------------------------------
  def input_value(self, atom):
    if isinstance(atom, jex.Literal):
      return jnp.asarray(atom.val)
    return self.view(atom) if atom in self.dp.chains else self.env[atom]

  def forward_loop(self, k):
    loop = self.dp.loops[k]
    outs, self.vjps[k] = loop.forward(
      loop.stacked_shards(self), loop.input_values(self), self.anchor
    )
    self.env.update(zip(loop.outputs, outs))
    if outs:
      self.anchor = outs[0]

  def backward_loop(self, k):
    loop = self.dp.loops[k]
    ct_outs = []
    for o in loop.outputs:
      ct = self.cts.pop(o, None)
      aval = self.dp.program.avals[o]
      if not ir.is_float(aval.dtype):
        ct = None
      elif ct is None:
        ct = jnp.zeros(aval.shape, aval.dtype)
      ct_outs.append(ct)
    consts, *residuals = self.vjps.pop(k)
    ct_inputs, grads = loop.backward(
      loop.stacked_shards(self),
      (loop.backward_consts(self, consts), *residuals),
      ct_outs,
      self.anchor,
    )
    for a, ct in loop.input_cotangents(ct_inputs):
      if a in self.dp.chains:  # a parameter (view): trained ones get the gradient
        if ir.has_gradient(self.dp.s.params[self.dp.chains[a][0]]):
          self._accumulate_param_grad(a, ct)
      elif a in self.dp.needs_gradient:
        self.cts[a] = ct if a not in self.cts else self.cts[a] + ct
        self.anchor = ct
    for i, chunks in grads.items():  # stacked parameters: [L, c] local gradient chunks
      self.add_shard_grad(self.dp.storage_of[i], chunks)
    for i, ct in loop.stacked_param_cotangents(ct_inputs):  # rolled persistent stacks
      if ir.has_gradient(self.dp.s.params[i]):  # kept stacked until averaged
        self.stacked_grads[self.dp.storage_of[i]] = ct
    self._average_done_gradients(k)

  # ---- backward --------------------------------------------------------------------------
  def start_backward(self, loss_id, loss):
    self.cts = {loss_id: jnp.ones_like(loss)}
    self.anchor = loss  # not the constant seed: backward gathers must wait for the forward

  def backward_compute(self, k):
    io = self.dp.segments[k]
    params = [self.view_or_placeholder(v) for v in io.param_inputs]
    ct_out = [self.cts.pop(o, None) for o in io.outputs]
    ct_out = [
      seg_lib.zero_cotangent(self.env[o]) if c is None else c for o, c in zip(io.outputs, ct_out)
    ]
    if params:
      params, ct_out = lax.optimization_barrier((params, ct_out))
    vjp_fn = seg_lib.restore_params(self.vjps.pop(k), params)
    ct_params, ct_acts = vjp_fn(ct_out)
    diff_acts = [a for a, d in zip(io.act_inputs, self.dp.diff_acts[k]) if d]
    for a, ct in zip(diff_acts, ct_acts):
      if seg_lib.is_real_cotangent(ct):
        self.cts[a] = ct if a not in self.cts else self.cts[a] + ct
    diff_params = [v for v, d in zip(io.param_inputs, self.dp.diff_params[k]) if d]
    for v, ct in zip(diff_params, ct_params):
      self._accumulate_param_grad(v, ct)
    anchors = [c for c in ct_acts if seg_lib.is_real_cotangent(c)]
    if anchors:
      self.anchor = anchors[-1]
    self._average_done_gradients(k)

  def _average_done_gradients(self, k):
    """Average the persistent gradients that segment k's backward completed (one
    all-reduce), pinned before the next backward compute: else XLA combines every
    segment's all-reduce into one at the end, with all full gradients live until then."""
    done = {}
    for leaf in self.dp.grad_done_at.get(k, ()):
      i = self.dp.s.storage[leaf].members[0]
      grad = (
        self.stacked_grads.pop(leaf, None)
        if self.dp.s.storage[leaf].rolled
        else self.full_grads.pop(i, None)
      )
      if grad is not None:
        done[leaf] = self._as_reduced(i, grad)
    if done:
      averaged = self.mean_over_devices(done)
      pending = {a: c for a, c in self.cts.items() if seg_lib.is_real_cotangent(c)}
      if pending and self.dp.s.data_parallel_size > 1:  # (one device: no all-reduce)
        averaged, pending = lax.optimization_barrier((averaged, pending))
        self.cts.update(pending)
      self.averaged.update(averaged)

  def _as_reduced(self, i, grad):
    """A persistent gradient as the backend sums it (the reduce dtype, on the wire)."""
    return grad.astype(self.dp.reduce_dtype(i)).astype(self.dp.wire_dtype(i))

  def _accumulate_param_grad(self, vid, ct):
    if not seg_lib.is_real_cotangent(ct):
      return
    param, chain = self.dp.chains[vid]
    if chain:  # back through the lazy layout ops (reshape, transpose, cast): all linear
      entry = self.dp.s.params[param]
      base = jax.ShapeDtypeStruct(entry.shape, self.dp.compute_dtype(param))
      (ct,) = jax.linear_transpose(lambda x: seg_lib.apply_chain(chain, x), base)(ct)
    self.full_grads[param] = ct if param not in self.full_grads else self.full_grads[param] + ct

  def mean_over_devices(self, tree):
    """pmean over the data axes; on one device nothing to reduce (no collective at all)."""
    if self.dp.s.data_parallel_size == 1 or not jax.tree.leaves(tree):
      return tree
    return lax.pmean(tree, self.dp.data_axes)

  def average_extra(self, tree):
    """New non-parameter state (e.g. batch statistics): floats averaged over devices."""
    floats = [jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(tree)]
    averaged = iter(self.mean_over_devices([x for x, f in zip(jax.tree.leaves(tree), floats) if f]))
    leaves = [next(averaged) if f else x for x, f in zip(jax.tree.leaves(tree), floats)]
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)

  def gradients(self) -> list:
    """One local gradient per storage leaf: persistent ones averaged over devices (in one
    pmean), sharded ones as reduce-scattered; zeros where untrained or unused."""
    s, persistent = self.dp.s, {}
    for k, leaf in enumerate(s.storage):
      i = leaf.members[0]
      if not leaf.entry.persistent or not ir.has_gradient(leaf.entry):
        continue
      grad = self.stacked_grads.get(k) if leaf.rolled else self.full_grads.pop(i, None)
      if grad is not None:  # summed as the backend would
        persistent[k] = self._as_reduced(i, grad)
    persistent = self.mean_over_devices(persistent)
    for k, grad in self.averaged.items():  # (plus anything that arrived after: none)
      persistent[k] = grad if k not in persistent else persistent[k] + grad
    out = []
    for k, leaf in enumerate(s.storage):
      entry, i = leaf.entry, leaf.members[0]
      if entry.persistent:
        grad = persistent.get(k, jnp.zeros(entry.shape, entry.dtype))
        out.append(grad.astype(self.dp.reduce_dtype(i)).astype(entry.dtype))
      elif k in self.shard_grads:
        out.append(self.shard_grads[k].astype(entry.dtype))
      else:  # unused, frozen or non-float: zero gradient
        out.append(jnp.zeros(layout.local_shape(entry, s.num_devices), entry.dtype))
    return out
