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
# LLVM's optimizations off (jax_disable_most_optimizations), here and in the subprocesses:
# XLA's HLO passes still run in full, so the optimized program (its collectives, barriers,
# fusions and memory assignment) is the one users get (tests/test_compile_mode.py checks
# that); only its machine code is less optimized, which the suite's small programs do not
# notice, and XLA compiles in half the time. JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs it with
# every optimization.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402  (must follow the cache settings)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # example models are test fixtures too


@pytest.fixture
def fully_optimized():
  """Compiles with every optimization inside the test, as users' programs are: for tests of
  rounding (against fp64, or two XLA programs to an ulp), which LLVM's code generation moves
  (helpers.fully_optimized_compiles)."""
  from helpers import fully_optimized_compiles

  with fully_optimized_compiles():
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Tiers (tests/README.md): slow tests first, so that the xdist workers finish together
  instead of one waiting on a long test drawn last; `whole_machine` tests in one xdist group,
  so that they run one after another (`--dist loadgroup`), never two at once."""
  for item in items:
    if item.get_closest_marker("whole_machine"):
      item.add_marker(pytest.mark.xdist_group("whole_machine"))
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


# --- Suite statistics (opt-in): ZJAX_TEST_STATS=FILE.jsonl writes one line per test with its
# seconds (setup + call + teardown), XLA compiles (each `backend_compile` of this process),
# how many of those the persistent cache answered (a program compiled before, in this session
# or one of its processes), and subprocesses started. `python tests/suite_stats.py FILE...`
# sums them per file. Subprocesses' own compiles are not counted here.
if os.environ.get("ZJAX_TEST_STATS"):
  import json
  import subprocess
  import time

  from jax import monitoring

  _counts = {"compiles": 0, "compile_s": 0.0, "cache_hits": 0, "subprocesses": 0}

  def _on_duration(event, seconds, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      _counts["compiles"] += 1
      _counts["compile_s"] += seconds

  def _on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
      _counts["cache_hits"] += 1

  monitoring.register_event_duration_secs_listener(_on_duration)
  monitoring.register_event_listener(_on_event)
  _popen_init = subprocess.Popen.__init__

  def _counting_popen_init(self, *args, **kwargs):
    _counts["subprocesses"] += 1
    _popen_init(self, *args, **kwargs)

  subprocess.Popen.__init__ = _counting_popen_init

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    before, start = dict(_counts), time.perf_counter()
    yield
    row = {
      "test": item.nodeid,
      "file": item.nodeid.split("::")[0],
      "seconds": round(time.perf_counter() - start, 3),
      "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    row.update({k: round(v - before[k], 3) for k, v in _counts.items()})
    with open(os.environ["ZJAX_TEST_STATS"], "a") as f:
      f.write(json.dumps(row) + "\n")
