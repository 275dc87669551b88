"""Human-readable tables of a schedule and of the parameter-use table."""

import re

from zjax._src.schedule import ir, report


def format_bytes(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def render_schedule(s, sim) -> str:
  """The steps as a table: step, phase, op, bucket, what, bytes, live bytes after the step."""
  head = (
    f"zjax schedule v{ir.FORMAT_VERSION}: {s.num_devices} device(s){_layout_words(s)}, "
    f"{len(s.params)} "
    f"params ({sum(p.persistent for p in s.params)} persistent), {len(s.buckets)} "
    f"buckets, {len(s.segments)} segments, fingerprint {s.fingerprint[:12]}"
  )
  rows = [("step", "phase", "op", "axes", "bucket", "what", "bytes", "live after")]
  notes = {
    k: _reduction_note(s, n) for k, n in report.persistent_reduction_bytes_by_segment(s).items()
  }
  for phase, steps, live in (
    ("fwd", s.forward, sim.forward_live),
    ("bwd", s.backward, sim.backward_live),
  ):
    ends = notes if phase == "bwd" else {}  # what a segment's backward ends with
    for i, (step, live_after) in enumerate(zip(steps, live)):
      if step.op == ir.LOOP_OP:
        rows += _loop_rows(s, sim, phase, i, step, live_after, ends.get(step.segment, ""))
      else:
        rows.append(_step_row(s, sim, phase, i, step, live_after, ends.get(step.segment, "")))
  if len(s.roles.data_axes) == 1:  # every collective spans the one axis: no column
    rows = [r[:3] + r[4:] for r in rows]
  rolling = "".join(f"\nlayer rolling: {note}" for note in s.rolling)
  return head + "\n" + table(rows) + rolling + "".join(f"\nnote: {n}" for n in s.notes)


def _layout_words(s) -> str:
  """How the devices are used, for the header (nothing to add on a one-axis mesh)."""
  if s.roles.tensor_axes:
    ((axis, size),) = s.tensor_axis_sizes.items()
    split = sum(p.tensor_dim is not None for p in s.params)
    return _data_words(s) + f" x {size}-way tensor parallel over {axis} ({split} params split)"
  return _data_words(s)


def _data_words(s) -> str:
  sizes = "x".join(str(n) for n in s.axis_sizes.values())
  axes = ",".join(s.roles.data_axes)
  if s.config.secondary_partition:
    return (
      f" ({sizes} over {axes}), hpZ: forward over every axis, backward re-gathers "
      f"from a secondary 1/{s.shards} shard over {','.join(s.roles.shard_axes)}"
    )
  if s.roles.replicate_axes:
    return f" x {s.replicas} replicas over {', '.join(s.roles.replicate_axes)} (HSDP)"
  return f" ({sizes} over {axes})" if len(s.roles.shard_axes) > 1 else ""


def _axes_cell(s, step, phase) -> str:
  """The mesh axes the step's collective spans ("" for steps without one)."""
  info = s.roles.collective_axes(step.op, "backward" if phase == "bwd" else "forward")
  if not info:
    return ""
  cell = ir.axes_key(info["axes"])
  return cell + (f", mean over {ir.axes_key(info['mean_over'])}" if "mean_over" in info else "")


def _loop_rows(s, sim, phase, i, step, live_after, end=""):
  """A loop step, then its body indented: these steps run once per iteration; a prefetched
  gather fetches the next iteration's layer (the first one before the loop), or in a body
  cut into parts a later part's bucket."""
  seg = s.segments[step.segment]
  rows = [
    (
      str(i),
      phase,
      f"loop x{step.length}",
      "",
      "",
      f"segment {seg.id} ops [{seg.start},{seg.end}) {seg.label}".rstrip()
      + end
      + ", per iteration:",
      "",
      format_bytes(live_after),
    )
  ]
  scan = not any(s.buckets[b].layers for b in seg.buckets)  # its parts number body ops
  for j, inner in enumerate(step.body):
    row = (
      _part_row(step, inner, phase, "body ops" if scan else "ops")
      if inner.op in ("compute", "recompute")
      else _step_row(s, sim, phase, j, inner, None)
    )
    op = row[2].replace("prefetch", "next layer") if inner.ahead else row[2]
    rows.append((f"{i}.{j}", phase, "  " + op, *row[3:7], ""))
  return rows


def _reduction_note(s, reduced: int) -> str:
  """What a segment's backward ends with besides its steps: the all-reduce of the
  `reduced` bytes of persistent gradients it completed (none on one device)."""
  if not reduced or s.data_parallel_size == 1:
    return ""
  return f", then all-reduce of the persistent gradients done ({format_bytes(reduced)})"


def _part_row(loop, step, phase, ops="ops"):
  """A compute step of a loop body: of a part (`ops`: what its op numbers count: the
  program's, or a scan body's) or of the whole layer; forward, recomputed, or its vjp."""
  if loop.parts:
    part = loop.parts[step.part]
    what = f"part {part.id} {ops} [{part.start},{part.end}) {part.label}".rstrip()
  else:
    what = "the whole layer"
  op = {"recompute": "recompute", "compute": "compute" if phase == "fwd" else "compute_vjp"}
  return ("", phase, op[step.op], "", "", what, "", "")


def _step_row(s, sim, phase, i, step, live_after, end=""):
  if step.op == "compute":
    seg = s.segments[step.segment]
    what = f"segment {seg.id} ops [{seg.start},{seg.end}) {seg.label}".rstrip() + end
    return (
      str(i),
      phase,
      "compute" if phase == "fwd" else "compute_vjp",
      "",
      "",
      what,
      "",
      format_bytes(live_after) if live_after is not None else "",
    )
  bucket = s.buckets[step.bucket]
  names = ",".join(leaf_name(p) for p in bucket.params)
  long_phase = "backward" if phase == "bwd" else "forward"
  op, size = step.op, sim.bucket_bytes[step.bucket]
  quantized = ir.step_quantization(step, long_phase, s.buckets, s.config).get("quantized")
  if step.op == "gather":
    op = ("re-gather" if phase == "bwd" else "gather") + (" (prefetch)" if step.prefetch else "")
    size = sim.wire_bytes(step, long_phase)
  elif step.op == "reduce_scatter":
    size = sim.wire_bytes(step, long_phase)
    op = "reduce (all-to-all)" if quantized else op
  elif step.op in ("keep_secondary", "drop_secondary"):  # hpZ: 1/S of the gathered wire
    op, size = op.replace("_", " "), sim.gather_wire_bytes[step.bucket][0] // s.shards
  if quantized:
    op += f" {quantized['dtype']}"
  layers = f", layer i of {len(bucket.layers)}" if bucket.layers else ""
  return (
    str(i),
    phase,
    op,
    _axes_cell(s, step, phase),
    str(step.bucket),
    f"{bucket.module or '<root>'} [{names}]{layers}",
    format_bytes(size),
    format_bytes(live_after) if live_after is not None else "",
  )


def render_param_table(trace, s) -> str:
  """Every parameter leaf: shape, dtype, layout, bucket and its uses (op, where, by whom)."""
  rows = [("param", "shape", "dtype", "layout", "bucket", "uses", "notes")]
  entries = {p.path: p for p in s.params}
  for p in trace.params:
    entry = entries[p.path]
    layout = (
      "replicated"
      if entry.persistent
      else f"sharded 1/{s.num_devices}" + (" per layer" if entry.stacked else "")
    )
    if entry.tensor_dim is not None:  # tensor parallelism: which dim, over which axis
      of = " of each layer" if entry.stacked else ""  # (a stack's: counted in one layer)
      layout += f", dim {entry.tensor_dim}{of} over {s.roles.tensor_axes[0]}"
    uses = (
      "; ".join(
        f"op {u.op} {u.primitive}" + (f" in {u.context}" if u.context else "") for u in p.uses
      )
      or "-"
    )
    notes = (
      _notes(p)
      + ("; frozen" if entry.frozen else "")
      + ("; zero gradient (read only where no gradient flows)" if entry.zero_gradient else "")
    )
    rows.append(
      (
        p.path,
        str(list(p.shape)),
        p.dtype.name,
        layout,
        "" if entry.bucket is None else str(entry.bucket),
        uses,
        notes.lstrip("; "),
      )
    )
  return table(rows)


def _notes(p) -> str:
  notes = []
  if not p.uses:
    notes.append("unused (zero gradient)")
  elif len(p.uses) > 1:
    notes.append(f"reused x{len(p.uses)} (gradient summed)")
  if p.size == 0:
    notes.append("empty")
  elif p.shape == ():
    notes.append("scalar")
  if not p.is_float:
    notes.append("non-float (no gradient)")
  foreign = sorted({u.module for u in p.uses if u.module and not _owned_by(u.module, p.owner)})
  if foreign:
    notes.append("used by " + ", ".join(foreign))
  return "; ".join(notes)


def _owned_by(module: str, owner: str) -> bool:
  """Whether a use's name stack ('GPT/block_0/mlp.fc') lies on the owner's module path
  ('params/block_0/mlp'). A higher-order op (scan, remat) carries its parent's name stack,
  so an ancestor of the owner counts as the owner. Without a linen 'params' collection in
  the path there is no module path to compare."""
  parts = owner.split("/")
  if "params" not in parts:
    return True
  owned = parts[parts.index("params") + 1 :]
  used = [part.split(".")[0] for part in module.split("/")[1:]]
  return used[: len(owned)] == owned or owned[: len(used)] == used


_KEY = re.compile(r"\['([^']*)'\]|\[\"([^\"]*)\"\]|\[(\d+)\]|\.(\w+)")


def leaf_name(path: str) -> str:
  """Last key of a keystr path, skipping NNX's trailing `.value`: "['l1']['kernel'].value" ->
  "kernel"."""
  keys = ["".join(m) for m in _KEY.findall(path)]
  if len(keys) > 1 and keys[-1] == "value":
    keys.pop()
  return keys[-1] if keys else path


def table(rows) -> str:
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  widths[-1] = 0  # no padding on the last column
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
  lines.insert(1, "  ".join("-" * max(w, 1) for w in widths[:-1]) + "  " + "-" * 10)
  return "\n".join(lines)
