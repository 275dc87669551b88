"""The planner: parameter-use table + config + N devices -> Schedule.

1. Layout: parameters with at most `param_persistence_threshold` elements (and all of them on
   one device) are persistent (replicated); the others are sharded.
2. Buckets: sharded, used parameters grouped by owning module and dtype, in first-use order;
   stacked parameters (loops.py: consumed one layer per iteration by a scan) form buckets
   of their own, gathered one layer at a time. With `roll_layers`, runs of identical
   layers (roll.py) are loops too: their buckets hold the first layer's parameters and
   list every layer's (`Bucket.layers`); each per-layer parameter is stored in its run's
   stack (`ParamEntry.stack`/`layer`: one [L, ...] leaf of the layout, as a scan's).
3. Segments: the op list cut so that a segment starts where a bucket that is not yet in use
   is needed, and ends after its last parameter use (releases come promptly): right after
   it, or past the elementwise ops that follow where that makes backward keep fewer bytes
   (a BatchNorm's segment takes its ReLU when a residual add reads the ReLU's output).
   Persistent trained parameters cut the same way, one group per owning module where its
   gradient outweighs the activations the cut makes backward keep: each segment's
   backward ends with the all-reduce of the persistent gradients it completed
   (ir.persistent_reductions), so they are not all live at once at the end. A scan
   with stacked parameters, or a rolled run of layers, is a segment of its own, run by a
   "loop" step.
4. Instances: each bucket's uses are grouped into gather instances; a gap of more than
   `max_reuse_distance` elements of work (parameter elements used in between) splits an
   instance (release, then gather again). The last instance stays gathered into backward
   when the work to the mirrored backward use is within the distance. Then
   `max_live_parameters` is enforced by releasing the kept bucket whose next use is farthest.
5. Steps: each phase (forward segments 0..K-1, backward K-1..0) gathers at need, moved
   earlier (prefetch) while upcoming-but-unused gathered elements stay within
   `prefetch_bucket_size` and live elements within `max_live_parameters`. In backward each
   instance's gradient is reduce-scattered after its last backward use, then released.
   A loop segment's compute becomes a loop step whose body gathers its stacked buckets'
   current layer, computes, (backward: reduce-scatters the layer's gradient,) releases.
   The body gathers one iteration ahead (prefetch) when one layer's elements fit in
   `prefetch_bucket_size` and two layers fit under `max_live_parameters`. A rolled layer
   is first planned by these same rules over its sub-modules (loop_parts.py: its parts);
   unless that plan gathers the whole layer at once, the body follows it part by part
   (backward: recompute the parts, then their vjps in reverse), without the prefetch
   across iterations; a run that cannot keep the knobs is planned unrolled, and
   `schedule.rolling` says why.
6. hpZ (`secondary_partition`): a bucket that backward re-gathers gets "keep_secondary"
   right after its first forward gather and "drop_secondary" right after its last backward
   gather (in a loop body: after the layer's gather, in both directions).
"""

import bisect
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zjax._src.config import ZeroConfig
from zjax._src.errors import ScheduleError
from zjax._src.layout import tensor_parallel
from zjax._src.layout import tensor_specs as tensor_specs_lib
from zjax._src.plan import tensor_comm
from zjax._src.program import loop_parts, loops, roll
from zjax._src.program import segments as seg_lib
from zjax._src.program.trace import (
  ProgramTrace,
  data_axis_bound,
  gradient_free,
  param_views,
  trace_for_schedule,
)
from zjax._src.schedule import ir
from zjax._src.schedule.schedule import Schedule, program_hash


def compile_schedule(
  loss_fn: Callable,
  params: Any,
  batch: Any,
  *,
  mesh=None,
  num_devices: int | None = None,
  config: ZeroConfig | None = None,
  frozen: Any = None,
  extra: Any = None,
  platform: str | None = None,
  replica_sizes: tuple[int, ...] | None = None,
  axis_sizes: dict[str, int] | None = None,
  tensor_specs: Any = None,
  logical_axis_rules: Any = None,
) -> Schedule:
  """Trace `loss_fn(params, batch)` and plan its ZeRO-3 schedule.

  Args:
    loss_fn: `(params, batch) -> scalar loss`; any pure JAX function (Flax linen: wrap
      `model.apply`; NNX: merge the split graph inside).
    params, batch: example pytrees of arrays or `jax.ShapeDtypeStruct`s (no device memory is
      needed: planning is analytic). `batch` is the global batch; the program is traced on
      one device's share of it (leading dimensions / N), which is what the executor runs.
      If some leading dimension does not divide by N (planning for more devices than the
      example batch has rows), the batch is traced as given.
    mesh: the mesh to run on; every axis must be one of `config.shard_axes` or
      `config.replicate_axes` (HSDP: one sharded copy per replica).
    num_devices: N, instead of a mesh (e.g. to plan for more devices than are present),
      for one shard axis.
    axis_sizes: instead of a mesh, the size of every axis the config names (e.g.
      `{"replica": 128, "fsdp": 8}`): analytic planning for any mesh shape.
    config: the knobs; `ZeroConfig()` by default.
    frozen: parameters that are not trained: a pytree of bools shaped like params, or a
      function of a leaf's path string (e.g. `lambda path: "embed" in path`). They are
      gathered for compute but get no gradient communication and no optimizer state.
    extra: non-parameter state (e.g. batch statistics) for a loss of the form
      `loss_fn(params, batch, extra) -> (loss, new_extra)`: replicated, not differentiated.
    replica_sizes: with `num_devices`, the sizes of `config.replicate_axes` (default 1
      each); taken from the mesh otherwise.
    platform: the backend whose compiled program the report predicts ("cpu", "gpu",
      "tpu"); by default the mesh's, or JAX's default backend. On "cpu" 16-bit gradients
      are reduced in float32, as XLA's CPU collectives do, and the report counts those bytes.
    tensor_specs: with `config.tensor_axes` (tensor parallelism), which dimension of each
      parameter is split over the tensor axis: a pytree of `PartitionSpec`/None with the
      params' structure, or a list of `(regex, PartitionSpec)` rules searched in the
      "/"-joined parameter path ("params/Dense_0/kernel"; first match wins; no match:
      replicated). Data axes in a spec are ignored (zjax shards every leaf over them).
      Without it, Flax partitioning metadata is used: params boxed by
      `nn.with_logical_partitioning` / `nn.with_partitioning`, or NNX state whose
      variables carry sharding names.
    logical_axis_rules: the rules mapping logical axis names of that metadata to mesh axes
      (MaxText style, e.g. `[("embed", "fsdp"), ("mlp", "tensor")]`); by default the
      rules of the enclosing `nn.logical_axis_rules` context.

  Example:
    >>> import jax, jax.numpy as jnp, zjax
    >>> params = {"w": jnp.ones((512, 512))}
    >>> sched = zjax.compile_schedule(lambda p, x: (x @ p["w"]).mean(), params,
    ...                               jnp.ones((8, 512)), num_devices=8)
    >>> sched.report()["all_gather_count"]
    1
  """
  config = ZeroConfig() if config is None else config
  if not isinstance(config, ZeroConfig):
    raise TypeError(f"config must be a zjax.ZeroConfig, got {type(config).__name__}.")
  sizes = resolve_axis_sizes(config, mesh, num_devices, replica_sizes, axis_sizes)
  tensor = tensor_parallel.resolve(
    params, config, mesh, axis_sizes, tensor_specs, logical_axis_rules
  )
  given, params = params, tensor_specs_lib.unbox(params)
  trace = trace_for_schedule(
    loss_fn, params, batch, config, sizes, extra, mesh=_trace_mesh(config, mesh, axis_sizes)
  )
  if platform is None:
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  schedule = plan_schedule(
    trace,
    config,
    sizes,
    frozen=_frozen_indices(params, frozen, trace),
    platform=platform,
    tensor=tensor,
  )
  object.__setattr__(schedule, "params_treedef", jax.tree_util.tree_structure(params))
  if given is not params:  # Flax boxes: unshard gives them back
    object.__setattr__(schedule, "boxed_treedef", jax.tree_util.tree_structure(given))
  return schedule


