"""The zero3 trainer: a NamedTuple of pure functions, in the style of optax.

The optimizer runs on the sharded layout: every leaf is the flat, zero-padded array whose
1/N chunks live on the devices, so under `jit` element-wise optimizer math touches only
each device's own chunk, while global quantities (the gradient norm for clipping, per-leaf
norms for trust ratios) are exact reductions over all devices. Padding stays zero: its
gradients are zero, and `zero3` refuses an optimizer that would move it (see optcheck.py).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

# No public dead-code elimination in JAX; this is the one jit applies.
from jax._src.interpreters import partial_eval as pe
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax._src.errors import ZjaxError
from zjax._src.execute import offload_stream
from zjax._src.execute.execute import is_key, value_and_grad
from zjax._src.layout import layout, tensor_specs
from zjax._src.schedule import ir
from zjax._src.train import offload, optcheck
from zjax._src.xla import xla_options


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
  step: Callable  # (TrainState, batch) -> (TrainState, metrics); jitted, state donated;
  #                 step.lower(state, batch) for zjax.hlo.compile_for_analysis
  gather_params: Callable  # TrainState -> natural-shape params
  abstract_state: Callable  # (extra=None) -> TrainState of ShapeDtypeStructs with shardings
  schedule: Any  # the schedule it runs
  mesh: Any  # the mesh it runs on
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
  _check_offload(offload_optimizer, offload_params)
  if offload_optimizer:
    offload.check_host_memory(mesh)
  trainable = _trainable_fn(schedule)
  masked_opt = optax.masked(optimizer, trainable)  # non-float, frozen: no optimizer state
  grad_fn = value_and_grad(loss_fn, schedule, mesh=mesh)
  sub_groups = plan_sub_groups(schedule)

  def init(params, extra=None) -> TrainState:
    """Shard `params` and initialise the optimizer on the shards. The optimizer is checked
    for shard-compatibility here, where the parameters' structure is first known. `extra`:
    non-parameter state for a loss `loss_fn(params, batch, extra) -> (loss, new_extra)`."""
    return _state_from(layout.shard(params, schedule, mesh), extra)

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
    return _state_from(build(*args), extra)

  leaf_shardings = offload.leaf_shardings(schedule, mesh)
  copies_kind = offload.HOST if offload_params else offload.DEVICE
  copy_shardings = [offload.with_kind(s, copies_kind) for s in leaf_shardings]

  def _state_from(sharded, extra) -> TrainState:
    optcheck.check_optimizer(
      optimizer,
      schedule,
      mesh,
      jax.tree_util.tree_structure(sharded),
      jax.tree.leaves(trainable(sharded)),
      name=optcheck.transform_name(optimizer),
    )
    masters = None
    if offload_optimizer:  # masters to the host, device copies in the compute dtype
      masters = offload.place(sharded, _like(sharded, leaf_shardings), offload.HOST)
      dtypes = offload.copy_dtypes(schedule)
      sharded = jax.jit(
        lambda m: offload.device_copies(m, dtypes), out_shardings=_like(sharded, copy_shardings)
      )(sharded)
    with jax.set_mesh(mesh):  # optax creates unsharded scalars: Explicit meshes need context
      # explicit output shardings: on Auto axes jit would otherwise replicate the moments
      base = sharded if masters is None else masters
      shardings = _opt_state_shardings(
        jax.eval_shape(masked_opt.init, base), schedule, mesh, offload_optimizer
      )
      init_opt = offload.on_host(masked_opt.init) if offload_optimizer else masked_opt.init
      opt_state = jax.jit(init_opt, out_shardings=shardings)(base)
    state = TrainState(
      step=jnp.zeros((), jnp.int32),
      params=sharded,
      opt_state=opt_state,
      # copies: the state is donated, the caller's arrays must survive
      extra=jax.tree.map(lambda x: jnp.array(x, copy=True), extra),
      masters=masters,
    )
    return _on_mesh(state, mesh)

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
    )
    trainable_leaves = trainable(state.params)
    grad_norm = optax.tree.norm(_select(grads, trainable_leaves))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    masters = state.masters
    if offload_optimizer:  # each sub-group's state to the device, updated, back to the host
      masters, opt_state, params = offload_stream.streamed_update(
        update,
        grads,
        state.opt_state,
        state.masters,
        state.params,
        sub_groups,
        finite,
        offload.copy_dtypes(schedule),
        copies_kind,
      )
    else:
      params, opt_state = update(grads, state.opt_state, state.params, finite)
    keep = lambda n, o: jnp.where(finite, n, o)  # noqa: E731
    new = TrainState(
      keep(state.step + 1, state.step),
      params,
      opt_state,
      jax.tree.map(keep, extra, state.extra),
      masters,
    )
    return new, {"loss": loss, "grad_norm": grad_norm, "finite": finite}

  plain_jit = xla_options.jit(train_step, donate_argnums=0)
  offload_jits = {}

  def jitted_for(state):
    """The jitted step; offloaded, with the state's own shardings (memory kinds) as its
    outputs', so that donated host buffers stay on the host."""
    if not offload_optimizer:
      return plain_jit
    key = jax.tree.structure(state)
    if key not in offload_jits:
      shardings = jax.tree.map(lambda x: x.sharding, state)
      offload_jits[key] = xla_options.jit(
        train_step, donate_argnums=0, out_shardings=(shardings, NamedSharding(mesh, P()))
      )
    return offload_jits[key]

  skipped_in_a_row = [0]  # steps skipped since the last finite one (max_consecutive_skips)

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

  # ahead-of-time analysis: zjax.hlo.compile_for_analysis(step.lower(state, batch))
  step.lower = lambda state, batch: jitted_for(state).lower(state, batch)

  def gather_params(state: TrainState):
    if state.masters is None:
      return layout.unshard(state.params, schedule)
    return layout.unshard(
      offload.place(state.masters, _like(state.masters, leaf_shardings), offload.DEVICE), schedule
    )

  def abstract_state(extra=None) -> TrainState:
    """The state `init` would return, as ShapeDtypeStructs carrying their shardings (for
    checkpoint restore and ahead-of-time compilation); `extra` as a pytree of arrays or
    ShapeDtypeStructs. Needs the params' pytree structure: known for a schedule compiled
    in this process; a schedule loaded from JSON rebuilds nested dicts from the paths."""
    params = layout.abstract_storage(schedule, mesh)
    with jax.set_mesh(mesh):
      opt_state = jax.eval_shape(masked_opt.init, params)
    replicated = NamedSharding(mesh, P())
    opt_shardings = _opt_state_shardings(opt_state, schedule, mesh, offload_optimizer)
    masters = None
    if offload_optimizer:
      masters = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=offload.with_kind(x.sharding, offload.HOST)
        ),
        params,
      )
      params = jax.tree.map(
        lambda x, d, s: jax.ShapeDtypeStruct(x.shape, d, sharding=s),
        params,
        _like(params, offload.copy_dtypes(schedule)),
        _like(params, copy_shardings),
      )
    return TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
      params=params,
      opt_state=jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt_state, opt_shardings
      ),
      extra=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), extra
      ),
      masters=masters,
    )

  return Zero3(
    init=init,
    init_from=init_from,
    step=step,
    gather_params=gather_params,
    abstract_state=abstract_state,
    schedule=schedule,
    mesh=mesh,
    offload_plan=offload_stream.predicted(schedule, sub_groups, params_on_host=offload_params)
    if offload_optimizer
    else None,
  )


