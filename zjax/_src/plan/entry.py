"""compile_schedule: the user's arguments (mesh or sizes, frozen, tensor specs) checked and
resolved, the loss traced, then planned (plan.py).
"""

from typing import Any, Callable

import jax
import numpy as np

from zjax._src.config import ZeroConfig
from zjax._src.layout import tensor_parallel
from zjax._src.layout import tensor_specs as tensor_specs_lib
from zjax._src.plan.plan import plan_schedule
from zjax._src.program.trace import trace_for_schedule
from zjax._src.schedule.schedule import Schedule


def compile_schedule(
  loss_fn: Callable,
  params: Any,
  batch: Any,
  *,
  mesh=None,
  num_devices: int | None = None,
  config: ZeroConfig | None = None,
  frozen: Any = None,
  extra: Any = None,
  platform: str | None = None,
  replica_sizes: tuple[int, ...] | None = None,
  axis_sizes: dict[str, int] | None = None,
  tensor_specs: Any = None,
  logical_axis_rules: Any = None,
) -> Schedule:
  """Trace `loss_fn(params, batch)` and plan its ZeRO-3 schedule.

  Args:
    loss_fn: `(params, batch) -> scalar loss`; any pure JAX function (Flax linen: wrap
      `model.apply`; NNX: merge the split graph inside).
    params, batch: example pytrees of arrays or `jax.ShapeDtypeStruct`s (no device memory is
      needed: planning is analytic). `batch` is the global batch; the program is traced on
      one device's share of it (leading dimensions / N), which is what the executor runs.
      If some leading dimension does not divide by N (planning for more devices than the
      example batch has rows), the batch is traced as given.
    mesh: the mesh to run on; every axis must be one of `config.shard_axes` or
      `config.replicate_axes` (HSDP: one sharded copy per replica).
    num_devices: N, instead of a mesh (e.g. to plan for more devices than are present),
      for one shard axis.
    axis_sizes: instead of a mesh, the size of every axis the config names (e.g.
      `{"replica": 128, "fsdp": 8}`): analytic planning for any mesh shape.
    config: the knobs; `ZeroConfig()` by default.
    frozen: parameters that are not trained: a pytree of bools shaped like params, or a
      function of a leaf's path string (e.g. `lambda path: "embed" in path`). They are
      gathered for compute but get no gradient communication and no optimizer state.
    extra: non-parameter state (e.g. batch statistics) for a loss of the form
      `loss_fn(params, batch, extra) -> (loss, new_extra)`: replicated, not differentiated.
    replica_sizes: with `num_devices`, the sizes of `config.replicate_axes` (default 1
      each); taken from the mesh otherwise.
    platform: the backend whose compiled program the report predicts ("cpu", "gpu",
      "tpu"); by default the mesh's, or JAX's default backend. On "cpu" 16-bit gradients
      are reduced in float32, as XLA's CPU collectives do, and the report counts those bytes.
    tensor_specs: with `config.tensor_axes` (tensor parallelism), which dimension of each
      parameter is split over the tensor axis: a pytree of `PartitionSpec`/None with the
      params' structure, or a list of `(regex, PartitionSpec)` rules searched in the
      "/"-joined parameter path ("params/Dense_0/kernel"; first match wins; no match:
      replicated). Data axes in a spec are ignored (zjax shards every leaf over them).
      Without it, Flax partitioning metadata is used: params boxed by
      `nn.with_logical_partitioning` / `nn.with_partitioning`, or NNX state whose
      variables carry sharding names.
    logical_axis_rules: the rules mapping logical axis names of that metadata to mesh axes
      (MaxText style, e.g. `[("embed", "fsdp"), ("mlp", "tensor")]`); by default the
      rules of the enclosing `nn.logical_axis_rules` context.

  Example:
    >>> import jax, jax.numpy as jnp, zjax
    >>> params = {"w": jnp.ones((512, 512))}
    >>> sched = zjax.compile_schedule(lambda p, x: (x @ p["w"]).mean(), params,
    ...                               jnp.ones((8, 512)), num_devices=8)
    >>> sched.report()["all_gather_count"]
    1
  """
  config = ZeroConfig() if config is None else config
  if not isinstance(config, ZeroConfig):
    raise TypeError(f"config must be a zjax.ZeroConfig, got {type(config).__name__}.")
  sizes = resolve_axis_sizes(config, mesh, num_devices, replica_sizes, axis_sizes)
  tensor = tensor_parallel.resolve(
    params, config, mesh, axis_sizes, tensor_specs, logical_axis_rules
  )
  given, params = params, tensor_specs_lib.unbox(params)
  trace = trace_for_schedule(
    loss_fn, params, batch, config, sizes, extra, mesh=_trace_mesh(config, mesh, axis_sizes)
  )
  if platform is None:
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
  schedule = plan_schedule(
    trace,
    config,
    sizes,
    frozen=frozen_indices(params, frozen, trace),
    platform=platform,
    tensor=tensor,
  )
  object.__setattr__(schedule, "params_treedef", jax.tree_util.tree_structure(params))
  if given is not params:  # Flax boxes: unshard gives them back
    object.__setattr__(schedule, "boxed_treedef", jax.tree_util.tree_structure(given))
  return schedule