def _trace_mesh(config, mesh, axis_sizes):
  """The mesh, or every axis's size in mesh order (tensor parallelism's constraints refer to
  it); None without tensor axes."""
  if not config.tensor_axes:
    return None
  return mesh if mesh is not None else dict(axis_sizes)


def _frozen_indices(params, frozen, trace) -> frozenset:
  if frozen is None:
    return frozenset()
  if callable(frozen):
    return frozenset(p.index for p in trace.params if frozen(p.path))
  flags = jax.tree.leaves(frozen)
  if jax.tree_util.tree_structure(frozen) != jax.tree_util.tree_structure(params) or not all(
    isinstance(f, (bool, np.bool_)) for f in flags
  ):
    raise ValueError(
      "frozen must be a function of the parameter path, or a pytree of bools "
      "with the params' structure (True = frozen)."
    )
  return frozenset(i for i, f in enumerate(flags) if f)


def plan_schedule(
  trace: ProgramTrace,
  config: ZeroConfig,
  axis_sizes: dict[str, int],
  frozen: frozenset = frozenset(),
  platform: str = "",
  tensor=None,
) -> Schedule:
  """Plan a schedule from a traced program (see the module docstring for the steps);
  `axis_sizes`: the size of every data axis (`resolve_axis_sizes`); `tensor`: tensor
  parallelism (`tensor_parallel.resolve`), None without."""
  tensor = tensor_parallel.NONE if tensor is None else tensor
  with data_axis_bound(axis_sizes):  # vjps are traced here too
    return _plan(trace, config, axis_sizes, frozen, platform, tensor)


def _plan(trace, config, axis_sizes, frozen, platform, tensor) -> Schedule:
  rolling = None
  while True:
    try:
      return _plan_with(trace, config, axis_sizes, frozen, platform, rolling, tensor)
    except _DoNotRoll as e:  # plan that run unrolled, and say why
      rolling = roll.Rolling(
        tuple(r for r in e.rolling.runs if r is not e.run), e.rolling.notes + (e.reason,)
      )


class _DoNotRoll(Exception):
  def __init__(self, rolling, run, reason):
    super().__init__(reason)
    self.rolling, self.run, self.reason = rolling, run, reason


