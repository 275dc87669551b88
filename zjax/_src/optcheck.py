"""Does an optax transformation give the same result on the sharded layout as on whole
parameters? Checked by running both on random probes, not guessed from names.

The trainer applies the optimizer to flat, zero-padded leaves. That is exact for element-wise
transforms and for global or per-leaf norms (reductions over the whole flat leaf, padding
zero), and wrong for transforms that use a parameter's shape (Adafactor's factored moments,
Muon's orthogonalisation) or that write into the padding. The probe runs two updates on
random parameters and gradients of the real shapes, both ways, and compares every trainable
leaf; the probes are sharded over the mesh, so no device ever holds a whole model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zjax._src import ir, layout
from zjax._src.errors import ZjaxError

_RTOL = 1e-4  # reduction order differs between the two layouts; shape-dependence is O(1)


def check_optimizer(optimizer, schedule, mesh, treedef, trainable, *, name: str) -> None:
  """Raise ZjaxError naming the parameter where `optimizer` differs on the sharded layout."""
  with jax.set_mesh(mesh):
    _check(optimizer, schedule, mesh, treedef, trainable, name)


def _check(optimizer, schedule, mesh, treedef, trainable, name):
  natural_params, *grads = _probes(schedule, mesh, treedef, count=3)
  try:
    natural = _run(optimizer, natural_params, grads)
    flat = _run(optimizer, _shard(natural_params, schedule, mesh),
                [_shard(g, schedule, mesh) for g in grads])
  except Exception as e:  # the transform cannot even run on flat leaves
    raise ZjaxError(f"The optimizer {name} cannot run on the sharded layout (flat, padded "
                    f"leaves): {type(e).__name__}: {e}. It depends on parameter shapes; use "
                    f"an element-wise optimizer (sgd, adam, adamw, lion, ...).") from None
  table = np.asarray(_differences(schedule, mesh, trainable)(natural, flat))
  for step, rows in enumerate(table):
    for entry, (diff, pad, scale) in zip(
        [e for e, t in zip(schedule.params, trainable) if t], rows):
      _judge(name, entry, step, float(diff), float(pad), float(scale))


def _judge(name, entry, step, diff, pad, scale):
  if pad != 0.0 or diff > _RTOL * max(scale, 1e-30):
    what = (f"writes into the zero padding (max {pad:.3g})" if pad else
            f"differs from optax on the whole parameter (max difference {diff:.3g} vs update "
            f"scale {scale:.3g})")
    raise ZjaxError(
        f"The optimizer {name} is not shard-compatible: on the flat sharded layout its update "
        f"of {entry.path} (shape {list(entry.shape)}, update {step + 1}) {what}. It depends "
        f"on parameter shapes (like Adafactor's factored moments or Muon's "
        f"orthogonalisation); use an element-wise or norm-based optimizer (sgd, adam, adamw, "
        f"lion, lamb, lars, ...).")


def _differences(schedule, mesh, trainable):
  """One jitted program: (natural updates per step, flat updates per step) -> array
  [step, trainable leaf, (max |difference|, max |padding|, max |natural|)]. Each leaf is
  replicated before comparing, which XLA does one leaf at a time."""
  def leaf(entry, natural, flat):
    natural = layout.place(natural, mesh, P()).astype(jnp.float32)
    flat = layout.place(flat, mesh, P()).astype(jnp.float32)
    zero = jnp.zeros((), jnp.float32)
    scale = jnp.max(jnp.abs(natural), initial=0.0)
    if entry.persistent or entry.size == 0:
      return jnp.stack([jnp.max(jnp.abs(natural - flat), initial=0.0), zero, scale])
    diff = jnp.max(jnp.abs(layout.natural_from_storage(flat, entry) - natural))
    pad = jnp.max(jnp.abs(layout.storage_padding(flat, entry)), initial=0.0)
    return jnp.stack([diff, pad, scale])

  def differences(natural_steps, flat_steps):
    rows = []
    for natural, flat in zip(natural_steps, flat_steps):
      rows.append(jnp.stack([leaf(e, a, b) for e, a, b, t in zip(
          schedule.params, jax.tree.leaves(natural), jax.tree.leaves(flat), trainable) if t]))
    return jnp.stack(rows)

  return jax.jit(differences)


def _run(optimizer, params, grads_list):
  def run(params, grads_list):
    state = optimizer.init(params)
    outs = []
    for g in grads_list:
      updates, state = optimizer.update(g, state, params)
      params = jax.tree.map(
          lambda p, u: optax.apply_updates(p, u) if jnp.issubdtype(p.dtype, jnp.inexact)
          else p, params, updates)
      outs.append(updates)
    return outs
  return jax.jit(run)(params, grads_list)


def _probes(schedule, mesh, treedef, count):
  """`count` trees of random natural-shape values (zeros for non-float leaves), made in one
  program, each leaf sharded along its largest divisible dimension."""
  axis, n = schedule.config.axis_name, schedule.num_devices
  shardings = [NamedSharding(mesh, layout.largest_dim_spec(e.shape, n, axis))
               for e in schedule.params]

  def make(key):
    trees = []
    for c in range(count):
      leaves = []
      for i, entry in enumerate(schedule.params):
        dtype = jnp.dtype(entry.dtype)
        k = jax.random.fold_in(jax.random.fold_in(key, c), i)
        leaves.append(jax.random.normal(k, entry.shape, jnp.float32).astype(dtype)
                      if ir.is_float(dtype) else jnp.zeros(entry.shape, dtype))
      trees.append(jax.tree_util.tree_unflatten(treedef, leaves))
    return trees

  out = [jax.tree_util.tree_unflatten(treedef, shardings)] * count
  return jax.jit(make, out_shardings=out)(jax.random.key(0))


def _shard(tree, schedule, mesh):
  return layout.shard(tree, schedule, mesh)


def transform_name(optimizer) -> str:
  """A readable name for an optax transformation (its init function's qualified name)."""
  qualname = getattr(optimizer.init, "__qualname__", "") or repr(optimizer)
  return qualname.replace(".<locals>.init_fn", "").replace(".<locals>.init", "")
