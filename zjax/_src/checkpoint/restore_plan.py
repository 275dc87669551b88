"""Planning a checkpoint restore into any trainer's layout (see checkpoint.py for the format).

Every saved leaf that mirrors a parameter holds one or more natural parameters: its own, or
a rolled stack's layers (`members`, one per row). A target storage leaf is read from the
saved leaves holding its members:
  * from one saved leaf holding exactly its members (same model, any device count or
    schedule): read straight into the target's storage, truncated or zero-extended by orbax
    (per row if stacked), or, where the layout kind differs (stacked vs replicated), read
    whole and converted on device;
  * from several, or from rows of a stack (rolled <-> not rolled, runs cut differently):
    each saved leaf is read once, as sharded storage of the target's row length when both
    sides are sharded (no device holds more than its share), else as replicated natural
    values, and the target is assembled from the rows on device.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax._src.errors import ZjaxError
from zjax._src.layout import layout
from zjax._src.train import offload


class CheckpointError(ZjaxError):
  """A checkpoint is missing, unreadable, corrupted or does not fit the model."""


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One stored array, as the manifest describes it."""

  key: str  # key in the orbax tree
  path: str  # keystr path in the train state's part (params / opt_state / extra)
  shape: tuple  # natural shape (for mirrored leaves, the parameter's; a stack's [L, ...])
  dtype: str
  stored: tuple  # shape as stored
  param: int | None  # index of the mirrored parameter leaf (in the manifest's params)
  checksum: int = 0
  row: int = 0  # stored per layer: the natural elements of each stored row (else 0)
  members: tuple = ()  # a rolled stack: the natural parameter path of each row


def natural_params(saved_params) -> dict:
  """natural parameter path -> (saved leaf holding it, its row there or None)."""
  out = {}
  for leaf in saved_params:
    if leaf.members:
      out.update((path, (leaf, row)) for row, path in enumerate(leaf.members))
    else:
      out[leaf.path] = (leaf, None)
  return out


def check_params(saved, schedule, where):
  """The saved parameters must be the model's: same paths, shapes and dtypes."""
  by_path = {
    path: (tuple(leaf.shape[1:]) if row is not None else tuple(leaf.shape), leaf.dtype)
    for path, (leaf, row) in natural_params(saved).items()
  }
  for entry in schedule.params:
    found = by_path.pop(entry.path, None)
    if found is None:
      raise CheckpointError(
        f"{where} has no parameter {entry.path}: it was saved from a "
        f"different model. Restore it with the model that saved it."
      )
    if found != (tuple(entry.shape), entry.dtype):
      raise CheckpointError(
        f"Parameter {entry.path} in {where} is {found[1]}{list(found[0])}, but this "
        f"model has {entry.dtype}{list(entry.shape)}: a different model. Restore it with "
        f"the model that saved it."
      )
  if by_path:
    raise CheckpointError(
      f"{where} has parameters this model lacks: {sorted(by_path)[:3]}; "
      f"it was saved from a different model."
    )


def restore_plan(saved, target, schedule, where):
  """Orbax restore items {part: {key: (abstract, restore args, checksum row)}} for the
  target state, and per target leaf (keys it reads, conversion after the read)."""
  items = {"params": {}, "opt": {}, "extra": {}}
  sources = natural_params(saved["params"])
  targets = layout.stored_leaves(_param_target(target), schedule, "target params")
  plans = {
    "params": [
      _plan_storage(items, "params", sources, x, leaf, schedule, where)
      for x, leaf in zip(targets, schedule.storage)
    ]
  }
  plans["opt"] = _plan_opt(items, saved, target.opt_state, schedule, where)
  plans["extra"] = _plan_plain(
    items, "extra", saved["extra"], target.extra, where, "extra state", "the same extra state"
  )
  return items, plans