def _plan_with(trace, config, axis_sizes, frozen, platform, rolling, tensor) -> Schedule:
  num_devices = int(np.prod([axis_sizes[a] for a in config.storage_axes], dtype=np.int64))
  replica_sizes = tuple(axis_sizes[a] for a in config.replicate_axes)
  shard_sizes = tuple(axis_sizes[a] for a in config.shard_axes)
  persistent = {
    p.index
    for p in trace.params
    if num_devices == 1 or p.size <= config.param_persistence_threshold
  }
  sharded = {p.index for p in trace.params if p.index not in persistent}
  stacked = loops.stacked_params(trace.program, trace.params, sharded)
  tensor = tensor_parallel.per_layer(trace, tensor, stacked)
  zero_gradient = _zero_gradient(trace, frozen)
  if rolling is None:
    rolling = _find_rolling(
      trace, config, persistent, frozen, zero_gradient, set(stacked.values()), tensor
    )
  layers_of = {
    run.stacked[p][0]: run.stacked[p]
    for run in rolling.runs
    for p in range(len(run.stacked))
    if run.stacked[p][0] in sharded
  }
  groups = _group_buckets(trace, persistent, frozen, zero_gradient, stacked, layers_of)
  bucket_of = {i: b for b, (*_, members) in enumerate(groups) for i in members}
  bucket_of.update({i: bucket_of[layers[0]] for layers in layers_of.values() for i in layers})
  stack_of = {
    i: (trace.params[layers[0]].path, layer)
    for run in rolling.runs
    for layers in run.stacked
    for layer, i in enumerate(layers)
  }
  entries = tuple(
    ir.ParamEntry(
      path=p.path,
      shape=p.shape,
      dtype=p.dtype.name,
      persistent=p.index in persistent,
      bucket=bucket_of.get(p.index),
      uses=tuple(u.op for u in p.uses),
      frozen=p.index in frozen,
      stacked=p.index in stacked,
      stack=stack_of.get(p.index, ("", 0))[0],
      layer=stack_of.get(p.index, ("", 0))[1],
      tensor_dim=tensor.dim(p.index),
      tensor_size=tensor.size if tensor.dim(p.index) is not None else 1,
      zero_gradient=p.index in zero_gradient,
    )
    for p in trace.params
  )
  buckets = tuple(
    ir.Bucket(
      id=b,
      module=module,
      dtype=dtype,
      params=tuple(trace.params[i].path for i in members),
      frozen=is_frozen,
      stacked=members[0] in stacked or members[0] in layers_of,
      layers=_layer_paths(trace, members, layers_of),
      zero_gradient=is_zero,
    )
    for b, (module, dtype, is_frozen, is_zero, _, members) in enumerate(groups)
  )
  loop_ranges = {op: op + 1 for op in stacked.values()}  # a scan: one op
  loop_ranges.update((run.start, run.end) for run in rolling.runs)
  segments = _make_segments(trace, {**bucket_of, **_gradient_groups(trace, entries)}, loop_ranges)
  split = frozenset(i for i, e in enumerate(entries) if e.tensor_dim is not None)
  segments, recomputed_lookups = _with_backward_buckets(
    segments, trace, bucket_of, entries, loop_ranges, split
  )
  elements = [
    sum(ir.gathered_elements(entries[i], num_devices) for i in members) for *_, members in groups
  ]
  lengths = {
    b: len(buckets[b].layers) or entries[members[0]].shape[0]
    for b, (*_, members) in enumerate(groups)
    if buckets[b].stacked
  }
  bodies, rolled = {}, []
  for run in rolling.runs:
    k = next(seg.id for seg in segments if seg.start == run.start)
    rolled.append((run, k))
    bodies[k] = _rolled_body(
      trace, run, segments[k], buckets, elements, bucket_of, entries, config, rolling, tensor.any
    )
  unread = (
    {}
    if config.secondary_partition
    # hpZ: each layer's secondary is dropped
    else _scan_unread(trace, segments, stacked, bucket_of, entries, buckets)
  )
  forward, backward = _StepPlanner(
    segments, elements, buckets, config, lengths, bodies, unread
  ).plan()
  return Schedule(
    num_devices=num_devices,
    platform=platform,
    replica_sizes=replica_sizes,
    shard_sizes=shard_sizes,
    config=config,
    num_ops=len(trace.ops),
    program_hash=program_hash(o.primitive for o in trace.ops),
    params=entries,
    buckets=buckets,
    segments=segments,
    forward=forward,
    backward=backward,
    rolling=rolling.notes,
    tensor_sizes=tensor.sizes,
    notes=trace.notes,
    tensor_estimate=tuple(
      tensor_comm.megatron_estimate(
        trace,
        entries,
        segments,
        recomputed_lookups,
        {run.start: (run, bodies[k].backward_ops) for run, k in rolled},
      )
    ),
  )


@dataclasses.dataclass(frozen=True)
class _RolledBody:
  """A rolled loop's per-iteration steps when its layer is cut into parts."""

  parts: tuple  # ir.Segment per part
  forward: tuple  # body steps
  backward: tuple
  need: int  # peak gathered elements inside an iteration
  # a whole-layer loop (no parts): buckets without gradient whose values its backward
  # iteration does not use (an integer leaf's): not re-gathered (XLA would delete them)
  unread: frozenset = frozenset()
  # under tensor parallelism: signatures of the matmuls and gathers its backward iteration
  # executes (loop_parts.backward_op_signatures), for the tensor axis's estimate
  backward_ops: frozenset = frozenset()


def _rolled_body(
  trace, run, seg, buckets, elements, bucket_of, entries, config, rolling, tensor_parallel=False
):
  """The run's layer planned part by part, as the unrolled planner plans segments (the same
  knobs; what the segments around the loop keep gathered through it counts against
  max_live_parameters). Without parts when one whole layer gathered at once is what that
  plan says (the loop gathers it as one, prefetching the next layer where the knobs allow).
  Raises _DoNotRoll where the run cannot keep the knobs (the unrolled plan decides).
  `tensor_parallel`: also find what the backward iteration executes (_RolledBody)."""
  body = _rolled_body_steps(trace, run, seg, buckets, elements, bucket_of, entries, config, rolling)
  if not tensor_parallel:
    return body
  runner, stacked = _runner(trace, run, seg, buckets, bucket_of, entries)
  backward = (
    body.backward
    if body.parts
    else loop_parts.whole_layer_backward(runner, [b for b in stacked if b not in body.unread])
  )
  return dataclasses.replace(
    body, backward_ops=frozenset(loop_parts.backward_op_signatures(runner, list(backward)))
  )


def _runner(trace, run, seg, buckets, bucket_of, entries):
  """The run's loop_parts.PartRunner, and the loop segment's stacked buckets."""
  stacked = [b for b in seg.buckets if buckets[b].stacked]
  members = {
    b: [
      i
      for i in range(len(entries))
      if bucket_of.get(i) == b and trace.params[i].path in buckets[b].params
    ]
    for b in stacked
  }
  return loop_parts.part_runner(trace.program, run, members, entries, bucket_of), stacked


