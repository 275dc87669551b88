"""Segments: where the op list is cut (plan.py's docstring, step 3), and the buckets each
segment's backward needs.
"""

import bisect
import dataclasses

import numpy as np

from zjax._src.program import segments as seg_lib
from zjax._src.schedule import ir


def crossing_bytes(program) -> list[int]:
  """Per op j: bytes of the values computed before op j and read at or after it."""
  n, last = len(program.ops), _last_reads(program)
  change = np.zeros(n + 2, np.int64)
  for j, op in enumerate(program.ops):
    for v in op.outputs:
      if last.get(v, -1) > j:
        change[j + 1] += ir.aval_bytes(program.avals[v])
        change[last[v] + 1] -= ir.aval_bytes(program.avals[v])
  return np.cumsum(change)[: n + 1].tolist()


def make_segments(trace, bucket_of, loop_ranges=None) -> tuple[ir.Segment, ...]:
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


def with_backward_buckets(segments, trace, bucket_of, entries, loop_ranges=None, split=frozenset()):
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
