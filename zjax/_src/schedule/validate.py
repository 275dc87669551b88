"""Validation of a schedule: structure first, then a simulation of its steps.

Every schedule passes through here, planned or loaded from a (possibly hand-edited) file. The
simulation also yields the live-bytes trajectory used by the report and the renderer.
"""

import dataclasses

from zjax._src.errors import ScheduleError
from zjax._src.schedule import ir


@dataclasses.dataclass(frozen=True)
class Simulation:
  """Live gathered parameter bytes (and gradient bytes) after each step of each phase."""

  forward_live: tuple[int, ...]
  backward_live: tuple[int, ...]
  backward_grad_live: tuple[int, ...]
  bucket_bytes: tuple[int, ...]  # gathered bytes of each bucket (compute dtype, padded)
  bucket_grad_bytes: tuple[int, ...]  # its full gradient's bytes (reduce dtype, padded)
  peak_secondary_bytes: int = 0  # hpZ: secondary shards held at once (all layers of a loop)
  # what each bucket's collectives move: a gather's wire buffer per phase (forward,
  # backward; quantized under qwZ), its gradient reduction's full buffer (qgZ: all-to-all)
  gather_wire_bytes: tuple[tuple[int, int], ...] = ()
  reduce_wire_bytes: tuple[int, ...] = ()

  def wire_bytes(self, step, phase: str) -> int:
    """Bytes of the collective of a gather or reduce_scatter step."""
    if step.op == "gather":
      return self.gather_wire_bytes[step.bucket][phase == "backward"]
    return self.reduce_wire_bytes[step.bucket]


def validate_schedule(s) -> Simulation:
  """Check `s` (a Schedule) and return its simulation; raise ScheduleError on any defect."""
  _check_params(s)
  _check_buckets(s)
  _check_segments(s)
  _check_stacks(s)
  return _Simulator(s).run()


def describe_bucket(s, bucket_id: int) -> str:
  b = s.buckets[bucket_id]
  return f"bucket {bucket_id} ({b.module or '<root>'}: {', '.join(b.params)})"


def _check_params(s):
  if not isinstance(s.num_devices, int) or s.num_devices < 1:
    raise ScheduleError(f"num_devices must be a positive integer, got {s.num_devices!r}.")
  if s.roles.storage_size != s.num_devices:  # (Schedule._roles checked each size)
    raise ScheduleError(
      f"num_devices is {s.num_devices}, but the storage axes "
      f"{list(s.roles.storage_axes)} have {s.roles.storage_size} devices "
      f"(axis sizes {s.axis_sizes})."
    )
  seen = set()
  for p in s.params:
    if p.path in seen:
      raise ScheduleError(f"Parameter {p.path} appears twice in the parameter table.")
    seen.add(p.path)
    for op in p.uses:
      if not 0 <= op < s.num_ops:
        raise ScheduleError(
          f"Parameter {p.path} is used by op {op}, outside the program's {s.num_ops} ops."
        )
    if p.persistent and p.bucket is not None:
      raise ScheduleError(
        f"Parameter {p.path} is persistent (replicated) but also placed in "
        f"bucket {p.bucket}; persistent parameters are never gathered."
      )
    if p.stacked and (p.persistent or len(set(p.uses)) != 1 or len(p.shape) < 1):
      raise ScheduleError(
        f"Parameter {p.path} is stacked, which needs a sharded parameter "
        f"with a layer axis used by one loop op; it is persistent="
        f"{p.persistent}, shape {list(p.shape)}, uses {list(p.uses)}."
      )
    if not p.persistent and p.uses and p.bucket is None:
      raise ScheduleError(
        f"Parameter {p.path} is sharded and used but belongs to no bucket: "
        f"it would never be gathered. Add it to a bucket of its dtype."
      )