def _rolled_body_steps(trace, run, seg, buckets, elements, bucket_of, entries, config, rolling):
  runner, stacked = _runner(trace, run, seg, buckets, bucket_of, entries)
  position_bucket = {q: bucket_of[i] for q, i in runner.gathered.items()}
  parts = tuple(
    ir.Segment(
      id=p,
      start=run.start + io.start,
      end=run.start + io.end,
      buckets=tuple(sorted({position_bucket[q] for q in io.positions})),
      backward_buckets=loop_parts.backward_reads(runner, p, position_bucket),
      label=_part_label(trace, run, runner, io),
    )
    for p, io in enumerate(runner.parts)
  )
  around = sum(elements[b] for b in seg.buckets if not buckets[b].stacked)
  inner_config = dataclasses.replace(
    config, max_live_parameters=max(config.max_live_parameters - around, 0)
  )
  flat = tuple(dataclasses.replace(b, stacked=False) for b in buckets)
  names = roll.layer_names(trace.params, run)
  try:
    forward, backward = _StepPlanner(parts, elements, flat, inner_config).plan()
  except ScheduleError as e:  # e.g. with what is kept around it, a part does not fit
    raise _DoNotRoll(rolling, run, f"not rolled: {names}: {e}; planned unrolled") from None
  # every bucket gathered before the first part and none again in backward: the peak is one
  # whole layer either way, and the whole-layer loop may prefetch the next layer
  first_compute = next(k for k, st in enumerate(forward) if st.op == "compute")
  whole_layer = _RolledBody(
    (),
    (),
    (),
    0,
    frozenset() if config.secondary_partition else _unread_in_backward(runner, stacked, buckets),
  )
  if not any(st.op == "gather" for st in forward[first_compute:] + backward):
    return whole_layer
  if config.secondary_partition:  # hpZ keeps one secondary per layer gather: whole layers
    whole = sum(elements[b] for b in stacked)
    if whole + around <= config.max_live_parameters:
      return whole_layer
    raise _DoNotRoll(
      rolling,
      run,
      (
        f"not rolled: one layer of {names} needs {whole} "
        f"gathered elements, above max_live_parameters={config.max_live_parameters} with "
        f"what is kept around it, and under hpZ (secondary_partition) a rolled layer is "
        f"gathered whole; planned unrolled, sub-module by sub-module"
      ),
    )
  kept = [b for b in stacked if not any(st.op == "release" and st.bucket == b for st in forward)]
  as_part = lambda st, op=None: (
    dataclasses.replace(  # noqa: E731
      st, op=op or st.op, segment=seg.id, part=st.segment
    )
    if st.op == "compute"
    else st
  )
  forward_body = tuple(as_part(st) for st in forward) + tuple(
    ir.Step("release", bucket=b) for b in sorted(kept)
  )
  backward_body = [as_part(st, ir.RECOMPUTE_OP) for st in forward]
  backward_body += [as_part(st) for st in backward]
  unused, _ = loop_parts.unused_gathers(runner, backward_body)
  backward_body = _without_gathers(backward_body, unused)
  need = max(_peak(forward_body, elements), _peak(backward_body, elements))
  return _RolledBody(parts, forward_body, tuple(backward_body), need)


def _scan_unread(trace, segments, stacked, bucket_of, entries, buckets) -> dict:
  """Scan segment -> its stacked buckets without gradient whose values a backward iteration
  does not read (loops.backward_unread): the loop step does not re-gather them."""
  views, out = None, {}
  for seg in segments:
    members = [i for i, op in stacked.items() if op == seg.start]
    if not any(not ir.has_gradient(buckets[bucket_of[i]]) for i in members):
      continue
    views = views or param_views(trace.program, len(trace.params))
    op = trace.program.ops[seg.start]
    positions = {j: i for i in members for j in loops.input_positions(op, i, views)}
    unread = loops.backward_unread(
      op, {j: ir.has_gradient(entries[i]) for j, i in positions.items()}
    )
    out[seg.id] = frozenset(
      b
      for b in {bucket_of[i] for i in members}
      if not ir.has_gradient(buckets[b])
      and all(j in unread for j, i in positions.items() if bucket_of[i] == b)
    )
  return out


def _part_label(trace, run, runner, io) -> str:
  """The module of the part's first op that reads a gathered weight (as segments' labels)."""
  for j in range(io.start, io.end):
    if any(src[0] == "layer" and src[1] in runner.gathered for src in run.sources[j]):
      return trace.ops[run.start + j].module
  return trace.ops[run.start + io.start].module


def _unread_in_backward(runner, stacked, buckets) -> frozenset:
  unused, _ = loop_parts.unused_gathers(runner, loop_parts.whole_layer_backward(runner, stacked))
  return frozenset(stacked[k] for k in unused if not ir.has_gradient(buckets[stacked[k]]))


def _without_gathers(body, unused) -> list:
  """The body without the gathers at `unused` and the releases that close them."""
  out, closing = [], set()
  for k, st in enumerate(body):
    if k in unused:
      closing.add(st.bucket)
    elif st.op == "release" and st.bucket in closing:
      closing.discard(st.bucket)
    else:
      out.append(st)
  return out


def _peak(body, elements) -> int:
  live, peak = set(), 0
  for st in body:
    if st.op == "gather":
      live.add(st.bucket)
    elif st.op == "release":
      live.discard(st.bucket)
    peak = max(peak, sum(elements[b] for b in live))
  return peak


def _zero_gradient(trace, frozen) -> frozenset[int]:
  """Trained parameters that the loss reads, but only where no gradient flows
  (trace.gradient_free): zero gradient, not reduced. (A parameter it never reads has no
  uses, which says the same.)"""
  free = gradient_free(trace.program, len(trace.params))
  return frozenset(
    p.index
    for p in trace.params
    if p.index in free and p.uses and ir.is_float(p.dtype) and p.index not in frozen
  )


def _find_rolling(
  trace, config, persistent, frozen, zero_gradient, loop_ops, tensor
) -> roll.Rolling:
  """Runs of identical layers to run as loops (roll.py), unless config.roll_layers is off."""
  if not config.roll_layers:
    return roll.Rolling((), ("layer rolling is off (ZeroConfig.roll_layers=False)",))
  facts = roll.param_facts(trace.params, persistent, frozen, tensor.dims, zero_gradient)
  return roll.find_runs(trace.program, facts, excluded=loop_ops)


def _layer_paths(trace, members, layers_of) -> tuple[tuple[str, ...], ...]:
  """A rolled bucket's parameter paths per layer (layer 0 first); () for other buckets."""
  if members[0] not in layers_of:
    return ()
  length = len(layers_of[members[0]])
  return tuple(
    tuple(trace.params[layers_of[i][layer]].path for i in members) for layer in range(length)
  )