def _plan_opt(items, saved, target_tree, schedule, where):
  """Optimizer leaves: those mirroring a parameter leaf (adam's mu, nu) by the natural
  parameters they hold under their prefix (e.g. "[0].mu"), the others by path."""
  sources, plain = {}, []
  for leaf in saved["opt"]:
    if leaf.param is None:
      plain.append(leaf)
      continue
    holder = saved["params"][leaf.param]
    prefix = leaf.path[: len(leaf.path) - len(holder.path)]
    for path, source in natural_params([dataclasses.replace(holder, key=leaf.key)]).items():
      sources[prefix, path] = (dataclasses.replace(leaf, members=holder.members), source[1])
  targets, expected = [], set()
  for path, x in jax.tree_util.tree_flatten_with_path(target_tree)[0]:
    path = jax.tree_util.keystr(path)
    index = layout.mirrored_storage(path, x.shape, schedule)
    leaf = schedule.storage[index] if index is not None else None
    prefix = path[: len(path) - len(leaf.path)] if leaf is not None else None
    targets.append((path, x, leaf, prefix))
    expected |= (
      {(prefix, schedule.params[i].path) for i in leaf.members}
      if leaf is not None
      else {(None, path)}
    )
  found = set(sources) | {(None, leaf.path) for leaf in plain}
  if found != expected:
    missing, extra = sorted(map(str, expected - found)), sorted(map(str, found - expected))
    raise CheckpointError(
      f"The optimizer state in {where} differs from the trainer's "
      f"(missing: {missing[:3]}, unexpected: {extra[:3]}). Restore with "
      f"the same optimizer that saved it."
    )
  by_path = {leaf.path: leaf for leaf in plain}
  plans = []
  for path, x, leaf, prefix in targets:
    if leaf is None:
      plans.append(_plan_whole(items, "opt", by_path[path], x, where))
    else:
      mine = {p: s for (q, p), s in sources.items() if q == prefix}
      plans.append(_plan_storage(items, "opt", mine, x, leaf, schedule, where))
  return plans


def _plan_plain(items, part, saved, target_tree, where, what, advice):
  by_path = {leaf.path: leaf for leaf in saved}
  targets = jax.tree_util.tree_flatten_with_path(target_tree)[0]
  expected = {jax.tree_util.keystr(p) for p, _ in targets}
  if set(by_path) != expected:
    missing = sorted(expected - set(by_path))
    extra = sorted(set(by_path) - expected)
    raise CheckpointError(
      f"The {what} in {where} differs from the trainer's (missing: "
      f"{missing[:3]}, unexpected: {extra[:3]}). Restore with {advice} "
      f"that saved it."
    )
  return [_plan_whole(items, part, by_path[jax.tree_util.keystr(p)], x, where) for p, x in targets]


def _plan_whole(items, part, leaf, target, where):
  """A leaf that mirrors no parameter: read as it is."""
  _check_dtype(part, leaf, target, where)
  if tuple(leaf.stored) != tuple(target.shape):
    raise CheckpointError(
      f"{what(part)} {leaf.path} in {where} has shape "
      f"{list(leaf.stored)}; the trainer expects {list(target.shape)}."
    )
  _add_item(
    items, part, leaf.key, tuple(target.shape), target.dtype, target.sharding, 0, strict=True
  )
  return (leaf.key,), None


def _plan_storage(items, part, sources, target, leaf, schedule, where):
  """One storage leaf of the target (a parameter's, or a mirroring optimizer leaf) from
  `sources` (natural parameter path -> (saved leaf, row or None))."""
  rows = [sources[schedule.params[i].path] for i in leaf.members]
  saved = rows[0][0]
  for s, _ in rows:
    _check_dtype(part, s, target, where)
  member_paths = tuple(schedule.params[i].path for i in leaf.members)
  if all(s.key == saved.key for s, _ in rows) and saved.members == (
    member_paths if leaf.rolled else ()
  ):  # the same leaf: read straight or convert
    shape, sharding, convert, row = _conversion(saved, leaf.entry, target)
    _add_item(items, part, saved.key, shape, target.dtype, sharding, row)
    return (saved.key,), convert
  return _plan_regroup(items, part, rows, target, leaf, schedule)


