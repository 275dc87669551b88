"""Models written as Flax users write them (tests/real_models.py): gradient parity with plain
single-device JAX on the full batch, the compiled program's collectives equal to the report
at two knob settings, three trainer steps against optax, and a checkpoint round trip.

Tolerances: fp32 rtol 1e-5 (atol 1e-6 for gradients and parameters). The trainer runs
clipped SGD with momentum: Adam turns the reduction-order noise of gradients that are zero
in exact arithmetic (an attention key bias) into parameter differences of its step size.
The sync-BatchNorm ResNet is compared with the same model without axis_name on the full
batch: synchronised statistics must equal full-batch statistics.
"""

import jax
import numpy as np
import optax
import pytest

import zjax
from helpers import ATOL, RTOL, LazyAnalysis, assert_trees_close, mesh_of
from real_models import CASES

KNOBS = {
  "release-every-use": zjax.ZeroConfig(
    param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0
  ),
  "keep-and-prefetch": zjax.ZeroConfig(param_persistence_threshold=64),
}
PARAM_ATOL = 1e-6


def _args(case, sharded, batch=None):
  batch = case.batch if batch is None else batch
  return (sharded, batch) if case.extra is None else (sharded, batch, case.extra)


def run_zjax(case, n, config):
  mesh = mesh_of(n)
  schedule = zjax.compile_schedule(
    case.loss_fn, case.params, case.batch, mesh=mesh, config=config, extra=case.extra
  )
  step = zjax.value_and_grad(case.loss_fn, schedule, mesh=mesh)
  args = _args(case, zjax.shard(case.params, schedule, mesh))
  out, grads = step(*args)
  return schedule, out, zjax.unshard(grads, schedule), LazyAnalysis(step.lower(*args))


def reference(case):
  """Plain jax.value_and_grad, jitted on one device (op by op, XLA compiled each op alone)."""
  if case.extra is None:
    return jax.jit(jax.value_and_grad(case.reference_loss_fn))(case.params, case.batch)
  return jax.jit(jax.value_and_grad(case.reference_loss_fn, has_aux=True))(
    case.params, case.batch, case.extra
  )


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
  return request.param, CASES[request.param]()


@pytest.fixture(scope="module")
def references(case):
  return reference(case[1])


def assert_same_outputs(case, out, ref_out):
  if case.extra is None:
    np.testing.assert_allclose(out, ref_out, rtol=RTOL)
  else:
    np.testing.assert_allclose(out[0], ref_out[0], rtol=RTOL)
    assert_trees_close(out[1], ref_out[1], rtol=RTOL, atol=ATOL)  # updated statistics


@pytest.mark.slow
@pytest.mark.parametrize("knobs", sorted(KNOBS))
def test_gradients_match_and_the_report_equals_the_compiled_program(case, references, knobs):
  name, case = case
  schedule, out, grads, compiled = run_zjax(case, 8, KNOBS[knobs])
  ref_out, ref_grads = references
  assert_same_outputs(case, out, ref_out)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL)
  report = schedule.report()
  executed = zjax.hlo.executed(compiled.as_text())
  assert report["all_gather_count"] > 0, name
  print(
    f"\n{name} {knobs}: report AG {report['all_gather_count']} / "
    f"{report['all_gather_bytes']} B, RS {report['reduce_scatter_count']} / "
    f"{report['reduce_scatter_bytes']} B; compiled AG {executed.get('all_gather_count')} / "
    f"{executed.get('all_gather_bytes')} B, RS {executed.get('reduce_scatter_count')} / "
    f"{executed.get('reduce_scatter_bytes')} B"
  )  # the table of `pytest -s`
  for kind in ("all_gather", "reduce_scatter"):
    assert (executed.get(f"{kind}_count", 0), executed.get(f"{kind}_bytes", 0)) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), (name, knobs, kind)


def test_gradients_match_on_4_devices(case, references):
  name, case = case
  _, out, grads, _ = run_zjax(case, 4, KNOBS["release-every-use"])
  ref_out, ref_grads = references
  assert_same_outputs(case, out, ref_out)
  assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL)


def reference_training(case, optimizer, steps):
  def loss_and_extra(p, extra):
    if case.extra is None:
      return jax.value_and_grad(case.reference_loss_fn)(p, case.batch), None
    (loss, new_extra), grads = jax.value_and_grad(case.reference_loss_fn, has_aux=True)(
      p, case.batch, extra
    )
    return (loss, grads), new_extra

  @jax.jit
  def step(p, s, extra):
    (loss, grads), extra = loss_and_extra(p, extra)
    updates, s = optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s, extra, loss

  p, s, extra, losses = case.params, optimizer.init(case.params), case.extra, []
  for _ in range(steps):
    p, s, extra, loss = step(p, s, extra)
    losses.append(loss)
  return p, extra, losses


@pytest.mark.slow
def test_three_trainer_steps_match_optax_and_checkpoints_round_trip(case, tmp_path):
  name, case = case
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
  mesh = mesh_of(8)
  config = KNOBS["release-every-use"]
  schedule = zjax.compile_schedule(
    case.loss_fn, case.params, case.batch, mesh=mesh, config=config, extra=case.extra
  )
  trainer = zjax.zero3(case.loss_fn, optimizer, schedule, mesh=mesh)
  state = trainer.init(case.params, extra=case.extra)
  losses = []
  for _ in range(3):
    state, metrics = trainer.step(state, case.batch)
    losses.append(metrics["loss"])
  ref_params, ref_extra, ref_losses = reference_training(case, optimizer, 3)
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
  assert_trees_close(trainer.gather_params(state), ref_params, rtol=RTOL, atol=PARAM_ATOL)
  if case.extra is not None:
    assert_trees_close(state.extra, ref_extra, rtol=RTOL, atol=ATOL)

  ckpt = zjax.CheckpointManager(tmp_path / "ckpt", trainer)
  ckpt.save(3, state)
  ckpt.wait_until_finished()
  restored = ckpt.restore()
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  half = mesh_of(4)
  trainer_4 = zjax.zero3(
    case.loss_fn,
    optimizer,
    zjax.compile_schedule(
      case.loss_fn, case.params, case.batch, mesh=half, config=config, extra=case.extra
    ),
    mesh=half,
  )
  on_4 = ckpt.restore(trainer_4)
  for a, b in zip(
    jax.tree.leaves(trainer_4.gather_params(on_4)), jax.tree.leaves(trainer.gather_params(state))
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ckpt.close()
