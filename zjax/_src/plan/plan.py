"""The planner: parameter-use table + config + N devices -> Schedule.

1. Layout: parameters with at most `param_persistence_threshold` elements (and all of them on
   one device) are persistent (replicated); the others are sharded.
2. Buckets: sharded, used parameters grouped by owning module and dtype, in first-use order
   (a module whose group exceeds `max_live_parameters` gets one bucket per parameter);
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
   A loop segment's compute becomes a loop step with a per-iteration body (ir.py, "loop
   bodies"), planned first by these same rules over the layer's sub-modules
   (loop_parts.py: its parts; a scan's body is read as a rolled layer's). Where that plan
   gathers the whole layer at once, the body is one part: gather the stacked buckets'
   current layer, compute (backward: recompute, then the vjp, then reduce-scatter),
   release; its gathers are issued one iteration ahead when one layer's elements fit in
   `prefetch_bucket_size` and two layers fit under `max_live_parameters`. Otherwise the
   body follows the plan part by part (backward: recompute the parts, then their vjps in
   reverse). A rolled run that cannot keep the knobs is planned unrolled, and
   `schedule.rolling` says why.
6. hpZ (`secondary_partition`): a bucket that backward re-gathers gets "keep_secondary"
   right after its first forward gather and "drop_secondary" right after its last backward
   gather (in a loop body: after the iteration's first forward gather and its last
   backward one).
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from zjax._src.config import ZeroConfig
from zjax._src.errors import ScheduleError
from zjax._src.layout import tensor_parallel
from zjax._src.layout.mesh_roles import MeshRoles
from zjax._src.plan import tensor_comm
from zjax._src.plan.loop_bodies import DoNotRoll, rolled_body
from zjax._src.plan.segmentation import crossing_bytes, make_segments, with_backward_buckets
from zjax._src.plan.steps import StepPlanner
from zjax._src.program import loops, roll
from zjax._src.program.trace import (
  ProgramTrace,
  data_axis_bound,
  gradient_free,
)
from zjax._src.schedule import ir
from zjax._src.schedule.schedule import Schedule, program_hash


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
    except DoNotRoll as e:  # plan that run unrolled, and say why
      rolling = roll.Rolling(
        tuple(r for r in e.rolling.runs if r is not e.run), e.rolling.notes + (e.reason,)
      )


def _plan_with(trace, config, axis_sizes, frozen, platform, rolling, tensor) -> Schedule:
  roles = MeshRoles.of(config, {**axis_sizes, **dict(zip(config.tensor_axes, tensor.sizes))})
  num_devices = roles.storage_size
  replica_sizes, shard_sizes = roles.size_of(roles.replicate_axes), roles.size_of(roles.shard_axes)
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
      bucket=None,  # (set below, once the buckets are final)
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
  groups = _split_above_cap(trace, groups, entries, config.max_live_parameters, num_devices)
  bucket_of = {i: b for b, (*_, members) in enumerate(groups) for i in members}
  bucket_of.update({i: bucket_of[layers[0]] for layers in layers_of.values() for i in layers})
  entries = tuple(dataclasses.replace(e, bucket=bucket_of.get(i)) for i, e in enumerate(entries))
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
  segments = make_segments(trace, {**bucket_of, **_gradient_groups(trace, entries)}, loop_ranges)
  split = frozenset(i for i, e in enumerate(entries) if e.tensor_dim is not None)
  segments, recomputed_lookups = with_backward_buckets(
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
    bodies[k] = rolled_body(
      trace, run, segments[k], buckets, elements, bucket_of, entries, config, rolling, tensor.any
    )
  bodies.update(
    _scan_bodies(trace, segments, stacked, buckets, elements, bucket_of, entries, config, rolling)
  )
  forward, backward = StepPlanner(segments, elements, buckets, config, lengths, bodies).plan()
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


def _scan_bodies(
  trace, segments, stacked, buckets, elements, bucket_of, entries, config, rolling
) -> dict:
  """Scan segment -> its body (the scan's body as a rolled layer's, loops.scan_run): cut
  into parts where the knobs cut it, else one part, the whole layer."""
  out = {}
  for seg in segments:
    members = {i for i, op in stacked.items() if op == seg.start}
    if not members:
      continue
    run = loops.scan_run(trace.program, seg.start, members, len(trace.params))
    args = (trace, run, seg, buckets, elements, bucket_of, entries, config, rolling)
    try:
      body = rolled_body(*args)
    except DoNotRoll as e:
      if e.need is None:  # one part (the step planner says whether the whole layer fits)
        out[seg.id] = rolled_body(*args, whole=True)
        continue
      raise ScheduleError(
        f"Segment {seg.id} ({seg.label or 'a scan'}) is a scan whose layer, gathered part "
        f"by part, needs {e.need} parameter elements gathered at once (its largest part, "
        f"{e.largest}, and what is kept gathered around the loop), above max_live_parameters="
        f"{config.max_live_parameters}: raise max_live_parameters to at least {e.need}."
      ) from None
    out[seg.id] = body
  return out


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


def _split_above_cap(trace, groups, entries, cap, num_devices) -> list:
  """`groups` with each module's bucket whose gathered elements exceed `max_live_parameters`
  split into one bucket per parameter, in order of first use: its segment is then cut
  between the parameters' uses (a Dense layer's kernel, then its bias), so that one is
  gathered at a time, as DeepSpeed fetches parameter by parameter. A scan's stacked bucket
  is not split (the scan reads every one of them in each iteration), and one parameter
  above the cap stays an error naming it (StepPlanner)."""
  out = []
  for *key, loop, members in groups:
    scan = loop is not None and not isinstance(loop, tuple)  # (a rolled run's: ("rolled", L))
    size = sum(ir.gathered_elements(entries[i], num_devices) for i in members)
    if len(members) > 1 and size > cap and not scan:
      out += [(*key, loop, [i]) for i in members]
    else:
      out.append((*key, loop, members))
  first_use = lambda group: (trace.params[group[-1][0]].uses[0].op, group[-1][0])  # noqa: E731
  return sorted(out, key=first_use)


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
  crossing = crossing_bytes(trace.program)
  groups = {}
  for g, ids in enumerate(members.values()):
    first = min(u.op for i in ids for u in trace.params[i].uses)
    if sum(entries[i].size * jnp.dtype(entries[i].dtype).itemsize for i in ids) > crossing[first]:
      groups.update((i, -1 - g) for i in ids)
  return groups
