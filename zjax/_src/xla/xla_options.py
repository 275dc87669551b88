"""How zjax compiles: the programs it runs, and the ones it only analyses.

Why two kinds (measured on jaxlib 0.10.2, docs/results.md "CPU execution"): the executor pins its
order with optimization barriers. XLA's GPU pipeline keeps them until after scheduling;
its CPU pipeline removes them early (pass `cse_barrier_expander`). Kept on CPU (the old
process-wide `--xla_disable_hlo_passes=cse_barrier_expander`), they become run-time
dependencies of a gather on the *compute* it is tied to, while XLA's CPU runtime links one
collective to the next only by issue order. A gather can then be launched from a worker
thread while the device's previous collective still waits in its rendezvous. Every
collective JAX lowers has channel id 1, and the CPU runtime keys rendezvous by it, so two
collectives in flight are one rendezvous to it: mixed buffers (NaN), a device arriving
twice (`id < num_threads`), or devices waiting in different collectives (timeouts).

On GPUs, XLA's collective combiners merge independent collectives into one launch. The
schedule's buckets are zjax's own combining decision, so zjax turns them off for its
programs (`GPU_OPTIONS`). Measured on an H200 (jaxlib 0.11.2, a mock 8-GPU topology,
docs/results.md "On an NVIDIA H200"): with them on, the unrolled bench GPT's 34
reduce-scatters became one at the end of the step, every gradient bucket alive until then,
and the counts differed from the report (the bytes were equal). The compiled GPU programs
had no optimization barrier left.

So:
- programs zjax runs are compiled with XLA's own pipeline (`jit`), on GPUs with the
  combiners off; a process-wide flag that keeps barriers is undone for them, with one
  warning;
- analysis compiles (`hlo.compile_for_analysis`) keep the barriers on CPU for that one
  compile, so memory and collectives are those of the program in the schedule's order
  (scheduled for memory, `analysis_options`), the stand-in for a GPU's program; on GPUs
  they are the programs zjax runs. They are never executed.
"""

import os
import re
import warnings

import jax

BARRIER_PASS = "cse_barrier_expander"
GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})
# A threshold of 0 bytes turns a combiner off (XLA skips the pass).
GPU_OPTIONS = {
  "xla_gpu_all_gather_combine_threshold_bytes": 0,
  "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
  "xla_gpu_all_reduce_combine_threshold_bytes": 0,
}
_PASSES_FLAG = re.compile(r"--xla_disable_hlo_passes[= ]([^\s]*)")
_warned = False


def disabled_passes(xla_flags: str | None = None) -> list[str]:
  """The HLO passes XLA_FLAGS (or `xla_flags`) disables, in order."""
  text = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  found = []
  for value in _PASSES_FLAG.findall(text):
    found += [p for p in value.split(",") if p and p not in found]
  return found


def execution_options(platform: str | None = None) -> dict:
  """Compiler options for a program zjax runs on `platform` (default: JAX's default
  backend): on GPUs the collective combiners off (`GPU_OPTIONS`); and if XLA_FLAGS keeps
  optimization barriers (the old CPU recipe), that pass back on, with a warning once."""
  platform = platform or jax.default_backend()
  options = dict(GPU_OPTIONS) if platform in GPU_PLATFORMS else {}
  passes = disabled_passes()
  if BARRIER_PASS not in passes:
    return options
  _warn_once()
  return {**options, "xla_disable_hlo_passes": ",".join(p for p in passes if p != BARRIER_PASS)}


def jit(fn, **kwargs):
  """`jax.jit(fn, **kwargs)` for a program zjax runs (see `execution_options`)."""
  options = execution_options()
  return _TopLevelOptions(fn, options, kwargs) if options else jax.jit(fn, **kwargs)


class _TopLevelOptions:
  """A jit whose calls carry compiler options at top level. Called inside another jit (as
  the trainer calls value_and_grad), where JAX refuses compiler options, it is the plain
  jit: the enclosing program is compiled with the enclosing jit's options."""

  def __init__(self, fn, options, kwargs):
    self._top = jax.jit(fn, compiler_options=options, **kwargs)
    self._nested = jax.jit(fn, **kwargs)

  def _pick(self, args, kwargs):
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
    return self._nested if traced else self._top

  def __call__(self, *args, **kwargs):
    return self._pick(args, kwargs)(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._pick(args, kwargs).lower(*args, **kwargs)

  def __getattr__(self, name):
    return getattr(self._top, name)


def analysis_options(platform: str) -> dict:
  """Compiler options of an analysis compile on `platform`. GPUs: those of the programs
  zjax runs there (`GPU_OPTIONS`). CPU: barriers kept, and XLA's
  memory-optimized CPU scheduler, which orders for the smallest peak within the order the
  barriers pin: the schedule's memory model (each buffer freed after its last use). XLA's
  default CPU scheduler orders for the CPU runtime's thread parallelism instead, starting
  independent work early (the hpZ test model: 500 KiB temp, 279 KiB memory-optimized; the
  sharded init then exceeds its bound of one bucket + the share). It is a heuristic: on
  the unrolled bench GPT its peak is the higher one (13.2 vs 8.9 MiB). Elsewhere none: GPU
  compilers keep barriers through scheduling and reject them with the pass off. These are
  options that take effect per compile (the region-analysis and concurrency-scheduler
  flags are read process-wide only)."""
  if platform in GPU_PLATFORMS:
    return dict(GPU_OPTIONS)
  if platform != "cpu":
    return {}
  return {
    "xla_disable_hlo_passes": BARRIER_PASS,
    "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
  }


def _warn_once():
  global _warned
  if not _warned:
    _warned = True
    warnings.warn(
      f"XLA_FLAGS disables {BARRIER_PASS} (--xla_disable_hlo_passes), which keeps "
      f"optimization barriers in every program of this process. XLA's CPU runtime then "
      f"can run two collectives of a device at once (NaN, rendezvous aborts under load), "
      f"so zjax compiles the programs it runs with that pass on. Remove the flag: "
      f"zjax.hlo.compile_for_analysis keeps barriers for analysis, per compile.",
      RuntimeWarning,
      stacklevel=3,
    )
