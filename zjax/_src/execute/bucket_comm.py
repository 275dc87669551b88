"""A bucket's collectives, chosen once from the schedule: its gather and reduce-scatter
(with qwZ / qgZ as the config asks), hpZ's secondary shard and the re-gather from it, and
the region they run in. The top level and every loop (scanned, rolled, part by part) call
the same object, so a feature is composed here once instead of branching in each walker.

The region: without tensor parallelism the collectives run directly on this device's
values; with it they run manual over the tensor axis too (tensor_parallel.nested): every
device moves its own TP slices over the data axes, and the parameters come out
natural-shaped, split over the tensor axis on their tensor dimension. A bucket's wire (and
its hpZ secondary) is then one per tensor rank: a leading axis of T rows."""

import functools

import jax
import jax.numpy as jnp

from zjax._src.execute import collectives, quantize
from zjax._src.layout import layout, tensor_parallel
from zjax._src.schedule import ir


class _Direct:
  """No tensor axis: the collectives see this device's values as they are."""

  ranks = ()

  def run(self, fn, entries, inputs, outputs, ranked_in=0, ranked_out=0):
    return fn

  def slices(self, entries):
    return list(entries)

  def local(self, chunk, entry):
    return jax.ShapeDtypeStruct(chunk.shape, chunk.dtype)


class _TensorManual:
  """A tensor axis: the collectives run per tensor rank, on its TP slices."""

  def __init__(self, axis: str, size: int):
    self.axis, self.ranks = axis, (size,)

  def run(self, fn, entries, inputs, outputs, ranked_in=0, ranked_out=0):
    return tensor_parallel.nested(fn, entries, self.axis, inputs, outputs, ranked_in, ranked_out)

  def slices(self, entries):
    return [tensor_parallel.slice_entry(e) for e in entries]

  def local(self, chunk, entry):
    return tensor_parallel.rank_chunk(chunk, entry)


def region_of(schedule):
  """Where a schedule's bucket collectives run: directly, or manual over its tensor axis."""
  tensor = schedule.roles.tensor_axis_sizes
  if not tensor:
    return _Direct()
  ((axis, size),) = tensor.items()
  return _TensorManual(axis, size)


class BucketComm:
  """Bucket b's collectives on one device (inside the step's shard_map); `first`: the index
  of its first member parameter. `entries` given to each method describe what one gather
  makes whole (a layer entry for stacked members)."""

  def __init__(self, schedule, b: int, first: int, region):
    config, bucket = schedule.config, schedule.buckets[b]
    self.region, self.n = region, schedule.num_devices
    self.axes = {
      phase: tuple(schedule.roles.collective_axes("gather", phase)["axes"])
      for phase in ("forward", "backward")
    }
    self.quantization = {
      phase: ir.gather_quantization(bucket, phase, config) for phase in ("forward", "backward")
    }
    self.reduce_quantization = ir.reduce_quantization(bucket, config)
    roles = schedule.roles
    self.storage_axes, self.shard_axes = roles.storage_axes, roles.shard_axes
    self.mean_over = roles.averaged_axes  # HSDP: gradient shards averaged over replicas
    self.replicas = roles.replicas
    dtype = schedule.params[first].dtype
    self.wire_dtype = ir.reduce_wire_dtype(dtype, config, schedule.platform)

  def gather(self, phase: str, chunks, entries, keep_wire=False):
    """-> (the bucket's parameters from this device's chunks, its gathered wire or None)."""
    quantization, axes = self.quantization[phase], self.axes[phase]
    slices = self.region.slices(entries)

    def gather(local):
      wire, _ = collectives.gather_wire(local, axes, quantization)
      values = collectives.unpack_wire(wire, local, slices, self.n, quantization)
      return values + [wire] if keep_wire else values

    out = self.region.run(gather, entries, "storage", "natural", ranked_out=int(keep_wire))(chunks)
    return (out[:-1], out[-1]) if keep_wire else (out, None)

  def secondary(self, wire, entries):
    """hpZ: this device's secondary rows of the bucket's gathered wire."""
    rows = functools.partial(
      collectives.secondary_rows, replicas=self.replicas, shard_axes=self.shard_axes
    )
    (secondary,) = self.region.run(
      lambda w: [rows(w[0])], entries, "none", "none", ranked_in=1, ranked_out=1
    )([wire])
    return secondary

  def regather(self, secondary, chunks, entries):
    """hpZ's backward gather from the secondary, over the shard axes only (`chunks`: the
    shapes of this device's storage chunks, for unpacking)."""
    quantization = self.quantization["backward"]
    slices = self.region.slices(entries)
    local = [self.region.local(c, e) for c, e in zip(chunks, entries)]

    def regather(values):
      wire = collectives.gather_from_secondary(values[0], self.shard_axes)
      return collectives.unpack_wire(wire, local, slices, self.n, quantization)

    return self.region.run(regather, entries, "none", "natural", ranked_in=1)([secondary])

  def scatter(self, grads, entries):
    """-> this device's chunks of the bucket's gradients (natural-shaped `grads`, in the
    reduce dtype), reduce-scattered and averaged over the devices."""
    slices = self.region.slices(entries)

    def scatter(local):
      return collectives.reduce_scatter_bucket(
        local,
        slices,
        self.n,
        self.storage_axes,
        self.wire_dtype,
        self.mean_over,
        self.reduce_quantization,
      )

    return self.region.run(scatter, entries, "natural", "storage")(grads)

  def secondary_stack(self, length: int, rows, entries):
    """Zeros for every layer's hpZ secondary shard of a loop, [L, (T,) R, W] (W: the wire
    length; `rows`: the shapes of this device's rows of one layer's storage chunks)."""
    local = [self.region.local(r, e) for r, e in zip(rows, entries)]
    quantization = self.quantization["forward"]
    wire = jax.eval_shape(
      lambda r: (
        layout.to_wire(jnp.concatenate(r))
        if quantization is None
        else quantize.pack(jnp.concatenate(r), quantization)
      ),
      local,
    )
    return jnp.zeros((length,) + self.region.ranks + (self.replicas, wire.shape[0]), wire.dtype)