def _check_buckets(s):
  by_path = {p.path: p for p in s.params}
  for i, b in enumerate(s.buckets):
    if b.id != i:
      raise ScheduleError(f"Bucket at position {i} has id {b.id}; ids must be 0, 1, 2, ...")
    if not b.params:
      raise ScheduleError(f"Bucket {i} holds no parameters; remove it.")
    _check_layers(b, by_path)
    for path in b.loop_paths:
      if path not in by_path:
        raise ScheduleError(
          f"Bucket {i} names unknown parameter {path}; the parameter table has no such path."
        )
      p = by_path[path]
      if p.bucket != i:
        raise ScheduleError(
          f"Bucket {i} lists {path}, but that parameter's entry says bucket "
          f"{p.bucket}. A parameter belongs to exactly one bucket."
        )
      if p.dtype != b.dtype:
        raise ScheduleError(
          f"Bucket {i} has dtype {b.dtype} but holds {path} of dtype "
          f"{p.dtype}; a bucket holds one dtype."
        )
      if p.stacked != (b.stacked and not b.layers):
        raise ScheduleError(
          f"Bucket {i} is {'' if b.stacked else 'not '}stacked but holds "
          f"{path}, which is {'' if p.stacked else 'not '}stacked; a bucket "
          f"never mixes per-layer and whole gathers (a rolled bucket's "
          f"leaves are per layer, not stacked)."
        )
      if p.frozen != b.frozen:
        raise ScheduleError(
          f"Bucket {i} is {'' if b.frozen else 'not '}frozen but holds "
          f"{path}, which is {'' if p.frozen else 'not '}frozen; a bucket "
          f"never mixes frozen and trained parameters."
        )
      if p.zero_gradient != b.zero_gradient:
        raise ScheduleError(
          f"Bucket {i} has zero_gradient={b.zero_gradient} but holds "
          f"{path}, which has zero_gradient={p.zero_gradient}; a bucket "
          f"never mixes parameters with and without a gradient."
        )
  for p in s.params:
    if p.bucket is not None and (
      p.bucket >= len(s.buckets) or p.path not in s.buckets[p.bucket].loop_paths
    ):
      raise ScheduleError(
        f"Parameter {p.path} says bucket {p.bucket}, but that bucket does not list it."
      )


def _check_layers(b, by_path):
  """A rolled bucket: layer 0 is `params`, every layer has the same number of leaves, each
  shaped like its layer-0 counterpart, and no leaf appears twice."""
  if not b.layers:
    return
  if not b.stacked or len(b.layers) < 2 or b.layers[0] != b.params:
    raise ScheduleError(
      f"Bucket {b.id} lists layers, which needs a stacked bucket whose "
      f"first layer is its params and at least two layers."
    )
  paths = [p for layer in b.layers for p in layer]
  if len(set(paths)) != len(paths):
    raise ScheduleError(f"Bucket {b.id} lists a parameter in two layers.")
  for k, layer in enumerate(b.layers):
    if len(layer) != len(b.params):
      raise ScheduleError(
        f"Bucket {b.id} layer {k} has {len(layer)} parameters; layer 0 has {len(b.params)}."
      )
    for path, first in zip(layer, b.params):
      if path in by_path and tuple(by_path[path].shape) != tuple(by_path[first].shape):
        raise ScheduleError(
          f"Bucket {b.id} layer {k}: {path} has shape "
          f"{list(by_path[path].shape)}, but its layer-0 counterpart {first} "
          f"has {list(by_path[first].shape)}."
        )


