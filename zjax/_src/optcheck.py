"""Does an optax transformation give the same result on the sharded layout as on whole
parameters? Checked by running both on random probes, not guessed from names.

The trainer applies the optimizer to flat, zero-padded leaves. That is exact for element-wise
transforms and for global or per-leaf norms (reductions over the whole flat leaf, padding
zero), and wrong for transforms that use a parameter's shape (Adafactor's factored moments,
Muon's orthogonalisation) or that write into the padding. The probe runs two updates on
random parameters and gradients, both ways, and compares them.

What it costs: one compiled program over one representative trained leaf per distinct
(shape, dtype, layout), so it grows with the number of distinct shapes, not with leaves or
devices; results are cached per optimizer and layout. Representatives keep their own paths
(path-based masks and labels see real names). An optimizer that cannot run on that smaller
tree (e.g. a label pytree shaped like the whole model) is probed on every leaf in the
params' own structure instead. Probes are generated on the host shard by shard and placed
sharded over the mesh, so no device holds more than one whole probe leaf.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zjax._src import ir, layout
from zjax._src.errors import ZjaxError

_RTOL = 1e-4  # reduction order differs between the two layouts; shape-dependence is O(1)
_UPDATES = 2
_cache: dict = {}  # (optimizer, layout signature) -> None (compatible) or the error text
_CACHE_LIMIT = 64


class _CannotRunNatural(Exception):
  """The optimizer fails on the probe tree in the natural layout."""


def check_optimizer(optimizer, schedule, mesh, treedef, trainable, *, name: str) -> None:
  """Raise ZjaxError naming a parameter where `optimizer` differs on the sharded layout.

  `trainable`: one bool per schedule parameter (tree order); `treedef`: the params' pytree
  structure (for the fallback that probes every leaf)."""
  reps = representatives(schedule, trainable)
  if not reps:
    return
  key = _cache_key(optimizer, schedule, reps)
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
  """The first trained leaf of each distinct (shape, dtype, layout) in tree order."""
  seen, reps = set(), []
  for entry, trains in zip(schedule.params, trainable):
    kind = (entry.shape, entry.dtype, entry.persistent, entry.stacked)
    if trains and kind not in seen:
      seen.add(kind)
      reps.append(entry)
  return reps


def _cache_key(optimizer, schedule, reps):
  key = (optimizer, schedule.num_devices,
         tuple((e.path, e.shape, e.dtype, e.persistent, e.stacked) for e in reps))
  try:
    hash(key)
  except TypeError:  # an optimizer object that cannot be hashed: not cached
    return None
  return key


def _find_error(optimizer, schedule, mesh, treedef, trainable, reps, name) -> str | None:
  """The error text, or None when the optimizer is shard-compatible."""
  auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)
  try:
    tree = _tree_by_paths(reps)
    return _probe(optimizer, schedule, auto, reps, tree, name)
  except _CannotRunNatural:  # needs the params' own structure (e.g. a label pytree)
    mask = jax.tree_util.tree_unflatten(treedef, list(trainable))
    entries = list(schedule.params)
    build = lambda leaves: jax.tree_util.tree_unflatten(treedef, leaves)
    try:
      return _probe(optax.masked(optimizer, mask), schedule, auto, entries, build, name,
                    judged=trainable)
    except _CannotRunNatural as e:
      raise ZjaxError(f"The optimizer {name} fails on the parameters themselves (before "
                      f"any sharding): {e}") from None


def _tree_by_paths(entries):
  paths = [e.path for e in entries]
  try:
    layout.tree_from_paths(paths, list(range(len(paths))))
  except ZjaxError as e:  # paths that do not rebuild into nested dicts
    raise _CannotRunNatural(str(e)) from None
  return lambda leaves: layout.tree_from_paths(paths, leaves)


def _probe(optimizer, schedule, mesh, entries, build, name, judged=None) -> str | None:
  judged = [True] * len(entries) if judged is None else list(judged)
  params, *grads = [_random_leaves(entries, schedule, mesh, c) for c in range(1 + _UPDATES)]
  natural_run = lambda p, gs: _updates(optimizer, build(p), [build(g) for g in gs])
  try:
    jax.eval_shape(natural_run, params, grads)
  except Exception as e:
    raise _CannotRunNatural(f"{type(e).__name__}: {e}") from None
  program = _comparison(optimizer, schedule, mesh, entries, judged, build)
  try:
    table = np.asarray(program(params, grads))
  except Exception as e:  # the transform cannot even run on flat leaves
    return (f"The optimizer {name} cannot run on the sharded layout (flat, padded leaves): "
            f"{type(e).__name__}: {e}. It depends on parameter shapes; use an element-wise "
            f"optimizer (sgd, adam, adamw, lion, ...).")
  for step, rows in enumerate(table):
    for entry, (diff, pad, scale) in zip([e for e, j in zip(entries, judged) if j], rows):
      error = _judge(name, entry, step, float(diff), float(pad), float(scale))
      if error:
        return error
  return None


def _judge(name, entry, step, diff, pad, scale) -> str | None:
  if pad == 0.0 and diff <= _RTOL * max(scale, 1e-30):
    return None
  what = (f"writes into the zero padding (max {pad:.3g})" if pad else
          f"differs from optax on the whole parameter (max difference {diff:.3g} vs update "
          f"scale {scale:.3g})")
  return (f"The optimizer {name} is not shard-compatible: on the flat sharded layout its "
          f"update of {entry.path} (shape {list(entry.shape)}, update {step + 1}) {what}. It "
          f"depends on parameter shapes (like Adafactor's factored moments or Muon's "
          f"orthogonalisation); use an element-wise or norm-based optimizer (sgd, adam, adamw, "
          f"lion, lamb, lars, ...).")


def _comparison(optimizer, schedule, mesh, entries, judged, build):
  """One jitted program: probes -> [update, judged leaf, (max |difference|, max |padding|,
  max |natural update|)]."""
  n, axis = schedule.num_devices, layout.storage_axis(schedule.config)

  # Leaves change layout through their replicated form: GSPMD reshards any other way by a
  # full rematerialisation, with a warning per leaf.
  whole = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))

  def flat(leaves):
    return [jax.lax.with_sharding_constraint(
        layout.storage_from_natural(whole(x), e, n),
        NamedSharding(mesh, layout.storage_spec(e, axis))) for x, e in zip(leaves, entries)]

  def leaf_row(entry, natural, flat_update):
    natural = whole(natural).astype(jnp.float32)
    flat_update = whole(flat_update).astype(jnp.float32)
    scale = jnp.max(jnp.abs(natural), initial=0.0)
    back = layout.natural_from_storage(flat_update, entry)
    pad = jnp.max(jnp.abs(layout.storage_padding(flat_update, entry)), initial=0.0)
    return jnp.stack([jnp.max(jnp.abs(back - natural), initial=0.0), pad, scale])

  def compare(params, grads):
    natural_steps = _updates(optimizer, build(params), [build(g) for g in grads])
    flat_steps = _updates(optimizer, build(flat(params)), [build(flat(g)) for g in grads])
    return jnp.stack([
        jnp.stack([leaf_row(e, a, b) for e, a, b, j in zip(
            entries, jax.tree.leaves(nat), jax.tree.leaves(fl), judged) if j])
        for nat, fl in zip(natural_steps, flat_steps)])

  return jax.jit(compare, out_shardings=NamedSharding(mesh, P()))


def _updates(optimizer, params, grads_list):
  state = optimizer.init(params)
  outs = []
  for g in grads_list:
    updates, state = optimizer.update(g, state, params)
    params = jax.tree.map(
        lambda p, u: optax.apply_updates(p, u) if jnp.issubdtype(p.dtype, jnp.inexact)
        else p, params, updates)
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
