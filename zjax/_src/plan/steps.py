"""The step planner: gather instances, prefetch, release and reduce-scatter steps for each
phase (plan.py's docstring, steps 4-6).
"""

import dataclasses

from zjax._src.config import ZeroConfig
from zjax._src.errors import ScheduleError
from zjax._src.schedule import ir


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


class StepPlanner:
  def __init__(
    self,
    segments,
    elements,
    buckets,
    config: ZeroConfig,
    lengths=None,
    bodies=None,
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
    # loop segment -> its loop_bodies.LoopBody (cut into parts, or one whole-layer part)
    self.bodies = bodies or {}
    self.loop_need = [self.bodies[seg.id].need if seg.id in self.bodies else 0 for seg in segments]
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
          f"bucket (one module's parameters of one dtype; one parameter where they exceed "
          f"the cap; a scan's stacked ones together) is gathered whole, as the ops that "
          f"read it need it: raise max_live_parameters to at least {need}."
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
    """compute k, or for a loop segment the loop step with its per-iteration body (a
    whole-layer body gathered one iteration ahead where the knobs allow)."""
    stacked = [b for b in self.full_segments[k].buckets if self.buckets[b].stacked]
    if not stacked:
      return ir.Step("compute", segment=k)
    body = self.bodies[k]
    steps = body.forward if phase == "forward" else body.backward
    length = self.lengths[stacked[0]]
    if not body.parts and self._ahead_fits(length, body.need, live):
      steps = tuple(
        dataclasses.replace(st, prefetch=True, ahead=True) if st.op == "gather" else st
        for st in steps
      )
    return ir.Step(ir.LOOP_OP, segment=k, length=length, parts=body.parts, body=steps)

  def _ahead_fits(self, length: int, need: int, live: int) -> bool:
    """Whether a loop may gather its next layer while this one computes: a layer within
    prefetch_bucket_size, and two layers plus what is live around within the cap."""
    return (
      length > 1
      and need <= self.config.prefetch_bucket_size
      and live + need <= self.config.max_live_parameters
    )
