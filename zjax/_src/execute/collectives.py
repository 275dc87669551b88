"""The schedule's collectives as one device runs them inside shard_map: a bucket's coalesced
all-gather, its hpZ secondary partition, and its gradient's reduce-scatter (see layout.py
for the packing). `axes` are mesh axis names (a tuple spans several, row-major).
`quantization` (quantize.py; None: exact): ZeRO++ qwZ for gathers (the wire is each
device's int8 values and scales), qgZ for gradients (an all-to-all of quantized chunks)."""

import jax.numpy as jnp
from jax import lax

from zjax._src.execute import quantize
from zjax._src.layout import layout


def gather_wire(chunks, axes, quantization=None):
  """Each member's local chunk (in the compute dtype) -> (the gathered [N, W] wire buffer,
  the local buffer); row d is device d's."""
  local = jnp.concatenate(chunks) if len(chunks) > 1 else chunks[0]
  wire = layout.to_wire(local) if quantization is None else quantize.pack(local, quantization)
  return lax.all_gather(wire, axes, tiled=False), local


def unpack_wire(wire, chunks, entries, num_devices: int, quantization=None) -> list:
  """The gathered wire buffer of the bucket whose local `chunks` (or arrays of their shape
  and dtype) are these -> each member's whole natural-shape value (dequantized to the
  chunks' dtype when the wire is quantized)."""
  length, dtype = sum(c.shape[0] for c in chunks), chunks[0].dtype
  full = (
    layout.from_wire(wire, dtype, length)
    if quantization is None
    else quantize.unpack(wire, quantization, length, dtype)
  )
  return layout.unpack_gathered(full, entries, num_devices)


def all_gather_bucket(chunks, entries, num_devices: int, axes, quantization=None) -> list:
  """Each member's local chunk -> its whole natural-shape value. `entries` describe what
  one gather makes whole (a layer entry for stacked members)."""
  wire, _ = gather_wire(chunks, axes, quantization)
  return unpack_wire(wire, chunks, entries, num_devices, quantization)


def secondary_rows(wire, replicas: int, shard_axes):
  """hpZ: this device's secondary shard of a gathered [R*S, W] wire buffer, the rows of
  its own position s on the shard axes in every replica group ([R, W], 1/S of it)."""
  rows = wire.reshape(replicas, -1, wire.shape[-1])  # [R, S, W]: device r*S + s
  return lax.dynamic_index_in_dim(rows, lax.axis_index(shard_axes), 1, keepdims=False)


def gather_from_secondary(secondary, shard_axes):
  """hpZ re-gather: the [R, W] secondary shards of the S devices on the shard axes -> the
  whole [R*S, W] wire buffer, without crossing the replicate axes."""
  parts = lax.all_gather(secondary, shard_axes, tiled=False)  # [S, R, W]
  return jnp.swapaxes(parts, 0, 1).reshape(-1, secondary.shape[-1])


def reduce_scatter_bucket(
  grads, entries, num_devices: int, axes, wire_dtype, mean_over=(), quantization=None
) -> list:
  """Each member's whole gradient (natural shape, one dtype) -> this device's chunk of the
  gradient averaged over the N devices of `axes`, in that dtype; summed in `wire_dtype`
  (ir.reduce_wire_dtype). HSDP (`mean_over`: the replicate axes) then averages the chunk
  over the replicas (an all-reduce of 1/N of the bucket): the mean over every device.
  Quantized (qgZ): each destination's chunk is quantized, one all-to-all delivers them, and
  the receiver dequantizes and sums them in float32."""
  packed = layout.pack_for_scatter(grads, entries, num_devices)
  if quantization is None:
    mine = lax.psum_scatter(packed.astype(wire_dtype), axes, scatter_dimension=0, tiled=False)
  else:
    sent = quantize.pack(packed, quantization)  # row d: device d's chunk, quantized
    received = lax.all_to_all(sent, axes, 0, 0, tiled=False)  # row d: from device d
    chunks = quantize.unpack(received, quantization, packed.shape[1], jnp.float32)
    mine = jnp.sum(chunks, axis=0).astype(wire_dtype)
  mine = mine / num_devices
  if mean_over:
    mine = lax.pmean(mine, mean_over)
  return layout.split_chunks(mine.astype(packed.dtype), entries, num_devices)
