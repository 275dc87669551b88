"""Does an optax transformation give the same result on the sharded layout as on whole
parameters? Checked by running both on random probes, not guessed from names.

The trainer applies the optimizer to flat, zero-padded leaves. That is exact for element-wise
transforms and for global or per-leaf norms (reductions over the whole flat leaf, padding
zero), and wrong for transforms that use a parameter's shape (Adafactor's factored moments,
Muon's orthogonalisation) or that write into the padding. A rolled run's layers are one
stacked leaf, so per-leaf norms or labels would span all its layers there: wrong too. The
probe runs two updates on random parameters and gradients, both ways, and compares them.

What it costs: one compiled program over one representative trained leaf per distinct
(shape, dtype, layout), so it grows with the number of distinct shapes, not with leaves or
devices; results are cached per layout and per optimizer's code and settings (`_structure`:
the same transformation built again is not probed again). Representatives keep their own paths
(path-based masks and labels see real names). An optimizer that cannot run on that smaller
tree (e.g. a label pytree shaped like the whole model) is probed on every leaf in the
params' own structure instead. A small probe runs on one local device (`_probe_mesh`);
a large one is generated on the host shard by shard and placed sharded over the mesh, so no
device holds more than one whole probe leaf.
"""

import functools
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zjax._src.errors import ZjaxError
from zjax._src.layout import layout
from zjax._src.schedule import ir

_RTOL = 1e-4  # reduction order differs between the two layouts; shape-dependence is O(1)
_UPDATES = 2
_cache: dict = {}  # (optimizer's structure, layout signature) -> None or the error text
_CACHE_LIMIT = 64


class _CannotRunNatural(Exception):
  """The optimizer fails on the probe tree in the natural layout."""


def check_optimizer(optimizer, schedule, mesh, treedef, trainable, *, name: str) -> None:
  """Raise ZjaxError naming a parameter where `optimizer` differs on the sharded layout.

  `trainable`: one bool per leaf of the sharded layout (schedule.storage); `treedef`: the
  sharded layout's pytree structure (for the fallback that probes every leaf)."""
  reps = representatives(schedule, trainable)
  if not reps:
    return
  key = _cache_key(optimizer, schedule, mesh, reps, name)
  if key is not None and key in _cache:
    error = _cache[key]
  else:
    error = _find_error(optimizer, schedule, mesh, treedef, trainable, reps, name)
    if key is not None:
      if len(_cache) >= _CACHE_LIMIT:
        _cache.pop(next(iter(_cache)))
      _cache[key] = error
  if error is not None:
    raise ZjaxError(error)


def representatives(schedule, trainable) -> list:
  """The first trained storage leaf of each distinct (shape, dtype, layout) in tree order;
  a rolled stack stands in with its first two layers (enough to tell statistics per layer,
  as optax keeps them on the natural leaves, from statistics over the whole stack)."""
  seen, reps = set(), []
  for leaf, trains in zip(schedule.storage, trainable):
    e = leaf.entry
    kind = (e.shape[1:] if leaf.rolled else e.shape, e.dtype, e.persistent, e.stacked, leaf.rolled)
    if trains and kind not in seen:
      seen.add(kind)
      reps.append(_two_layers(leaf, schedule) if leaf.rolled else leaf)
  return reps


def _two_layers(leaf, schedule):
  first = schedule.params[leaf.members[0]]
  return ir.StorageLeaf(ir.stacked_entry(first, 2), leaf.members[:2])


def _cache_key(optimizer, schedule, mesh, reps, name):
  """The probe's result depends on the optimizer's code and settings, not on the object:
  `optax.adamw(1e-3)` built twice (a sweep, a rebuilt trainer) is probed once. An optimizer
  holding something that cannot be compared (an array) is keyed by itself; one that cannot
  be hashed at all gets None: not cached."""
  layout = (
    name,
    schedule.num_devices,
    tuple(mesh.shape.items()),  # (the axes each layout shards over)
    tuple(
      (r.path, r.entry.shape, r.entry.dtype, r.entry.persistent, r.entry.stacked, r.rolled)
      for r in reps
    ),
  )
  for identify in (lambda: _structure(optimizer, ()), lambda: optimizer):
    try:
      key = (identify(), *layout)
      hash(key)
      return key
    except TypeError:
      continue
  return None


