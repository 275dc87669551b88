"""The zero3 trainer: a NamedTuple of pure functions, in the style of optax.

The optimizer runs on the sharded layout: every leaf is the flat, zero-padded array whose
1/N chunks live on the devices, so under `jit` element-wise optimizer math touches only
each device's own chunk, while global quantities (the gradient norm for clipping, per-leaf
norms for trust ratios) are exact reductions over all devices. Padding stays zero: its
gradients are zero, and `zero3` refuses an optimizer that would move it (see optcheck.py).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

# No public dead-code elimination in JAX; this is the one jit applies.
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax._src.errors import ScheduleMismatchError, ZjaxError, batch_leaf
from zjax._src.execute.execute import is_key, value_and_grad
from zjax._src.layout import layout
from zjax._src.schedule import ir
from zjax._src.train import optcheck, placement
from zjax._src.train.sharded_init import sharded_init


class TrainState(NamedTuple):
  """Everything that changes during training, sharded like the schedule's layout."""

  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # the parameters in the sharded layout (offloaded: the device copies, in
  #              the compute dtype, that the step gathers from)
  opt_state: Any  # optax state over the trainable leaves of the sharded layout
  extra: Any = None  # non-parameter state (e.g. batch statistics), replicated
  masters: Any = None  # offload_optimizer: the fp32 master shards, in host memory
  #                      (offload_params: `params` too)


class Zero3(NamedTuple):
  """The trainer's pure functions (see `zero3`)."""

  init: Callable  # natural-shape params -> TrainState
  init_from: Callable  # (init_fn, *args) -> TrainState, never holding the whole model
  step: Callable  # (TrainState, batch) -> (TrainState, metrics); jitted, state donated
  gather_params: Callable  # TrainState -> natural-shape params
  abstract_state: Callable  # (extra=None) -> TrainState of ShapeDtypeStructs with shardings
  schedule: Any  # the schedule it runs
  mesh: Any  # the mesh it runs on
  lower: Callable  # (TrainState, batch) -> the step lowered, for ahead-of-time compiles
  #                  (zjax.hlo.compile_for_analysis(trainer.lower(state, batch)))
  offload_plan: dict | None = None  # offload_optimizer: predicted device / host bytes and
  #                                   the update stream's sub-groups (offload_stream.predicted)


class NonFiniteError(FloatingPointError):
  """Raised when a step's loss or gradients are not finite (on_nonfinite="raise"), or when
  `max_consecutive_skips` steps in a row were. The step left the state unchanged; it is
  `.state`, and the step's metrics (loss, grad_norm, finite) are `.metrics`."""

  def __init__(self, message, state, metrics=None):
    super().__init__(message)
    self.state, self.metrics = state, metrics


