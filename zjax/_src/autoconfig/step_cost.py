"""What one training step of a planned schedule costs on one device, predicted without
compiling: its memory, broken down, and its time on a cluster.

Memory (per device): the trainer's whole step (`zjax.zero3` with its optimizer and
accumulation) traced on an abstract mesh, its program walked by the activation model
(plan/activation_memory.py): the state and batch the step is given, plus the peak of what
it allocates (activations, gathered parameters, gradients, the optimizer's temporaries).
The breakdown's parts other than activations are exact (the schedule's report, the
optimizer state's shapes); activations are the rest of the peak.

With optimizer offload the device holds parameter copies in the compute dtype (none with
parameter offload) instead of the masters and the optimizer state, plus, while the update
streams, two sub-groups of masters and state (counted on top: an upper bound).

Time:

    compute  = FLOPs of the step's device program (K micro-batches) / (peak * efficiency)
    exposed  = communication the schedule cannot hide: all of it without prefetch; with
               prefetch, what exceeds compute (collectives overlap compute, not each other)
    host     = offload's transfers over the host link (not overlapped)
    step     = compute + exposed + host

FLOPs are the matmuls' and convolutions' (2 per multiply-add) in the program the executor
runs, so a rolled layer's recomputed forward counts.
"""

import dataclasses
import math

import jax
import numpy as np

from zjax._src.execute import offload_stream
from zjax._src.plan import activation_memory
from zjax._src.program.trace import sub_jaxprs
from zjax._src.schedule import ir
from zjax._src.train.train import plan_sub_groups, zero3


@dataclasses.dataclass(frozen=True)
class Memory:
  """Predicted bytes on one device at the step's peak, by what holds them."""

  parameters: int  # stored shards (offload: device copies), persistent parameters whole
  optimizer: int  # optimizer state on the device (offload: the update stream's window)
  gradients: int  # gradient shards (and the accumulator)
  gathered: int  # gathered parameters at their peak (hpZ: with the secondary shards)
  activations: int  # the rest of the gradient step's temp: saved and working activations
  batch: int  # the device's share of the batch
  total: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Time:
  """Predicted seconds of one step: compute, communication (all of it and the part not
  hidden behind compute) per mesh axis group, host transfers, and the step."""

  compute: float
  communication: float
  exposed_communication: float
  host_transfer: float
  step: float
  by_axis: dict
  communication_bytes: int
  host_transfer_bytes: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def device_flops(jaxpr) -> float:
  """FLOPs of the matmuls and convolutions of `jaxpr` (2 per multiply-add), a scan's body
  counted once per iteration, a cond's costliest branch."""
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      shape = eqn.invars[0].aval.shape
      total += 2.0 * _size(eqn.outvars[0].aval.shape) * _size([shape[d] for d in lhs_contract])
    elif name == "conv_general_dilated":
      kernel = eqn.invars[1].aval.shape
      out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
      total += 2.0 * _size(eqn.outvars[0].aval.shape) * _size(kernel) / out_features
    subs = [getattr(sub, "jaxpr", sub) for _, sub, _ in sub_jaxprs(eqn)]
    if not subs:
      continue
    inner = [device_flops(sub) for sub in subs]
    if name == "cond":
      total += max(inner)
    elif name == "scan":
      total += eqn.params["length"] * sum(inner)
    else:  # a while loop's trip count is unknown: counted once (docs/autoconfig.md)
      total += sum(inner)
  return total


