"""Test setup: 8 simulated CPU devices, and XLA's barrier-removing pass disabled so that CPU
programs keep the ordering a GPU would (see DESIGN.md §2). Both must happen before the JAX
backend starts, hence at import time of this conftest; so does the session's compilation
cache."""

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

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

# One persistent compilation cache for the session and its subprocesses, new each session:
# many tests build the same programs in other trainers or processes, and XLA then compiles
# each once (the suite ran 18% faster). Set JAX_COMPILATION_CACHE_DIR to choose another.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zjax-tests-xla-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402  (must follow the XLA_FLAGS update)

jax.config.update("jax_num_cpu_devices", 8)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # example models are test fixtures too