def resolve_axis_sizes(
  config, mesh=None, num_devices=None, replica_sizes=None, axis_sizes=None
) -> dict[str, int]:
  """The size of every data axis (replicate axes, then shard axes), from exactly one of a
  mesh, N (one shard axis; replica_sizes: the replicate axes', default 1) or axis_sizes."""
  if sum(x is not None for x in (mesh, num_devices, axis_sizes)) != 1:
    raise ValueError(
      "Pass exactly one of mesh= (the mesh to run on), num_devices= (N, to "
      "plan analytically) or axis_sizes= (every axis's size, analytically)."
    )
  if replica_sizes is not None and num_devices is None:
    raise ValueError(
      "replica_sizes goes with num_devices= (analytic planning); with a mesh "
      "the replicate axes' sizes are the mesh's, with axis_sizes= name them."
    )
  axes = config.data_axes
  if num_devices is not None:
    if config.tensor_axes:
      raise ValueError(
        f"num_devices= gives the shard axis's size only, but ZeroConfig."
        f"tensor_axes is {config.tensor_axes}; pass axis_sizes= with every "
        f"axis's size (or mesh=)."
      )
    if len(config.shard_axes) > 1:
      raise ValueError(
        f"num_devices= names one shard axis's size, but ZeroConfig.shard_axes "
        f"is {config.shard_axes}; pass axis_sizes= with every axis's size."
      )
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
      raise ValueError(f"num_devices must be a positive int, got {num_devices!r}.")
    replica_sizes = (
      (1,) * len(config.replicate_axes) if replica_sizes is None else tuple(replica_sizes)
    )
    if len(replica_sizes) != len(config.replicate_axes):
      raise ValueError(
        f"replica_sizes must give one positive int per replicate axis "
        f"{list(config.replicate_axes)}, got {replica_sizes!r}."
      )
    axis_sizes = dict(zip(axes, (*replica_sizes, num_devices)))
  elif mesh is not None:
    for axis in axes:
      if axis not in mesh.shape:
        field = "replicate_axes" if axis in config.replicate_axes else "shard_axes/axis_name"
        raise ValueError(
          f"ZeroConfig.{field} names {axis!r}, but the mesh has axes "
          f"{tuple(mesh.shape)}; name the mesh axis {axis!r} or change the "
          f"config."
        )
    for axis in mesh.axis_names:
      if axis not in config.mesh_axes:
        raise ValueError(
          f"Mesh axis {axis!r} is neither a shard axis (ZeroConfig.shard_axes="
          f"{config.shard_axes!r}) nor a replicate axis (ZeroConfig."
          f"replicate_axes={config.replicate_axes!r}) nor a tensor axis "
          f"(ZeroConfig.tensor_axes={config.tensor_axes!r}); add it to one of "
          f"them (replicate_axes: HSDP) or use a mesh without it."
        )
    axis_sizes = {a: int(mesh.shape[a]) for a in axes}
  else:
    if not isinstance(axis_sizes, dict) or set(axis_sizes) != set(config.mesh_axes):
      raise ValueError(
        f"axis_sizes must give the size of exactly the config's axes "
        f"{list(config.mesh_axes)}, got {axis_sizes!r}."
      )
    axis_sizes = {a: axis_sizes[a] for a in axes}
  for axis, size in axis_sizes.items():
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(f"The size of axis {axis!r} must be a positive int, got {size!r}.")
  return {a: int(n) for a, n in axis_sizes.items()}


def _group_buckets(
  trace, persistent, frozen, zero_gradient, stacked, layers_of
) -> list[tuple[str, str, bool, bool, Any, list[int]]]:
  """(owner module, dtype, frozen, zero gradient, loop or None, param indices) per bucket,
  in order of first use. Stacked parameters are bucketed per loop, apart from the others; a
  rolled run's buckets hold its first layer's parameters (`layers_of`: first-layer
  parameter -> its counterpart in every layer), standing for every layer."""
  later_layers = {i for layers in layers_of.values() for i in layers[1:]}
  used = [
    p for p in trace.params if p.uses and p.index not in persistent and p.index not in later_layers
  ]
  used.sort(key=lambda p: (p.uses[0].op, p.index))
  groups: dict[tuple, list[int]] = {}
  for p in used:
    loop = stacked.get(
      p.index, ("rolled", len(layers_of[p.index])) if p.index in layers_of else None
    )
    key = (p.owner, p.dtype.name, p.index in frozen, p.index in zero_gradient, loop)
    groups.setdefault(key, []).append(p.index)
  return [(*key, members) for key, members in groups.items()]


def _gradient_groups(trace, entries) -> dict[int, int]:
  """Persistent trained parameters (outside rolled stacks) -> a negative segment key per
  owning module, for the modules whose gradient is worth a cut of its own. Such a group
  cuts segments as a bucket does, so that its gradients are averaged right after the
  backward that completes them (the executor's `_average_done_gradients`), not with all the
  others at the end of the step, where every full gradient of a data-parallel model would
  be live together. A cut also makes backward keep the values that cross it (the next
  segment's inputs): a module whose gradient is not larger than those (a norm's scale)
  cuts nothing and is averaged with the segment it falls in."""
  members: dict[str, list[int]] = {}  # owning module -> its persistent trained leaves
  for p in trace.params:
    e = entries[p.index]
    if e.persistent and ir.has_gradient(e) and p.uses and not e.stack:
      members.setdefault(p.owner, []).append(p.index)
  crossing = _crossing_bytes(trace.program)
  groups = {}
  for g, ids in enumerate(members.values()):
    first = min(u.op for i in ids for u in trace.params[i].uses)
    if sum(entries[i].size * jnp.dtype(entries[i].dtype).itemsize for i in ids) > crossing[first]:
      groups.update((i, -1 - g) for i in ids)
  return groups


def _crossing_bytes(program) -> list[int]:
  """Per op j: bytes of the values computed before op j and read at or after it."""
  n, last = len(program.ops), _last_reads(program)
  change = np.zeros(n + 2, np.int64)
  for j, op in enumerate(program.ops):
    for v in op.outputs:
      if last.get(v, -1) > j:
        change[j + 1] += ir.aval_bytes(program.avals[v])
        change[last[v] + 1] -= ir.aval_bytes(program.avals[v])
  return np.cumsum(change)[: n + 1].tolist()


