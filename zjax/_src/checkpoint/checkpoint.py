"""Orbax checkpoints of a zero3 train state that restore on any device count and schedule.

On-disk format: one orbax step directory per step, with two items.
  state/  an orbax PyTree {"params": {"p00000": ...}, "opt": {"o00000": ...},
          "extra": {"e00000": ...}}. Every parameter, and every optimizer leaf that mirrors
          one (adam's mu and nu), is stored flat: a sharded leaf as its zero-padded layout
          storage, a persistent one raveled; a stacked one (gathered per layer in a loop)
          as its [layers, padded layer] storage. Each process writes only its own shards.
          A rolled run's layers are one stacked leaf, as in the train state (its rows are
          the layers, `members` in the manifest).
  zjax/   a JSON manifest: format, zjax version, the train step, the saving schedule (JSON),
          and for every stored array its tree path, natural shape, dtype, the parameter it
          mirrors, the natural parameters a stack holds, and a checksum.
Restoring reads each flat array truncated or zero-extended to the target layout's length
(orbax does it shard by shard), so 8 -> 4 devices, or another bucket plan, is one online
read; stacked storage likewise per row. Where the layout kind differs (a stacked parameter
restored where it is replicated, e.g. on 1 device, or the reverse) the leaf is read whole
and converted on device; where layers were rolled on one side only, rows are regrouped
(restore_plan.py). The checksum (a position-weighted uint32 sum of the value bits, in
natural order, computed on device) ignores padding, so it holds across layouts and catches
silently corrupted data.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import PartitionSpec as P

from zjax._src.checkpoint import preemption
from zjax._src.checkpoint import restore_plan as plan
from zjax._src.checkpoint.restore_plan import CheckpointError
from zjax._src.checkpoint.restore_plan import Leaf as _Leaf
from zjax._src.layout import layout
from zjax._src.schedule import ir
from zjax._src.train import offload
from zjax._src.version import __version__

FORMAT = "zjax-checkpoint-v1"


class CheckpointManager:
  """Sharded, asynchronous checkpoints of a `zero3` train state (a layer over orbax).

  Args:
    directory: where step directories go (created if missing).
    trainer: the `zero3` trainer whose states are saved / restored by default.
    max_to_keep: keep the newest this many steps (None: all).
    async_save: `save` returns once the data is off the devices; writing continues in the
      background (`wait_until_finished()`).

  Example:
    >>> ckpt = zjax.CheckpointManager("/tmp/run", trainer, max_to_keep=3)  # doctest: +SKIP
    >>> ckpt.save(100, state)                                             # doctest: +SKIP
    >>> state = ckpt.restore()          # latest step, in trainer's layout # doctest: +SKIP
  """

  def __init__(
    self, directory, trainer=None, *, max_to_keep: int | None = None, async_save: bool = True
  ):
    self.directory = os.path.abspath(os.fspath(directory))
    self.trainer = trainer
    try:
      os.makedirs(self.directory, exist_ok=True)
      _check_writable(self.directory)
      self._manager = ocp.CheckpointManager(
        self.directory,
        item_names=("state", "zjax"),
        options=ocp.CheckpointManagerOptions(
          max_to_keep=max_to_keep,
          cleanup_tmp_directories=True,
          enable_async_checkpointing=async_save,
        ),
      )
    except OSError as e:
      raise CheckpointError(
        f"Cannot use checkpoint directory {self.directory}: {e}. Choose a writable directory."
      ) from None

  # ---- steps ----------------------------------------------------------------------------

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ---- preemption ---------------------------------------------------------------------

  def reached_preemption(self, step: int) -> bool:
    """Whether the job is being preempted (SIGTERM) and `step` is where to save: the same
    answer at the same step on every process of a `jax.distributed` run (JAX's preemption
    sync point). In one process the first call installs a SIGTERM handler; from then on the
    signal no longer ends the process by itself, so ask every step (see preemption.py)."""
    return preemption.reached(step)

  def save_if_preempted(self, step: int, state, trainer=None) -> bool:
    """If the job is being preempted at `step` (`reached_preemption`), save `state` as
    `step` (unless that step is saved already), wait until it is written, and return True:
    the caller then stops. Call it after every step.

    Example:
      >>> for step in range(start, num_steps):                          # doctest: +SKIP
      ...   state, _ = trainer.step(state, batch_at(step))               # doctest: +SKIP
      ...   if ckpt.save_if_preempted(step + 1, state):                  # doctest: +SKIP
      ...     break  # saved; exit 0 and resume from ckpt.restore()     # doctest: +SKIP
    """
    if not self.reached_preemption(step):
      return False
    self._manager.wait_until_finished()
    if int(step) not in self._manager.all_steps():
      self.save(step, state, trainer)
    self._manager.wait_until_finished()
    return True

  # ---- save -----------------------------------------------------------------------------

  def save(self, step: int, state, trainer=None) -> None:
    """Start saving `state` as `step`. Returns when the data is off the devices (the state
    may be donated to the next step right away); the files appear atomically when written.
    An existing step is never overwritten."""
    trainer = self._trainer(trainer, "save")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise CheckpointError(f"Checkpoint step must be a non-negative int, got {step!r}.")
    step = int(step)
    self._manager.wait_until_finished()  # a previous save may still be writing this step
    if step in self._manager.all_steps():
      raise CheckpointError(
        f"Step {step} already exists in {self.directory}; nothing was "
        f"written. Save under a new step or delete that directory."
      )
    tree, leaves = _to_stored(state, trainer.schedule)
    sums = _checksums(
      tree, _rows({part: [(leaf.key, leaf.row) for leaf in ls] for part, ls in leaves.items()})
    )
    leaves = {
      part: [dataclasses.replace(leaf, checksum=sums[part][leaf.key]) for leaf in ls]
      for part, ls in leaves.items()
    }
    manifest = {
      "format": FORMAT,
      "zjax_version": __version__,
      "train_step": int(state.step),
      "num_devices": trainer.schedule.num_devices,
      "schedule": trainer.schedule.to_json(),
      **{part: [dataclasses.asdict(leaf) for leaf in ls] for part, ls in leaves.items()},
    }
    try:
      self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree), zjax=ocp.args.JsonSave(manifest)),
      )
    except OSError as e:
      raise CheckpointError(
        f"Saving step {step} to {self.directory} failed: {e}. Earlier steps are intact."
      ) from None

  # ---- restore --------------------------------------------------------------------------

  def restore(self, trainer=None, step: int | None = None, *, like=None):
    """The train state of `step` (default: the latest) in `trainer`'s layout, on its mesh,
    whatever device count and schedule saved it. `like`: a train state (or
    `trainer.abstract_state(...)`) whose pytree structure to use; by default the trainer's,
    with extra state as nested dicts."""
    trainer = self._trainer(trainer, "restore")
    step = self._resolve_step(step)
    manifest = self._manifest(step)
    where = f"checkpoint step {step} in {self.directory}"
    saved = {
      part: [
        _Leaf(
          **{
            **d,
            "shape": tuple(d["shape"]),
            "stored": tuple(d["stored"]),
            "members": tuple(d.get("members", ())),
          }
        )
        for d in manifest[part]
      ]
      for part in ("params", "opt", "extra")
    }
    plan.check_params(saved["params"], trainer.schedule, where)
    target = like if like is not None else trainer.abstract_state(_extra_template(saved["extra"]))
    items, plans = plan.restore_plan(saved, target, trainer.schedule, where)
    restored = self._read(step, items, manifest, where)
    _verify_checksums(restored, saved, items, where)
    return plan.assemble(restored, plans, target, manifest["train_step"], trainer.mesh)

  def _read(self, step, items, manifest, where):
    tree = {part: {k: v for k, (v, _, _) in entries.items()} for part, entries in items.items()}
    args = {part: {k: a for k, (_, a, _) in entries.items()} for part, entries in items.items()}
    try:
      return self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=tree, restore_args=args))
      )["state"]
    except Exception as e:  # tensorstore / orbax errors: find the leaf that fails
      culprit = self._failing_leaf(step, tree, args, manifest)
      raise CheckpointError(
        f"Cannot read {where}{culprit}: the data files are missing, truncated or corrupted "
        f"({_first_line(e)}). Restore another step ({self.all_steps()}) or re-create the "
        f"checkpoint."
      ) from None

  def _failing_leaf(self, step, tree, args, manifest) -> str:
    """Which leaf cannot be read (each tried alone), for the error message."""
    for part, entries in tree.items():
      for key in entries:
        try:
          self._manager.restore(
            step,
            args=ocp.args.Composite(
              state=ocp.args.PyTreeRestore(
                item={part: {key: entries[key]}},
                restore_args={part: {key: args[part][key]}},
                partial_restore=True,
              )
            ),
          )
        except Exception:  # noqa: BLE001 -- any failure identifies the leaf
          return f", {_describe(part, key, manifest)}"
    return ""

  def _manifest(self, step) -> dict:
    try:
      manifest = self._manager.restore(step, args=ocp.args.Composite(zjax=ocp.args.JsonRestore()))[
        "zjax"
      ]
    except Exception as e:
      raise CheckpointError(
        f"Checkpoint step {step} in {self.directory} has no readable zjax manifest "
        f"({_first_line(e)}): it is incomplete or not a zjax checkpoint. Restore another "
        f"step ({self.all_steps()})."
      ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
      raise CheckpointError(
        f"Checkpoint step {step} in {self.directory} is not a {FORMAT} checkpoint "
        f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r})."
      )
    return manifest

  def _resolve_step(self, step) -> int:
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(
        f"No checkpoint in {self.directory}. Check the directory, or start from init."
      )
    if step is None:
      return steps[-1]
    if step not in steps:
      raise CheckpointError(f"No step {step} in {self.directory}; it holds steps {steps}.")
    return int(step)

  def _trainer(self, trainer, what):
    trainer = trainer if trainer is not None else self.trainer
    if trainer is None or not hasattr(trainer, "abstract_state"):
      raise CheckpointError(
        f"{what} needs the zero3 trainer (its schedule and mesh): pass "
        f"CheckpointManager(directory, trainer) or {what}(..., trainer)."
      )
    return trainer


# ---- export ----------------------------------------------------------------------------


def export_params(directory, step: int | None = None, *, save_to=None):
  """The natural-shape params of a checkpoint as a pytree of numpy arrays (nested dicts by
  path), read and checked one parameter at a time, with no mesh: each parameter's natural
  region is read straight into the returned array, so host memory holds the output, the
  parameter being read and tensorstore's runtime (measured in docs/checkpoints.md). `save_to`: also
  write them as a plain orbax checkpoint (`orbax.checkpoint.StandardCheckpointer().restore(save_to)`
  gives the dict, for `model.apply` without zjax); an existing `save_to` is never
  overwritten.

  Example:
    >>> params = zjax.export_params("/tmp/run")              # doctest: +SKIP
    >>> model.apply(params, x)                               # doctest: +SKIP
  """
  manager = CheckpointManager(directory)
  step = manager._resolve_step(step)
  manifest = manager._manifest(step)
  where = f"checkpoint step {step} in {manager.directory}"
  if save_to is not None and os.path.exists(save_to):
    raise CheckpointError(
      f"Export target {save_to} exists; nothing was written. Choose a new path."
    )
  paths, values = [], []
  state_dir = os.path.join(manager.directory, str(step), "state")
  for d in manifest["params"]:
    try:
      value = _read_natural(state_dir, d)
    except Exception as e:  # tensorstore errors: say which parameter, what to do
      raise CheckpointError(
        f"Cannot read parameter {d['path']} of {where} ({_first_line(e)}): "
        f"the data files are missing, truncated or corrupted."
      ) from None
    if int(_checksum(value, np)) != d["checksum"]:
      raise CheckpointError(
        f"Parameter {d['path']} in {where} fails its checksum: the data "
        f"was corrupted after it was written."
      )
    members = d.get("members") or [d["path"]]  # a rolled stack: one row per layer (views)
    paths += members
    values += [value[row] for row in range(len(members))] if d.get("members") else [value]
  manager.close()
  params = layout.tree_from_paths(paths, values)
  if save_to is not None:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(os.path.abspath(os.fspath(save_to)), params)
  return params


def _read_natural(state_dir, d) -> np.ndarray:
  """One stored parameter's natural values, read by tensorstore straight into the array
  that is returned (only the natural region: no padding, no staging copy)."""
  store = ts.open(
    {
      "driver": "zarr",
      "kvstore": {
        "driver": "ocdbt",
        "base": f"file://{os.path.abspath(state_dir)}/",
        "path": f"params.{d['key']}",
      },
    },
    open=True,
    read=True,
  ).result()
  size = int(np.prod(d["shape"], dtype=np.int64))
  region = store[:, : d.get("row", 0)] if len(d["stored"]) == 2 else store[:size]
  if tuple(store.shape) != tuple(d["stored"]):
    raise ValueError(f"stored shape {tuple(store.shape)}, manifest says {tuple(d['stored'])}")
  return region.read().result().reshape(d["shape"])


# ---- the stored form ------------------------------------------------------------------


def _to_stored(state, schedule):
  """(orbax tree, leaf descriptions) of a train state; persistent leaves are raveled."""
  n = schedule.num_devices
  # offloaded states save their fp32 masters (host), not the device copies
  masters = getattr(state, "masters", None)
  param_leaves = layout.stored_leaves(
    state.params if masters is None else masters, schedule, "state.params"
  )
  for x, leaf in zip(param_leaves, schedule.storage):
    if tuple(x.shape) != layout.storage_shape(leaf.entry, n):
      raise CheckpointError(
        f"state.params leaf {leaf.path} has shape {tuple(x.shape)}, not "
        f"the schedule's layout {layout.storage_shape(leaf.entry, n)}."
      )
  opt = [
    (jax.tree_util.keystr(path), x)
    for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  ]
  mirrors = [layout.mirrored_storage(path, x.shape, schedule) for path, x in opt]
  mirrored = [None if k is None else schedule.storage[k] for k in mirrors]
  saved = _without_slices(
    list(param_leaves) + [x for _, x in opt],
    [leaf.entry for leaf in schedule.storage]
    + [None if leaf is None else leaf.entry for leaf in mirrored],
  )
  tree = {"params": {}, "opt": {}, "extra": {}}
  leaves = {"params": [], "opt": [], "extra": []}
  for k, (x, leaf) in enumerate(zip(saved, schedule.storage)):
    members = tuple(schedule.params[i].path for i in leaf.members) if leaf.rolled else ()
    _add(tree, leaves, "params", f"p{k:05d}", leaf.path, x, leaf, k, members)
  for j, ((path, _), x, leaf, index) in enumerate(
    zip(opt, saved[len(schedule.storage) :], mirrored, mirrors)
  ):
    _add(tree, leaves, "opt", f"o{j:05d}", path, x, leaf, index)
  for j, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(state.extra)[0]):
    _add(tree, leaves, "extra", f"e{j:05d}", jax.tree_util.keystr(path), jnp.asarray(x), None, None)
  return tree, leaves


def _add(tree, leaves, part, key, path, x, leaf, index, members=()):
  """Store x (a leaf of `part`; `leaf`: the storage leaf it mirrors, or None; `members`:
  a rolled stack's parameter paths, one per row)."""
  entry = leaf.entry if leaf is not None else None
  if entry is not None and entry.persistent:
    x = _ravel(x)
  shape = tuple(entry.shape) if entry is not None else tuple(x.shape)
  dtype = jnp.dtype(x.dtype).name
  row = entry.layer_size if entry is not None and entry.stacked else 0
  tree[part][key] = x
  leaves[part].append(
    _Leaf(key, path, shape, dtype, tuple(x.shape), index, row=row, members=members)
  )


@jax.jit
def _ravel(x):
  return jnp.ravel(x)


def _without_slices(xs, entries) -> list:
  """Storage leaves as saved: a tensor-parallel one ([T, padded slice]; `entries`: the
  parameter each leaf holds or mirrors, or None) in the flat natural layout (natural order,
  zero-padded to a multiple of the devices; a stacked one [L, T, padded slice] per layer
  row, as a stack without tensor parallelism is stored), so that a checkpoint does not
  depend on the tensor axis and restores on any mesh, with or without one. One program for
  all of them."""
  split = [
    k
    for k, e in enumerate(entries)
    if e is not None and e.tensor_dim is not None and not e.persistent
  ]
  if not split:
    return list(xs)
  out = list(xs)
  flat = _flat_natural(
    tuple(xs[k] for k in split), tuple(entries[k] for k in split), xs[split[0]].sharding.mesh
  )
  for k, x in zip(split, flat):
    out[k] = x
  return out


@functools.partial(jax.jit, static_argnums=(1, 2))
def _flat_natural(xs, entries, mesh):
  out = []
  devices = tuple(mesh.axis_names)
  for x, entry in zip(xs, entries):
    natural = layout.natural_from_storage(x, entry)
    if entry.stacked:  # rows [L, padded layer]
      rows = natural.reshape(entry.shape[0], -1)
      rows = jnp.pad(
        rows, ((0, 0), (0, ir.padded_size(entry.layer_size, mesh.size) - entry.layer_size))
      )
      out.append(layout.place(rows, mesh, P(None, devices)))
      continue
    flat = jnp.pad(natural.reshape(-1), (0, ir.padded_size(entry.size, mesh.size) - entry.size))
    out.append(layout.place(flat, mesh, P(devices)))
  return out


@functools.partial(jax.jit, static_argnums=1)
def _checksum_tree(tree, rows):
  rows = {(part, key): row for part, key, row in rows}
  return {
    part: {key: _checksum_where_it_is(x, rows.get((part, key), 0)) for key, x in leaves.items()}
    for part, leaves in tree.items()
  }


def _checksum_where_it_is(x, row):
  """The checksum, computed in the memory the array lives in (an offloaded state's host
  leaves on the host: no device copy of them)."""
  if getattr(x.aval, "memory_space", None) == jax.memory.Space.Host:
    return offload.on_host(functools.partial(_checksum, row=row))(x)
  return _checksum(x, row=row)


def _rows(rows_by_part) -> tuple:
  """{part: [(key, row)]} as the static argument of `_checksum_tree`."""
  return tuple(
    (part, key, row) for part, pairs in rows_by_part.items() for key, row in pairs if row
  )


def _checksum(x, xp=jnp, row=0):
  """Position-weighted wrap-around sum of the bits of x in natural order: exact in any
  reduction order, and zero padding adds nothing, so it is the same in every layout.
  `row`: x is stacked storage [layers, padded row] holding `row` natural elements per row
  (weights follow the natural position; no reshape, so a sharded x stays sharded).
  `xp`: jax.numpy on device, numpy on the host (export, in blocks: no temporaries the size
  of x); the same bits either way."""
  if xp is np:
    return _host_checksum(np.ravel(x))
  values = x if row else jnp.ravel(x)
  bits = _bits(values, jax.lax.bitcast_convert_type)
  if values.dtype.itemsize == 8:  # two uint32 words per value, in order
    bits = bits.reshape(bits.shape[:-1] + (-1,)) if row else bits.reshape(-1)
  if row:
    words = bits.shape[1] // x.shape[1] if x.shape[1] else 1
    r = jax.lax.broadcasted_iota(np.uint32, bits.shape, 0)
    c = jax.lax.broadcasted_iota(np.uint32, bits.shape, 1)
    position = r * np.uint32(row * words) + c
  else:
    position = jnp.arange(bits.shape[0], dtype=np.uint32)
  if getattr(bits.aval, "memory_space", None) == jax.memory.Space.Host:
    position = jax.device_put(position, jax.memory.Space.Host)  # computed beside x
  return jnp.sum(bits * (position * np.uint32(2) + np.uint32(1)), dtype=np.uint32)


def _bits(values, bitcast):
  if values.dtype == np.bool_:
    return values.astype(np.uint32)
  width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[values.dtype.itemsize]
  return bitcast(values, width).astype(np.uint32)


_BLOCK = 1 << 16


def _host_checksum(flat: np.ndarray) -> np.uint32:
  words = 2 if flat.dtype.itemsize == 8 else 1  # uint32 words per value
  total = 0
  for start in range(0, flat.shape[0], _BLOCK):
    block = _bits(flat[start : start + _BLOCK], lambda v, w: v.view(w)).reshape(-1)
    first = start * words
    weights = np.arange(first, first + block.shape[0], dtype=np.uint32) * np.uint32(2) + np.uint32(
      1
    )
    total = (total + int(np.sum(block * weights, dtype=np.uint32))) & 0xFFFFFFFF
  return np.uint32(total)


def _checksums(tree, rows=()) -> dict:
  return jax.tree.map(int, jax.device_get(_checksum_tree(tree, rows)))


# ---- restore planning -----------------------------------------------------------------


def _extra_template(saved_extra):
  if not saved_extra:
    return None
  return layout.tree_from_paths(
    [leaf.path for leaf in saved_extra],
    [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in saved_extra],
  )


def _verify_checksums(restored, saved, items, where):
  sums = _checksums(
    restored,
    tuple(
      (part, key, row)
      for part, entries in items.items()
      for key, (_, _, row) in entries.items()
      if row
    ),
  )
  for part, leaves in saved.items():
    for leaf in leaves:
      if sums[part][leaf.key] != leaf.checksum:
        raise CheckpointError(
          f"{plan.what(part)} {leaf.path} in {where} fails its checksum: the data was "
          f"corrupted after it was written. Restore another step or re-create the "
          f"checkpoint."
        )


# ---- helpers --------------------------------------------------------------------------


def _describe(part, key, manifest) -> str:
  for d in manifest.get(part, []):
    if d["key"] == key:
      return f"{plan.what(part).lower()} {d['path']}"
  return key


def _first_line(e) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _check_writable(directory):
  if not os.access(directory, os.W_OK | os.X_OK):
    raise PermissionError("not writable")