def zero3(
  loss_fn: Callable,
  optimizer: optax.GradientTransformation,
  schedule,
  *,
  mesh,
  accumulation_steps: int = 1,
  on_nonfinite: str = "skip",
  max_consecutive_skips: int | None = None,
  offload_optimizer: bool = False,
  offload_params: bool = False,
) -> Zero3:
  """A ZeRO-3 trainer for `loss_fn(params, batch) -> scalar` running `schedule` on `mesh`.

  Args:
    loss_fn: a mean-over-batch loss (see `value_and_grad`).
    optimizer: any optax transformation that acts on each parameter element-wise or through
      global / per-leaf norms; shape-dependent ones (factored moments, matrix
      orthogonalisation) are refused with an error naming the parameter where they differ.
    schedule: from `compile_schedule`, for this mesh.
    accumulation_steps: K micro-batches per step; the global batch's leading dimension is
      split into K equal micro-batches (each divisible by N). Equals one step on the batch.
      The loss runs on micro-batches, so compile `schedule` on one (a schedule compiled on
      the whole batch serves only a loss whose program does not depend on the batch size).
    on_nonfinite: "skip" (default) leaves the state unchanged when the loss or gradient norm
      is not finite and reports it in metrics (`metrics["finite"]` False, with the loss and
      `grad_norm`); "raise" also raises `NonFiniteError`.
    max_consecutive_skips: with "skip", raise `NonFiniteError` once this many steps in a
      row were skipped (the state is the last good one); None (default): never. Checking
      it waits for each step's result (one small device-to-host read).
    offload_optimizer: ZeRO-Offload (DeepSpeed ``offload_optimizer.device = cpu``): the
      fp32 master shards (`TrainState.masters`) and the optimizer state live in host
      memory ("pinned_host"); the device keeps parameter copies in the compute dtype
      (`TrainState.params`) and the gradients. The update streams sub-group by sub-group
      (`ZeroConfig.sub_group_size`): each group's masters and state move to the device, are
      updated and move back (offload.py, offload_stream.py); `offload_plan` predicts it.
    offload_params: ZeRO-Infinity's parameter offload (DeepSpeed ``offload_param.device =
      cpu``; needs offload_optimizer): the parameter copies (`TrainState.params`) live in
      host memory too; each gather step moves its bucket's shards to the device just
      before the all-gather, so the schedule's prefetch covers that copy, and persistent
      (replicated) leaves move at the step's start. Between steps the device then holds no
      parameter or optimizer bytes.

  Example:
    >>> trainer = zjax.zero3(loss_fn, optax.adamw(1e-3), schedule, mesh=mesh)  # doctest: +SKIP
    >>> state = trainer.init(params)                                          # doctest: +SKIP
    >>> state, metrics = trainer.step(state, batch)                           # doctest: +SKIP
  """
  _check_args(optimizer, accumulation_steps, on_nonfinite, max_consecutive_skips)
  layout.check_mesh(schedule, mesh)
  trainable = _trainable_fn(schedule)
  masked_opt = optax.masked(optimizer, trainable)  # non-float, frozen: no optimizer state
  sub_groups = plan_sub_groups(schedule)
  place = placement.choose(
    schedule,
    mesh,
    masked_opt,
    sub_groups,
    offload_optimizer=offload_optimizer,
    offload_params=offload_params,
  )
  grad_fn = value_and_grad(loss_fn, schedule, mesh=mesh)

  def state_from(sharded, extra) -> TrainState:
    optcheck.check_optimizer(
      optimizer,
      schedule,
      mesh,
      jax.tree_util.tree_structure(sharded),
      jax.tree.leaves(trainable(sharded)),
      name=optcheck.transform_name(optimizer),
    )
    params, opt_state, masters = place.initial(sharded)
    # copies of extra: the state is donated, the caller's arrays must survive
    extra = jax.tree.map(lambda x: jnp.array(x, copy=True), extra)
    return _on_mesh(TrainState(jnp.zeros((), jnp.int32), params, opt_state, extra, masters), mesh)

  def init(params, extra=None) -> TrainState:
    """Shard `params` and initialise the optimizer on the shards. The optimizer is checked
    for shard-compatibility here, where the parameters' structure is first known. `extra`:
    non-parameter state for a loss `loss_fn(params, batch, extra) -> (loss, new_extra)`."""
    return state_from(layout.shard(params, schedule, mesh), extra)

  def update(grads, opt_state, params, finite, groups=sub_groups):
    """(new params, new optimizer state): optax on the shards, unchanged unless `finite`;
    the additions of `groups` only (offloaded: the stream passes one group at a time)."""
    updates, new_opt = masked_opt.update(grads, opt_state, params)
    new_params = _apply_by_sub_group(params, updates, groups)
    keep = lambda n, o: jnp.where(finite, n, o)  # noqa: E731
    return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state)

  def train_step(state: TrainState, batch):
    loss, extra, grads = _accumulated(
      grad_fn,
      state.params,
      batch,
      state.extra,
      accumulation_steps,
      mesh,
      schedule.config.fold_rng_keys,
      schedule.data_parallel_size,
    )
    grad_norm = optax.tree.norm(_select(grads, trainable(state.params)))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    params, opt_state, masters = place.update(update, grads, state, finite)
    keep = lambda n, o: jnp.where(finite, n, o)  # noqa: E731
    step = keep(state.step + 1, state.step)
    new = TrainState(step, params, opt_state, jax.tree.map(keep, extra, state.extra), masters)
    return new, {"loss": loss, "grad_norm": grad_norm, "finite": finite}

  def abstract_state(extra=None) -> TrainState:
    """The state `init` would return, as ShapeDtypeStructs carrying their shardings (for
    checkpoint restore and ahead-of-time compilation); `extra` as a pytree of arrays or
    ShapeDtypeStructs. Needs the params' pytree structure: known for a schedule compiled
    in this process; a schedule loaded from JSON rebuilds nested dicts from the paths."""
    replicated = NamedSharding(mesh, P())
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)  # noqa: E731
    params, opt_state, masters = place.abstract()
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return TrainState(step, params, opt_state, jax.tree.map(abstract, extra), masters)

  jitted_for = place.jit(train_step)
  return Zero3(
    init=init,
    init_from=_init_from(state_from, schedule, mesh),
    step=_checked(jitted_for, on_nonfinite, max_consecutive_skips),
    gather_params=place.gather,
    abstract_state=abstract_state,
    schedule=schedule,
    mesh=mesh,
    lower=lambda state, batch: jitted_for(state).lower(state, batch),
    offload_plan=place.plan,
  )


