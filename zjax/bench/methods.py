"""The methods `zjax bench` compares, each a compiled training step (loss, gradients and an
optax adamw update) on the same mesh and batch:

  zjax_rolled    the zero3 trainer running the model's schedule, identical layers rolled
                 into loops (ZeroConfig.roll_layers, zjax's default)
  zjax_unrolled  the same with roll_layers=False: one segment per layer
  zjax_qwz       zjax_rolled with ZeRO++ qwZ: int8 weight gathers (block 256, fp32 scales)
  zjax_qgz       zjax_rolled with ZeRO++ qgZ: int8 gradient all-to-all instead of the
                 reduce-scatter
  zjax_qwz_qgz   both
  zjax_scanned   the model with its layers stacked by nn.scan (GPT; per-iteration gathers)
  gspmd_fsdp     JAX's default FSDP: every parameter sharded along its largest dimension
                 divisible by N, the batch sharded, jax.jit(value_and_grad + optax); XLA
                 inserts the collectives
  data_parallel  parameters and optimizer state replicated, the batch sharded
On a 2 x N/2 mesh ("replica", "fsdp"; the batch split over both):
  zjax_hsdp      zjax, parameters sharded over "fsdp", replicated over "replica" (HSDP)
  zjax_hpz       zjax hpZ: storage over both axes, backward re-gathers within "fsdp"
  gspmd_hsdp     GSPMD with parameters sharded over "fsdp" only (the fair HSDP baseline)
On an N/2 x 2 mesh ("fsdp", "tensor"; the batch split over "fsdp"), GPT with logical axis
names (vocab, heads and MLP width over "tensor"):
  zjax_tp        zjax ZeRO-3 x tensor parallelism (ZeroConfig.tensor_axes)
  gspmd_2d       GSPMD with the weights sharded over both axes from the same names
                 (MaxText's layout: embed -> fsdp, vocab / heads / mlp -> tensor)
"""

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax
from zjax._src.layout import layout
from zjax._src.xla.xla_warnings import Held, partitioner_warnings_held

# XLA's partitioner warnings while compiling the GSPMD baselines: counted, not shown
PARTITIONER_WARNINGS = Held()


@dataclasses.dataclass
class Method:
  name: str
  analysis: Any  # the training step compiled as a GPU orders it (zjax: on CPU with the
  #                barriers kept, hlo.compile_for_analysis; the baselines have none)
  run: Callable[[], Any]  # one step (state carried inside); returns the loss
  state: Callable[[], Any]  # the current (params, optimizer state)
  setup_seconds: float  # before the step compiles: zjax plans and inits (optimizer check
  #                       included), the others place parameters and init the optimizer
  compile_seconds: float  # lowering + XLA compilation of the step as analysed, nothing else
  schedule: Any = None  # zjax only
  mesh: Any = None  # the mesh the step runs on


def zjax_method(name, loss_fn, params, batch, mesh, config, optimizer, **plan) -> Method:
  """`plan`: more compile_schedule arguments (tensor_specs=, logical_axis_rules=)."""
  start = time.perf_counter()
  schedule = zjax.compile_schedule(loss_fn, params, batch, mesh=mesh, config=config, **plan)
  trainer = zjax.zero3(loss_fn, optimizer, schedule, mesh=mesh)
  box = [jax.block_until_ready(trainer.init(params))]
  setup = time.perf_counter() - start
  compile_start = time.perf_counter()
  lowered = trainer.lower(box[0], batch)
  analysis = zjax.hlo.compile_for_analysis(lowered)
  seconds = time.perf_counter() - compile_start
  executable = []  # XLA's own compile of the same lowering, made when first run

  def run():
    if not executable:
      executable.append(lowered.compile())
    box[0], metrics = executable[0](box[0], batch)
    return metrics["loss"]

  return Method(
    name, analysis, run, lambda: (box[0].params, box[0].opt_state), setup, seconds, schedule, mesh
  )


def gspmd_method(
  name, loss_fn, params, batch, mesh, optimizer, shard_params, param_specs=None, batch_axes=None
) -> Method:
  """GSPMD: parameters sharded over the mesh's last axis (or replicated), or by
  `param_specs` (a pytree of PartitionSpecs like params); the batch over every axis, or
  over `batch_axes`."""
  start = time.perf_counter()
  axis, n = mesh.axis_names[-1], mesh.shape[mesh.axis_names[-1]]
  if batch_axes is None:
    batch_axes = mesh.axis_names if len(mesh.axis_names) > 1 else axis
  spec = (lambda x: layout.largest_dim_spec(x.shape, n, axis)) if shard_params else (lambda x: P())
  specs = jax.tree.map(spec, params) if param_specs is None else param_specs
  placed = jax.tree.map(  # copies: the step donates them, the caller's params must survive
    lambda x, s: jax.device_put(jnp.array(x, copy=True), NamedSharding(mesh, s)), params, specs
  )
  placed_batch = jax.tree.map(
    lambda x: jax.device_put(x, NamedSharding(mesh, P(batch_axes) if x.ndim else P())), batch
  )
  opt_state = optimizer.init(placed)  # eager: each moment keeps its parameter's sharding
  mesh_devices = set(mesh.devices.flat)
  opt_state = jax.tree.map(  # scalars (step counts) made on one device: replicate them
    lambda x: (
      x if x.sharding.device_set == mesh_devices else jax.device_put(x, NamedSharding(mesh, P()))
    ),
    opt_state,
  )
  shardings = (
    jax.tree.map(lambda x: x.sharding, placed),
    jax.tree.map(lambda x: x.sharding, opt_state),
    NamedSharding(mesh, P()),
  )

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(train_step, out_shardings=shardings, donate_argnums=(0, 1))
  setup = time.perf_counter() - start
  with partitioner_warnings_held(PARTITIONER_WARNINGS):
    compiled, seconds = _compile(lambda: step.lower(placed, opt_state, placed_batch).compile())
  box = [placed, opt_state]

  def run():
    box[0], box[1], loss = compiled(box[0], box[1], placed_batch)
    return loss

  return Method(name, compiled, run, lambda: (box[0], box[1]), setup, seconds, mesh=mesh)


def _compile(lower_and_compile):
  """(compiled step, seconds of lowering + compilation)."""
  start = time.perf_counter()
  compiled = lower_and_compile()
  return compiled, time.perf_counter() - start
