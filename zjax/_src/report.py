"""Predicted per-device memory and communication of one training step under a schedule."""

import jax.numpy as jnp

from zjax._src import ir


def make_report(s, sim) -> dict:
  """JSON-serialisable predictions for schedule `s` with simulation `sim`.

  Bytes of a collective are those of its full (gathered / pre-reduction) buffer, padding
  included. A collective inside a loop counts once per iteration (v1 schedules have none).
  """
  bucket_bytes, grad_bytes = list(sim.bucket_bytes), list(sim.bucket_grad_bytes)
  gathers = [st for st in s.forward + s.backward if st.op == "gather"]
  scatters = [st for st in s.backward if st.op == "reduce_scatter"]
  persistent = [p for p in s.params if p.persistent]
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
      "forward_all_gather_count": sum(st.op == "gather" for st in s.forward),
      "backward_all_gather_count": sum(st.op == "gather" for st in s.backward),
      "prefetch_count": sum(st.prefetch for st in gathers),
      "reduce_scatter_count": len(scatters),
      "reduce_scatter_bytes": sum(grad_bytes[st.bucket] for st in scatters),
      "persistent_grad_all_reduce_bytes": sum(
          p.size * ir.reduce_dtype(p.dtype, s.config).itemsize
          for p in persistent if ir.has_gradient(p)),
      "peak_live_param_bytes": max(sim.forward_live + sim.backward_live, default=0),
      "peak_live_grad_bytes": max(sim.backward_grad_live, default=0),
      "state_bytes_per_device": state_bytes_per_device(s),
  }


def state_bytes_per_device(s) -> int:
  """Parameter state each device holds: its shard of every sharded parameter plus the whole
  of every persistent one, in the parameters' own dtype. Under a lower compute dtype these
  shards are the fp32 masters; the compute-dtype copy exists only while gathered.
  Optimizer state is added by the trainer."""
  total = 0
  for p in s.params:
    elements = p.size if p.persistent else ir.padded_size(p.size, s.num_devices) // s.num_devices
    total += elements * jnp.dtype(p.dtype).itemsize
  return total
