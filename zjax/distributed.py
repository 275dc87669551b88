"""Multi-process runs on JAX's own runtime (`jax.distributed`): join a run, feed batches.

A script joins a run with one call at its top, before any JAX computation:

    zjax.distributed.initialize()   # reads what `zjax launch` set; no-op in a plain run

`zjax launch --nproc P --devices-per-process D -- python script.py` starts P such
processes on this machine (simulated CPU devices, gloo collectives). On a cluster call
`jax.distributed.initialize()` yourself instead (it reads SLURM / Open MPI / cloud TPU
environments, or takes coordinator_address, num_processes and process_id); everything in
zjax then works on the global mesh unchanged.

Each process feeds its own rows of the global batch with `global_batch(local, mesh)`.
"""

import os
import sys

import numpy as np

__all__ = ["initialize", "global_batch", "check_same_schedule"]

ENV_COORDINATOR = "ZJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ZJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZJAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "ZJAX_LOCAL_DEVICES"
ENV_TIMEOUT = "ZJAX_TIMEOUT"


def initialize() -> bool:
  """Join the multi-process run `zjax launch` started (True), or do nothing when this
  process was not started by it (False)."""
  if ENV_COORDINATOR not in os.environ:
    return False
  import jax

  from zjax.cli.devices import setup

  local = int(os.environ.get(ENV_LOCAL_DEVICES, "1"))
  setup(local)  # simulated CPU devices (the CPU backend only)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  timeout = int(float(os.environ.get(ENV_TIMEOUT, "60")))
  jax.distributed.initialize(
    coordinator_address=os.environ[ENV_COORDINATOR],
    num_processes=int(os.environ[ENV_NUM_PROCESSES]),
    process_id=int(os.environ[ENV_PROCESS_ID]),
    initialization_timeout=timeout,
    heartbeat_timeout_seconds=timeout,
  )
  _exit_at_once_on_error()
  return True


def _exit_at_once_on_error():
  """An uncaught exception ends this process right after its traceback. Python's normal
  exit runs jax.distributed's shutdown, which waits (300 s) for every other process to shut
  down too, while they may be blocked in a collective that waits for this one: nothing
  exited, so `zjax launch` (which stops the others `--timeout` seconds after a process
  exits) could not act, and the run hung."""
  previous = sys.excepthook

  def hook(kind, value, traceback):
    previous(kind, value, traceback)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)

  sys.excepthook = hook


def global_batch(local_batch, mesh, axis="fsdp"):
  """This process's rows of the global batch -> a global `jax.Array` sharded over `axis`
  (an axis name, or a tuple of them: the data axes of an HSDP mesh, `config.data_axes`;
  0-d leaves are replicated and must be equal in every process). In a one-process run it
  is the batch itself, placed on the mesh."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  def place(x):
    x = np.asarray(x)
    spec = P(axis) if x.ndim else P()
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x)

  return jax.tree.map(place, local_batch)


def _mocked_processes() -> bool:
  """A mock GPU topology (`jax_mock_gpu_topology`, `mock_num_gpu_processes`): one process
  stands for all, its collectives move no data, so processes cannot be compared."""
  from jax._src import xla_bridge

  topology = getattr(xla_bridge, "MOCK_GPU_TOPOLOGY", None)
  processes = getattr(xla_bridge, "MOCK_NUM_GPU_PROCESSES", None)
  return bool(topology is not None and topology.value) or bool(
    processes is not None and processes.value
  )


def check_same_schedule(schedule) -> None:
  """Every process must run the same schedule; otherwise fail here, naming the processes
  that differ, instead of hanging in a collective."""
  import jax

  if jax.process_count() == 1 or _mocked_processes():
    return
  from jax.experimental import multihost_utils

  from zjax._src.errors import ScheduleMismatchError

  mine = np.frombuffer(bytes.fromhex(schedule.fingerprint), np.uint8)
  summary = np.array([len(schedule.params), schedule.num_ops, schedule.num_devices])
  fingerprints = np.asarray(multihost_utils.process_allgather(mine))
  summaries = np.asarray(multihost_utils.process_allgather(summary))
  reference = fingerprints[0]
  differing = [p for p in range(len(fingerprints)) if (fingerprints[p] != reference).any()]
  if differing:
    described = "; ".join(
      f"process {p}: fingerprint {bytes(fingerprints[p]).hex()[:12]}, "
      f"{summaries[p][0]} params, {summaries[p][1]} ops, {summaries[p][2]} devices"
      for p in [0] + differing
    )
    raise ScheduleMismatchError(
      f"Processes {differing} traced a different schedule than process 0 ({described}). "
      f"Every process must build the same model, loss and config."
    )
