"""The sharded layout: every sharded leaf flat, zero-padded to a multiple of N, 1/N per device;
persistent leaves replicated; a stacked leaf (gathered one layer at a time in a loop) as
[L, padded layer], each layer's row split over the devices, so that every device holds 1/N
of every layer. The pytree keeps the params' own structure, except that a rolled run's L
per-layer leaves are one stacked leaf at layer 0's path (stored as a scanned parameter
[L, ...] would be) and the other layers' paths hold None.

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
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zjax._src.errors import ZjaxError
from zjax._src.layout import tensor_parallel, tensor_specs
from zjax._src.schedule import ir


def storage_specs(schedule) -> list[P]:
  """PartitionSpec of each leaf of the sharded layout (schedule.storage order): over the
  storage axes, and a tensor-parallel leaf's slices over the tensor axis."""
  axis = storage_axis(schedule.config)
  tensor = schedule.roles.tensor_axes[0] if schedule.roles.tensor_axes else None
  return [storage_spec(leaf.entry, axis, tensor) for leaf in schedule.storage]


def manual_specs(schedule) -> list[P]:
  """The storage specs as zjax's shard_map sees them: the data axes only (it is manual over
  those; the tensor axis stays GSPMD's)."""
  axis = storage_axis(schedule.config)
  return [storage_spec(leaf.entry, axis) for leaf in schedule.storage]


def abstract_storage(schedule, mesh):
  """The sharded layout as a pytree of ShapeDtypeStructs carrying their shardings."""
  n = schedule.num_devices
  return storage_tree(
    schedule,
    [
      jax.ShapeDtypeStruct(
        storage_shape(leaf.entry, n), leaf.entry.dtype, sharding=NamedSharding(mesh, spec)
      )
      for leaf, spec in zip(schedule.storage, storage_specs(schedule))
    ],
  )


def storage_axis(config):
  """The PartitionSpec entry of sharded storage (device d = row-major index over the
  storage axes)."""
  return spec_entry(config.storage_axes)


def spec_entry(axes):
  """A PartitionSpec entry splitting one dimension over `axes`: the name, or their tuple."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def storage_spec(entry, axis, tensor_axis=None) -> P:
  """A leaf's storage spec over the storage axes `axis`, and over `tensor_axis` if given
  and the leaf is tensor-parallel (None: the data axes only)."""
  tp = tensor_axis if entry.tensor_dim is not None else None
  if entry.persistent:
    return tensor_parallel.tp_spec(entry, tp) if tp else P()
  layers = (None,) if entry.stacked else ()
  if entry.tensor_dim is not None:  # [T, padded slice] ([L, T, padded slice] if stacked)
    return P(*layers, tp, axis)
  return P(*layers, axis)


def storage_shape(entry, num_devices: int) -> tuple[int, ...]:
  """Shape of a leaf in the sharded layout: natural if persistent, flat and padded if
  sharded, [layers, padded layer] if stacked; a tensor-parallel one has its T slices as
  rows before the flat dimension ([T, padded slice], [L, T, padded slice])."""
  if entry.persistent:
    return tuple(entry.shape)
  padded = ir.padded_size(entry.slice_size, num_devices)
  layers = (entry.shape[0],) if entry.stacked else ()
  slices = (entry.tensor_size,) if entry.tensor_dim is not None else ()
  return layers + slices + (padded,)


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
  pad = ir.padded_size(entry.slice_size, num_devices) - entry.slice_size
  if entry.tensor_dim is not None:  # row t: TP slice t, flat (per layer if stacked)
    rows = tp_rows(x, entry, xp)
    return xp.pad(rows, ((0, 0),) * (rows.ndim - 1) + ((0, pad),))
  if entry.stacked:
    return xp.pad(xp.reshape(x, (entry.shape[0], -1)), ((0, 0), (0, pad)))
  return xp.pad(xp.ravel(x), (0, pad))


def natural_from_storage(x, entry):
  """Inverse of `storage_from_natural`: padding dropped, natural shape."""
  if entry.persistent:
    return x
  if entry.tensor_dim is not None:
    return natural_from_tp_rows(x[..., : entry.slice_size], entry)
  if entry.stacked:
    return x[:, : entry.layer_size].reshape(entry.shape)
  return x[: entry.size].reshape(entry.shape)


def tp_rows(x, entry, xp=jnp):
  """A natural tensor-parallel leaf as [T, slice size]: row t is slice t along its tensor
  dimension, flat; a stacked one as [L, T, slice size], per layer."""
  lead = 1 if entry.stacked else 0  # the tensor dim counts from the layer's dimensions
  d, t, shape = entry.tensor_dim + lead, entry.tensor_size, tuple(entry.shape)
  split = xp.reshape(x, shape[:d] + (t, shape[d] // t) + shape[d + 1 :])
  return xp.reshape(xp.moveaxis(split, d, lead), shape[:lead] + (t, -1))


def natural_from_tp_rows(rows, entry):
  """Inverse of `tp_rows`: the slices put back side by side along the tensor dimension."""
  lead = 1 if entry.stacked else 0
  slices = rows.reshape(tuple(entry.shape[:lead]) + (entry.tensor_size,) + entry.slice_shape)
  return jnp.moveaxis(slices, lead, lead + entry.tensor_dim).reshape(entry.shape)


def storage_padding(x, entry):
  """The padding elements of a leaf's storage, flat (empty when there are none)."""
  if entry.persistent:
    return x.reshape(-1)[:0]
  if entry.tensor_dim is not None:
    return x[..., entry.slice_size :].reshape(-1)
  if entry.stacked:
    return x[:, entry.layer_size :].reshape(-1)
  return x[entry.size :]


