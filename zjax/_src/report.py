"""Predicted per-device memory and communication of one training step under a schedule."""

import jax.numpy as jnp

from zjax._src import ir


def make_report(s, sim) -> dict:
  """JSON-serialisable predictions for schedule `s` with simulation `sim`.

  Bytes of a collective are those of its full (gathered / pre-reduction) buffer, padding
  included. A collective inside a loop counts once per iteration; `loops` lists each loop's
  per-iteration collectives (what the compiled program's while body holds).
  """
  bucket_bytes, grad_bytes = list(sim.bucket_bytes), list(sim.bucket_grad_bytes)
  forward, backward = executed_steps(s.forward), executed_steps(s.backward)
  gathers = [st for st in forward + backward if st.op == "gather"]
  scatters = [st for st in backward if st.op == "reduce_scatter"]
  persistent = [p for p in s.params if p.persistent]
  scatter_bytes = sum(grad_bytes[st.bucket] for st in scatters)
  replica_bytes = scatter_bytes // s.num_devices if s.config.averaged_axes else 0
  persistent_bytes = persistent_grad_bytes(s)
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
      "all_gather_bytes": sum(bucket_bytes[st.bucket] for st in gathers),
      "forward_all_gather_count": sum(st.op == "gather" for st in forward),
      "backward_all_gather_count": sum(st.op == "gather" for st in backward),
      "prefetch_count": sum(st.prefetch for st in gathers),
      "reduce_scatter_count": len(scatters),
      "reduce_scatter_bytes": scatter_bytes,
      "replicas": s.replicas,
      "axis_sizes": s.axis_sizes,
      # HSDP: each reduce-scattered gradient shard (1/N of the bucket) is then all-reduced
      # over the replicate axes (XLA may combine those all-reduces: bytes, not count, are
      # what to compare)
      "replica_all_reduce_bytes": replica_bytes,
      "persistent_grad_all_reduce_bytes": persistent_bytes,
      # the same bytes by the mesh axes each collective spans ("replica+fsdp": both); the
      # loss's scalar all-reduce over every data axis is not counted
      **{f"{kind}_bytes_by_axis": _by_axis(collectives, kind)
         for kind in ("all_gather", "reduce_scatter", "all_reduce")},
      "secondary_bytes": sim.peak_secondary_bytes,
      "peak_live_param_bytes": max(sim.forward_live + sim.backward_live, default=0),
      "peak_live_grad_bytes": max(sim.backward_grad_live, default=0),
      "state_bytes_per_device": state_bytes_per_device(s),
      "loops": [_loop_report(phase, st, bucket_bytes, grad_bytes)
                for phase, steps in (("forward", s.forward), ("backward", s.backward))
                for st in steps if st.op == ir.LOOP_OP],
  }


def persistent_grad_bytes(s) -> int:
  """Bytes of the persistent (replicated) parameters' gradients, as all-reduced."""
  return sum(p.size * ir.reduce_wire_dtype(p.dtype, s.config, s.platform).itemsize
             for p in s.params if p.persistent and ir.has_gradient(p))


def executed_collectives(s, sim) -> list[tuple[str, tuple[str, ...], int]]:
  """(kind, mesh axes, full-buffer bytes) of every collective one step executes, loops
  unrolled: gathers, reduce-scatters, HSDP's replica all-reduce of each reduce-scattered
  shard, and the persistent gradients' all-reduce (when there is more than one device).
  The loss's scalar all-reduce is left out."""
  out = []
  for phase, steps in (("forward", s.forward), ("backward", s.backward)):
    for st in executed_steps(steps):
      if st.op not in ("gather", "reduce_scatter"):
        continue
      axes = ir.collective_axes(st.op, phase, s.config)
      if st.op == "gather":
        out.append(("all_gather", tuple(axes["axes"]), sim.bucket_bytes[st.bucket]))
        continue
      size = sim.bucket_grad_bytes[st.bucket]
      out.append(("reduce_scatter", tuple(axes["axes"]), size))
      if "mean_over" in axes:
        out.append(("all_reduce", tuple(axes["mean_over"]), size // s.num_devices))
  persistent = persistent_grad_bytes(s)
  if persistent and s.data_parallel_size > 1:
    out.append(("all_reduce", s.config.data_axes, persistent))
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


def _loop_report(phase, step, bucket_bytes, grad_bytes) -> dict:
  gathers = [st.bucket for st in step.body if st.op == "gather"]
  scatters = [st.bucket for st in step.body if st.op == "reduce_scatter"]
  return {"phase": phase, "segment": step.segment, "length": step.length,
          "prefetch": any(st.prefetch for st in step.body),
          "all_gather_count_per_iteration": len(gathers),
          "all_gather_bytes_per_iteration": sum(bucket_bytes[b] for b in gathers),
          "reduce_scatter_count_per_iteration": len(scatters),
          "reduce_scatter_bytes_per_iteration": sum(grad_bytes[b] for b in scatters)}


def state_bytes_per_device(s) -> int:
  """Parameter state each device holds: its shard of every sharded parameter plus the whole
  of every persistent one, in the parameters' own dtype. Under a lower compute dtype these
  shards are the fp32 masters; the compute-dtype copy exists only while gathered.
  Optimizer state is added by the trainer."""
  total = 0
  for p in s.params:
    total += ir.local_elements(p, s.num_devices) * jnp.dtype(p.dtype).itemsize
  return total