def _init_from(state_from, schedule, mesh) -> Callable:
  """The trainer's `init_from`, one compiled builder per init function."""
  builders = {}

  def init_from(init_fn: Callable, *args, extra=None) -> TrainState:
    """Build the sharded state from `init_fn(*args) -> params` (e.g. a Flax `model.init`)
    in one compiled program whose outputs are the shards: no device holds the whole model
    (see `sharded_init` for its memory analysis)."""
    try:
      build = builders.get(init_fn)
      if build is None:
        build = builders[init_fn] = sharded_init(init_fn, schedule, mesh)
    except TypeError:  # an unhashable init_fn: built again on every call
      build = sharded_init(init_fn, schedule, mesh)
    return state_from(build(*args), extra)

  return init_from


def _checked(jitted_for, on_nonfinite, max_consecutive_skips) -> Callable:
  """The trainer's `step`: the jitted step, then `on_nonfinite` and `max_consecutive_skips`
  applied to its metrics."""
  skipped_in_a_row = [0]  # steps skipped since the last finite one

  def step(state: TrainState, batch):
    new, metrics = jitted_for(state)(state, batch)
    if on_nonfinite == "raise" and not bool(metrics["finite"]):
      raise NonFiniteError(
        f"Step {int(new.step)}: the loss ({float(metrics['loss'])}) or the "
        f"gradient norm ({float(metrics['grad_norm'])}) is not finite; the "
        f"state was left unchanged (see .state).",
        new,
        metrics,
      )
    if max_consecutive_skips is not None:
      skipped_in_a_row[0] = 0 if bool(metrics["finite"]) else skipped_in_a_row[0] + 1
      if skipped_in_a_row[0] >= max_consecutive_skips:
        skipped_in_a_row[0] = 0
        raise NonFiniteError(_too_many_skips(max_consecutive_skips, new, metrics), new, metrics)
    return new, metrics

  return step


def plan_sub_groups(schedule) -> list[list[int]]:
  """Trained storage leaves (tree order) in groups of at most `sub_group_size` elements per
  device; a leaf larger than that (e.g. a rolled stack) is a group of its own."""
  limit, n = schedule.config.sub_group_size, schedule.num_devices
  groups, current, size = [], [], 0
  for i, leaf in enumerate(schedule.storage):
    if not ir.is_trained(leaf.entry):
      continue
    local = ir.local_elements(leaf.entry, n)
    if current and size + local > limit:
      groups.append(current)
      current, size = [], 0
    current.append(i)
    size += local
  return groups + ([current] if current else [])