def _plan_regroup(items, part, rows, target, leaf, schedule):
  """A target storage leaf from rows of several saved leaves (module docstring): read as
  sharded storage of the target's row length where the target is sharded and every source
  is a flat leaf or a stack stored per row, else as replicated natural values."""
  entry, sharding = leaf.entry, target.sharding
  axis = sharding.spec[-1] if len(sharding.spec) else None
  as_rows = (
    not entry.persistent
    and entry.tensor_dim is None
    and all(len(s.stored) == (2 if s.members else 1) for s, _ in rows)
  )
  width = target.shape[-1]  # the target's padded row
  keys, picks = [], []
  for s, row in rows:
    layers = s.shape[0] if s.members else 1
    if s.key not in keys:
      keys.append(s.key)
      size = int(np.prod(s.shape, dtype=np.int64)) // max(layers, 1)
      if as_rows:
        shape, spec = ((layers, width), P(None, axis)) if s.members else ((width,), P(axis))
      else:  # natural values, replicated: [L, layer] if stored per row, else flat
        shape = (layers, size) if len(s.stored) == 2 else (layers * size,)
        spec = P()
      _add_item(
        items,
        part,
        s.key,
        shape,
        target.dtype,
        NamedSharding(sharding.mesh, spec),
        size if len(shape) == 2 else 0,
      )
    picks.append((keys.index(s.key), -1 if row is None else row, layers))
  kind = "rows" if as_rows else "naturals"
  return tuple(keys), (kind, entry, schedule.num_devices, tuple(sharding.spec), tuple(picks))


def _add_item(items, part, key, shape, dtype, sharding, row, strict=False):
  args = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, strict=strict)
  items[part][key] = (jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), args, row)


def _check_dtype(part, leaf, target, where):
  if leaf.dtype != jnp.dtype(target.dtype).name:
    raise CheckpointError(
      f"{what(part)} {leaf.path} in {where} is {leaf.dtype}; the trainer "
      f"expects {jnp.dtype(target.dtype).name}. Restore with the "
      f"precision settings that saved it."
    )


def _conversion(leaf, entry, target):
  """(shape to read, its sharding, conversion to the target storage, read row) for a
  parameter-shaped leaf held by one saved leaf. Same layout kind: read straight into the
  target's storage, truncated or zero-extended (per row if stacked). Otherwise read the
  natural values replicated and convert."""
  sharding, shape = target.sharding, tuple(target.shape)
  stored_stacked, replicated = len(leaf.stored) == 2, NamedSharding(sharding.mesh, P())
  spec = tuple(sharding.spec)
  if entry.tensor_dim is not None and not entry.persistent:  # natural, flat (rows if stacked)
    if stored_stacked:
      return (
        (entry.shape[0], entry.layer_size),
        replicated,
        ("tensor", entry, shape, spec),
        entry.layer_size,
      )
    return (entry.size,), replicated, ("tensor", entry, shape, spec), 0
  if entry.stacked and stored_stacked:
    return shape, sharding, None, entry.layer_size
  if not entry.stacked and not stored_stacked:
    if entry.persistent:
      return (entry.size,), replicated, ("natural", tuple(entry.shape), spec), 0
    return shape, sharding, None, 0
  if stored_stacked:  # -> replicated natural, or flat padded
    layer = int(np.prod(entry.shape[1:], dtype=np.int64))
    read = (entry.shape[0], layer)
    if entry.persistent:
      return read, replicated, ("natural", tuple(entry.shape), spec), layer
    return read, replicated, ("flat", shape, spec), layer
  return (entry.size,), replicated, ("stacked", shape, spec), 0


# ---- after the read -------------------------------------------------------------------


def _param_target(target):
  """Where the checkpoint's parameters go: an offloaded state's host masters (its params
  are device copies made from them), else its params."""
  masters = getattr(target, "masters", None)
  return target.params if masters is None else masters