def _check_stacks(s):
  """Rolled stacks: a stack is named by its layer 0, holds layers 0..L-1 (L >= 2) once each,
  alike in shape, dtype, persistence and frozen flag; a rolled bucket's layers are exactly
  the stacks of its parameters, and a sharded stacked parameter is in a rolled bucket."""
  by_path = {p.path: p for p in s.params}
  rows: dict[str, list] = {}
  for p in s.params:
    if p.stack:
      head = by_path.get(p.stack)
      if head is None or head.stack != head.path or head.layer != 0:
        raise ScheduleError(
          f"Parameter {p.path} says it is stored in the stack of {p.stack}, "
          f"which is not a parameter stored as layer 0 of its own stack."
        )
      rows.setdefault(p.stack, []).append(p)
  for path, members in rows.items():
    head = by_path[path]
    if sorted(p.layer for p in members) != list(range(len(members))) or len(members) < 2:
      raise ScheduleError(
        f"The stack of {path} holds layers {sorted(p.layer for p in members)}; "
        f"a stack holds layers 0, 1, ..., L-1 (L >= 2) once each."
      )
    for p in members:
      if (p.shape, p.dtype, p.persistent, p.frozen, p.stacked, p.zero_gradient) != (
        head.shape,
        head.dtype,
        head.persistent,
        head.frozen,
        False,
        head.zero_gradient,
      ):
        raise ScheduleError(
          f"Parameter {p.path} (layer {p.layer} of the stack of {path}) is "
          f"{p.dtype}{list(p.shape)}, persistent={p.persistent}, frozen="
          f"{p.frozen}, stacked={p.stacked}; the layers of a stack are alike "
          f"and not stacked themselves ({head.dtype}{list(head.shape)}, "
          f"persistent={head.persistent}, frozen={head.frozen})."
        )
      if not p.persistent and not (
        p.bucket is not None and p.bucket < len(s.buckets) and s.buckets[p.bucket].layers
      ):
        raise ScheduleError(
          f"Parameter {p.path} is stored in a stack but its bucket "
          f"{p.bucket} is not a rolled one (with layers)."
        )
  for path, members in rows.items():
    _check_stack_in_loop(s, path, sorted(members, key=lambda p: p.layer))
  for b in s.buckets:
    for k, layer in enumerate(b.layers):
      for path, first in zip(layer, b.params):
        p = by_path[path]
        if p.stack != first or p.layer != k:
          raise ScheduleError(
            f"Bucket {b.id} lists {path} as layer {k} of {first}, but the "
            f"parameter says it is layer {p.layer} of the stack of "
            f"{p.stack or '(none: stored on its own)'}."
          )
    for first in b.params if b.layers else ():
      if len(rows.get(first, ())) != len(b.layers):
        raise ScheduleError(
          f"Bucket {b.id} rolls {len(b.layers)} layers, but the stack of "
          f"{first} holds {len(rows.get(first, ()))}."
        )


def _check_stack_in_loop(s, path, members):
  """Layer l of a stack is read only by layer l of one rolled loop segment of L layers."""
  loops = {st.segment: st.length for st in s.forward if st.op == ir.LOOP_OP}
  first = next((p.uses[0] for p in members if p.uses), None)
  k = next(
    (seg.id for seg in s.segments if first is not None and seg.start <= first < seg.end), None
  )
  if k is None or loops.get(k) != len(members):
    raise ScheduleError(
      f"The stack of {path} holds {len(members)} layers, but its uses are "
      f"not in a loop segment of {len(members)} layers (segment {k}, "
      f"{loops.get(k, 'no loop')})."
    )
  seg = s.segments[k]
  block = (seg.end - seg.start) // len(members)
  for p in members:
    lo = seg.start + p.layer * block
    if any(not lo <= op < lo + block for op in p.uses):
      raise ScheduleError(
        f"Parameter {p.path} is layer {p.layer} of the stack of {path}, but "
        f"is used at ops {list(p.uses)}, outside that layer's ops "
        f"[{lo}, {lo + block}) of segment {k}."
      )


def loop_length(s, b) -> int:
  """Layers a stacked bucket is gathered for, one per loop iteration."""
  bucket = s.buckets[b]
  return len(bucket.layers) if bucket.layers else s.param(bucket.params[0]).shape[0]


