"""Optimizer offload (ZeRO-Offload; DeepSpeed `offload_optimizer.device = cpu`): the fp32
master shards and the optimizer state live in host memory (memory kind "pinned_host"), the
device keeps what the step reads: the parameter shards in the compute dtype (bf16 under
bf16 compute) and, while the step runs, the gradient shards.

The update runs on the device: inside the step the masters and the optimizer state move to
the device, optax updates them, and they move back (12 bytes per fp32 parameter / N each
way with adam), one sub-group after another (offload_stream.py), so the device holds about
two sub-groups' state at a time. Updating on the host instead (`compute_on("device_host")`,
DeepSpeed's CPU Adam) would move only the gradients and the new parameter copies, but in
jax 0.10.2 a host computation must not create arrays (they are device arrays, and mixing
memory spaces is an error), which optax transforms do (`clip_by_global_norm` makes zeros
for the imaginary part): measured, not built.
"""

import inspect

import jax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

from zjax._src.errors import ZjaxError
from zjax._src.layout import layout
from zjax._src.schedule import ir

HOST = "pinned_host"
DEVICE = "device"


def check_host_memory(mesh) -> None:
  """A clear error, before anything runs, when the backend has no pinned host memory."""
  device = mesh.devices.flat[0]
  kinds = sorted({m.kind for m in device.addressable_memories()})
  if HOST not in kinds:
    raise ZjaxError(
      f"offload_optimizer=True needs host memory of kind {HOST!r}, but the "
      f"{device.platform} backend's devices offer {kinds}. Train without "
      f"offload on this backend (offload_optimizer=False)."
    )


def with_kind(sharding, kind):
  return NamedSharding(sharding.mesh, sharding.spec, memory_kind=kind)


def place(tree, shardings, kind):
  """Every leaf moved to `kind` memory with its sharding (eagerly or inside jit)."""
  return jax.tree.map(lambda x, s: jax.device_put(x, with_kind(s, kind)), tree, shardings)


def copy_dtypes(schedule) -> list:
  """dtype of each storage leaf's device copy: the compute dtype for floats."""
  return [
    ir.gather_dtype(leaf.entry.dtype, schedule.config.compute_dtype) for leaf in schedule.storage
  ]


def device_copies(masters, dtypes):
  """The device copies (values, not placement) of the master storage leaves, in `dtypes`
  (copy_dtypes), cast on the device (inside jit; masters on the host are moved first)."""
  leaves, treedef = jax.tree.flatten(masters)
  return jax.tree.unflatten(treedef, [on_device(x).astype(d) for x, d in zip(leaves, dtypes)])


def on_device(x):
  """x in device memory: moved there (inside jit or shard_map) if it lives on the host
  (offload_params: the executor moves each shard just before its gather)."""
  if jax.typeof(x).memory_space == jax.memory.Space.Host:
    return jax.device_put(x, jax.memory.Space.Device)
  return x


def to_space(tree, space: str):
  """Every leaf moved (inside jit) to device or host memory, keeping its sharding."""
  target = jax.memory.Space.Device if space == "device" else jax.memory.Space.Host
  return jax.tree.map(lambda x: jax.device_put(x, target), tree)


def on_host(fn):
  """fn as a computation on the host (inputs and outputs in host memory)."""
  if "out_memory_spaces" in inspect.signature(compute_on).parameters:  # jax >= 0.11
    return compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(
      jax.jit(fn)
    )
  return compute_on("device_host")(jax.jit(fn))


def bytes_by_kind(tree) -> dict:
  """{memory kind: bytes on the most loaded device} of a pytree of arrays."""
  kinds = {getattr(x.sharding, "memory_kind", None) or DEVICE for x in jax.tree.leaves(tree)}
  return {kind: layout.per_device_bytes(tree, kind) for kind in sorted(kinds)}


def leaf_shardings(schedule, mesh) -> list:
  """The storage leaves' device shardings (schedule.storage order)."""
  return [NamedSharding(mesh, spec) for spec in layout.storage_specs(schedule)]
