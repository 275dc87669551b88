"""The sharded layout: every sharded leaf flat, zero-padded to a multiple of N, 1/N per device;
persistent leaves replicated; a stacked leaf (gathered one layer at a time in a loop) as
[L, padded layer], each layer's row split over the devices, so that every device holds 1/N
of every layer. The pytree keeps the params' own structure.

Also the per-bucket packing used at gather time: device d concatenates its chunks of a
bucket's leaves, one all-gather returns an [N, bucket/N] rank-major buffer, and each leaf is
read back from its column range. The reduce-scatter is the mirror image.
"""

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from zjax._src import ir
from zjax._src.errors import ZjaxError


def param_specs(schedule) -> list[P]:
  """PartitionSpec of each leaf's storage, in schedule (= tree-flatten) order."""
  return [storage_spec(p, storage_axis(schedule.config)) for p in schedule.params]


def storage_axis(config):
  """The PartitionSpec entry of sharded storage (device d = row-major index over the
  storage axes)."""
  return spec_entry(config.storage_axes)


def spec_entry(axes):
  """A PartitionSpec entry splitting one dimension over `axes`: the name, or their tuple."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def storage_spec(entry, axis) -> P:
  if entry.persistent:
    return P()
  return P(None, axis) if entry.stacked else P(axis)


def storage_shape(entry, num_devices: int) -> tuple[int, ...]:
  """Shape of a leaf in the sharded layout: natural if persistent, flat and padded if
  sharded, [layers, padded layer] if stacked."""
  if entry.persistent:
    return tuple(entry.shape)
  padded = ir.padded_size(entry.layer_size, num_devices)
  return (entry.shape[0], padded) if entry.stacked else (padded,)


def local_shape(entry, num_devices: int) -> tuple[int, ...]:
  """Shape of the part of a leaf's storage each device holds."""
  shape = storage_shape(entry, num_devices)
  if entry.persistent:
    return shape
  return shape[:-1] + (shape[-1] // num_devices,)


def layer_entry(entry):
  """The entry of one layer slice of a stacked parameter (what one loop gather makes whole)."""
  return dataclasses.replace(entry, shape=entry.layer_shape, stacked=False)


def storage_from_natural(x, entry, num_devices: int, xp=jnp):
  """A natural-shape leaf as its storage (`xp`: jax.numpy, or numpy on the host)."""
  if entry.persistent:
    return x
  pad = ir.padded_size(entry.layer_size, num_devices) - entry.layer_size
  if entry.stacked:
    return xp.pad(xp.reshape(x, (entry.shape[0], -1)), ((0, 0), (0, pad)))
  return xp.pad(xp.ravel(x), (0, pad))


def natural_from_storage(x, entry):
  """Inverse of `storage_from_natural`: padding dropped, natural shape."""
  if entry.persistent:
    return x
  if entry.stacked:
    return x[:, :entry.layer_size].reshape(entry.shape)
  return x[:entry.size].reshape(entry.shape)


def storage_padding(x, entry):
  """The padding elements of a leaf's storage, flat (empty when there are none)."""
  if entry.persistent:
    return x.reshape(-1)[:0]
  if entry.stacked:
    return x[:, entry.layer_size:].reshape(-1)
  return x[entry.size:]


def mirrored_param(path: str, shape, schedule) -> int | None:
  """Index of the parameter an optimizer-state leaf mirrors (e.g. adam's mu for that
  parameter): its path ends with the parameter's path and it has the parameter's storage
  shape. None for other leaves (step counts, scalars)."""
  best = None
  for i, entry in enumerate(schedule.params):
    if path.endswith(entry.path) and \
        tuple(shape) == storage_shape(entry, schedule.num_devices) and \
        (best is None or len(entry.path) > len(schedule.params[best].path)):
      best = i
  return best


def tree_from_paths(paths, leaves):
  """A pytree of nested dicts from keystr paths ("['a']['b']", "[0]", ".attr")."""
  root: dict = {}
  for path, leaf in zip(paths, leaves):
    keys = [_key(m) for m in _KEY_RE.finditer(path)]
    if not keys or "".join(m.group(0) for m in _KEY_RE.finditer(path)) != path:
      raise ZjaxError(f"Cannot rebuild the pytree structure from the path {path}.")
    node = root
    for key in keys[:-1]:
      node = node.setdefault(key, {})
    node[keys[-1]] = leaf
  return root


_KEY_RE = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[(-?\d+)\]|\.([A-Za-z_][A-Za-z_0-9]*)")


def _key(match):
  string, index, attr = match.groups()
  return string if string is not None else (int(index) if index is not None else attr)


def place(x, mesh, spec):
  """Constrain `x` (inside jit) to NamedSharding(mesh, spec), on Explicit or Auto meshes."""
  sharding = NamedSharding(mesh, spec)
  axes = _spec_axes(spec) or mesh.axis_names  # replicated: resharding matters on any axis
  explicit = any(mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit for a in axes)
  return jax.reshard(x, sharding) if explicit else jax.lax.with_sharding_constraint(x, sharding)


def shard(params: Any, schedule, mesh) -> Any:
  """Place natural-shape `params` into the schedule's layout on `mesh`.

  Accepts numpy or jax arrays on any placement. Padding is always zero. Host (numpy) leaves
  are padded on the host and sent straight to their shards; device leaves are laid out by
  one compiled program.

  Example:
    >>> sharded = zjax.shard(params, schedule, mesh)       # doctest: +SKIP
    >>> sharded["w"].shape                                 # doctest: +SKIP
    (4096,)
  """
  check_mesh(schedule, mesh)
  leaves, treedef = matching_leaves(params, schedule, "params")
  shardings = [NamedSharding(mesh, spec) for spec in param_specs(schedule)]
  out = [None] * len(leaves)
  on_device = []
  for i, (leaf, entry) in enumerate(zip(leaves, schedule.params)):
    _check_leaf(leaf, entry)
    if isinstance(leaf, jax.Array):
      on_device.append(i)
    else:
      host = storage_from_natural(np.asarray(leaf), entry, schedule.num_devices, np)
      out[i] = jax.device_put(host, shardings[i])
  if on_device:
    laid_out = _lay_out_on_devices([leaves[i] for i in on_device],
                                   [schedule.params[i] for i in on_device],
                                   [shardings[i] for i in on_device], schedule, mesh)
    for i, x in zip(on_device, laid_out):
      out[i] = x
  return jax.tree_util.tree_unflatten(treedef, out)


def _lay_out_on_devices(leaves, entries, shardings, schedule, mesh):
  """One program for all device leaves. A leaf on other devices than the mesh's goes
  through the host; one sharded some other way is replicated first, inside the program."""
  devices = set(mesh.devices.flat)
  leaves = [np.asarray(x) if x.sharding.device_set != devices else x for x in leaves]

  def lay_out(xs):
    return [x if e.persistent else
            storage_from_natural(place(x, mesh, P()), e, schedule.num_devices)
            for x, e in zip(xs, entries)]

  return jax.jit(lay_out, out_shardings=shardings)(leaves)


def largest_dim_spec(shape, num_devices: int, axis: str) -> P:
  """Sharding along the largest dimension divisible by N (GSPMD-style), else replicated."""
  dims = [d for d in range(len(shape)) if shape[d] % num_devices == 0 and shape[d] > 0]
  if not dims:
    return P()
  d = max(dims, key=lambda d: shape[d])
  return P(*([None] * d + [axis]))


def per_device_bytes(tree) -> int:
  """Bytes a pytree of jax arrays occupies on its most loaded device."""
  per_device: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


def unshard(sharded: Any, schedule) -> Any:
  """The natural-shape params of a sharded pytree, bitwise equal to what `shard` was given.
  Leaves on one mesh come back replicated on it, from one compiled program."""
  leaves, treedef = matching_leaves(sharded, schedule, "sharded")
  for leaf, entry in zip(leaves, schedule.params):
    expected = storage_shape(entry, schedule.num_devices)
    if tuple(np.shape(leaf)) != expected:
      raise ZjaxError(f"Sharded leaf {entry.path} has shape {tuple(np.shape(leaf))}; the "
                      f"schedule's layout stores it as {expected}.")
  meshes = {getattr(getattr(x, "sharding", None), "mesh", None) for x in leaves}
  mesh = meshes.pop() if len(meshes) == 1 else None
  if not isinstance(mesh, jax.sharding.Mesh):  # host or mixed placements: leaf by leaf
    out = [natural_from_storage(jnp.asarray(leaf), e) for leaf, e in zip(leaves, schedule.params)]
  else:
    out = _unshard_program(schedule, mesh)(leaves)
  return jax.tree_util.tree_unflatten(treedef, out)


@functools.lru_cache(maxsize=32)
def _unshard_program(schedule, mesh):
  entries = schedule.params

  def natural(leaves):
    return [x if e.persistent else natural_from_storage(place(x, mesh, P()), e)
            for x, e in zip(leaves, entries)]

  replicated = NamedSharding(mesh, P())
  return jax.jit(natural, out_shardings=[
      NamedSharding(mesh, spec) if e.persistent else replicated
      for e, spec in zip(entries, param_specs(schedule))])


def check_mesh(schedule, mesh) -> None:
  """The mesh must be the one the schedule was planned for: the same data axes and sizes."""
  sizes, config = schedule.axis_sizes, schedule.config
  for name, size in sizes.items():
    role = "replicates" if name in config.replicate_axes else "shards"
    if name not in mesh.shape:
      field = "replicate_axes" if role == "replicates" else "shard_axes"
      raise ZjaxError(f"The mesh has axes {tuple(mesh.shape)}, but the schedule {role} over "
                      f"{name!r} (ZeroConfig.{field}), an axis this mesh lacks. Plan the "
                      f"schedule for this mesh (compile_schedule(..., mesh=mesh)).")
    if mesh.shape[name] != size:
      found = (f"Mesh axis {name!r} has size {mesh.shape[name]}, but the schedule was planned "
               f"with it as a replicate axis of size {size}" if role == "replicates" else
               f"The schedule was planned for {size} devices but the mesh axis {name!r} has "
               f"{mesh.shape[name]}")
      raise ZjaxError(f"{found}. Plan it for this mesh (compile_schedule(..., mesh=mesh)).")
  for name, size in mesh.shape.items():
    if name not in sizes:
      raise ZjaxError(f"Mesh axis {name!r} has size {size}, but the schedule does not use it "
                      f"(it is not in ZeroConfig.shard_axes or replicate_axes). Plan the "
                      f"schedule for this mesh (compile_schedule(..., mesh=mesh)).")


# ---- per-bucket packing (used per device, inside shard_map) ----------------------------

def chunk_size(entry, num_devices: int) -> int:
  return ir.padded_size(entry.size, num_devices) // num_devices


def unpack_gathered(full_NxC, entries, num_devices) -> list:
  """[N, sum of chunks] rank-major buffer -> natural-shape arrays of the bucket's leaves."""
  out, offset = [], 0
  for entry in entries:
    c = chunk_size(entry, num_devices)
    column = full_NxC[:, offset:offset + c].reshape(-1)
    out.append(column[:entry.size].reshape(entry.shape))
    offset += c
  return out


def to_wire(local):
  """A gather's local buffer as sent: 16-bit floats packed two per uint32 (bit-exact), so
  that no backend widens them (XLA's CPU backend runs bf16 collectives in f32)."""
  if local.dtype.itemsize != 2:
    return local
  if local.shape[0] % 2:
    local = jnp.pad(local, (0, 1))
  return jax.lax.bitcast_convert_type(local.reshape(-1, 2), jnp.uint32)


def from_wire(gathered, dtype, length):
  """Inverse of `to_wire` on the gathered [N, wire length] buffer -> [N, length]."""
  if jnp.dtype(dtype).itemsize != 2:
    return gathered
  unpacked = jax.lax.bitcast_convert_type(gathered, dtype)  # [N, W, 2]
  return unpacked.reshape(gathered.shape[0], -1)[:, :length]


def pack_for_scatter(grads, entries, num_devices):
  """Natural-shape gradients -> [N, sum of chunks], row d holding device d's chunks."""
  rows = []
  for g, entry in zip(grads, entries):
    pad = ir.padded_size(entry.size, num_devices) - entry.size
    rows.append(jnp.pad(g.reshape(-1), (0, pad)).reshape(num_devices, -1))
  return jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]


