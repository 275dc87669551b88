"""Predicted per-device memory and communication of one training step under a schedule."""

import jax.numpy as jnp

from zjax._src.schedule import ir


def make_report(s, sim) -> dict:
  """JSON-serialisable predictions for schedule `s` with simulation `sim`.

  Bytes of a collective are those of its full (gathered / pre-reduction) buffer, padding
  included; quantized ones (qwZ, qgZ) count their int8 values and float32 scales. A
  collective inside a loop counts once per iteration; `loops` lists each loop's
  per-iteration collectives (what the compiled program's while body holds).
  """
  steps = [
    (phase, st)
    for phase, phase_steps in (("forward", s.forward), ("backward", s.backward))
    for st in executed_steps(phase_steps)
  ]
  gathers = [(phase, st) for phase, st in steps if st.op == "gather"]
  reductions = [st for _, st in steps if st.op == "reduce_scatter"]
  scatters = [st for st in reductions if not _quantized(st, "backward", s)]
  exchanges = [st for st in reductions if _quantized(st, "backward", s)]
  persistent = [p for p in s.params if p.persistent]
  replica_bytes = (
    sum(sim.bucket_grad_bytes[st.bucket] // s.num_devices for st in reductions)
    if s.roles.averaged_axes
    else 0
  )
  collectives = executed_collectives(s, sim)
  return {
    "num_devices": s.num_devices,
    "num_params": len(s.params),
    "num_sharded_params": len(s.params) - len(persistent),
    "num_persistent_params": len(persistent),
    "num_buckets": len(s.buckets),
    "num_segments": len(s.segments),
    "param_elements": sum(p.size for p in s.params),
    "all_gather_count": len(gathers),
    "all_gather_bytes": sum(sim.wire_bytes(st, phase) for phase, st in gathers),
    "forward_all_gather_count": sum(phase == "forward" for phase, _ in gathers),
    "backward_all_gather_count": sum(phase == "backward" for phase, _ in gathers),
    "prefetch_count": sum(st.prefetch for _, st in gathers),
    "reduce_scatter_count": len(scatters),
    "reduce_scatter_bytes": sum(sim.wire_bytes(st, "backward") for st in scatters),
    # qgZ: each quantized gradient reduction is one all-to-all of the N quantized chunks
    "all_to_all_count": len(exchanges),
    "all_to_all_bytes": sum(sim.wire_bytes(st, "backward") for st in exchanges),
    "replicas": s.replicas,
    "axis_sizes": s.axis_sizes,
    # HSDP: each reduced gradient shard (1/N of the bucket) is then all-reduced over the
    # replicate axes (XLA may combine those all-reduces: bytes, not count, are what to
    # compare)
    "replica_all_reduce_bytes": replica_bytes,
    # one all-reduce per segment whose backward completes persistent gradients (none on
    # one data-parallel device)
    "persistent_grad_all_reduce_bytes": (
      persistent_grad_bytes(s) if s.data_parallel_size > 1 else 0
    ),
    "persistent_grad_all_reduce_count": (
      len(persistent_reductions_bytes(s)) if s.data_parallel_size > 1 else 0
    ),
    # the same bytes by the mesh axes each collective spans ("replica+fsdp": both); the
    # loss's scalar all-reduce over every data axis is not counted
    **{
      f"{kind}_bytes_by_axis": _by_axis(collectives, kind)
      for kind in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
    },
    "secondary_bytes": sim.peak_secondary_bytes,
    "peak_live_param_bytes": max(sim.forward_live + sim.backward_live, default=0),
    "peak_live_grad_bytes": max(sim.backward_grad_live, default=0),
    "state_bytes_per_device": state_bytes_per_device(s),
    "quantization": quantization_report(s, sim, gathers, reductions),
    **tensor_report(s),
    "loops": [
      _loop_report(phase, st, sim, s)
      for phase, phase_steps in (("forward", s.forward), ("backward", s.backward))
      for st in phase_steps
      if st.op == ir.LOOP_OP
    ],
  }


def _quantized(step, phase, s) -> bool:
  return bool(ir.step_quantization(step, phase, s.buckets, s.config))


def quantization_report(s, sim, gathers, reductions) -> dict:
  """What qwZ / qgZ do to the step's collectives: their formats and the bytes of the
  quantized ones (values and scales apart) against the same collectives unquantized;
  `bytes_vs_unquantized`: all gathers and reductions. {} when neither is on."""
  elements, config = s.bucket_elements(), s.config

  def plain(st):  # the collective's bytes without quantization
    if st.op == "reduce_scatter":
      return sim.bucket_grad_bytes[st.bucket]
    dtype = ir.gather_dtype(s.buckets[st.bucket].dtype, config.compute_dtype)
    return ir.gathered_bytes(elements[st.bucket], s.num_devices, dtype)

  out, moved, unquantized = {}, 0, 0
  for phase, st in list(gathers) + [("backward", st) for st in reductions]:
    bucket = s.buckets[st.bucket]
    moved, unquantized = moved + sim.wire_bytes(st, phase), unquantized + plain(st)
    q = (
      ir.gather_quantization(bucket, phase, config)
      if st.op == "gather"
      else ir.reduce_quantization(bucket, config)
    )
    if q is None:
      continue
    local = elements[st.bucket] // s.num_devices
    entry = out.setdefault(
      "gather" if st.op == "gather" else "reduce",
      {**q.describe(), "steps": 0, "value_bytes": 0, "scale_bytes": 0, "unquantized_bytes": 0},
    )
    entry["steps"] += 1
    entry["value_bytes"] += s.num_devices * q.value_bytes(local)
    entry["scale_bytes"] += s.num_devices * q.scale_bytes(local)
    entry["unquantized_bytes"] += plain(st)
  if "gather" in out:
    out["gather"]["phases"] = list(config.gather_quantization_phases)
  if out:
    out["bytes_vs_unquantized"] = moved / max(unquantized, 1)
  return out


def tensor_report(s) -> dict:
  """Tensor parallelism: the tensor axis's size, how many parameters (and what share of the
  parameter state per device) are split over it. Its own collectives are GSPMD's: measured
  from the compiled program (zjax.hlo.executed_by_axis); here only a Megatron-style
  estimate of their bytes (tensor_comm.py), labelled as one."""
  if not s.roles.tensor_axes:
    return {}
  tp = [p for p in s.params if p.tensor_dim is not None]
  state = state_bytes_per_device(s)
  tp_state = sum(ir.local_elements(p, s.num_devices) * jnp.dtype(p.dtype).itemsize for p in tp)
  return {
    "tensor_axis_sizes": s.tensor_axis_sizes,
    "tensor_parallel_params": len(tp),
    "tensor_parallel_state_share": tp_state / max(state, 1),
    "tensor_axis_estimated_count": len(s.tensor_estimate),
    "tensor_axis_estimated_bytes": sum(n for *_, n in s.tensor_estimate),
  }


def persistent_grad_bytes(s) -> int:
  """Bytes of the persistent (replicated) parameters' gradients, as all-reduced (each device
  all-reduces its TP slice of a tensor-parallel one)."""
  return sum(persistent_reductions_bytes(s))


def persistent_reductions_bytes(s) -> list[int]:
  """Bytes of each persistent-gradient all-reduce, in the order backward runs them (one per
  segment that completes persistent gradients, ir.persistent_reductions); a gradient of a
  parameter that is never used is zero and not reduced."""
  by_segment = persistent_reduction_bytes_by_segment(s)
  return [by_segment[k] for k in sorted(by_segment, reverse=True)]


def persistent_reduction_bytes_by_segment(s) -> dict[int, int]:
  """Segment -> bytes of the persistent gradients all-reduced after its backward."""
  return {
    k: sum(_persistent_reduced_bytes(s, s.params[i]) for i in members)
    for k, members in ir.persistent_reductions(s.params, s.segments).items()
  }


def _persistent_reduced_bytes(s, p) -> int:
  return p.size // p.tensor_slices * ir.reduce_wire_dtype(p.dtype, s.config, s.platform).itemsize


def executed_collectives(s, sim) -> list[tuple[str, tuple[str, ...], int]]:
  """(kind, mesh axes, full-buffer bytes) of every collective one step executes, loops
  unrolled: gathers, gradient reductions (reduce-scatters, or qgZ's all-to-alls), HSDP's
  replica all-reduce of each reduced shard, and the persistent gradients' all-reduce (when
  there is more than one device). The loss's scalar all-reduce is left out."""
  out = []
  for phase, steps in (("forward", s.forward), ("backward", s.backward)):
    for st in executed_steps(steps):
      if st.op not in ("gather", "reduce_scatter"):
        continue
      axes = s.roles.collective_axes(st.op, phase)
      if st.op == "gather":
        out.append(("all_gather", tuple(axes["axes"]), sim.wire_bytes(st, phase)))
        continue
      kind = "all_to_all" if _quantized(st, phase, s) else "reduce_scatter"
      out.append((kind, tuple(axes["axes"]), sim.wire_bytes(st, phase)))
      if "mean_over" in axes:
        out.append(
          (
            "all_reduce",
            tuple(axes["mean_over"]),
            sim.bucket_grad_bytes[st.bucket] // s.num_devices,
          )
        )
  if s.data_parallel_size > 1:
    out += [("all_reduce", s.roles.data_axes, n) for n in persistent_reductions_bytes(s)]
  return out


def _by_axis(collectives, kind) -> dict[str, int]:
  """Bytes of the collectives of `kind` per mesh axes key ("replica+fsdp")."""
  out = {}
  for k, axes, n in collectives:
    if k == kind and n:
      out[ir.axes_key(axes)] = out.get(ir.axes_key(axes), 0) + n
  return out


def executed_steps(steps) -> list:
  """The steps as executed: a loop's body repeated once per iteration."""
  out = []
  for st in steps:
    out += list(st.body) * st.length if st.op == ir.LOOP_OP else [st]
  return out


def _loop_report(phase, step, sim, s) -> dict:
  gathers = [st for st in step.body if st.op == "gather"]
  reductions = [st for st in step.body if st.op == "reduce_scatter"]
  exchanges = [st for st in reductions if _quantized(st, phase, s)]
  scatters = [st for st in reductions if st not in exchanges]
  return {
    "phase": phase,
    "segment": step.segment,
    "length": step.length,
    "prefetch": any(st.prefetch for st in step.body),
    "all_gather_count_per_iteration": len(gathers),
    "all_gather_bytes_per_iteration": sum(sim.wire_bytes(st, phase) for st in gathers),
    "reduce_scatter_count_per_iteration": len(scatters),
    "reduce_scatter_bytes_per_iteration": sum(sim.wire_bytes(st, phase) for st in scatters),
    "all_to_all_count_per_iteration": len(exchanges),
    "all_to_all_bytes_per_iteration": sum(sim.wire_bytes(st, phase) for st in exchanges),
  }


def state_bytes_per_device(s) -> int:
  """Parameter state each device holds: its shard of every sharded parameter plus the whole
  of every persistent one, in the parameters' own dtype. Under a lower compute dtype these
  shards are the fp32 masters; the compute-dtype copy exists only while gathered.
  Optimizer state is added by the trainer."""
  total = 0
  for p in s.params:
    total += ir.local_elements(p, s.num_devices) * jnp.dtype(p.dtype).itemsize
  return total