def _structure(value, seen: tuple):
  """A hashable value equal for two optimizers that run the same code on the same settings:
  functions by their code, defaults, closure cells (optax's transformations are closures)
  and the values of the plain globals they read (a module-level learning rate); partials
  and containers by their parts; anything else by itself (hashable objects keep their own
  equality; others raise TypeError)."""
  if isinstance(value, (types.FunctionType, functools.partial, tuple, list, dict)):
    if id(value) in seen:  # a closure that refers to itself
      return ("cycle", seen.index(id(value)))
    seen = (*seen, id(value))
  if isinstance(value, types.FunctionType):
    cells = tuple(_cell(c, seen) for c in value.__closure__ or ())
    defaults = _structure(value.__defaults__, seen), _structure(value.__kwdefaults__, seen)
    return ("function", value.__code__, defaults, cells, _globals_read(value, seen))
  if isinstance(value, functools.partial):
    parts = (value.func, value.args, value.keywords)
    return ("partial", *(_structure(v, seen) for v in parts))
  if isinstance(value, (tuple, list)):
    return (type(value), tuple(_structure(v, seen) for v in value))
  if isinstance(value, dict):
    return (
      type(value),
      tuple((_structure(k, seen), _structure(v, seen)) for k, v in value.items()),
    )
  hash(value)  # TypeError for an array or another unhashable value
  return (type(value), value)


def _globals_read(function, seen) -> tuple:
  """The globals `function` reads that hold values; modules, functions and classes count
  as themselves (their code is not the optimizer's settings)."""
  names = [n for n in function.__code__.co_names if n in function.__globals__]
  values = [function.__globals__[n] for n in names]
  return tuple(
    (n, v if isinstance(v, (types.ModuleType, types.FunctionType, type)) else _structure(v, seen))
    for n, v in zip(names, values)
  )


def _cell(cell, seen):
  try:
    return _structure(cell.cell_contents, seen)
  except ValueError:  # an empty cell
    return ("empty",)


def _find_error(optimizer, schedule, mesh, treedef, trainable, reps, name) -> str | None:
  """The error text, or None when the optimizer is shard-compatible."""
  auto = _probe_mesh(mesh, [schedule.params[i] for leaf in reps for i in leaf.members])
  try:
    return _probe(optimizer, schedule, auto, reps, *_trees_by_paths(schedule, reps), name)
  except _CannotRunNatural:  # needs the params' own structure (e.g. a label pytree)
    trains = {p.path: ir.is_trained(p) for p in schedule.params}
    mask = lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, _: trains[jax.tree_util.keystr(path)], tree
    )
    order = [i for leaf in schedule.storage for i in leaf.members]  # the probe's order
    natural = lambda values: layout.natural_tree(
      schedule, [x for _, x in sorted(zip(order, values), key=lambda pair: pair[0])]
    )
    stored = lambda leaves: jax.tree_util.tree_unflatten(treedef, leaves)
    try:
      return _probe(
        optax.masked(optimizer, mask),
        schedule,
        _probe_mesh(mesh, schedule.params),
        list(schedule.storage),
        natural,
        stored,
        name,
        judged=trainable,
      )
    except _CannotRunNatural as e:
      raise ZjaxError(
        f"The optimizer {name} fails on the parameters themselves (before any sharding): {e}"
      ) from None


# Probes of at most this many bytes (the representatives' members, once) run on one local
# device: the comparison then compiles without partitioning (examples/startup_time.py, the
# bench GPT on 8 CPU devices: `trainer.init` with an uncached probe 1.45 s against 1.70 s
# sharded, CPU 2.25 against 2.60 s). Larger ones are sharded over the whole mesh, so that no
# device holds more than one probe leaf.
ONE_DEVICE_PROBE_BYTES = 16 << 20


