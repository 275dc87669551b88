"""Rolled layers keep every knob: under a max_live_parameters below one whole layer (or
max_reuse_distance / prefetch_bucket_size that release or fetch sub-module by sub-module)
a rolled loop gathers its layer part by part (loop_parts.py), as the unrolled planner
gathers segment by segment.

Each case: rolled == unrolled == plain single-device JAX gradients (fp32 rtol 1e-5), the
compiled collectives equal the report, rolled and unrolled alike, and the peak of live
gathered bytes is no higher rolled than unrolled."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import real_models
import zjax
from helpers import assert_parity, assert_trees_close, reference
from test_rolling import gpt, rolled_lengths
from zjax._src.errors import ScheduleError
from zjax._src.schedule import ir
from zjax._src.schedule.validate import bucket_elements
from zjax._src.xla import hlo

MODELS = {
  "gpt": lambda: real_models.Case(*gpt(2)),
  "llama": real_models.llama,
  "bert": real_models.bert,
}


def largest_bucket(case) -> int:
  """The elements of the largest bucket: below it nothing plans, rolled or not."""
  s = zjax.compile_schedule(
    case.loss_fn,
    case.params,
    case.batch,
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  return max(bucket_elements(s))


def assert_exact(schedule, compiled):
  report, executed = schedule.report(), hlo.summarize(compiled)
  for kind in ("all_gather", "reduce_scatter"):
    assert (executed[f"{kind}_count"], executed[f"{kind}_bytes"]) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind


def rolled_and_unrolled(case, config, n=8):
  out = {}
  for roll in (True, False):
    c = dataclasses.replace(config, roll_layers=roll)
    schedule, compiled = assert_parity(case.loss_fn, case.params, case.batch, n=n, config=c)
    assert_exact(schedule, compiled)
    out[roll] = schedule
  assert out[True].report()["peak_live_param_bytes"] <= out[False].report()["peak_live_param_bytes"]
  return out


def parted_loops(schedule):
  return [st for st in schedule.forward if st.op == ir.LOOP_OP and st.parts]


@pytest.mark.slow
@pytest.mark.parametrize("leaves", [1, 2])
def test_gpt_at_one_and_two_largest_leaves(leaves):
  case = MODELS["gpt"]()
  cap = leaves * largest_bucket(case)
  out = rolled_and_unrolled(
    case, zjax.ZeroConfig(param_persistence_threshold=0, max_live_parameters=cap)
  )
  assert rolled_lengths(out[True]) == [2]
  if leaves == 1:  # the layer (12,576 elements) does not fit at once: gathered by parts
    assert parted_loops(out[True])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_point_two_models_at_one_largest_leaf(name):
  case = MODELS[name]()
  config = zjax.ZeroConfig(param_persistence_threshold=0, max_live_parameters=largest_bucket(case))
  out = rolled_and_unrolled(case, config, n=4)
  assert rolled_lengths(out[True]) == [3], out[True].rolling
  assert parted_loops(out[True])


@pytest.mark.slow
def test_release_after_every_use_without_prefetch_gathers_by_parts():
  """ZeRO-3's leanest regime: every bucket gathered at its use and released after it. A
  whole-layer loop would hold a layer (and prefetch the next); parts hold one sub-module."""
  case = MODELS["gpt"]()
  config = zjax.ZeroConfig(
    param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0
  )
  out = rolled_and_unrolled(case, config)
  (loop,) = parted_loops(out[True])
  assert len(loop.parts) > 1
  backward = next(st for st in out[True].backward if st.op == ir.LOOP_OP)
  assert [st.part for st in backward.body if st.op == ir.RECOMPUTE_OP] == list(
    range(len(loop.parts))
  )


@pytest.mark.slow
@pytest.mark.parametrize("n, leaves", [(8, 1), (4, 2)])
def test_hpz_rolls_part_by_part(n, leaves):
  """hpZ (secondary_partition) where one layer does not fit max_live_parameters: the layer
  rolls and is gathered part by part (it was planned unrolled), each part's first forward
  gather keeping the layer's secondary shard for the backward re-gathers, which move over
  the shard axis only. Rolled and unrolled: gradients == plain JAX (fp32 rtol 1e-5), the
  compiled collectives == the report in count and bytes per mesh axis; rolled, the peak of
  live gathered bytes is no higher than unrolled."""
  case = MODELS["gpt"]()
  mesh = jax.make_mesh((2, n // 2), ("data", "fsdp"), devices=jax.devices()[:n])
  config = zjax.ZeroConfig(
    param_persistence_threshold=0,
    max_reuse_distance=0,
    max_live_parameters=leaves * largest_bucket(case),
    replicate_axes=("data",),
    secondary_partition=True,
  )
  ref_loss, ref_grads = reference(case.loss_fn, case.params, case.batch)
  schedules = {}
  for roll in (True, False):
    schedule = zjax.compile_schedule(
      case.loss_fn,
      case.params,
      case.batch,
      mesh=mesh,
      config=dataclasses.replace(config, roll_layers=roll),
    )
    assert_hpz_step_exact(case, schedule, mesh, (ref_loss, ref_grads))
    schedules[roll] = schedule
  rolled = schedules[True]
  assert rolled_lengths(rolled) == [2]
  (loop,) = parted_loops(rolled)
  (backward,) = [st for st in rolled.backward if st.op == ir.LOOP_OP]
  kept = [st.bucket for st in loop.body if st.op == "keep_secondary"]
  assert kept and sorted(kept) == sorted(
    st.bucket for st in backward.body if st.op == "drop_secondary"
  )
  peaks = {roll: s.report()["peak_live_param_bytes"] for roll, s in schedules.items()}
  assert peaks[True] <= peaks[False]
  assert 0 < rolled.report()["secondary_bytes"] == schedules[False].report()["secondary_bytes"]
  assert zjax.Schedule.from_json(rolled.to_json()) == rolled
  assert "keep secondary" in str(rolled)  # zjax inspect shows it
  data = json.loads(rolled.to_json())
  body = next(st for st in data["forward"] if st["op"] == ir.LOOP_OP)["body"]
  body.remove(next(st for st in body if st["op"] == "keep_secondary"))
  with pytest.raises(ScheduleError, match="none is kept"):
    zjax.Schedule.from_json(json.dumps(data))


def assert_hpz_step_exact(case, schedule, mesh, ref):
  """Under hpZ on a (data, fsdp) mesh: gradients == plain JAX (`ref`: loss, grads; fp32
  rtol 1e-5), and the compiled collectives == the report in count and bytes per mesh axis
  (backward gathers over fsdp only)."""
  step = zjax.value_and_grad(case.loss_fn, schedule, mesh=mesh)
  sharded = zjax.shard(case.params, schedule, mesh)
  loss, grads = step(sharded, case.batch)
  np.testing.assert_allclose(loss, ref[0], rtol=1e-5)
  assert_trees_close(zjax.unshard(grads, schedule), ref[1])
  compiled = hlo.compile_for_analysis(step.lower(sharded, case.batch))
  assert_exact(schedule, compiled)
  report, by_axis = schedule.report(), hlo.executed_by_axis(compiled.as_text(), dict(mesh.shape))
  assert by_axis["all_gather"] == report["all_gather_bytes_by_axis"]
  assert by_axis["reduce_scatter"] == report["reduce_scatter_bytes_by_axis"]
  assert set(report["all_gather_bytes_by_axis"]) == {"data+fsdp", "fsdp"}


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_a_body_cut_into_parts_may_gather_ahead(n):
  """One body form: a gather issued an iteration ahead (what the planner writes for a
  whole layer) runs in a body cut into parts too, as a hand edit: the first part's bucket
  of the next layer arrives while this layer computes, in both directions. Gradients ==
  plain JAX (fp32 rtol 1e-5), the compiled collectives == the report (still one gather per
  layer), and the report's peak counts the next layer's bucket."""
  case = MODELS["gpt"]()
  config = zjax.ZeroConfig(
    param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0
  )
  mesh = jax.make_mesh((n,), ("fsdp",), devices=jax.devices()[:n])
  planned = zjax.compile_schedule(case.loss_fn, case.params, case.batch, mesh=mesh, config=config)
  data = json.loads(planned.to_json())
  for phase in ("forward", "backward"):
    loop = next(st for st in data[phase] if st["op"] == ir.LOOP_OP)
    assert len(loop["parts"]) > 1 and loop["body"][0]["op"] == "gather"
    loop["body"][0].update(prefetch=True, ahead=True)
  edited = zjax.Schedule.from_json(json.dumps(data))
  for phase in ("forward", "backward"):  # the loop step's peak: + the next layer's bucket
    at = next(i for i, st in enumerate(getattr(edited, phase)) if st.op == ir.LOOP_OP)
    ahead = getattr(edited, phase)[at].body[0].bucket
    live = [getattr(s._simulation, f"{phase}_live")[at] for s in (planned, edited)]
    assert live[1] - live[0] == planned._simulation.bucket_bytes[ahead], phase
  step = zjax.value_and_grad(case.loss_fn, edited, mesh=mesh)
  sharded = zjax.shard(case.params, edited, mesh)
  loss, grads = step(sharded, case.batch)
  ref_loss, ref_grads = reference(case.loss_fn, case.params, case.batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_trees_close(zjax.unshard(grads, edited), ref_grads)
  compiled = hlo.compile_for_analysis(step.lower(sharded, case.batch))
  assert_exact(edited, compiled)
  # ahead, the first layer is gathered before the loop and the last iteration runs after
  # it: no while loop runs all the layers, as the planned program's do
  planned_step = zjax.value_and_grad(case.loss_fn, planned, mesh=mesh)
  planned_text = hlo.compile_for_analysis(planned_step.lower(sharded, case.batch)).as_text()
  length = rolled_lengths(planned)[0]
  assert length in hlo.while_loops(planned_text).values()
  assert length not in hlo.while_loops(compiled.as_text()).values()


def test_parted_schedule_round_trips_and_edits_are_checked():
  case = MODELS["gpt"]()
  config = zjax.ZeroConfig(
    param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0
  )
  s = zjax.compile_schedule(case.loss_fn, case.params, case.batch, num_devices=8, config=config)
  assert zjax.Schedule.from_json(s.to_json()) == s
  data = json.loads(s.to_json())
  loop = next(st for st in data["backward"] if st["op"] == ir.LOOP_OP)
  # drop the first re-gather after the first vjp: a later vjp needs it
  first_vjp = next(j for j, st in enumerate(loop["body"]) if st["op"] == "compute")
  j = next(j for j, st in enumerate(loop["body"]) if j > first_vjp and st["op"] == "gather")
  bucket = loop["body"].pop(j)["bucket"]
  release = next(
    k
    for k, st in enumerate(loop["body"])
    if k >= j and st["op"] == "release" and st["bucket"] == bucket
  )
  loop["body"].pop(release)
  with pytest.raises(ScheduleError, match="not gathered"):
    zjax.Schedule.from_json(json.dumps(data))


def test_a_leaf_above_the_cap_stays_a_clear_error():
  case = MODELS["gpt"]()
  config = zjax.ZeroConfig(
    param_persistence_threshold=0, max_live_parameters=largest_bucket(case) - 1
  )
  with pytest.raises(ScheduleError, match=r"\['embed'\]\['embedding'\].*at least"):
    zjax.compile_schedule(case.loss_fn, case.params, case.batch, num_devices=8, config=config)


def while_loop_layers(num_layers=3, d=16):
  """Identical layers, each running a float from the batch through a while_loop (JAX
  cannot reverse-differentiate one; jax.value_and_grad never asks: no parameter reaches
  it)."""
  keys = jax.random.split(jax.random.key(21), 2 * num_layers + 1)
  params = {
    f"layer_{i}": {
      "a": {"w": jax.random.normal(keys[2 * i], (d, d)) / np.sqrt(d)},
      "b": {"w": jax.random.normal(keys[2 * i + 1], (d, d)) / np.sqrt(d)},
    }
    for i in range(num_layers)
  }
  batch = {"x": jax.random.normal(keys[-1], (16, d)), "t": jnp.float32(0.9)}

  def loss(p, b):
    x = b["x"]
    for i in range(num_layers):
      halved = jax.lax.while_loop(
        lambda c: c[1] > 0.3, lambda c: (c[0] + 1, c[1] / 2), (0, b["t"])
      )[1]
      h = jnp.tanh(x @ p[f"layer_{i}"]["a"]["w"]) * halved
      x = h @ p[f"layer_{i}"]["b"]["w"] + x
    return jnp.mean(x**2)

  return real_models.Case(loss, params, batch, reference_loss_fn=loss)


@pytest.mark.slow
@pytest.mark.parametrize("parts", [False, True], ids=["whole-layer", "by-parts"])
def test_a_rolled_layer_with_a_while_loop_on_a_batch_float(parts):
  """Rolled backward iterations differentiate only the loop inputs that depend on trained
  parameters (loop_parts.differentiable_inputs), as scans and unrolled layers do."""
  case = while_loop_layers()
  config = zjax.ZeroConfig(param_persistence_threshold=0)  # the whole layer at once
  if parts:  # one weight at a time
    config = dataclasses.replace(config, max_reuse_distance=0, max_live_parameters=16 * 16)
  for n in (8, 4):
    schedule = rolled_and_unrolled(case, config, n)[True]
    assert rolled_lengths(schedule) == [3], n
    assert bool(parted_loops(schedule)) == parts, n


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_a_weight_every_layer_reads_is_regathered_for_the_backward(n):
  """A sharded weight that every rolled layer reads (a loop const) at max_reuse_distance=0:
  released after the forward loop, re-gathered before the backward one. The validator
  accepts its gradient as the loop's (it refused: 'no backward compute has produced its
  gradient'), and the backward reads the re-gathered value, not a copy of the forward's
  kept in the loop's residuals (the re-gather was dead code: one all-gather fewer than the
  report). (Its peak is above the unrolled plan's: a loop const stays gathered through
  the loop, which the unrolled plan releases between layers.)"""
  from test_rolling import net

  loss, params, batch = net()
  config = zjax.ZeroConfig(
    param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0
  )
  schedule, compiled = assert_parity(loss, params, batch, n=n, config=config)
  assert_exact(schedule, compiled)
  assert rolled_lengths(schedule) == [4] and parted_loops(schedule)
  shared = schedule.param("['shared']").bucket
  assert shared in [st.bucket for st in schedule.backward if st.op == "gather"]


def reused_weight_layers(d=16, layers=3):
  """Identical layers that each read their `a` twice, with `b` between (a weight reused
  in two sub-modules of one layer)."""
  keys = jax.random.split(jax.random.key(0), 2 * layers + 1)
  params = {
    f"layer{i}": {
      "a": {"w": jax.random.normal(keys[2 * i], (d, d)) / 4},
      "b": {"w": jax.random.normal(keys[2 * i + 1], (d, d)) / 4},
    }
    for i in range(layers)
  }

  def loss(p, x):
    for i in range(layers):
      a, b = p[f"layer{i}"]["a"]["w"], p[f"layer{i}"]["b"]["w"]
      x = jnp.tanh(jnp.tanh(jnp.tanh(x @ a) @ b) @ a)
    return jnp.mean(x**2)

  return real_models.Case(loss, params, jax.random.normal(keys[-1], (8, d)))


LEAN = zjax.ZeroConfig(param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0)


def scanned_reused_weight_layers(d=16, layers=3):
  """The same layers as a lax.scan over stacked `a` and `b`."""
  keys = jax.random.split(jax.random.key(1), 3)
  params = {
    "a": {"w": jax.random.normal(keys[0], (layers, d, d)) / 4},
    "b": {"w": jax.random.normal(keys[1], (layers, d, d)) / 4},
  }

  def loss(p, x):
    def layer(x, weights):
      a, b = weights
      return jnp.tanh(jnp.tanh(jnp.tanh(x @ a) @ b) @ a), None

    return jnp.mean(jax.lax.scan(layer, x, (p["a"]["w"], p["b"]["w"]))[0] ** 2)

  return loss, params, jax.random.normal(keys[2], (8, d))


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["once", "per_gather"])
@pytest.mark.parametrize("n", [8, 4])
def test_a_weight_read_in_two_parts_of_a_layer(n, reduction):
  """Released after each use (reuse 0), a layer's `a` is gathered for part 0, released,
  and gathered again for part 2, whose gather is still live when the forward plan ends (it
  stays into the plan's backward): the body releases it at its end (it was planned, then
  refused by the validator: "still gathered at the end of the body"). Under per_gather
  each of those gathers' gradients is reduce-scattered, and the two add up in the layer's
  row (the second overwrote the first: wrong gradients). Rolled == unrolled == plain JAX
  gradients (fp32 rtol 1e-5), collectives == report; the same for the layers as a scan."""
  config = dataclasses.replace(LEAN, gradient_reduction=reduction)
  out = rolled_and_unrolled(reused_weight_layers(), config, n=n)
  (loop,) = parted_loops(out[True])
  assert [p.buckets for p in loop.parts] == [(0,), (1,), (0,)]
  scanned, compiled = assert_parity(*scanned_reused_weight_layers(), n=n, config=config)
  assert_exact(scanned, compiled)
  (loop,) = parted_loops(scanned)
  assert [p.buckets for p in loop.parts] == [(0,), (1,), (0,)]
  (backward,) = [st for st in scanned.backward if st.op == ir.LOOP_OP]
  scatters = [st.bucket for st in backward.body if st.op == "reduce_scatter"]
  assert scatters.count(0) == (2 if reduction == "per_gather" else 1)


def test_a_part_that_lists_other_buckets_than_it_reads_is_refused():
  """The validator checks that a part's buckets are gathered where it computes, and that a
  loop's forward and backward steps list the same parts; the executor checks the list is
  what the part's ops read. A layer that reads its `a` twice, with `b` between, released
  after each use: `a` is in parts 0 and 2, and a file whose part 2 lists no bucket is
  valid as data but refused when run (it would read zeros)."""
  case = reused_weight_layers()
  mesh = jax.make_mesh((8,), ("fsdp",))
  s = zjax.compile_schedule(case.loss_fn, case.params, case.batch, mesh=mesh, config=LEAN)
  data = json.loads(s.to_json())
  (forward,) = [st for st in data["forward"] if st["op"] == ir.LOOP_OP]
  assert (
    len(forward["parts"]) == 3 and forward["parts"][0]["buckets"] == forward["parts"][2]["buckets"]
  )
  forward["parts"][2]["buckets"] = []
  with pytest.raises(ScheduleError, match="other parts than its forward loop step"):
    zjax.Schedule.from_json(json.dumps(data))
  (backward,) = [st for st in data["backward"] if st["op"] == ir.LOOP_OP]
  backward["parts"][2]["buckets"] = []
  edited = zjax.Schedule.from_json(json.dumps(data))
  with pytest.raises(zjax.ScheduleMismatchError, match="part 2 lists buckets \\[\\]"):
    zjax.value_and_grad(case.loss_fn, edited, mesh=mesh).lower(
      zjax.shard(case.params, edited, mesh), case.batch
    )