def natural_of_leaf(values, leaf, xp=jnp):
  """The natural value a storage leaf holds, from its members' natural values: a rolled
  stack's layers stacked [L, ...], any other leaf's own value."""
  return xp.stack(values) if leaf.rolled else values[0]


def members_of_natural(x, leaf) -> list:
  """Inverse of `natural_of_leaf`: the members' natural values (a stack's rows)."""
  return [x[layer] for layer in range(len(leaf.members))] if leaf.rolled else [x]


def mirrored_storage(path: str, shape, schedule) -> int | None:
  """Index (in schedule.storage) of the leaf an optimizer-state leaf mirrors (e.g. adam's
  mu for that parameter): its path ends with the leaf's path and it has the leaf's storage
  shape. None for other leaves (step counts, scalars)."""
  best = None
  for i, leaf in enumerate(schedule.storage):
    entry = leaf.entry
    if (
      path.endswith(entry.path)
      and tuple(shape) == storage_shape(entry, schedule.num_devices)
      and (best is None or len(entry.path) > len(schedule.storage[best].entry.path))
    ):
      best = i
  return best


def storage_tree(schedule, leaves, like=None):
  """The sharded layout's pytree from its leaves (schedule.storage order): the structure of
  `like` (natural params), else the params' (nested dicts by path for a schedule loaded
  from a file), with None at the paths of a rolled stack's layers 1..L-1."""
  heads = iter(leaves)
  stored = {leaf.members[0] for leaf in schedule.storage}
  full = [next(heads) if i in stored else None for i in range(len(schedule.params))]
  if like is not None:
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), full)
  return natural_tree(schedule, full)


def natural_like(tree, schedule, leaves):
  """Natural leaves (one per parameter, schedule order) in the structure of `tree`, a
  pytree in the sharded layout (its containers, e.g. FrozenDict or nnx.State, are kept)."""
  by_path = {p.path: x for p, x in zip(schedule.params, leaves)}
  return jax.tree_util.tree_map_with_path(
    lambda path, x: by_path.get(jax.tree_util.keystr(path), x), tree, is_leaf=lambda x: x is None
  )


