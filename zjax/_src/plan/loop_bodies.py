"""A loop's body (a rolled run's or a scan's): its layer planned part by part by the step
planner's rules (plan.py's docstring, step 5), or as one part, the whole layer; or a
reason a rolled run is planned unrolled (DoNotRoll).
"""

import dataclasses

from zjax._src.errors import ScheduleError
from zjax._src.plan.steps import StepPlanner
from zjax._src.program import loop_parts, roll
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
class LoopBody:
  """A loop's per-iteration steps (ir.py, "loop bodies"): its layer cut into parts, or as
  one part, the whole layer (`parts` empty), which the step planner may gather one
  iteration ahead."""

  parts: tuple  # ir.Segment per part; () for one part, the whole layer
  forward: tuple  # body steps
  backward: tuple
  need: int  # peak gathered elements inside an iteration
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
  whole=False,
):
  """The run's layer planned part by part, as the unrolled planner plans segments (the same
  knobs; what the segments around the loop keep gathered through it counts against
  max_live_parameters); as one part where one whole layer gathered at once is what that
  plan says (or `whole`). Raises DoNotRoll where the run cannot keep the knobs (the
  unrolled plan decides). `tensor_parallel`: also find what the backward iteration
  executes (LoopBody.backward_ops)."""
  body = None
  if not whole:
    runner, stacked = _runner(trace, run, seg, buckets, bucket_of, entries)
    body = _parted_body(trace, run, runner, seg, stacked, buckets, elements, config, rolling)
  if body is None:
    runner, stacked = _runner(trace, run, seg, buckets, bucket_of, entries, whole=True)
    body = _whole_body(runner, seg, stacked, buckets, elements, config)
  if not tensor_parallel:
    return body
  signatures = loop_parts.backward_op_signatures(runner, list(body.backward))
  return dataclasses.replace(body, backward_ops=frozenset(signatures))


def _runner(trace, run, seg, buckets, bucket_of, entries, whole=False):
  """The run's loop_parts.PartRunner (`whole`: one part), and the loop segment's stacked
  buckets."""
  stacked = [b for b in seg.buckets if buckets[b].stacked]
  members = {
    b: [
      i
      for i in range(len(entries))
      if bucket_of.get(i) == b and trace.params[i].path in buckets[b].params
    ]
    for b in stacked
  }
  runner = loop_parts.part_runner(trace.program, run, members, entries, bucket_of, whole)
  return runner, stacked


def _parted_body(trace, run, runner, seg, stacked, buckets, elements, config, rolling):
  """The layer cut into parts and planned by the step planner, or None where that plan
  gathers every bucket before the first part and none again in backward (the peak is one
  whole layer either way, and one part may be gathered an iteration ahead)."""
  position_bucket = runner.bucket_of  # gathered position -> its bucket
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
  first_compute = next(k for k, st in enumerate(forward) if st.op == "compute")
  if not any(st.op == "gather" for st in forward[first_compute:] + backward):
    return None
  kept = set()  # gathered at the end of the forward plan (kept into its backward)
  for st in forward:
    if st.op == "gather":
      kept.add(st.bucket)
    elif st.op == "release":
      kept.discard(st.bucket)
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
  return LoopBody(parts, forward_body, tuple(backward_body), need)


def _whole_body(runner, seg, stacked, buckets, elements, config) -> LoopBody:
  """The layer as one part: every stacked bucket gathered, the layer computed (backward:
  recomputed, then its vjp), the trained buckets reduce-scattered, all released. Backward
  leaves out the buckets without gradient whose values it does not read (an integer
  leaf's; XLA would delete their gathers), except under hpZ (each layer's secondary is
  dropped by its re-gather)."""
  unread = set() if config.secondary_partition else _unread_in_backward(runner, stacked, buckets)
  regathered = [b for b in stacked if b not in unread]
  compute = lambda op: ir.Step(op, segment=seg.id, part=0)  # noqa: E731
  forward = (
    [ir.Step("gather", bucket=b) for b in stacked]
    + [compute("compute")]
    + [ir.Step("release", bucket=b) for b in stacked]
  )
  backward = (
    [ir.Step("gather", bucket=b) for b in regathered]
    + [compute(ir.RECOMPUTE_OP), compute("compute")]
    + [ir.Step("reduce_scatter", bucket=b) for b in stacked if ir.has_gradient(buckets[b])]
    + [ir.Step("release", bucket=b) for b in regathered]
  )
  if config.secondary_partition:
    forward, backward = _with_secondaries(forward, backward)
  return LoopBody((), tuple(forward), tuple(backward), sum(elements[b] for b in stacked))


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


def _part_label(trace, run, runner, io) -> str:
  """The module of the part's first op that reads a gathered weight (as segments' labels)."""
  for j in range(io.start, io.end):
    if any(src[0] == "layer" and src[1] in runner.gathered for src in run.sources[j]):
      return runner.template[j].module
  return runner.template[io.start].module


def _unread_in_backward(runner, stacked, buckets) -> set:
  """Stacked buckets without gradient whose values a one-part backward iteration does not
  read (JAX's dead-code elimination of the traced body: loop_parts.unused_gathers)."""
  probe = [ir.Step("gather", bucket=b) for b in stacked]
  probe += [ir.Step(op, part=0) for op in (ir.RECOMPUTE_OP, "compute")]
  unused, _ = loop_parts.unused_gathers(runner, probe)
  return {stacked[k] for k in unused if not ir.has_gradient(buckets[stacked[k]])}


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
