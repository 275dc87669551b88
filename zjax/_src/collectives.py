"""The schedule's two collectives as one device runs them inside shard_map: a bucket's
coalesced all-gather and its gradient's reduce-scatter (see layout.py for the packing)."""

import jax.numpy as jnp
from jax import lax

from zjax._src import layout


def all_gather_bucket(chunks, entries, num_devices: int, axis: str) -> list:
  """Each member's local chunk (in the compute dtype) -> its whole natural-shape value.
  `entries` describe what one gather makes whole (a layer entry for stacked members)."""
  local = jnp.concatenate(chunks) if len(chunks) > 1 else chunks[0]
  wire = lax.all_gather(layout.to_wire(local), axis, tiled=False)
  full = layout.from_wire(wire, local.dtype, local.shape[0])
  return layout.unpack_gathered(full, entries, num_devices)


def reduce_scatter_bucket(grads, entries, num_devices: int, axis: str, wire_dtype,
                          replicate_axes=()) -> list:
  """Each member's whole gradient (natural shape, one dtype) -> this device's chunk of the
  gradient averaged over devices, in that dtype; summed in `wire_dtype` (ir.reduce_wire_dtype).
  With replicate axes (HSDP) the chunk is then averaged over the replicas (an all-reduce of
  1/N of the bucket), so it equals the mean over every data-parallel device."""
  packed = layout.pack_for_scatter(grads, entries, num_devices)
  mine = lax.psum_scatter(packed.astype(wire_dtype), axis, scatter_dimension=0, tiled=False)
  mine = mine / num_devices
  if replicate_axes:
    mine = lax.pmean(mine, replicate_axes)
  return layout.split_chunks(mine.astype(packed.dtype), entries, num_devices)