def split_chunks(buffer, entries, num_devices) -> list:
  out, offset = [], 0
  for entry in entries:
    c = chunk_size(entry, num_devices)
    out.append(buffer[offset:offset + c])
    offset += c
  return out


def _spec_axes(spec) -> list[str]:
  axes = []
  for part in spec:
    if part is None:
      continue
    axes.extend(part if isinstance(part, tuple) else (part,))
  return axes


def matching_leaves(tree, schedule, what):
  """Leaves of `tree` in schedule order; an error names what differs from the schedule."""
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
  expected = [p.path for p in schedule.params]
  if paths != expected:
    missing = sorted(set(expected) - set(paths))
    extra = sorted(set(paths) - set(expected))
    raise ZjaxError(f"The {what} pytree does not match the schedule's parameters "
                    f"(missing: {missing[:3]}, unexpected: {extra[:3]}). Use the params the "
                    f"schedule was compiled for.")
  return [leaf for _, leaf in path_leaves], treedef


def _check_leaf(leaf, entry):
  shape = tuple(np.shape(leaf))
  dtype = jnp.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
  if shape != tuple(entry.shape) or dtype.name != entry.dtype:
    raise ZjaxError(f"Parameter {entry.path} is {dtype.name}{list(shape)}, but the schedule "
                    f"expects {entry.dtype}{list(entry.shape)}.")