def natural_tree(schedule, leaves):
  """A pytree with the params' structure from one leaf per parameter (schedule order)."""
  if schedule.params_treedef is not None:
    return jax.tree_util.tree_unflatten(schedule.params_treedef, leaves)
  return tree_from_paths([p.path for p in schedule.params], leaves)


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
  """Constrain `x` (inside jit) to NamedSharding(mesh, spec), on Explicit or Auto meshes, or
  a mix (tensor parallelism: Explicit data axes, an Auto tensor axis): the Explicit axes by
  resharding (they are in the array's type), then the Auto ones by a constraint."""
  sharding = NamedSharding(mesh, spec)
  axes = _spec_axes(spec) or mesh.axis_names  # replicated: resharding matters on any axis
  kinds = {mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit for a in axes}
  if kinds == {True}:
    return jax.reshard(x, sharding)
  if kinds == {False}:
    return jax.lax.with_sharding_constraint(x, sharding)
  explicit = {
    a for a in mesh.axis_names if mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit
  }
  x = jax.reshard(x, NamedSharding(mesh, tensor_specs.filtered_spec(spec, lambda a: a in explicit)))
  return jax.lax.with_sharding_constraint(
    x,
    NamedSharding(
      mesh, tensor_specs.filtered_spec(spec, lambda a: a not in explicit, P.UNCONSTRAINED)
    ),
  )


def shard(params: Any, schedule, mesh) -> Any:
  """Place natural-shape `params` into the schedule's layout on `mesh`.

  Accepts numpy or jax arrays on any placement. Padding is always zero. Host (numpy) leaves
  are padded on the host and sent straight to their shards; device leaves are laid out by
  one compiled program. A rolled run's per-layer leaves become one stacked leaf at layer
  0's path (the others' paths hold None).

  Example:
    >>> sharded = zjax.shard(params, schedule, mesh)       # doctest: +SKIP
    >>> sharded["w"].shape                                 # doctest: +SKIP
    (4096,)
  """
  check_mesh(schedule, mesh)
  params = tensor_specs.unbox(params)  # Flax partitioning boxes: their values
  leaves = natural_leaves(params, schedule, "params")
  for leaf, entry in zip(leaves, schedule.params):
    _check_leaf(leaf, entry)
  shardings = [NamedSharding(mesh, spec) for spec in storage_specs(schedule)]
  members = [[leaves[i] for i in leaf.members] for leaf in schedule.storage]
  out = [None] * len(schedule.storage)
  on_device = []
  for k, (values, leaf) in enumerate(zip(members, schedule.storage)):
    if any(isinstance(x, jax.Array) for x in values):
      on_device.append(k)
    else:
      natural = natural_of_leaf([np.asarray(x) for x in values], leaf, np)
      host = storage_from_natural(natural, leaf.entry, schedule.num_devices, np)
      out[k] = jax.device_put(host, shardings[k])
  if on_device:
    laid_out = _lay_out_on_devices(
      [members[k] for k in on_device],
      [schedule.storage[k] for k in on_device],
      [shardings[k] for k in on_device],
      schedule,
      mesh,
    )
    for k, x in zip(on_device, laid_out):
      out[k] = x
  return storage_tree(schedule, out, like=params)


def _lay_out_on_devices(members, storage, shardings, schedule, mesh):
  """One program for all device leaves. A leaf on other devices than the mesh's goes
  through the host; one sharded some other way is replicated first, inside the program."""
  devices = set(mesh.devices.flat)
  members = [
    [
      x if isinstance(x, jax.Array) and x.sharding.device_set == devices else np.asarray(x)
      for x in values
    ]
    for values in members
  ]

  def lay_out(members):
    out = []
    for values, leaf in zip(members, storage):
      natural = natural_of_leaf([place(jnp.asarray(x), mesh, P()) for x in values], leaf)
      out.append(
        natural
        if leaf.entry.persistent
        else storage_from_natural(natural, leaf.entry, schedule.num_devices)
      )
    return out

  return jax.jit(lay_out, out_shardings=shardings)(members)