def _probe_mesh(mesh, members) -> Mesh:
  """The mesh the probe runs on: `mesh`'s axes over one of this process's devices (each
  process probes alone, the same program on the same inputs), or over all its devices for
  a large probe. Auto axes: the comparison reshards leaves with sharding constraints."""
  size = sum(int(np.prod(e.shape)) * jnp.dtype(e.dtype).itemsize for e in members)
  devices = mesh.devices
  local = [d for d in devices.flat if d.process_index == jax.process_index()]
  if size <= ONE_DEVICE_PROBE_BYTES and local:
    devices = np.array(local[:1]).reshape((1,) * devices.ndim)
  return Mesh(devices, mesh.axis_names, axis_types=(AxisType.Auto,) * devices.ndim)


def _trees_by_paths(schedule, leaves):
  """(natural build, storage build): pytrees by path of the leaves' members, and of the
  leaves themselves (None at a stack's other layers), as the trainer's trees are."""
  paths = [schedule.params[i].path for leaf in leaves for i in leaf.members]
  heads = {leaf.path for leaf in leaves}
  try:
    layout.tree_from_paths(paths, list(range(len(paths))))
  except ZjaxError as e:  # paths that do not rebuild into nested dicts
    raise _CannotRunNatural(str(e)) from None

  def stored(values):
    it = iter(values)
    return layout.tree_from_paths(paths, [next(it) if p in heads else None for p in paths])

  return (lambda values: layout.tree_from_paths(paths, values)), stored


def _probe(optimizer, schedule, mesh, leaves, natural, stored, name, judged=None):
  """The error text or None; `leaves`: the storage leaves probed, `natural` / `stored`:
  pytree builders from their members' / their own leaves."""
  judged = [True] * len(leaves) if judged is None else list(judged)
  members = [schedule.params[i] for leaf in leaves for i in leaf.members]
  params, *grads = [_random_leaves(members, schedule, mesh, c) for c in range(1 + _UPDATES)]
  natural_run = lambda p, gs: _updates(optimizer, natural(p), [natural(g) for g in gs])
  try:
    jax.eval_shape(natural_run, params, grads)
  except Exception as e:
    raise _CannotRunNatural(f"{type(e).__name__}: {e}") from None
  program = _comparison(optimizer, schedule, mesh, leaves, judged, natural, stored)
  try:
    table = np.asarray(program(params, grads))
  except Exception as e:  # the transform cannot even run on flat leaves
    return (
      f"The optimizer {name} cannot run on the sharded layout (flat, padded leaves): "
      f"{type(e).__name__}: {e}. It depends on parameter shapes; use an element-wise "
      f"optimizer (sgd, adam, adamw, lion, ...)."
    )
  judged_members = [
    (leaf, schedule.params[i]) for leaf, j in zip(leaves, judged) if j for i in leaf.members
  ]
  for step, rows in enumerate(table):
    for (leaf, entry), (diff, pad, scale) in zip(judged_members, rows):
      error = _judge(name, leaf, entry, step, float(diff), float(pad), float(scale))
      if error:
        return error
  return None


def _judge(name, leaf, entry, step, diff, pad, scale) -> str | None:
  if pad == 0.0 and diff <= _RTOL * max(scale, 1e-30):
    return None
  what = (
    f"writes into the zero padding (max {pad:.3g})"
    if pad
    else f"differs from optax on the whole parameter (max difference {diff:.3g} vs update "
    f"scale {scale:.3g})"
  )
  rolled = (
    " Its layers are stored as one stacked leaf (rolled layers): statistics or "
    "labels per leaf see every layer at once there. Use "
    "ZeroConfig(roll_layers=False) with this optimizer, or one that is element-wise "
    "or uses global norms."
    if leaf.rolled
    else ""
  )
  return (
    f"The optimizer {name} is not shard-compatible: on the flat sharded layout its "
    f"update of {entry.path} (shape {list(entry.shape)}, update {step + 1}) {what}.{rolled}"
    f" It depends on parameter shapes (like Adafactor's factored moments or Muon's "
    f"orthogonalisation); use an element-wise or norm-based optimizer (sgd, adam, adamw, "
    f"lion, lamb, lars, ...)."
  )