def _size(shape) -> int:
  return int(np.prod(shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class TrainerProgram:
  """What one trace of the trainer's step gives: its footprint per device and FLOPs."""

  arguments: int  # the state and the batch, per device
  peak: int  # the most it allocates beyond them at once
  flops: float  # per device, every micro-batch
  optimizer_bytes: int  # the optimizer state per device
  gradient_bytes: int  # the gradient shards one micro-batch's step returns


def trainer_program(schedule, loss_fn, mesh, *, optimizer, accumulation, batch, extra):
  """Trace `zjax.zero3(loss_fn, optimizer, schedule, mesh=mesh)`'s step on `mesh` (an
  AbstractMesh: nothing is compiled or allocated) and walk its program."""
  trainer = zero3(loss_fn, optimizer, schedule, mesh=mesh, accumulation_steps=accumulation)
  state = trainer.abstract_state(extra)
  body = jax.make_jaxpr(trainer.step)(state, batch).jaxpr
  body = activation_memory.inlined(body)  # the jitted step's program, its calls inlined
  grads = activation_memory.device_program(body).outvars[1 + len(jax.tree.leaves(extra)) :]
  return TrainerProgram(
    arguments=sum(activation_memory.device_bytes(v.aval) for v in body.invars),
    peak=activation_memory.peak_bytes(body, frozenset(body.invars)),
    flops=device_flops(body),
    optimizer_bytes=sum(
      activation_memory.device_bytes(x) for x in jax.tree.leaves(state.opt_state)
    ),
    gradient_bytes=sum(ir.aval_bytes(v.aval) for v in grads),
  )


def offload_plan(schedule, offload: str):
  """`offload_stream.predicted` for an offload mode ("optimizer", "optimizer+params"); None
  for "none"."""
  if offload == "none":
    return None
  return offload_stream.predicted(
    schedule, plan_sub_groups(schedule), params_on_host=offload == "optimizer+params"
  )


def memory(report, program: TrainerProgram, *, accumulation, plan, batch_bytes) -> Memory:
  """The trainer's step peak per device, by what holds it (module docstring). `report`:
  the schedule's; `plan`: its `offload_plan` (None: on the device)."""
  params = report["state_bytes_per_device"]
  optimizer = program.optimizer_bytes
  total = program.arguments + program.peak
  if plan is not None:
    total += plan["device_bytes"] + plan["stream_device_bytes"] - params - optimizer
    params, optimizer = plan["device_bytes"], plan["stream_device_bytes"]
  grads = program.gradient_bytes * (2 if accumulation > 1 else 1)
  grads += report["peak_live_grad_bytes"]
  gathered = report["peak_live_param_bytes"] + report["secondary_bytes"]
  known = params + optimizer + grads + gathered + batch_bytes
  return Memory(
    parameters=params,
    optimizer=optimizer,
    gradients=grads,
    gathered=gathered,
    activations=max(total - known, 0),
    batch=batch_bytes,
    total=total,
  )


def step_time(
  schedule, flops, comm, cluster, *, accumulation, plan, efficiency, compute_itemsize
) -> Time:
  """Predicted seconds of one trainer step (module docstring). `comm`: one micro-batch's
  `comm_model.predict`; `plan`: the `offload_plan` (None: on the device)."""
  k = accumulation
  compute = flops / (cluster.peak_flops(compute_itemsize) * efficiency)  # flops: all K
  communication = k * comm["seconds"]
  prefetch = schedule.config.prefetch_bucket_size > 0
  exposed = max(communication - compute, 0.0) if prefetch else communication
  host_bytes = 0
  if plan is not None:
    host_bytes = 2 * plan["whole_state_bytes"] + k * plan["param_transfer_bytes"]
  host = host_bytes / cluster.host_bandwidth
  by_axis = {
    axis: {"bytes": row["bytes"] * k, "seconds": row["seconds"] * k, "count": row["count"] * k}
    for axis, row in comm["by_axis"].items()
  }
  return Time(
    compute=compute,
    communication=communication,
    exposed_communication=exposed,
    host_transfer=host,
    step=compute + exposed + host,
    by_axis=by_axis,
    communication_bytes=sum(row["bytes"] for row in by_axis.values()),
    host_transfer_bytes=host_bytes,
  )


def batch_share_bytes(batch, data_parallel: int) -> int:
  """Bytes of one device's share of the global batch (0-d leaves replicated)."""
  total = 0
  for x in jax.tree.leaves(batch):
    nbytes = ir.aval_bytes(x)
    total += nbytes if np.ndim(x) == 0 else math.ceil(nbytes / data_parallel)
  return total
