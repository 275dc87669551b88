"""Test setup: 8 simulated CPU devices, and XLA's barrier-removing pass disabled so that CPU
programs keep the ordering a GPU would (see DESIGN.md §2). Both must happen before the JAX
backend starts, hence at import time of this conftest."""

import os
import pathlib
import sys

_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402  (must follow the XLA_FLAGS update)

jax.config.update("jax_num_cpu_devices", 8)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # example models are test fixtures too