def _check_segments(s):
  start = 0
  for i, seg in enumerate(s.segments):
    if seg.id != i or seg.start != start or seg.end < seg.start:
      raise ScheduleError(
        f"Segment {i} covers ops [{seg.start}, {seg.end}); segments must be "
        f"numbered 0, 1, ... and cover the program's ops contiguously from "
        f"op {start}."
      )
    start = seg.end
  if start != s.num_ops or not s.segments:
    raise ScheduleError(f"Segments cover ops [0, {start}) but the program has {s.num_ops} ops.")
  used = _buckets_used_per_segment(s)
  for seg in s.segments:
    if not set(seg.backward_buckets) <= set(seg.buckets):
      raise ScheduleError(
        f"Segment {seg.id} lists backward_buckets {list(seg.backward_buckets)} "
        f"that are not among its buckets {list(seg.buckets)}."
      )
  for seg, expected in zip(s.segments, used):
    if tuple(sorted(seg.buckets)) != tuple(sorted(expected)):
      raise ScheduleError(
        f"Segment {seg.id} (ops [{seg.start}, {seg.end})) lists buckets {list(seg.buckets)}, "
        f"but its ops use buckets {sorted(expected)} (bucket mismatch: the buckets of a "
        f"segment follow from the parameter uses)."
      )


def _buckets_used_per_segment(s) -> list[set]:
  op_to_segment = {}
  for seg in s.segments:
    for op in range(seg.start, seg.end):
      op_to_segment[op] = seg.id
  used = [set() for _ in s.segments]
  for p in s.params:
    if p.bucket is not None:
      for op in p.uses:
        used[op_to_segment[op]].add(p.bucket)
  return used


