"""Where the trainer keeps the parameters and the optimizer state: on the device (the
default) or offloaded to host memory (ZeRO-Offload, and ZeRO-Infinity's parameter offload).

A placement is one object that owns everything the choice changes: the state `init` builds,
the step's update, the step's jit (its output shardings), gathering the parameters back,
and the abstract state. The trainer (train.py) is one recipe over either; torchtitan's
`CPUOffloadPolicy` plays the same part in its FSDP setup.
"""

from typing import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zjax._src.execute import offload_stream
from zjax._src.layout import layout
from zjax._src.train import offload
from zjax._src.xla import xla_options


def choose(schedule, mesh, optimizer, sub_groups, *, offload_optimizer, offload_params):
  """The placement for these knobs (checked: bools, offload_params needs offload_optimizer,
  host memory where offloading). `optimizer`: the masked optax transformation."""
  _check_offload(offload_optimizer, offload_params)
  if not offload_optimizer:
    return OnDevice(schedule, mesh, optimizer)
  offload.check_host_memory(mesh)
  return Offloaded(schedule, mesh, optimizer, sub_groups, params_on_host=offload_params)


class OnDevice:
  """Parameter shards, gradients and optimizer state in device memory."""

  plan = None  # nothing to predict beyond the schedule's report

  def __init__(self, schedule, mesh, optimizer):
    self.schedule, self.mesh, self.optimizer = schedule, mesh, optimizer

  def initial(self, sharded):
    """(params, opt_state, masters) of a new state from the sharded parameters."""
    with mesh_context(self.mesh):  # optax makes unsharded scalars: Explicit meshes need it
      # explicit output shardings: on Auto axes jit would otherwise replicate the moments
      shardings = self.opt_state_shardings(jax.eval_shape(self.optimizer.init, sharded))
      return sharded, jax.jit(self.optimizer.init, out_shardings=shardings)(sharded), None

  def update(self, update: Callable, grads, state, finite):
    """(params, opt_state, masters) after the step; `update(grads, opt_state, params,
    finite)` is the trainer's update of the whole tree."""
    params, opt_state = update(grads, state.opt_state, state.params, finite)
    return params, opt_state, None

  def jit(self, train_step: Callable) -> Callable:
    """state -> the jitted `train_step(state, batch)` for a state of that structure."""
    jitted = xla_options.jit(train_step, donate_argnums=0)
    return lambda state: jitted

  def gather(self, state):
    """The natural-shape parameters of `state`."""
    return layout.unshard(state.params, self.schedule)

  def abstract(self):
    """(params, opt_state, masters) of the state `initial` makes, as ShapeDtypeStructs
    with their shardings."""
    params = layout.abstract_storage(self.schedule, self.mesh)
    return params, self._abstract_opt_state(params), None

  def opt_state_shardings(self, opt_shapes, kind=None):
    """Each optimizer leaf that mirrors a parameter (adam's mu, nu) sharded like it; the
    rest (step counts, scalars) replicated; in `kind` memory."""
    specs = layout.storage_specs(self.schedule)

    def sharding(path, leaf):
      index = layout.mirrored_storage(jax.tree_util.keystr(path), leaf.shape, self.schedule)
      return NamedSharding(self.mesh, P() if index is None else specs[index], memory_kind=kind)

    return jax.tree_util.tree_map_with_path(sharding, opt_shapes)

  def _abstract_opt_state(self, params, kind=None):
    with mesh_context(self.mesh):
      shapes = jax.eval_shape(self.optimizer.init, params)
    return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      shapes,
      self.opt_state_shardings(shapes, kind),
    )


class Offloaded(OnDevice):
  """ZeRO-Offload: the fp32 master shards (`TrainState.masters`) and the optimizer state in
  host memory; the device keeps parameter copies in the compute dtype (`TrainState.params`)
  and the gradients. With `params_on_host` (ZeRO-Infinity's parameter offload) the copies
  live on the host too, and each gather step brings its bucket's shards to the device.
  The update streams sub-group by sub-group (offload_stream.py)."""

  def __init__(self, schedule, mesh, optimizer, sub_groups, params_on_host: bool):
    super().__init__(schedule, mesh, optimizer)
    self.sub_groups, self.params_on_host = sub_groups, params_on_host
    self.leaf_shardings = offload.leaf_shardings(schedule, mesh)
    self.copies_kind = offload.HOST if params_on_host else offload.DEVICE
    self.copy_shardings = [offload.with_kind(s, self.copies_kind) for s in self.leaf_shardings]
    self.copy_dtypes = offload.copy_dtypes(schedule)
    self.plan = offload_stream.predicted(schedule, sub_groups, params_on_host=params_on_host)
    self._jits = {}

  def initial(self, sharded):
    masters = offload.place(sharded, _like(sharded, self.leaf_shardings), offload.HOST)
    copies = jax.jit(
      lambda m: offload.device_copies(m, self.copy_dtypes),
      out_shardings=_like(sharded, self.copy_shardings),
    )(sharded)
    with jax.set_mesh(self.mesh):
      shardings = self.opt_state_shardings(
        jax.eval_shape(self.optimizer.init, masters), offload.HOST
      )
      init = offload.on_host(self.optimizer.init)
      return copies, jax.jit(init, out_shardings=shardings)(masters), masters

  def update(self, update, grads, state, finite):
    masters, opt_state, params = offload_stream.streamed_update(
      update,
      grads,
      state.opt_state,
      state.masters,
      state.params,
      self.sub_groups,
      finite,
      self.copy_dtypes,
      self.copies_kind,
    )
    return params, opt_state, masters

  def jit(self, train_step):
    """Jitted with the state's own shardings (memory kinds) as its outputs', so that
    donated host buffers stay on the host: one per state structure."""

    def jitted_for(state):
      key = jax.tree.structure(state)
      if key not in self._jits:
        shardings = jax.tree.map(lambda x: x.sharding, state)
        self._jits[key] = xla_options.jit(
          train_step,
          donate_argnums=0,
          out_shardings=(shardings, NamedSharding(self.mesh, P())),
        )
      return self._jits[key]

    return jitted_for

  def gather(self, state):
    masters = offload.place(
      state.masters, _like(state.masters, self.leaf_shardings), offload.DEVICE
    )
    return layout.unshard(masters, self.schedule)

  def abstract(self):
    storage = layout.abstract_storage(self.schedule, self.mesh)
    masters = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=offload.with_kind(x.sharding, offload.HOST)
      ),
      storage,
    )
    copies = jax.tree.map(
      lambda x, d, s: jax.ShapeDtypeStruct(x.shape, d, sharding=s),
      storage,
      _like(storage, self.copy_dtypes),
      _like(storage, self.copy_shardings),
    )
    return copies, self._abstract_opt_state(storage, offload.HOST), masters


def mesh_context(mesh):
  """The context that makes `mesh` current: a device mesh, or an abstract one (the trainer
  traced without devices, e.g. to predict its memory)."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh)
  return jax.set_mesh(mesh)


def _like(tree, leaves):
  """`leaves` (one per leaf of `tree`, in order) in the structure of `tree`."""
  return jax.tree.unflatten(jax.tree.structure(tree), list(leaves))


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
