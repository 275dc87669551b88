"""What the CPU executes vs what the analysis judges (zjax/_src/xla/xla_options.py,
docs/results.md "CPU execution"): programs zjax runs are compiled with XLA's own pipeline
(no optimization barrier survives on CPU, even when XLA_FLAGS asks to keep them: undone,
with one warning); `zjax.hlo.compile_for_analysis` keeps the barriers for its compile
only and cannot be run. The CPU-executed step of the bench GPT is measured against the
analysed one: the same reduce-scatters, at most the analysed all-gathers (CSE may merge a
backward re-gather into the forward gather), and bitwise the same results every time it
runs.
"""

import dataclasses
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import zjax
from zjax._src.xla import xla_options
from zjax.bench.run import gpt_model

BARRIER_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"


def _barrier_program(x):
  y, _ = lax.optimization_barrier((x * 2, x))
  return y + 1


def test_disabled_passes_parses_every_form():
  assert xla_options.disabled_passes("") == []
  assert xla_options.disabled_passes(
    "--xla_foo=1 --xla_disable_hlo_passes=a,cse_barrier_expander --xla_disable_hlo_passes b,a"
  ) == ["a", "cse_barrier_expander", "b"]


def test_execution_options_undo_only_the_barrier_pass_and_warn_once(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=fusion,cse_barrier_expander")
  monkeypatch.setattr(xla_options, "_warned", False)
  with pytest.warns(RuntimeWarning, match="cse_barrier_expander.*Remove the flag"):
    assert xla_options.execution_options() == {"xla_disable_hlo_passes": "fusion"}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert xla_options.execution_options() == {"xla_disable_hlo_passes": "fusion"}
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  assert xla_options.execution_options() == {}


def test_analysis_compile_keeps_barriers_and_cannot_run():
  lowered = jax.jit(_barrier_program).lower(jnp.ones(4))
  assert "opt-barrier" not in lowered.compile().as_text()  # what the CPU runs
  analysis = zjax.hlo.compile_for_analysis(lowered)
  assert analysis.barriers_kept and analysis.platform == "cpu"
  assert "opt-barrier" in analysis.as_text()
  assert analysis.memory_analysis().temp_size_in_bytes >= 0
  with pytest.raises(TypeError, match="compiled for analysis"):
    analysis(jnp.ones(4))


@pytest.mark.slow
def test_a_script_that_still_sets_the_old_flag_runs_barrier_free_with_one_warning():
  """A user's own process-wide flag reaches neither value_and_grad nor the trainer."""
  code = (
    "import warnings, jax, jax.numpy as jnp, optax, zjax\n"
    "jax.config.update('jax_num_cpu_devices', 8)\n"
    "from helpers import mlp, mesh_of\n"
    "loss, params, batch = mlp()\n"
    "mesh = mesh_of(8)\n"
    "s = zjax.compile_schedule(loss, params, batch, mesh=mesh)\n"
    "with warnings.catch_warnings(record=True) as seen:\n"
    "  warnings.simplefilter('always')\n"
    "  step = zjax.value_and_grad(loss, s, mesh=mesh)\n"
    "  t = zjax.zero3(loss, optax.sgd(0.1), s, mesh=mesh)\n"
    "sharded = zjax.shard(params, s, mesh)\n"
    "assert 'opt-barrier' not in step.lower(sharded, batch).compile().as_text()\n"
    "state = t.init(params)\n"
    "assert 'opt-barrier' not in t.lower(state, batch).compile().as_text()\n"
    "assert 'opt-barrier' in zjax.hlo.compile_for_analysis(step.lower(sharded, batch))"
    ".as_text()\n"
    "t.step(state, batch)\n"
    "print(sum('cse_barrier_expander' in str(w.message) for w in seen))\n"
  )
  env = {
    **os.environ,
    "XLA_FLAGS": BARRIER_FLAG,
    "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
  }
  done = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == "1"  # one warning, naming the flag


@pytest.fixture(scope="module")
def bench_gpt_steps():
  """The bench's GPT (8 layers, its knobs: release after every use) rolled and unrolled:
  the report, the analysed program and the program the CPU runs."""
  model = gpt_model(8, 128, 16)
  mesh = jax.make_mesh((8,), ("fsdp",))
  out = {}
  for rolled in (True, False):
    config = dataclasses.replace(model.config, roll_layers=rolled)
    schedule = zjax.compile_schedule(
      model.loss_fn, model.params, model.batch, mesh=mesh, config=config
    )
    step = zjax.value_and_grad(model.loss_fn, schedule, mesh=mesh)
    sharded = zjax.shard(model.params, schedule, mesh)
    lowered = step.lower(sharded, model.batch)
    out[rolled] = (
      schedule.report(),
      zjax.hlo.compile_for_analysis(lowered),
      lowered.compile(),
      step,
      sharded,
      model.batch,
    )
  return out


@pytest.mark.slow
@pytest.mark.parametrize("rolled", [True, False], ids=["rolled", "unrolled"])
def test_the_cpu_executed_step_differs_from_the_analysed_one_only_by_merged_gathers(
  bench_gpt_steps, rolled
):
  report, analysis, executed, *_ = bench_gpt_steps[rolled]
  judged, ran = zjax.hlo.executed(analysis.as_text()), zjax.hlo.executed(executed.as_text())
  assert judged["all_gather_count"] == report["all_gather_count"]
  assert judged["reduce_scatter_count"] == report["reduce_scatter_count"]
  assert ran["reduce_scatter_count"] == report["reduce_scatter_count"]
  assert ran["all_gather_count"] <= judged["all_gather_count"]
  assert "opt-barrier" not in executed.as_text() and "opt-barrier" in analysis.as_text()
  print(
    f"\nbench GPT {'rolled' if rolled else 'unrolled'}: all-gathers analysed "
    f"{judged['all_gather_count']} / CPU-executed {ran['all_gather_count']}; temp "
    f"analysed {analysis.memory_analysis().temp_size_in_bytes / 2**10:.0f} KiB / "
    f"CPU-executed {executed.memory_analysis().temp_size_in_bytes / 2**10:.0f} KiB"
  )


def test_the_executed_step_is_deterministic(bench_gpt_steps):
  """Same program, same inputs: bitwise the same loss and gradients, call after call."""
  *_, step, sharded, batch = bench_gpt_steps[True]
  first = jax.device_get(step(sharded, batch))
  for _ in range(3):
    again = jax.device_get(step(sharded, batch))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
      np.testing.assert_array_equal(a, b)