def _apply_by_sub_group(params, updates, sub_groups):
  """p + u for the leaves of `sub_groups`, one group after another: each group's inputs are
  tied to the previous group's results, so the fused element-wise update work runs group
  by group (DeepSpeed's sub_group_size) instead of all at once. The first group's inputs
  pass a barrier too: each p + u is then its own fusion wherever its group stands (the
  offloaded stream applies one group per call), so the rounding is the same."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  update_leaves = jax.tree.leaves(updates)
  out, previous = list(leaves), None
  for group in sub_groups:
    inputs = [(leaves[i], update_leaves[i]) for i in group]
    inputs, _ = lax.optimization_barrier((inputs, previous))
    previous = [optax.apply_updates(p, u) for p, u in inputs]
    for i, value in zip(group, previous):
      out[i] = value
  return jax.tree_util.tree_unflatten(treedef, out)


def _on_mesh(tree, mesh):
  """Leaves not placed on the mesh (scalars made on one device) become replicated on it, as
  the step returns them: otherwise the second step would compile again."""
  devices = set(mesh.devices.flat)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(
    lambda x: x if x.sharding.device_set == devices else jax.device_put(x, replicated), tree
  )


def _call(grad_fn, params, batch, extra):
  """(loss, new extra, grads) with or without extra state."""
  if extra is None:
    loss, grads = grad_fn(params, batch)
    return loss, None, grads
  (loss, new_extra), grads = grad_fn(params, batch, extra)
  return loss, new_extra, grads


def _accumulated(grad_fn, params, batch, extra, k, mesh, fold_keys, data_parallel):
  """Mean loss, new extra state and gradients over k equal micro-batches (each sees the
  step's extra state; their new states are averaged; with `fold_keys`, 0-d PRNG keys get
  the micro-batch index folded in); gradients stay sharded. `data_parallel`: the devices
  each micro-batch is split over."""
  if k == 1:
    return _call(grad_fn, params, batch, extra)
  micro = jax.tree_util.tree_map_with_path(
    lambda path, x: _split_leading(path, x, k, mesh, data_parallel) if np.ndim(x) else x, batch
  )
  split = jax.tree.map(lambda x: np.ndim(x) > 0, batch)

  def micro_batch(x, is_split, i):
    if is_split:
      return x[i]
    return jax.random.fold_in(x, i) if fold_keys and is_key(x) else x

  def body(carry, i):
    b = jax.tree.map(lambda x, s: micro_batch(x, s, i), micro, split)
    try:
      out = _call(grad_fn, params, b, extra)
    except ScheduleMismatchError as e:
      raise ScheduleMismatchError(f"{e} {_micro_batch_hint(batch, k)}") from None
    return jax.tree.map(jnp.add, carry, out), None

  zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), extra, params))
  total, _ = lax.scan(body, zeros, jnp.arange(k))
  return jax.tree.map(lambda x: (x / k).astype(x.dtype), total)


def _micro_batch_hint(batch, k) -> str:
  """What to do when a micro-batch's program is not the schedule's."""
  sizes = sorted({x.shape[0] for x in jax.tree.leaves(batch) if np.ndim(x)})
  return (
    f"With accumulation_steps={k} the step runs the loss on micro-batches of 1/{k} of its "
    f"batch (leading dimension {' / '.join(str(n // k) for n in sizes)}, not "
    f"{' / '.join(map(str, sizes))}), and this loss's program depends on the batch size "
    f"(e.g. an index or reshape that JAX simplifies at one example per device): compile "
    f"the schedule on one micro-batch (the first 1/{k} of each batch leaf's leading "
    f"dimension), which is the program that runs."
  )


def _split_leading(path, x, k, mesh, data_parallel):
  if x.shape[0] % (k * data_parallel):
    raise ZjaxError(
      f"{batch_leaf(path)} has leading dimension {x.shape[0]}: "
      f"accumulation_steps={k} splits it into {k} micro-batches, each split over the "
      f"{data_parallel} devices of the data axes, so it must be a multiple of "
      f"{k} x {data_parallel} = {k * data_parallel}. Use such a batch, or fewer "
      f"accumulation steps."
    )
  x = layout.place(x, mesh, jax.sharding.PartitionSpec())
  return x.reshape((k, x.shape[0] // k) + x.shape[1:])


def _trainable_fn(schedule):
  """tree (the params' structure) -> tree of bools: floating-point, unfrozen leaves train."""
  trains = {p.path: ir.is_trained(p) for p in schedule.params}

  def trainable(tree):
    return jax.tree_util.tree_map_with_path(
      lambda path, _: trains[jax.tree_util.keystr(path)], tree
    )

  return trainable


def _select(tree, mask):
  return [x for x, m in zip(jax.tree.leaves(tree), jax.tree.leaves(mask)) if m]


def _too_many_skips(count, state, metrics) -> str:
  return (
    f"{count} steps in a row had a non-finite loss or gradient norm and were skipped "
    f"(the last: loss {float(metrics['loss'])}, gradient norm "
    f"{float(metrics['grad_norm'])}); the state is still that of optimizer step "
    f"{int(state.step)} (see .state). Check the learning rate (lower it, or warm up "
    f"longer), the inputs (inf or NaN in the batch), bf16 overflow (compute_dtype) and "
    f"gradient clipping; max_consecutive_skips sets how many skips in a row are "
    f"tolerated."
  )


def _check_args(optimizer, accumulation_steps, on_nonfinite, max_consecutive_skips=None):
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(
      f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}."
    )
  if (
    isinstance(accumulation_steps, bool)
    or not isinstance(accumulation_steps, int)
    or accumulation_steps < 1
  ):
    raise ValueError(f"accumulation_steps must be a positive int, got {accumulation_steps!r}.")
  if on_nonfinite not in ("skip", "raise"):
    raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}.")
  if max_consecutive_skips is not None and (
    isinstance(max_consecutive_skips, bool)
    or not isinstance(max_consecutive_skips, int)
    or max_consecutive_skips < 1
  ):
    raise ValueError(
      f"max_consecutive_skips must be a positive int or None, got {max_consecutive_skips!r}."
    )
