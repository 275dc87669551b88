"""Test setup: 8 simulated CPU devices, and XLA's barrier-removing pass disabled so that CPU
programs keep the ordering a GPU would (see DESIGN.md §2). Both must happen before the JAX
backend starts, hence at import time of this conftest."""

import os
import pathlib
import sys

# zjax.cli.devices.CPU_ORDERING_FLAGS (not imported: importing zjax first is not needed here),
# and XLA's concurrency-optimized CPU scheduler off: with it, the rolled GQA model of
# tests/real_models.py aborted in a collective rendezvous on 4 devices (devices.py says
# why the commands keep it on). Subprocesses inherit these flags.
_FLAGS = ("--xla_disable_hlo_passes=cse_barrier_expander",
          "--xla_cpu_copy_insertion_use_region_analysis=true",
          "--xla_cpu_enable_concurrency_optimized_scheduler=false")
for _flag in _FLAGS:
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402  (must follow the XLA_FLAGS update)

jax.config.update("jax_num_cpu_devices", 8)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # example models are test fixtures too