def _trace_mesh(config, mesh, axis_sizes):
  """The mesh, or every axis's size in mesh order (tensor parallelism's constraints refer to
  it); None without tensor axes."""
  if not config.tensor_axes:
    return None
  return mesh if mesh is not None else dict(axis_sizes)


def frozen_indices(params, frozen, trace) -> frozenset:
  if frozen is None:
    return frozenset()
  if callable(frozen):
    return frozenset(p.index for p in trace.params if frozen(p.path))
  flags = jax.tree.leaves(frozen)
  if jax.tree_util.tree_structure(frozen) != jax.tree_util.tree_structure(params) or not all(
    isinstance(f, (bool, np.bool_)) for f in flags
  ):
    raise ValueError(
      "frozen must be a function of the parameter path, or a pytree of bools "
      "with the params' structure (True = frozen)."
    )
  return frozenset(i for i, f in enumerate(flags) if f)


def resolve_axis_sizes(
  config, mesh=None, num_devices=None, replica_sizes=None, axis_sizes=None
) -> dict[str, int]:
  """The size of every data axis (replicate axes, then shard axes), from exactly one of a
  mesh, N (one shard axis; replica_sizes: the replicate axes', default 1) or axis_sizes."""
  if sum(x is not None for x in (mesh, num_devices, axis_sizes)) != 1:
    raise ValueError(
      "Pass exactly one of mesh= (the mesh to run on), num_devices= (N, to "
      "plan analytically) or axis_sizes= (every axis's size, analytically)."
    )
  if replica_sizes is not None and num_devices is None:
    raise ValueError(
      "replica_sizes goes with num_devices= (analytic planning); with a mesh "
      "the replicate axes' sizes are the mesh's, with axis_sizes= name them."
    )
  axes = config.data_axes
  if num_devices is not None:
    if config.tensor_axes:
      raise ValueError(
        f"num_devices= gives the shard axis's size only, but ZeroConfig."
        f"tensor_axes is {config.tensor_axes}; pass axis_sizes= with every "
        f"axis's size (or mesh=)."
      )
    if len(config.shard_axes) > 1:
      raise ValueError(
        f"num_devices= names one shard axis's size, but ZeroConfig.shard_axes "
        f"is {config.shard_axes}; pass axis_sizes= with every axis's size."
      )
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
      raise ValueError(f"num_devices must be a positive int, got {num_devices!r}.")
    replica_sizes = (
      (1,) * len(config.replicate_axes) if replica_sizes is None else tuple(replica_sizes)
    )
    if len(replica_sizes) != len(config.replicate_axes):
      raise ValueError(
        f"replica_sizes must give one positive int per replicate axis "
        f"{list(config.replicate_axes)}, got {replica_sizes!r}."
      )
    axis_sizes = dict(zip(axes, (*replica_sizes, num_devices)))
  elif mesh is not None:
    for axis in axes:
      if axis not in mesh.shape:
        field = "replicate_axes" if axis in config.replicate_axes else "shard_axes/axis_name"
        raise ValueError(
          f"ZeroConfig.{field} names {axis!r}, but the mesh has axes "
          f"{tuple(mesh.shape)}; name the mesh axis {axis!r} or change the "
          f"config."
        )
    for axis in mesh.axis_names:
      if axis not in config.mesh_axes:
        raise ValueError(
          f"Mesh axis {axis!r} is neither a shard axis (ZeroConfig.shard_axes="
          f"{config.shard_axes!r}) nor a replicate axis (ZeroConfig."
          f"replicate_axes={config.replicate_axes!r}) nor a tensor axis "
          f"(ZeroConfig.tensor_axes={config.tensor_axes!r}); add it to one of "
          f"them (replicate_axes: HSDP) or use a mesh without it."
        )
    axis_sizes = {a: int(mesh.shape[a]) for a in axes}
  else:
    if not isinstance(axis_sizes, dict) or set(axis_sizes) != set(config.mesh_axes):
      raise ValueError(
        f"axis_sizes must give the size of exactly the config's axes "
        f"{list(config.mesh_axes)}, got {axis_sizes!r}."
      )
    axis_sizes = {a: axis_sizes[a] for a in axes}
  for axis, size in axis_sizes.items():
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(f"The size of axis {axis!r} must be a positive int, got {size!r}.")
  return {a: int(n) for a, n in axis_sizes.items()}
