"""The compiled program does what the schedule says: collective counts and bytes equal the
schedule's report, and per-device memory stays within its predicted bound.

The programs judged are compiled as a GPU orders them (zjax.hlo.compile_for_analysis: on CPU
the optimization barriers are kept for that compile); test_cpu_executed.py measures how the
program the CPU runs differs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zjax
from helpers import analyse_zjax, assert_trees_close, mlp, reference, run_zjax

D = 256
W1 = D * D * 4  # bytes of one layer's weight


def deep_mlp(num_layers=8):
  """DESIGN.md's reference model: 8 layers, D=256, tiny batch (weights dominate memory)."""
  params = {
    f"l{i}": {"kernel": jax.random.normal(jax.random.key(i), (D, D)) / 16}
    for i in range(num_layers)
  }

  def loss(p, b):
    x = b["x"]
    for i in range(num_layers):
      x = jnp.tanh(x @ p[f"l{i}"]["kernel"])
    return jnp.mean((x - b["y"]) ** 2)

  batch = {"x": jax.random.normal(jax.random.key(99), (8, D)), "y": jnp.ones((8, D))}
  return loss, params, batch


def UNROLLED(config, unrolled=True):  # noqa: N802
  """The config with layer rolling off: what the unrolled planner's knobs do."""
  return dataclasses.replace(config, roll_layers=not unrolled)


def compiled_summary(model, config, n=8):
  schedule, compiled = analyse_zjax(*model, n=n, config=config)
  return schedule, schedule.report(), zjax.hlo.summarize(compiled)


CONFIGS = {
  "keep-all": zjax.ZeroConfig(param_persistence_threshold=0),
  "no-prefetch": zjax.ZeroConfig(
    param_persistence_threshold=0, prefetch_bucket_size=0, max_reuse_distance=0
  ),
  "prefetch-1": zjax.ZeroConfig(
    param_persistence_threshold=0,
    prefetch_bucket_size=D * D,
    max_reuse_distance=0,
    max_live_parameters=2 * D * D,
  ),
  "reuse-some": zjax.ZeroConfig(
    param_persistence_threshold=0, max_reuse_distance=5 * D * D, prefetch_bucket_size=D * D
  ),
}