def _make_segments(trace, bucket_of, loop_ranges=None) -> tuple[ir.Segment, ...]:
  """Cut the op list where a bucket not used by the current segment is needed (at the
  cheapest point after the current one's last use: `_cheapest_cut`); a loop
  (`loop_ranges`: first op -> end; a scan with stacked parameters, or a rolled run of
  layers) is a segment of its own. Negative keys in `bucket_of` (`_gradient_groups`) cut
  as buckets do but are not buckets of the segment."""
  loop_ranges = loop_ranges or {}
  last_read = _last_reads(trace.program)
  stops = sorted(
    {u.op for p in trace.params for u in p.uses}  # no cut moves past these
    | {k for k, op in enumerate(trace.program.ops) if not _elementwise(trace.program, op)}
  )
  buckets_at: dict[int, set[int]] = {}
  for p in trace.params:
    if p.index in bucket_of:
      for u in p.uses:
        buckets_at.setdefault(u.op, set()).add(bucket_of[p.index])
  cuts = []  # (end, bucket ids, first op that uses a bucket)
  current, last_op, first, loop_end = set(), None, None, -1
  for op in sorted(set(buckets_at) | set(loop_ranges)):
    if op < loop_end:
      continue
    if op in loop_ranges:
      end = cuts[-1][0] if cuts else 0
      if current or end < op:
        cuts.append((op, sorted(current), first))
      loop_end = loop_ranges[op]
      used = set().union(*(buckets_at.get(k, set()) for k in range(op, loop_end)))
      cuts.append((loop_end, sorted(used), op))
      current = set()
      continue
    if current and not buckets_at[op] <= current:
      start, lo = cuts[-1][0] if cuts else 0, last_op + 1
      hi = min(op, stops[bisect.bisect_left(stops, lo)])
      cuts.append((_cheapest_cut(trace.program, last_read, start, lo, hi), sorted(current), first))
      current = set()
    if not current:
      first = op
    current |= buckets_at[op]
    last_op = op
  if current or not cuts or cuts[-1][0] < len(trace.ops):
    cuts.append((len(trace.ops), sorted(current), first if current else None))
  segments, start = [], 0
  for i, (end, bucket_ids, first_op) in enumerate(cuts):
    label = trace.ops[first_op].module if first_op is not None else ""
    if not label and bucket_ids:  # no name stack (e.g. NNX): name the owner module instead
      first = min(bucket_ids, key=lambda b: (b < 0, abs(b)))  # a bucket, else a group
      label = trace.params[_first_member(first, bucket_of)].owner
    bucket_ids = [b for b in bucket_ids if b >= 0]
    segments.append(
      ir.Segment(
        id=i, start=start, end=end, buckets=tuple(bucket_ids), backward_buckets=(), label=label
      )
    )
    start = end
  return tuple(segments)


def _cheapest_cut(program, last_read, start: int, lo: int, hi: int) -> int:
  """Where to end the segment that starts at op `start`: at op lo (right after its last
  parameter use, op lo - 1) or later, up to op hi (the next parameter use, or the first op
  that is not elementwise), wherever the fewest bytes cross that only this cut makes
  backward keep; the earliest of equals. The next segment saves what crosses for its
  recompute. Not counted: a value computed before the segment or read after op hi (some
  segment's input wherever this cut goes) and a matmul's output (the residual policy keeps
  it). So a cut after a BatchNorm moves past its ReLU when a residual add reads the ReLU's
  output: it would otherwise keep both. Moving cuts further (over a norm's statistics,
  attention's matmuls) grew the recompute of the segment before: BERT-style 93 -> 123 KiB."""
  crossing = {}  # value id -> bytes, of the values computed in [start, j) read in [j, hi]
  for k in range(start, lo):
    _add_computed(program, k, lo, hi, last_read, crossing)
  best, best_bytes = lo, None
  for j in range(lo, hi + 1):
    crossing = {v: b for v, b in crossing.items() if last_read[v] >= j}
    kept = sum(crossing.values())
    if best_bytes is None or kept < best_bytes:
      best, best_bytes = j, kept
    _add_computed(program, j, j + 1, hi, last_read, crossing)
  return best


def _elementwise(program, op) -> bool:
  """Whether each output of `op` has an input's shape (an activation, a residual add)."""
  shapes = {tuple(program.avals[a].shape) for a in op.inputs if isinstance(a, int)}
  return bool(op.outputs) and all(tuple(program.avals[v].shape) in shapes for v in op.outputs)


def _add_computed(program, k: int, lo: int, hi: int, last_read, crossing):
  """Adds op k's outputs last read in [lo, hi] (not a matmul's: its outputs are kept)."""
  op = program.ops[k]
  if op.primitive in seg_lib.SAVED_PRIMITIVES:
    return
  for v in op.outputs:
    if lo <= last_read.get(v, -1) <= hi:
      crossing[v] = ir.aval_bytes(program.avals[v])


def _last_reads(program) -> dict[int, int]:
  """Value id -> the last op that reads it (len(ops): the program's result)."""
  last = {a: j for j, op in enumerate(program.ops) for a in op.inputs if isinstance(a, int)}
  last.update((a, len(program.ops)) for a in program.output_ids if isinstance(a, int))
  return last


def _with_backward_buckets(
  segments, trace, bucket_of, entries, loop_ranges=None, split=frozenset()
):
  """Fill each segment's backward_buckets: the buckets its vjp reads (see segments.py). A
  loop's backward recomputes each iteration, so it reads all its buckets. Also returns, per
  segment, the parameters in `bucket_of` or `split` (tensor-split, persistent or not) that
  a lookup (gather) the vjp recomputes reads: tensor_comm counts those lookups' collectives."""
  program = trace.program
  a = seg_lib.analyze(
    program, segments, [ir.has_gradient(e) for e in entries], [e.persistent for e in entries]
  )
  out, reads = [], []
  for k, (seg, io) in enumerate(zip(segments, a.ios)):
    if (loop_ranges or {}).get(seg.start) == seg.end:
      out.append(dataclasses.replace(seg, backward_buckets=seg.buckets))
      reads.append(frozenset(a.chains[v][0] for v in io.param_inputs))
      continue
    params = [a.chains[v][0] for v in io.param_inputs]
    asked = [j for j, i in enumerate(params) if i in bucket_of or i in split]
    needed, looked_up = (
      seg_lib.backward_param_reads(
        io, program.avals, a.diff_params[k], a.diff_acts[k], a.replicated[k]
      )
      if asked
      else ((), ())
    )
    backward = {bucket_of[params[j]] for j in needed if params[j] in bucket_of}
    out.append(dataclasses.replace(seg, backward_buckets=tuple(sorted(backward))))
    reads.append(frozenset(params[j] for j in looked_up if j in asked))
  return tuple(out), tuple(reads)


def _first_member(bucket: int, bucket_of: dict[int, int]) -> int:
  return min(i for i, b in bucket_of.items() if b == bucket)


