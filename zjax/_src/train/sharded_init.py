"""Sharded initialisation: a model's `init` run as one compiled program whose outputs are
the parameter shards, so that no device ever holds the whole model."""

from typing import Any, Callable, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax import lax

# No public dead-code elimination in JAX; this is the one jit applies.
from jax._src.interpreters import partial_eval as pe
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax._src.layout import layout, tensor_specs
from zjax._src.xla import xla_options


def sharded_init(init_fn: Callable, schedule, mesh) -> Callable:
  """A jitted `(*args) -> sharded params` that runs `init_fn(*args)` and lays every leaf out
  as the schedule says, with the shards as the program's outputs.

  Leaves are built one after another, each from a dead-code-eliminated copy of init_fn's
  program, so a device holds its share of the model plus the temporaries of the leaf being
  built, never the whole model. A leaf whose flat chunks are whole rows is generated
  directly in its shards (XLA partitions the generation to match); any other (e.g. 257 rows
  on 8 devices) is generated in uneven row blocks and gathered whole once to be sliced.
  Random generation itself needs about 3x its output (two uint32 counter arrays), so the
  peak is the share plus about 3/N of the largest leaf, or one whole leaf where it is
  uneven; measured in tests/test_train.py against the largest bucket plus the share.

  Example:
    >>> build = zjax.sharded_init(model.init, schedule, mesh)           # doctest: +SKIP
    >>> zjax.hlo.compile_for_analysis(build.lower(key, x)).memory_analysis()  # doctest: +SKIP
  """
  shardings = [NamedSharding(mesh, spec) for spec in layout.storage_specs(schedule)]
  boxed_init = init_fn
  init_fn = lambda *args: tensor_specs.unbox(boxed_init(*args))  # noqa: E731 (Flax boxes)

  def build(*args):
    """-> the storage leaves (schedule.storage order), each built after the previous."""
    closed = jax.make_jaxpr(init_fn)(*args)
    treedef = jax.tree_util.tree_structure(jax.eval_shape(init_fn, *args))
    layout.natural_leaves(
      jax.tree_util.tree_unflatten(treedef, closed.out_avals), schedule, "init_fn(*args)"
    )
    program = pe.convert_constvars_jaxpr(closed.jaxpr)
    inputs = list(closed.consts) + jax.tree.leaves(args)
    leaves, previous = [], None
    for leaf, sharding in zip(schedule.storage, shardings):
      rows = []
      for i in leaf.members:
        entry = schedule.params[i]
        finish = (
          (lambda x: x)
          if entry.persistent
          else (lambda x, entry=entry: _laid_out(x, entry, schedule, mesh))
        )
        rows.append(_one_output(program, inputs, i, previous, finish))
        previous = rows[-1]
      leaves.append(_stacked(rows, sharding) if leaf.rolled else rows[0])
      previous = leaves[-1]
    return leaves

  return ShardedInit(init_fn, schedule, xla_options.jit(build, out_shardings=shardings))


class ShardedInit(NamedTuple):
  """`sharded_init`'s result: call it as `init_fn` is called; `lower(*args)` for an
  ahead-of-time compile."""

  init_fn: Callable  # the (unboxing) init function
  schedule: Any
  jitted: Any  # (*args) -> the storage leaves

  def __call__(self, *args):
    treedef = jax.tree_util.tree_structure(jax.eval_shape(self.init_fn, *args))
    leaves = self.jitted(*args)
    stored = {leaf.members[0] for leaf in self.schedule.storage}
    heads = iter(leaves)  # the natural structure, None at rolled layers 1..L-1
    return jax.tree_util.tree_unflatten(
      treedef, [next(heads) if i in stored else None for i in range(len(self.schedule.params))]
    )

  def lower(self, *args):
    return self.jitted.lower(*args)


def _stacked(rows, sharding):
  """A rolled stack from its layers' storage rows, written one row at a time into the
  stack (in place: the stack plus one row alive, not all rows and the stack)."""
  stack = layout.place(
    jnp.zeros((len(rows),) + rows[0].shape, rows[0].dtype), sharding.mesh, sharding.spec
  )
  for layer, row in enumerate(rows):  # (Explicit axes: the row sharded as the stack's rows)
    row = layout.place(row, sharding.mesh, P(*sharding.spec[1:]))
    stack = lax.dynamic_update_index_in_dim(stack, row, layer, 0)
  return stack


def _laid_out(leaf, entry, schedule, mesh):
  """A freshly generated natural-shape leaf as its flat storage, generated sharded.

  Without guidance GSPMD generates a leaf whose flat chunks cut through rows replicated,
  with the random-number temporaries at several times its size; sharding its rows first
  (unevenly; only Auto axes allow that) keeps generation at 1/N and costs one gather."""
  n = schedule.num_devices
  if n > 1 and entry.shape and not entry.stacked and (entry.size % n or entry.shape[0] % n):
    auto = jax.sharding.Mesh(
      mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    )
    for spec in (P(layout.storage_axis(schedule.config)), P()):
      leaf = lax.with_sharding_constraint(leaf, jax.sharding.NamedSharding(auto, spec))
  return layout.storage_from_natural(leaf, entry, n)


def _one_output(program, inputs, index, previous, finish):
  """finish(output `index` of `program`), computing only what it needs, after `previous`.

  The work sits in a conditional whose predicate passes through an optimization barrier
  with `previous`: a plain data dependency is not enough, since XLA would hoist the
  input-free parts (the random counters, as large as the leaf) ahead of earlier leaves and
  keep them all live at once."""
  used_outputs = [j == index for j in range(len(program.outvars))]
  sub, used_inputs = pe.dce_jaxpr(program, used_outputs)
  args = [x for x, used in zip(inputs, used_inputs) if used]
  generate = lambda args: finish(jex.jaxpr_as_fun(jex.ClosedJaxpr(sub, []))(*args)[0])
  if previous is None:
    return generate(args)
  go, args, _ = lax.optimization_barrier((jnp.bool_(True), args, previous))
  out = jax.eval_shape(generate, args)
  return lax.cond(go, generate, lambda _: jnp.zeros(out.shape, out.dtype), args)
