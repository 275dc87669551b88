"""A rolled run's body: its layer planned part by part by the step planner's rules
(plan.py's docstring, step 5), or a reason it is planned unrolled (DoNotRoll).
"""

import dataclasses

from zjax._src.errors import ScheduleError
from zjax._src.plan.steps import StepPlanner
from zjax._src.program import loop_parts, loops, roll
from zjax._src.program.trace import param_views
from zjax._src.schedule import ir


class DoNotRoll(Exception):
  """`need`: the smallest max_live_parameters its parts plan at (what is kept gathered
  around the loop and its largest part, whose parameters `largest` names), where the cap
  is what stops them."""

  def __init__(self, rolling, run, reason, need=None, largest=""):
    super().__init__(reason)
    self.rolling, self.run, self.reason, self.need = rolling, run, reason, need
    self.largest = largest


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


def rolled_body(
  trace,
  run,
  seg,
  buckets,
  elements,
  bucket_of,
  entries,
  config,
  rolling,
  tensor_parallel=False,
  find_unread=True,
):
  """The run's layer planned part by part, as the unrolled planner plans segments (the same
  knobs; what the segments around the loop keep gathered through it counts against
  max_live_parameters). Without parts when one whole layer gathered at once is what that
  plan says (the loop gathers it as one, prefetching the next layer where the knobs allow).
  Raises DoNotRoll where the run cannot keep the knobs (the unrolled plan decides).
  `tensor_parallel`: also find what the backward iteration executes (_RolledBody);
  `find_unread`: a whole-layer body's unread buckets (a scan's come from loops.py)."""
  body = _rolled_body_steps(
    trace, run, seg, buckets, elements, bucket_of, entries, config, rolling, find_unread
  )
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


def _rolled_body_steps(
  trace, run, seg, buckets, elements, bucket_of, entries, config, rolling, find_unread=True
):
  runner, stacked = _runner(trace, run, seg, buckets, bucket_of, entries)
  position_bucket = {q: bucket_of[i] for q, i in runner.gathered.items()}
  parts = tuple(
    ir.Segment(
      id=p,
      start=run.op_offset + io.start,
      end=run.op_offset + io.end,
      buckets=tuple(sorted({position_bucket[q] for q in io.positions})),
      backward_buckets=loop_parts.backward_reads(runner, p, position_bucket),
      label=_part_label(trace, run, runner, io),
    )
    for p, io in enumerate(runner.parts)
  )
  around = sum(elements[b] for b in seg.buckets if not buckets[b].stacked)
  inner_config = dataclasses.replace(  # (hpZ's steps are added to the body below)
    config,
    max_live_parameters=max(config.max_live_parameters - around, 0),
    secondary_partition=False,
  )
  flat = tuple(dataclasses.replace(b, stacked=False) for b in buckets)
  names = roll.layer_names(trace.params, run)
  try:
    forward, backward = StepPlanner(parts, elements, flat, inner_config).plan()
  except ScheduleError as e:  # e.g. with what is kept around it, a part does not fit
    size = lambda part: sum(elements[b] for b in part.buckets)  # noqa: E731
    largest = max(parts, key=size)
    need = around + size(largest)
    reason = f"not rolled: {names}: {e}; planned unrolled"
    paths = ", ".join(p for b in largest.buckets for p in buckets[b].params)
    raise DoNotRoll(
      rolling, run, reason, need if need > config.max_live_parameters else None, paths
    ) from None

  # every bucket gathered before the first part and none again in backward: the peak is one
  # whole layer either way, and the whole-layer loop may prefetch the next layer
  first_compute = next(k for k, st in enumerate(forward) if st.op == "compute")
  if not any(st.op == "gather" for st in forward[first_compute:] + backward):
    unread = frozenset()  # hpZ: each layer's secondary is dropped
    if find_unread and not config.secondary_partition:
      unread = _unread_in_backward(runner, stacked, buckets)
    return _RolledBody((), (), (), 0, unread)
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
  if config.secondary_partition:
    forward_body, backward_body = _with_secondaries(forward_body, backward_body)
  need = max(_peak(forward_body, elements), _peak(backward_body, elements))
  return _RolledBody(parts, forward_body, tuple(backward_body), need)


def _with_secondaries(forward, backward) -> tuple[tuple, list]:
  """hpZ in a body cut into parts: each bucket that the backward body re-gathers keeps its
  secondary shard after its first forward gather of the iteration (the loop stacks every
  layer's) and drops it after its last backward gather; every backward gather of it reads
  that layer's secondary, over the shard axes only."""
  regathered = {st.bucket for st in backward if st.op == "gather"}
  fwd, kept = [], set()
  for st in forward:
    fwd.append(st)
    if st.op == "gather" and st.bucket in regathered and st.bucket not in kept:
      kept.add(st.bucket)
      fwd.append(ir.Step("keep_secondary", bucket=st.bucket))
  last = {st.bucket: k for k, st in enumerate(backward) if st.op == "gather"}
  bwd = []
  for k, st in enumerate(backward):
    bwd.append(st)
    if st.op == "gather" and last[st.bucket] == k:
      bwd.append(ir.Step("drop_secondary", bucket=st.bucket))
  return tuple(fwd), bwd


def scan_unread(trace, segments, stacked, bucket_of, entries, buckets) -> dict:
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
      return runner.template[j].module
  return runner.template[io.start].module


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