def assemble(restored, plans, target, train_step, mesh):
  """The train state in the target's structure, every leaf converted to its storage and
  in its memory (converted leaves are read to the device, then placed); an offloaded
  target's device copies are cast from its masters."""
  replicated = NamedSharding(mesh, P())
  parts = {
    part: [tuple(restored[part][k] for k in keys) for keys, _ in plans[part]] for part in plans
  }
  conversions = tuple((part, tuple(c for _, c in plans[part])) for part in plans)
  converted = _converted(parts, conversions, mesh)

  def tree(part, like):
    leaves = [
      jax.device_put(x, t.sharding) if x.sharding.memory_kind != t.sharding.memory_kind else x
      for x, t in zip(converted[part], jax.tree.leaves(like))
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)

  step = jax.device_put(jnp.asarray(train_step, jnp.int32), replicated)
  params = tree("params", _param_target(target))
  state = type(target)(
    step=step,
    params=params,
    opt_state=tree("opt", target.opt_state),
    extra=tree("extra", target.extra),
  )
  if getattr(target, "masters", None) is None:
    return state
  shardings = [t.sharding for t in jax.tree.leaves(target.params)]
  dtypes = [t.dtype for t in jax.tree.leaves(target.params)]
  copies = jax.jit(lambda ms: offload.device_copies(ms, dtypes), out_shardings=shardings)(
    jax.tree.leaves(params)
  )
  return state._replace(
    masters=params, params=jax.tree.unflatten(jax.tree.structure(target.params), copies)
  )


@functools.partial(jax.jit, static_argnums=(1, 2))
def _converted(parts, conversions, mesh):
  """Leaves read in another layout kind, converted (None: already the target storage)."""
  return {
    part: [_convert(xs, c, mesh) for xs, c in zip(parts[part], part_conversions)]
    for part, part_conversions in conversions
  }


def _convert(xs, conversion, mesh):
  if conversion is None:
    return xs[0]
  kind = conversion[0]
  if kind in ("rows", "naturals"):
    return _regrouped(xs, conversion, mesh)
  if kind == "tensor":  # natural values -> [T, padded slice] rows ([L, T, ...] if stacked)
    _, entry, shape, spec = conversion
    rows = layout.tp_rows(xs[0].reshape(entry.shape), entry)
    pad = ((0, 0),) * (rows.ndim - 1) + ((0, shape[-1] - rows.shape[-1]),)
    return layout.place(jnp.pad(rows, pad), mesh, P(*spec))
  x, (_, shape, spec) = xs[0], conversion
  if kind == "natural":  # -> persistent
    return x.reshape(shape)
  if kind == "flat":  # natural rows [L, layer] -> flat padded storage
    flat = x.reshape(-1)
    return layout.place(jnp.pad(flat, (0, shape[0] - flat.shape[0])), mesh, P(*spec))
  rows = x.reshape(shape[0], -1)  # natural flat -> [L, padded layer]
  return layout.place(jnp.pad(rows, ((0, 0), (0, shape[1] - rows.shape[1]))), mesh, P(*spec))


def _regrouped(xs, conversion, mesh):
  """A target storage leaf from rows picked out of the saved leaves read for it (a rolled
  stack has L >= 2 picks, any other leaf one)."""
  kind, entry, n, spec, picks = conversion
  stack = len(picks) > 1
  if kind == "rows":  # sharded storage rows of the target's width
    rows = [xs[k] if row < 0 else xs[k][row] for k, row, _ in picks]
    return layout.place(jnp.stack(rows) if stack else rows[0], mesh, P(*spec))
  layer_shape = tuple(entry.shape[1:] if stack else entry.shape)
  values = [
    xs[k].reshape(layer_shape) if row < 0 else xs[k].reshape((layers,) + layer_shape)[row]
    for k, row, layers in picks
  ]
  natural = jnp.stack(values) if stack else values[0]
  return layout.place(layout.storage_from_natural(natural, entry, n), mesh, P(*spec))


def what(part):
  return {"params": "Parameter", "opt": "Optimizer leaf", "extra": "Extra-state leaf"}[part]