@pytest.mark.parametrize("unrolled", [False, True], ids=["rolled", "unrolled"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_collectives_equal_the_report(name, unrolled):
  _, report, hlo = compiled_summary(deep_mlp(), UNROLLED(CONFIGS[name], unrolled))
  for kind in ("all_gather", "reduce_scatter"):
    assert hlo[f"{kind}_count"] == report[f"{kind}_count"], kind
    assert hlo[f"{kind}_bytes"] == report[f"{kind}_bytes"], kind


@pytest.mark.slow
def test_gpt_collectives_equal_the_report():
  from test_execute import gpt_setup

  cfg = zjax.ZeroConfig(
    param_persistence_threshold=256, max_reuse_distance=5000, prefetch_bucket_size=5000
  )
  _, report, hlo = compiled_summary(gpt_setup(), cfg)
  assert report["all_gather_count"] > 0 and report["backward_all_gather_count"] > 0
  for kind in ("all_gather", "reduce_scatter"):
    assert (hlo[f"{kind}_count"], hlo[f"{kind}_bytes"]) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind
  # only persistent gradients (and the loss) are all-reduced
  assert hlo["all_reduce_bytes"] <= report["persistent_grad_all_reduce_bytes"] + 16


@pytest.mark.parametrize("threshold", [0, 64])
def test_one_device_reports_no_collectives(threshold):
  """On a one-device mesh every parameter is replicated and nothing is communicated: the
  report says no gather, reduce-scatter or all-reduce (it said the persistent gradients'
  bytes were all-reduced), as the compiled program has none, and gradients equal plain
  JAX."""
  loss, params, batch = mlp()
  mesh = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
  config = zjax.ZeroConfig(param_persistence_threshold=threshold)
  schedule, value, grads, compiled = run_zjax(loss, params, batch, config=config, mesh=mesh)
  ref_value, ref_grads = reference(loss, params, batch)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_trees_close(grads, ref_grads)
  assert zjax.hlo.executed(compiled.as_text()) == {}
  report = schedule.report()
  for key in ("all_gather", "reduce_scatter", "persistent_grad_all_reduce"):
    assert report[f"{key}_count"] == 0 and report[f"{key}_bytes"] == 0, key
  assert report["all_reduce_bytes_by_axis"] == {} and "all-reduce" not in str(schedule)


def test_no_all_reduce_beyond_persistent_params_and_scalars():
  _, report, hlo = compiled_summary(mlp(), zjax.ZeroConfig(param_persistence_threshold=64))
  assert report["persistent_grad_all_reduce_bytes"] == 4 * 64 * 4  # the biases
  assert hlo["all_reduce_bytes"] <= report["persistent_grad_all_reduce_bytes"] + 16
  _, report, hlo = compiled_summary(mlp(), zjax.ZeroConfig(param_persistence_threshold=0))
  assert hlo["all_reduce_bytes"] <= 16  # the loss only


@pytest.mark.parametrize("reduce_dtype", [None, jnp.float32])
def test_bf16_parameters_report_equals_the_compiled_program(reduce_dtype):
  """bf16 parameters: gathers travel as packed words, gradients are reduced in bf16 where
  the backend can and in f32 on CPU (XLA's CPU collectives widen 16-bit floats; the
  executor does it explicitly and the report counts f32 bytes). Counts and bytes equal."""
  loss, params, batch = mlp(num_layers=3)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  config = zjax.ZeroConfig(
    param_persistence_threshold=64, max_reuse_distance=0, reduce_dtype=reduce_dtype
  )
  schedule, report, hlo = compiled_summary((loss, params, batch), config)
  assert schedule.platform == "cpu" and report["reduce_scatter_count"] == 3
  assert report["reduce_scatter_bytes"] == 3 * 64 * 64 * 4  # f32 on the wire
  for kind in ("all_gather", "reduce_scatter"):
    assert (hlo[f"{kind}_count"], hlo[f"{kind}_bytes"]) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind
  assert report["persistent_grad_all_reduce_bytes"] == 3 * 64 * 4
  assert (
    report["persistent_grad_all_reduce_bytes"]
    <= hlo["all_reduce_bytes"]
    <= report["persistent_grad_all_reduce_bytes"] + 16
  )  # + the loss
  gpu = zjax.compile_schedule(
    loss, params, batch, num_devices=8, config=config, platform="gpu"
  ).report()
  native = 2 if reduce_dtype is None else 4
  assert gpu["reduce_scatter_bytes"] == 3 * 64 * 64 * native


@pytest.mark.parametrize("name", ["no-prefetch", "keep-all"])
def test_unused_head_and_dead_concatenation_plan_no_collectives(name):
  """Dead code is removed before planning (XLA deletes it too): the report equals the
  compiled program, and parameters read only by dead code are neither gathered nor
  reduced."""
  loss_fn, params, batch = deep_mlp(num_layers=3)
  params = dict(params, aux_head={"kernel": jnp.ones((D, 10))})

  def loss(p, b):
    h = b["x"]
    for i in range(3):
      h = jnp.tanh(h @ p[f"l{i}"]["kernel"])
    aux = h @ p["aux_head"]["kernel"]  # an auxiliary head the loss does not use
    both = jnp.concatenate([p["l0"]["kernel"], p["l1"]["kernel"]])  # dead, as nn.scan leaves
    del aux, both
    return jnp.mean((h - b["y"]) ** 2)

  schedule, report, hlo = compiled_summary((loss, params, batch), CONFIGS[name])
  assert schedule.param("['aux_head']['kernel']").bucket is None
  assert report["reduce_scatter_count"] == 3
  for kind in ("all_gather", "reduce_scatter"):
    assert (hlo[f"{kind}_count"], hlo[f"{kind}_bytes"]) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind


def test_one_device_has_no_collectives():
  _, report, hlo = compiled_summary(mlp(), zjax.ZeroConfig(param_persistence_threshold=0), n=1)
  assert report["all_gather_count"] == report["reduce_scatter_count"] == 0
  assert hlo["all_gather_count"] == hlo["reduce_scatter_count"] == hlo["all_reduce_count"] == 0


def test_max_reuse_distance_changes_backward_gathers_as_predicted():
  keep = compiled_summary(deep_mlp(), UNROLLED(CONFIGS["keep-all"]))
  release = compiled_summary(deep_mlp(), UNROLLED(CONFIGS["no-prefetch"]))
  assert keep[1]["backward_all_gather_count"] == 0
  assert release[1]["backward_all_gather_count"] == 6  # layer 0 needs no weights, 7 is kept
  assert release[2]["all_gather_count"] - keep[2]["all_gather_count"] == 6


@pytest.mark.parametrize("roll", [True, False], ids=["rolled", "unrolled"])
def test_memory_within_the_predicted_bound(roll):
  """temp <= predicted peak live params + live gradients + one bucket of slack (the packed
  gradient / gathered buffer being written) + the activations (here ~0: batch of 1 row).
  Rolled layers read their stacked storage in place: no copies of it."""
  for name, config in CONFIGS.items():
    schedule, report, hlo = compiled_summary(deep_mlp(), UNROLLED(config, not roll))
    assert roll == bool(report["loops"])
    bound = report["peak_live_param_bytes"] + report["peak_live_grad_bytes"] + W1 + 0.05 * W1
    assert hlo["temp_bytes"] <= bound, (name, hlo["temp_bytes"] / W1, bound / W1)


def test_lower_max_live_parameters_lowers_memory():
  keep = compiled_summary(deep_mlp(), UNROLLED(CONFIGS["keep-all"]))[2]["temp_bytes"]
  capped = compiled_summary(
    deep_mlp(),
    zjax.ZeroConfig(
      param_persistence_threshold=0, max_live_parameters=2 * D * D, roll_layers=False
    ),
  )[2]["temp_bytes"]
  assert capped < 0.55 * keep  # 4 layers of weights instead of 8
  assert capped <= 4.1 * W1  # 2 live layers + 1 gradient + 1 bucket of slack


def test_residuals_hold_no_gathered_parameters():
  """What backward keeps from forward (argument + temp) does not grow with the gathered
  parameters: with nothing kept across the turn, memory is ~3 layers, not ~8."""
  _, _, hlo = compiled_summary(deep_mlp(), UNROLLED(CONFIGS["no-prefetch"]))
  assert hlo["temp_bytes"] < 3.1 * W1


def test_hlo_parser_on_async_and_sync_forms():
  text = """HloModule m

ENTRY %main {
  %a = f32[8,512]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %b = (f32[64]{0}, f32[512]{0}) all-gather-start(%y), replica_groups=[1,8]<=[8], dimensions={0}
  %c = f32[512]{0} all-gather-done(%b)
  %d = bf16[1,512]{1,0} reduce-scatter(%z), replica_groups=[1,8]<=[8], dimensions={0}
  %e = (f32[4]{0}, f32[]) all-reduce(%p, %q), replica_groups={{0,1}}
  ROOT %f = f32[16]{0} all-reduce-start(%r), replica_groups={{0,1}}
}
"""
  colls = zjax.hlo.collectives(text)
  assert [(c.kind, c.bytes) for c in colls] == [
    ("all_gather", 8 * 512 * 4),
    ("all_gather", 512 * 4),
    ("reduce_scatter", 8 * 512 * 2),
    ("all_reduce", 16 + 4),
    ("all_reduce", 64),
  ]
  assert {c.computation for c in colls} == {"main"}


def test_saved_residuals_are_never_gathered_parameters(monkeypatch):
  """Spy on what each segment's vjp keeps for backward: activations only; every residual
  that is a gathered parameter became a slot, refilled from a re-gather in backward."""
  from test_execute import gpt_setup
  from zjax._src.program import segments as seg_lib

  kept_shapes, slots = [], []
  strip = seg_lib.strip_params

  def spy(vjp_fn, params):
    stripped = strip(vjp_fn, params)
    kept_shapes.extend(tuple(x.shape) for x in stripped[1] if x is not None)
    slots.append(len(stripped[2]))
    return stripped

  monkeypatch.setattr(seg_lib, "strip_params", spy)
  loss, params, batch = gpt_setup()
  schedule, _, _, _ = run_zjax(
    loss,
    params,
    batch,
    config=zjax.ZeroConfig(param_persistence_threshold=256, max_reuse_distance=0),
  )
  sharded_shapes = {tuple(p.shape) for p in schedule.params if not p.persistent}
  assert sum(slots) > 0
  assert not sharded_shapes & set(kept_shapes)