def _comparison(optimizer, schedule, mesh, leaves, judged, natural, stored):
  """One jitted program: probes -> [update, judged member, (max |difference|, max
  |padding|, max |natural update|)]."""
  n, axis = schedule.num_devices, layout.storage_axis(schedule.config)

  # Leaves change layout through their replicated form: GSPMD reshards any other way by a
  # full rematerialisation, with a warning per leaf.
  whole = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))

  def flat(member_values):
    it, out = iter(member_values), []
    for leaf in leaves:
      x = layout.natural_of_leaf([whole(next(it)) for _ in leaf.members], leaf)
      out.append(
        jax.lax.with_sharding_constraint(
          layout.storage_from_natural(x, leaf.entry, n),
          NamedSharding(mesh, layout.storage_spec(leaf.entry, axis)),
        )
      )
    return out

  def leaf_rows(leaf, naturals, flat_update):
    flat_update = whole(flat_update).astype(jnp.float32)
    backs = layout.members_of_natural(layout.natural_from_storage(flat_update, leaf.entry), leaf)
    pad = jnp.max(jnp.abs(layout.storage_padding(flat_update, leaf.entry)), initial=0.0)
    rows = []
    for natural_update, back in zip(naturals, backs):
      natural_update = whole(natural_update).astype(jnp.float32)
      rows.append(
        jnp.stack(
          [
            jnp.max(jnp.abs(back - natural_update), initial=0.0),
            pad,
            jnp.max(jnp.abs(natural_update), initial=0.0),
          ]
        )
      )
    return rows

  # which input each flattened leaf of a built tree is (the builders may reorder: nested
  # dicts flatten in key order)
  members = [i for leaf in leaves for i in leaf.members]
  natural_order = jax.tree.leaves(natural(list(range(len(members)))))
  stored_order = jax.tree.leaves(stored(list(range(len(leaves)))))

  def compare(params, grads):
    natural_steps = _updates(optimizer, natural(params), [natural(g) for g in grads])
    flat_steps = _updates(optimizer, stored(flat(params)), [stored(flat(g)) for g in grads])
    table = []
    for nat, fl in zip(natural_steps, flat_steps):
      nat = dict(zip(natural_order, jax.tree.leaves(nat)))
      fl = dict(zip(stored_order, jax.tree.leaves(fl)))
      rows, first = [], 0
      for k, (leaf, j) in enumerate(zip(leaves, judged)):
        if j:
          naturals = [nat[first + m] for m in range(len(leaf.members))]
          rows += leaf_rows(leaf, naturals, fl[k])
        first += len(leaf.members)
      table.append(jnp.stack(rows))
    return jnp.stack(table)

  return jax.jit(compare, out_shardings=NamedSharding(mesh, P()))


def _updates(optimizer, params, grads_list):
  state = optimizer.init(params)
  outs = []
  for g in grads_list:
    updates, state = optimizer.update(g, state, params)
    params = jax.tree.map(
      lambda p, u: optax.apply_updates(p, u) if jnp.issubdtype(p.dtype, jnp.inexact) else p,
      params,
      updates,
    )
    outs.append(updates)
  return outs


def _random_leaves(entries, schedule, mesh, count) -> list:
  """Natural-shape random leaves (zeros for non-float), each sharded along its largest
  divisible dimension and generated on the host one shard at a time."""
  n, axis = schedule.num_devices, layout.storage_axis(schedule.config)
  out = []
  for i, entry in enumerate(entries):
    dtype = jnp.dtype(entry.dtype)
    sharding = NamedSharding(mesh, layout.largest_dim_spec(entry.shape, n, axis))

    def block(index, entry=entry, dtype=dtype, i=i):
      shape = tuple(len(range(*s.indices(d))) for s, d in zip(index, entry.shape))
      if not ir.is_float(dtype):
        return np.zeros(shape, dtype)
      starts = [s.indices(d)[0] for s, d in zip(index, entry.shape)]
      seed = zlib.crc32(repr((count, i, starts)).encode())
      return np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype)

    out.append(jax.make_array_from_callback(entry.shape, sharding, block))
  return out


def transform_name(optimizer) -> str:
  """A readable name for an optax transformation (its init function's qualified name)."""
  qualname = getattr(optimizer.init, "__qualname__", "") or repr(optimizer)
  return qualname.replace(".<locals>.init_fn", "").replace(".<locals>.init", "")