def _opt_state_shardings(opt_shapes, schedule, mesh, on_host=False):
  """Each optimizer leaf that mirrors a parameter (adam's mu, nu) sharded like it; the rest
  (step counts, scalars) replicated; all in host memory when offloaded."""
  specs = layout.storage_specs(schedule)
  kind = offload.HOST if on_host else None

  def sharding(path, leaf):
    index = layout.mirrored_storage(jax.tree_util.keystr(path), leaf.shape, schedule)
    return NamedSharding(mesh, P() if index is None else specs[index], memory_kind=kind)

  return jax.tree_util.tree_map_with_path(sharding, opt_shapes)


def _like(tree, leaves):
  """`leaves` (one per leaf of `tree`, in order) in the structure of `tree`."""
  return jax.tree.unflatten(jax.tree.structure(tree), list(leaves))


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

  compiled = []  # the jitted build (a second call does not recompile)

  def jitted(*args):
    if not compiled:
      compiled.append(xla_options.jit(build, out_shardings=shardings))
    return compiled[0]

  def run(*args):
    treedef = jax.tree_util.tree_structure(jax.eval_shape(init_fn, *args))
    leaves = jitted(*args)(*args)
    stored = {leaf.members[0] for leaf in schedule.storage}
    heads = iter(leaves)  # the natural structure, None at rolled layers 1..L-1
    return jax.tree_util.tree_unflatten(
      treedef, [next(heads) if i in stored else None for i in range(len(schedule.params))]
    )

  run.lower = lambda *args: jitted(*args).lower(*args)
  return run


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


def _accumulated(grad_fn, params, batch, extra, k, mesh, fold_keys):
  """Mean loss, new extra state and gradients over k equal micro-batches (each sees the
  step's extra state; their new states are averaged; with `fold_keys`, 0-d PRNG keys get
  the micro-batch index folded in); gradients stay sharded."""
  if k == 1:
    return _call(grad_fn, params, batch, extra)
  micro = jax.tree.map(lambda x: _split_leading(x, k, mesh) if np.ndim(x) else x, batch)
  split = jax.tree.map(lambda x: np.ndim(x) > 0, batch)

  def micro_batch(x, is_split, i):
    if is_split:
      return x[i]
    return jax.random.fold_in(x, i) if fold_keys and is_key(x) else x

  def body(carry, i):
    b = jax.tree.map(lambda x, s: micro_batch(x, s, i), micro, split)
    return jax.tree.map(jnp.add, carry, _call(grad_fn, params, b, extra)), None

  zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), extra, params))
  total, _ = lax.scan(body, zeros, jnp.arange(k))
  return jax.tree.map(lambda x: (x / k).astype(x.dtype), total)


def _split_leading(x, k, mesh):
  if x.shape[0] % k:
    raise ZjaxError(
      f"A batch leaf has leading dimension {x.shape[0]}, not divisible by accumulation_steps={k}."
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


def _check_offload(offload_optimizer, offload_params):
  for name, value in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params)):
    if not isinstance(value, bool):
      raise ValueError(f"{name} must be True or False, got {value!r}.")
  if offload_params and not offload_optimizer:
    raise ValueError(
      "offload_params=True needs offload_optimizer=True: the parameter copies "
      "are made from the fp32 masters that optimizer offload keeps on the host "
      "(DeepSpeed's ZeRO-Infinity offloads both). Pass offload_optimizer=True "
      "as well, or offload_params=False."
    )


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