class _Simulator:
  """Runs the steps on a model of the device: which buckets are gathered, which gradients
  are pending, how many bytes are live."""

  def __init__(self, s):
    self.s = s
    self.live: dict[int, str] = {}  # bucket -> where it was gathered
    self.released_at: dict[int, str] = {}
    self.pending_grad: set[int] = set()
    self.forward_gathers = [0] * len(s.buckets)
    self.reduce_scatters = [0] * len(s.buckets)
    self.elements = bucket_elements(s)
    self.bytes = [
      ir.gathered_bytes(n, s.num_devices, ir.gather_dtype(b.dtype, s.config.compute_dtype))
      for n, b in zip(self.elements, s.buckets)
    ]
    self.grad_bytes = [
      n * ir.reduce_wire_dtype(b.dtype, s.config, s.platform).itemsize
      for n, b in zip(self.elements, s.buckets)
    ]
    self.gather_wire = [
      tuple(ir.gather_wire_bytes(b, n, phase, s) for phase in ("forward", "backward"))
      for n, b in zip(self.elements, s.buckets)
    ]
    self.reduce_wire = [ir.reduce_wire_bytes(b, n, s) for n, b in zip(self.elements, s.buckets)]
    self.cap = s.config.max_live_parameters
    self.in_loop = False
    self.secondary: dict[int, int] = {}  # hpZ: bucket -> bytes of its kept secondary shards
    self.peak_secondary = 0

  def run(self) -> Simulation:
    forward_live = self._run_phase("forward", self.s.forward, range(len(self.s.segments)))
    backward_live, grad_live = [], []
    order = range(len(self.s.segments) - 1, -1, -1)
    backward_live = self._run_phase("backward", self.s.backward, order, grad_live)
    self._check_same_parts()
    self._check_end()
    return Simulation(
      tuple(forward_live),
      tuple(backward_live),
      tuple(grad_live),
      tuple(self.bytes),
      tuple(self.grad_bytes),
      self.peak_secondary,
      tuple(self.gather_wire),
      tuple(self.reduce_wire),
    )

  def _run_phase(self, phase, steps, segment_order, grad_live=None):
    expected = list(segment_order)
    live_after = []
    for i, step in enumerate(steps):
      where = f"{phase} step {i}"
      if step.op == ir.LOOP_OP:
        live_after.append(self._loop(step, phase, where, expected))
        if grad_live is not None:  # a layer's gradient is live inside the body
          grad_live.append(
            max(self.body_grad_peak, sum(self.grad_bytes[b] for b in self.pending_grad))
          )
        continue
      self._check_step_fields(step, phase, where)
      if step.op == "compute":
        self._compute(step, phase, where, expected)
      elif self.s.buckets[step.bucket].stacked and not self.in_loop:
        raise ScheduleError(
          f"{where}: {step.op} of {describe_bucket(self.s, step.bucket)}, "
          f"which is stacked: it is gathered one layer at a time inside "
          f"its loop step's body only."
        )
      else:
        getattr(self, "_" + step.op)(step.bucket, phase, where)
      live_after.append(sum(self.bytes[b] for b in self.live))
      if grad_live is not None:
        grad_live.append(sum(self.grad_bytes[b] for b in self.pending_grad))
    if expected:
      raise ScheduleError(
        f"The {phase} steps never compute segment(s) {expected}; each "
        f"segment must be computed once, in order."
      )
    return live_after

  def _loop(self, step, phase, where, expected) -> int:
    """Simulate a loop step: its body once (every iteration does the same); returns the
    peak live bytes inside, the next layer's gathered ahead included."""
    k = step.segment
    if not isinstance(k, int) or not 0 <= k < len(self.s.segments):
      raise ScheduleError(
        f"{where}: loop names segment {k!r}; segments are 0..{len(self.s.segments) - 1}."
      )
    seg = self.s.segments[k]
    stacked = [b for b in seg.buckets if self.s.buckets[b].stacked]
    if not stacked:
      raise ScheduleError(
        f"{where}: loop over segment {k}, which has no stacked bucket; a "
        f"segment without one is a plain compute step."
      )
    lengths = {loop_length(self.s, b) for b in stacked}
    lengths |= {
      self.s.param(p).shape[0]
      for b in stacked
      if not self.s.buckets[b].layers
      for p in self.s.buckets[b].params
    }
    if lengths != {step.length}:
      raise ScheduleError(
        f"{where}: loop length {step.length}, but the stacked parameters "
        f"of segment {k} have {sorted(lengths)} layers."
      )
    rolled = {bool(self.s.buckets[b].layers) for b in stacked}
    if rolled == {True, False} or (rolled == {True} and (seg.end - seg.start) % step.length):
      raise ScheduleError(
        f"{where}: a rolled loop's segment must hold only rolled buckets "
        f"and a whole number of layers ({step.length} layers, ops "
        f"[{seg.start}, {seg.end}))."
      )
    parts = step.parts or (self._whole_layer(seg, stacked, step),)
    if step.parts:
      self._check_parts(seg, step, stacked, where)
    order = list(range(len(parts)))
    wanted = {
      "forward": [("compute", p) for p in order],
      "backward": [("recompute", p) for p in order] + [("compute", p) for p in reversed(order)],
    }[phase]
    found = [(st.op, st.part) for st in step.body if st.op in ("compute", "recompute")]
    if found != wanted:
      raise ScheduleError(f"{where}: the body computes parts {found}; it must be {wanted}.")
    if any(st.segment != seg.id for st in step.body if st.op in ("compute", "recompute")):
      raise ScheduleError(f"{where}: body compute steps must name the loop's segment {seg.id}.")
    self._check_order(seg, phase, where, expected)
    needed = seg.buckets if phase == "forward" else seg.backward_buckets
    for b in needed:  # what the segments around keep gathered through the loop
      if not self.s.buckets[b].stacked and b not in self.live:
        raise ScheduleError(
          f"{where}: the loop needs {describe_bucket(self.s, b)} in every "
          f"iteration, but it is not gathered. Gather it before the loop."
        )
    ahead = self._ahead(step, where)
    around = tuple(b for b in seg.buckets if not self.s.buckets[b].stacked)
    self.in_loop, peak, peak_elements, self.body_grad_peak = True, 0, 0, 0
    for j, st in enumerate(step.body):
      inner = f"{where} body step {j}"
      if st.op == "recompute":
        pass  # weights it reads but that are not gathered are provably unused (planner)
      elif st.op == "compute":
        part = parts[st.part]
        needed = part.buckets if phase == "forward" else part.backward_buckets
        missing = [b for b in needed if b not in self.live]
        if missing:
          raise ScheduleError(
            f"{inner}: part {part.id} ({part.label}) needs "
            f"{describe_bucket(self.s, missing[0])}, which is not gathered. "
            f"Insert a gather of bucket {missing[0]} before this step."
          )
        if phase == "backward":  # (a weight every iteration reads: its gradient sums here)
          trained = [b for b in part.buckets + around if ir.has_gradient(self.s.buckets[b])]
          self.pending_grad.update(trained)
      else:
        self._check_step_fields(st, phase, inner)
        getattr(self, "_" + st.op)(st.bucket, phase, inner)
      peak = max(peak, sum(self.bytes[b] for b in self.live))
      peak_elements = max(peak_elements, sum(self.elements[b] for b in self.live))
      self.body_grad_peak = max(
        self.body_grad_peak, sum(self.grad_bytes[b] for b in self.pending_grad)
      )
    self.in_loop = False
    left = [b for b in stacked if b in self.live or b in self.pending_grad]
    if left:
      raise ScheduleError(
        f"{where}: the loop body is not closed: {describe_bucket(self.s, left[0])} is "
        f"still gathered or its gradient not reduce-scattered at the end of the body; every "
        f"iteration must release (and in backward reduce-scatter) its layer."
      )
    # the next layer's buckets gathered ahead arrive while this layer's are in use
    peak_elements += sum(self.elements[b] for b in ahead)
    if ahead and peak_elements > self.cap:
      raise ScheduleError(
        f"{where}: gathering the next layer ahead makes {peak_elements} parameter "
        f"elements live, above max_live_parameters={self.cap}. Remove the body gathers' "
        f"ahead (or raise the cap)."
      )
    return peak + sum(self.bytes[b] for b in ahead)

  def _check_same_parts(self):
    """A loop's forward and backward steps cut its layer the same way (the executor runs
    both directions with the forward step's parts)."""
    forward = {st.segment: st.parts for st in self.s.forward if st.op == ir.LOOP_OP}
    for i, st in enumerate(self.s.backward):
      if st.op == ir.LOOP_OP and forward.get(st.segment) != st.parts:
        raise ScheduleError(
          f"backward step {i}: the loop over segment {st.segment} lists other parts than its "
          f"forward loop step; both must cut the layer the same way."
        )

  def _whole_layer(self, seg, stacked, step) -> ir.Segment:
    """The one part of a loop body without parts: the whole layer, which reads every
    stacked bucket (backward: those with a gradient, and those its body gathers; the
    executor checks that the others are not read)."""
    gathered = {st.bucket for st in step.body if st.op == "gather"}
    read = [b for b in stacked if b in gathered or ir.has_gradient(self.s.buckets[b])]
    return ir.Segment(0, seg.start, seg.end, tuple(stacked), tuple(read), seg.label)

  def _check_parts(self, seg, step, stacked, where):
    """A loop's parts are numbered 0.. and cut its layer into consecutive op ranges: a
    rolled layer's, its first layer's ops; a scan's, its body's from op 0 (the executor
    checks the cut against the program)."""
    parts = step.parts
    if any(self.s.buckets[b].layers for b in stacked):
      first, end = seg.start, seg.start + (seg.end - seg.start) // step.length
      layer = f"its first layer, ops [{first}, {end}),"
    else:
      first, end, layer = 0, parts[-1].end, "its scan's body from op 0"
    if (
      [p.id for p in parts] != list(range(len(parts)))
      or parts[0].start != first
      or parts[-1].end != end
      or any(a.end != b.start or a.start >= a.end for a, b in zip(parts, parts[1:]))
    ):
      raise ScheduleError(
        f"{where}: the loop's parts must be numbered 0.. and cut {layer} into consecutive ranges."
      )

  def _ahead(self, step, where) -> list[int]:
    """The buckets a loop body gathers one iteration ahead: each such gather must be its
    bucket's first in the body, before any compute (it is issued in the previous
    iteration), and prefetch."""
    ahead, seen = [], set()
    for j, st in enumerate(step.body):
      if st.op == "gather" and st.ahead:
        computed = any(x.op in ("compute", "recompute") for x in step.body[:j])
        if computed or st.bucket in seen or not st.prefetch:
          raise ScheduleError(
            f"{where} body step {j}: a gather issued an iteration ahead must be its "
            f"bucket's first gather in the body, come before the first compute, and "
            f"prefetch."
          )
        ahead.append(st.bucket)
      seen.add(st.bucket)
    return ahead

  def _check_step_fields(self, step, phase, where):
    allowed = ir.FORWARD_OPS if phase == "forward" else ir.BACKWARD_OPS
    if step.op not in allowed:
      raise ScheduleError(
        f"{where}: unknown op {step.op!r}; {phase} steps are one of {list(allowed)}."
      )
    if step.op == "compute":
      if not isinstance(step.segment, int) or not 0 <= step.segment < len(self.s.segments):
        raise ScheduleError(
          f"{where}: compute names segment {step.segment!r}; segments are "
          f"0..{len(self.s.segments) - 1}."
        )
    elif not isinstance(step.bucket, int) or not 0 <= step.bucket < len(self.s.buckets):
      raise ScheduleError(
        f"{where}: {step.op} names bucket {step.bucket!r}; buckets are "
        f"0..{len(self.s.buckets) - 1}."
      )

  def _check_order(self, seg, phase, where, expected):
    if not expected or expected[0] != seg.id:
      raise ScheduleError(
        f"{where}: computes segment {seg.id} but the next {phase} segment is "
        f"{expected[0] if expected else 'none'}; segments run in program "
        f"order (backward: reverse order), each once."
      )
    expected.pop(0)

  def _compute(self, step, phase, where, expected):
    seg = self.s.segments[step.segment]
    self._check_order(seg, phase, where, expected)
    needed = seg.buckets if phase == "forward" else seg.backward_buckets
    for b in needed:
      if b not in self.live:
        when = self.released_at.get(b)
        why = (
          f"it was released at {when} before this use (release before last use)"
          if when
          else "it was never gathered (use before gather)"
        )
        raise ScheduleError(
          f"{where} (compute segment {seg.id}, "
          f"{seg.label or 'ops ' + str(seg.start)}): needs "
          f"{describe_bucket(self.s, b)}, but {why}. Insert a gather of "
          f"bucket {b} before this step."
        )
    if phase == "backward":
      self.pending_grad.update(b for b in seg.buckets if ir.has_gradient(self.s.buckets[b]))

  def _gather(self, b, phase, where):
    if b in self.live:
      raise ScheduleError(
        f"{where}: gathers {describe_bucket(self.s, b)}, which is already "
        f"gathered (at {self.live[b]}). Remove one of the two gathers."
      )
    if phase == "backward" and self.s.config.secondary_partition and b not in self.secondary:
      raise ScheduleError(
        f"{where}: re-gathers {describe_bucket(self.s, b)} in backward, "
        f"which under hpZ (secondary_partition) reads its secondary shard, "
        f"but none is kept: add keep_secondary after its forward gather."
      )
    self.live[b] = where
    if phase == "forward":
      self.forward_gathers[b] += 1
    live_elements = sum(self.elements[x] for x in self.live)
    if live_elements > self.cap:
      raise ScheduleError(
        f"{where}: gathering {describe_bucket(self.s, b)} makes "
        f"{live_elements} parameter elements live, above max_live_parameters="
        f"{self.cap}. Release something first or raise the cap."
      )

  def _secondary_bytes(self, b) -> int:
    """One forward gather's wire bytes over S (its rows on this device's shard position;
    quantized under qwZ), times the layers for a stacked bucket (the loop keeps every
    layer's)."""
    layers = loop_length(self.s, b) if self.s.buckets[b].stacked else 1
    return layers * (self.gather_wire[b][0] // self.s.shards)

  def _keep_secondary(self, b, phase, where):
    if not self.s.config.secondary_partition:
      raise ScheduleError(
        f"{where}: keep_secondary of {describe_bucket(self.s, b)}, but the "
        f"config has no secondary partition (secondary_partition=False)."
      )
    if b not in self.live or b in self.secondary:
      state = "already kept" if b in self.secondary else "not gathered"
      raise ScheduleError(
        f"{where}: keep_secondary of {describe_bucket(self.s, b)} must "
        f"directly follow its first forward gather (it slices that gather's "
        f"result); it is {state}."
      )
    self.secondary[b] = self._secondary_bytes(b)
    self.peak_secondary = max(self.peak_secondary, sum(self.secondary.values()))

  def _drop_secondary(self, b, phase, where):
    if b not in self.secondary:
      raise ScheduleError(
        f"{where}: drop_secondary of {describe_bucket(self.s, b)}, which holds no secondary shard."
      )
    del self.secondary[b]

  def _release(self, b, phase, where):
    if b not in self.live:
      raise ScheduleError(f"{where}: releases {describe_bucket(self.s, b)}, which is not gathered.")
    del self.live[b]
    self.released_at[b] = where

  def _reduce_scatter(self, b, phase, where):
    if not ir.has_gradient(self.s.buckets[b]):
      raise ScheduleError(
        f"{where}: reduce-scatters {describe_bucket(self.s, b)}, which has "
        f"no gradient (dtype {self.s.buckets[b].dtype}, frozen="
        f"{self.s.buckets[b].frozen})."
      )
    if b not in self.pending_grad:
      raise ScheduleError(
        f"{where}: reduce-scatters {describe_bucket(self.s, b)}, but no "
        f"backward compute has produced its gradient since the last "
        f"reduce-scatter."
      )
    self.pending_grad.discard(b)
    self.reduce_scatters[b] += 1

  def _check_end(self):
    if self.pending_grad:
      b = min(self.pending_grad)
      raise ScheduleError(
        f"The gradient of {describe_bucket(self.s, b)} is never "
        f"reduce-scattered after its last backward use; add a "
        f"reduce_scatter step."
      )
    if self.secondary:
      b = min(self.secondary)
      raise ScheduleError(
        f"The secondary shard of {describe_bucket(self.s, b)} is still kept "
        f"at the end of the backward steps; drop_secondary after its last "
        f"backward gather."
      )
    if self.live:
      b = min(self.live)
      raise ScheduleError(
        f"{describe_bucket(self.s, b)} is still gathered at the end of the "
        f"backward steps; release it."
      )
    per_gather = self.s.config.gradient_reduction == "per_gather"
    for b, bucket in enumerate(self.s.buckets):
      expected = self.forward_gathers[b] if per_gather else min(1, self.forward_gathers[b])
      if ir.has_gradient(bucket) and self.reduce_scatters[b] != expected:
        rule = (
          "each forward gather's gradient is reduce-scattered once (gradient_reduction="
          "'per_gather')"
          if per_gather
          else "its gradient is reduce-scattered once "
          "per step, after its last backward use (gradient_reduction='once')"
        )
        raise ScheduleError(
          f"{describe_bucket(self.s, b)} is gathered {self.forward_gathers[b]} time(s) in "
          f"forward but reduce-scattered {self.reduce_scatters[b]} time(s) in backward; "
          f"{rule}."
        )


def bucket_elements(s) -> list[int]:
  """Gathered (padded) elements of each bucket."""
  by_path = {p.path: p for p in s.params}
  return [sum(ir.gathered_elements(by_path[p], s.num_devices) for p in b.params) for b in s.buckets]