@dataclasses.dataclass
class _Instance:
  """One gathered lifetime of a bucket in forward (mirrored in backward)."""

  bucket: int
  uses: list[int]  # forward segments that use it, ascending
  keep_turn: bool = False  # stays gathered from its last forward use into backward
  backward_uses: list[int] = dataclasses.field(default_factory=list)  # uses whose vjp reads it

  @property
  def start(self) -> int:
    return self.uses[0]

  @property
  def end(self) -> int:
    return self.uses[-1]


@dataclasses.dataclass
class _Interval:
  """A live interval in one phase's time (the k-th segment computed in that phase)."""

  bucket: int
  need: int  # first compute that needs it
  end: int  # last compute before release
  live_at_start: bool = False  # kept from forward: no gather in this phase
  kept: bool = False  # stays gathered past this phase's end: no release in this phase
  gather_at: int = -1


class _StepPlanner:
  def __init__(
    self,
    segments,
    elements,
    buckets,
    config: ZeroConfig,
    lengths=None,
    bodies=None,
    scan_unread=None,
  ):
    self.k = len(segments)
    self.elements = elements
    self.buckets = buckets
    self.config = config
    self.full_segments = segments
    # Stacked buckets live inside their loop step only; the rest is planned around them.
    self.segments = tuple(
      dataclasses.replace(
        seg,
        buckets=self._regular(seg.buckets),
        backward_buckets=self._regular(seg.backward_buckets),
      )
      for seg in segments
    )
    # rolled loops: segment -> _RolledBody (with parts, or gathered as one whole layer)
    # loop segment -> stacked buckets its backward iteration does not read (not re-gathered)
    self.unread = {**(scan_unread or {}), **{k: body.unread for k, body in (bodies or {}).items()}}
    self.bodies = {k: body for k, body in (bodies or {}).items() if body.parts}
    self.loop_need = [
      self.bodies[seg.id].need
      if seg.id in self.bodies
      else sum(elements[b] for b in seg.buckets if buckets[b].stacked)
      for seg in segments
    ]  # one layer of every stacked bucket
    lengths = lengths or {}
    work = [sum(elements[b] * (lengths.get(b, 1)) for b in seg.buckets) for seg in segments]
    self.work_prefix = [0]
    for w in work:
      self.work_prefix.append(self.work_prefix[-1] + w)
    self.lengths = lengths

  def _regular(self, bucket_ids) -> tuple[int, ...]:
    return tuple(b for b in bucket_ids if not self.buckets[b].stacked)

  def plan(self) -> tuple[tuple[ir.Step, ...], tuple[ir.Step, ...]]:
    self._check_segments_fit()
    instances = self._instances()
    self._enforce_cap(instances)
    k = self.k
    fwd = [
      _Interval(i.bucket, i.start, k - 1 if i.keep_turn else i.end, kept=i.keep_turn)
      for i in instances
    ]
    bwd = [
      _Interval(
        i.bucket, k - 1 - i.backward_uses[-1], k - 1 - i.backward_uses[0], live_at_start=i.keep_turn
      )
      for i in instances
      if i.backward_uses
    ]
    fwd_live = self._place_gathers(fwd, self.loop_need)
    bwd_live = self._place_gathers(bwd, self.loop_need[::-1])
    scatter_at = [
      (k - 1 - i.start, i.bucket)
      for i in self._reducing(instances)
      if ir.has_gradient(self.buckets[i.bucket])
    ]
    # hpZ: a bucket re-gathered in backward keeps a secondary shard from its first forward
    # gather until its last backward gather
    self.secondary = (
      {iv.bucket for iv in bwd if not iv.live_at_start}
      if self.config.secondary_partition
      else set()
    )
    self.kept_secondary = set()
    forward = self._emit(fwd, "forward", scatter_at=[], live=fwd_live)
    backward = self._emit(bwd, "backward", scatter_at=scatter_at, live=bwd_live)
    return forward, backward

  def _reducing(self, instances) -> list[_Instance]:
    """The instances after whose backward uses a reduce-scatter runs: every one, or per
    bucket only the first (its backward comes last: one reduction per step)."""
    if self.config.gradient_reduction == "per_gather":
      return instances
    first = {}
    for inst in instances:
      if inst.bucket not in first or inst.start < first[inst.bucket].start:
        first[inst.bucket] = inst
    return list(first.values())

  def _distance(self, i: int, j: int) -> int:
    """Elements of work strictly between forward segments i < j."""
    return self.work_prefix[j] - self.work_prefix[i + 1]

  def _check_segments_fit(self):
    cap = self.config.max_live_parameters
    for seg in self.full_segments:
      regular = self.segments[seg.id].buckets  # a loop's stacked ones count as loop_need
      need = self.loop_need[seg.id] + sum(self.elements[b] for b in regular)
      if need > cap:
        names = "; ".join(
          f"bucket {b} ({self.buckets[b].module}: {self.elements[b]} elements"
          f" of {', '.join(self.buckets[b].params)})"
          for b in seg.buckets
        )
        raise ScheduleError(
          f"Segment {seg.id} ({seg.label or 'ops ' + str(seg.start)}) needs {need} gathered "
          f"parameter elements at once ({names}), above max_live_parameters={cap}. A "
          f"bucket (one module's parameters of one dtype) is gathered whole, as the ops "
          f"that read it need it: raise max_live_parameters to at least {need}."
        )

  def _instances(self) -> list[_Instance]:
    uses: dict[int, list[int]] = {}
    for seg in self.segments:
      for b in seg.buckets:
        uses.setdefault(b, []).append(seg.id)
    reuse = self.config.max_reuse_distance
    instances = []
    for b in sorted(uses):
      current = _Instance(b, [uses[b][0]])
      for s in uses[b][1:]:
        if self._distance(current.end, s) > reuse:
          instances.append(current)
          current = _Instance(b, [])
        current.uses.append(s)
      instances.append(current)
    for inst in instances:
      inst.backward_uses = [
        s for s in inst.uses if inst.bucket in self.segments[s].backward_buckets
      ]
    last = {inst.bucket: inst for inst in instances}  # each bucket's last instance
    for inst in last.values():
      inst.keep_turn = bool(inst.backward_uses) and self._turn_distance(inst) <= reuse
    return instances

  def _turn_distance(self, inst: _Instance) -> int:
    """Work from the last forward use to the first backward use that reads the bucket."""
    total = self.work_prefix[self.k]
    return (total - self.work_prefix[inst.end + 1]) + (
      total - self.work_prefix[inst.backward_uses[-1] + 1]
    )

  def _enforce_cap(self, instances: list[_Instance]):
    """Release kept buckets (farthest next use first) wherever live elements exceed the cap."""
    cap = self.config.max_live_parameters
    for t in range(self.k):
      while True:
        live = [i for i in instances if i.start <= t <= (self.k - 1 if i.keep_turn else i.end)]
        if sum(self.elements[i.bucket] for i in live) + self.loop_need[t] <= cap:
          break
        idle = [i for i in live if t not in i.uses]
        victim = max(idle, key=lambda i: self._next_use(i, t))
        self._split(instances, victim, t)

  def _next_use(self, inst: _Instance, t: int) -> int:
    later = [s for s in inst.uses if s > t]
    return later[0] if later else 2 * self.k  # next use is in backward

  def _split(self, instances, inst: _Instance, t: int):
    if t > inst.end:
      inst.keep_turn = False
      return
    tail = _Instance(
      inst.bucket,
      [s for s in inst.uses if s > t],
      inst.keep_turn,
      [s for s in inst.backward_uses if s > t],
    )
    inst.uses = [s for s in inst.uses if s < t]
    inst.backward_uses = [s for s in inst.backward_uses if s < t]
    inst.keep_turn = False
    instances.insert(instances.index(inst) + 1, tail)

  def _place_gathers(self, intervals: list[_Interval], loop_need) -> list[int]:
    """Gather at need, or earlier (prefetch) as DeepSpeed's lookahead window allows; returns
    the live elements at each time, loops' one layer included.

    A gather needed at time g is issued at t < g when the elements of every gather needed in
    (t, g] fit in `prefetch_bucket_size`, and live elements stay within the cap.
    """
    live = list(loop_need)
    needed_at = [0] * self.k  # elements of gathers needed at each time
    for iv in intervals:
      for t in range(0 if iv.live_at_start else iv.need, iv.end + 1):
        live[t] += self.elements[iv.bucket]
      if not iv.live_at_start:
        needed_at[iv.need] += self.elements[iv.bucket]
    previous_end: dict[int, int] = {}
    for iv in sorted(intervals, key=lambda iv: (iv.need, iv.bucket)):
      lo = previous_end.get(iv.bucket, -1) + 1
      previous_end[iv.bucket] = iv.end
      if iv.live_at_start:
        continue
      size, iv.gather_at, window = self.elements[iv.bucket], iv.need, 0
      for t in range(iv.need - 1, lo - 1, -1):
        window += needed_at[t + 1]
        if (
          window > self.config.prefetch_bucket_size
          or live[t] + size > self.config.max_live_parameters
        ):
          break
        live[t] += size
        iv.gather_at = t
    return live

  def _emit(self, intervals, phase, scatter_at, live) -> tuple[ir.Step, ...]:
    """Steps in time order: gathers, the compute (or loop), reduce-scatters, releases."""
    steps = []
    gathers_left = {
      b: sum(iv.bucket == b and not iv.live_at_start for iv in intervals) for b in self.secondary
    }
    for t in range(self.k):
      starting = sorted(
        (iv for iv in intervals if iv.gather_at == t),
        key=lambda iv: (iv.need > t, iv.need, iv.bucket),
      )
      for iv in starting:
        steps.append(ir.Step("gather", bucket=iv.bucket, prefetch=iv.need > t))
        steps += self._secondary_steps(iv.bucket, phase, gathers_left)
      steps.append(self._compute_step(t if phase == "forward" else self.k - 1 - t, phase, live[t]))
      steps += [ir.Step("reduce_scatter", bucket=b) for when, b in sorted(scatter_at) if when == t]
      ending = sorted(iv.bucket for iv in intervals if iv.end == t and not iv.kept)
      steps += [ir.Step("release", bucket=b) for b in ending]
    return tuple(steps)

  def _secondary_steps(self, b, phase, gathers_left) -> list[ir.Step]:
    """hpZ: keep the secondary after the first forward gather, drop it after the last
    backward one (`gathers_left`: bucket -> backward gathers still to come)."""
    if b not in gathers_left:
      return []
    if phase == "forward":
      if b in self.kept_secondary:
        return []
      self.kept_secondary.add(b)
      return [ir.Step("keep_secondary", bucket=b)]
    gathers_left[b] -= 1
    return [ir.Step("drop_secondary", bucket=b)] if gathers_left[b] == 0 else []

  def _compute_step(self, k: int, phase: str, live: int) -> ir.Step:
    """compute k, or for a loop segment the loop step with its per-iteration body."""
    stacked = [b for b in self.full_segments[k].buckets if self.buckets[b].stacked]
    if not stacked:
      return ir.Step("compute", segment=k)
    if k in self.bodies:  # cut into parts: no prefetch across iterations
      body = self.bodies[k]
      return ir.Step(
        ir.LOOP_OP,
        segment=k,
        length=self.lengths[stacked[0]],
        parts=body.parts,
        body=body.forward if phase == "forward" else body.backward,
      )
    need = self.loop_need[k]
    prefetch = (
      self.lengths[stacked[0]] > 1
      and need <= self.config.prefetch_bucket_size
      and live + need <= self.config.max_live_parameters
    )
    if phase == "backward":  # re-gather what the backward iteration reads
      stacked = [b for b in stacked if b not in self.unread.get(k, ())]
    body = [ir.Step("gather", bucket=b, prefetch=prefetch) for b in stacked]
    if self.config.secondary_partition:  # hpZ: every layer's secondary, kept until backward
      op = "keep_secondary" if phase == "forward" else "drop_secondary"
      body += [ir.Step(op, bucket=b) for b in stacked]
    body.append(ir.Step("compute", segment=k))
    if phase == "backward":
      body += [
        ir.Step("reduce_scatter", bucket=b) for b in stacked if ir.has_gradient(self.buckets[b])
      ]
    body += [ir.Step("release", bucket=b) for b in stacked]
    return ir.Step(ir.LOOP_OP, segment=k, length=self.lengths[stacked[0]], body=tuple(body))
