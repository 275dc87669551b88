"""Test setup: 8 simulated CPU devices and the session's compilation cache, both before the
JAX backend starts (hence at import time of this conftest). No XLA flags: programs run with
XLA's own CPU pipeline, and tests that judge memory or collectives use
zjax.hlo.compile_for_analysis (barriers kept for that compile, as a GPU orders the program).
"""

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

# One persistent compilation cache for the session and its subprocesses, new each session:
# many tests build the same programs in other trainers or processes, and XLA then compiles
# each once (the suite ran 18% faster). Set JAX_COMPILATION_CACHE_DIR to choose another.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zjax-tests-xla-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402  (must follow the cache settings)

jax.config.update("jax_num_cpu_devices", 8)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # example models are test fixtures too
