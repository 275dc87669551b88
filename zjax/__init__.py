"""zjax: ZeRO-3 style fully sharded data parallelism for JAX, planned at compile time.

Public API (everything else lives in `zjax._src` and may change):
  ZeroConfig        the knobs (DeepSpeed's names, units and defaults)
  compile_schedule  trace a loss function and plan its schedule for N devices
  autoconfig        choose the layout and knobs for a memory budget and a cluster
  Schedule          the schedule: data, JSON, validation, report, readable table
  trace_program     the parameter-use table of a loss function (what the planner sees)
  shard / unshard   natural-shape params <-> the schedule's sharded layout
  value_and_grad    a jitted (sharded_params, batch) -> (loss, sharded_grads) running a schedule
  zjax.hlo          collectives and memory of a compiled program
  zjax.distributed  join a multi-process run (zjax launch), feed per-process batches
  zero3             the trainer: init / step / gather_params, optax on the shards
  CheckpointManager orbax checkpoints: async sharded save, restore on any device count
  export_params     a checkpoint's natural-shape params (numpy), optionally as plain orbax
"""

from zjax import distributed, hlo
from zjax._src.autoconfig.search import AutoConfig, BudgetError, autoconfig
from zjax._src.checkpoint.checkpoint import CheckpointError, CheckpointManager, export_params
from zjax._src.config import ZeroConfig
from zjax._src.errors import ScheduleError, ScheduleMismatchError, TraceError, ZjaxError
from zjax._src.execute.execute import value_and_grad
from zjax._src.layout.layout import per_device_bytes, shard, unshard
from zjax._src.plan.entry import compile_schedule
from zjax._src.program.trace import trace_program
from zjax._src.schedule.schedule import Schedule
from zjax._src.train.train import NonFiniteError, TrainState, Zero3, sharded_init, zero3
from zjax._src.version import __version__  # noqa: F401 (re-exported)

__all__ = [
  "distributed",
  "ZeroConfig",
  "compile_schedule",
  "autoconfig",
  "AutoConfig",
  "BudgetError",
  "Schedule",
  "trace_program",
  "shard",
  "unshard",
  "value_and_grad",
  "hlo",
  "zero3",
  "sharded_init",
  "per_device_bytes",
  "Zero3",
  "TrainState",
  "NonFiniteError",
  "CheckpointManager",
  "CheckpointError",
  "export_params",
  "ZjaxError",
  "TraceError",
  "ScheduleError",
  "ScheduleMismatchError",
]