def largest_dim_spec(shape, num_devices: int, axis: str) -> P:
  """Sharding along the largest dimension divisible by N (GSPMD-style), else replicated."""
  dims = [d for d in range(len(shape)) if shape[d] % num_devices == 0 and shape[d] > 0]
  if not dims:
    return P()
  d = max(dims, key=lambda d: shape[d])
  return P(*([None] * d + [axis]))


def per_device_bytes(tree, memory_kind: str | None = None) -> int:
  """Bytes a pytree of jax arrays occupies on its most loaded device; with `memory_kind`
  ("device", "pinned_host", ...) only the arrays in that memory (an offloaded state's
  optimizer state and masters are in "pinned_host")."""
  per_device: dict = {}
  for leaf in jax.tree.leaves(tree):
    kind = getattr(leaf.sharding, "memory_kind", None) or "device"
    if memory_kind is not None and kind != memory_kind:
      continue
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


def unshard(sharded: Any, schedule) -> Any:
  """The natural-shape params of a sharded pytree, bitwise equal to what `shard` was given,
  in the structure `compile_schedule` was given: Flax partitioning boxes come back with
  their metadata, as `jax.value_and_grad` returns them (a schedule loaded from a file does
  not know them: plain arrays). Leaves on one mesh come back replicated on it, from one
  compiled program."""
  leaves = stored_leaves(sharded, schedule, "sharded")
  for x, leaf in zip(leaves, schedule.storage):
    expected = storage_shape(leaf.entry, schedule.num_devices)
    if tuple(np.shape(x)) != expected:
      raise ZjaxError(
        f"Sharded leaf {leaf.path} has shape {tuple(np.shape(x))}; the "
        f"schedule's layout stores it as {expected}."
      )
  meshes = {getattr(getattr(x, "sharding", None), "mesh", None) for x in leaves}
  mesh = meshes.pop() if len(meshes) == 1 else None
  if not isinstance(mesh, jax.sharding.Mesh):  # host or mixed placements: leaf by leaf
    out = _natural_members(
      schedule,
      [jnp.asarray(x) for x in leaves],
      lambda x, leaf: natural_from_storage(x, leaf.entry),
    )
  else:
    out = _unshard_program(schedule, mesh)(leaves)
  return reboxed(natural_like(sharded, schedule, out), schedule)


def reboxed(natural: Any, schedule) -> Any:
  """`natural` (plain arrays) in the boxed structure the schedule was compiled from, if it
  was compiled from Flax boxes; else unchanged."""
  boxed = schedule.boxed_treedef
  leaves = jax.tree_util.tree_leaves(natural)
  if boxed is None or boxed.num_leaves != len(leaves):
    return natural
  return jax.tree_util.tree_unflatten(boxed, leaves)


def _natural_members(schedule, leaves, natural) -> list:
  """One natural value per parameter (schedule order) from the storage leaves."""
  out = [None] * len(schedule.params)
  for x, leaf in zip(leaves, schedule.storage):
    for i, value in zip(leaf.members, members_of_natural(natural(x, leaf), leaf)):
      out[i] = value
  return out


@functools.lru_cache(maxsize=32)
def _unshard_program(schedule, mesh):
  def natural(x, leaf):
    return x if leaf.entry.persistent else natural_from_storage(place(x, mesh, P()), leaf.entry)

  replicated = NamedSharding(mesh, P())
  return jax.jit(
    lambda leaves: _natural_members(schedule, leaves, natural),
    out_shardings=[replicated] * len(schedule.params),
  )


def check_mesh(schedule, mesh) -> None:
  """The mesh must be the one the schedule was planned for: the same data axes and sizes."""
  roles = schedule.roles
  sizes = roles.axis_sizes
  for name, size in sizes.items():
    role = "replicates" if name in roles.replicate_axes else "shards"
    if name not in mesh.shape:
      field = "replicate_axes" if role == "replicates" else "shard_axes"
      raise ZjaxError(
        f"The mesh has axes {tuple(mesh.shape)}, but the schedule {role} over "
        f"{name!r} (ZeroConfig.{field}), an axis this mesh lacks. Plan the "
        f"schedule for this mesh (compile_schedule(..., mesh=mesh))."
      )
    if mesh.shape[name] != size:
      found = (
        f"Mesh axis {name!r} has size {mesh.shape[name]}, but the schedule was planned "
        f"with it as a replicate axis of size {size}"
        if role == "replicates"
        else f"The schedule was planned for {size} devices but the mesh axis {name!r} has "
        f"{mesh.shape[name]}"
      )
      raise ZjaxError(f"{found}. Plan it for this mesh (compile_schedule(..., mesh=mesh)).")
  for name, size in roles.tensor_axis_sizes.items():
    if mesh.shape.get(name) != size:
      raise ZjaxError(
        f"The schedule splits tensors over axis {name!r} of size {size} "
        f"(ZeroConfig.tensor_axes), but the mesh has axes {dict(mesh.shape)}. "
        f"Plan it for this mesh (compile_schedule(..., mesh=mesh))."
      )
  sizes = {**sizes, **roles.tensor_axis_sizes}
  for name, size in mesh.shape.items():
    if name not in sizes:
      raise ZjaxError(
        f"Mesh axis {name!r} has size {size}, but the schedule does not use it "
        f"(it is not in ZeroConfig.shard_axes or replicate_axes). Plan the "
        f"schedule for this mesh (compile_schedule(..., mesh=mesh))."
      )


# ---- per-bucket packing (used per device, inside shard_map) ----------------------------


def chunk_size(entry, num_devices: int) -> int:
  return ir.padded_size(entry.size, num_devices) // num_devices


def unpack_gathered(full_NxC, entries, num_devices) -> list:
  """[N, sum of chunks] rank-major buffer -> natural-shape arrays of the bucket's leaves."""
  out, offset = [], 0
  for entry in entries:
    c = chunk_size(entry, num_devices)
    column = full_NxC[:, offset : offset + c].reshape(-1)
    out.append(column[: entry.size].reshape(entry.shape))
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
    out.append(buffer[offset : offset + c])
    offset += c
  return out


def _spec_axes(spec) -> list[str]:
  axes = []
  for part in spec:
    if part is None:
      continue
    axes.extend(part if isinstance(part, tuple) else (part,))
  return axes


def natural_leaves(tree, schedule, what) -> list:
  """Leaves of a natural-shape params `tree`, one per parameter in schedule order; an error
  names what differs from the schedule."""
  return _leaves_by_paths(
    tree, [p.path for p in schedule.params], what, "Use the params the schedule was compiled for."
  )


def stored_leaves(tree, schedule, what) -> list:
  """Leaves of a pytree in the sharded layout (schedule.storage order)."""
  advice = (
    "Use a pytree in the schedule's sharded layout (zjax.shard(params, schedule, "
    "mesh)): a rolled run's layers are one stacked leaf at layer 0's path."
  )
  return _leaves_by_paths(tree, [leaf.path for leaf in schedule.storage], what, advice)


def _leaves_by_paths(tree, expected, what, advice) -> list:
  path_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
  if paths != expected:
    missing = sorted(set(expected) - set(paths))
    extra = sorted(set(paths) - set(expected))
    raise ZjaxError(
      f"The {what} pytree does not match the schedule's parameters "
      f"(missing: {missing[:3]}, unexpected: {extra[:3]}). {advice}"
    )
  return [leaf for _, leaf in path_leaves]


def _check_leaf(leaf, entry):
  shape = tuple(np.shape(leaf))
  dtype = jnp.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
  if shape != tuple(entry.shape) or dtype.name != entry.dtype:
    raise ZjaxError(
      f"Parameter {entry.path} is {dtype.name}{list(shape)}, but the schedule "
      f"expects {entry.dtype}{list(entry.shape)}."
    )
