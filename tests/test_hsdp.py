"""Hybrid sharding (HSDP): parameters sharded over `axis_name`, replicated over
`ZeroConfig.replicate_axes`, the batch split over both. Results equal plain single-device
JAX on the full batch (fp32 rtol 1e-5) and flat 8-device zjax; the compiled collectives
equal the report (gathers and reduce-scatters within a shard group, one all-reduce of each
gradient shard over the replicas)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, mesh_of, mlp, reference
from real_models import CASES, resnet_syncbn
from test_execute import COND_PARAMS, cond_loss, gpt_setup
from test_real_models import assert_same_outputs
from test_real_models import reference as case_reference
from test_train import ADAMW, reference_run

import zjax

SHAPES = [(2, 4), (4, 2)]
# After Adam steps: Adam's m/sqrt(v) turns the last-bit reduction-order differences of
# near-zero gradient elements (a few per layer; HSDP sums over the group, then averages over
# the replicas) into ~3e-5 parameter differences (see test_train.py). Gradients themselves
# are compared at atol 1e-6 above, losses at rtol 1e-5.
PARAM_ATOL = 5e-5
CONFIG = zjax.ZeroConfig(param_persistence_threshold=64, max_reuse_distance=0,
                         replicate_axes=("data",))


def hsdp_mesh(shape):
  return jax.make_mesh(shape, ("data", "fsdp"))


def scanned_gpt_setup():
  from gpt import GPT, GPTConfig, make_loss_fn
  cfg = GPTConfig(d_model=64, n_layer=2, n_head=4, d_ff=128, seq_len=16, scan_layers=True)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
  return make_loss_fn(model), model.init(jax.random.key(1), tokens[:, :-1]), {"tokens": tokens}


def tied_cond_setup():
  """A weight used twice (tied) and branches (cond/switch) on a replicated flag."""
  x = jax.random.normal(jax.random.key(10), (8, 16))
  batch = {"x": x, "flag": jnp.float32(1.0), "choice": jnp.int32(1)}
  loss = lambda p, b: cond_loss(p, b) + jnp.mean((b["x"] @ p["a"] @ p["a"].T) ** 2)
  return loss, COND_PARAMS, batch


MODELS = {"mlp": mlp, "gpt": gpt_setup, "scanned_gpt": scanned_gpt_setup,
          "tied_cond": tied_cond_setup}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_equal_the_full_batch_and_the_report_the_program(name, shape):
  loss, params, batch = MODELS[name]()
  mesh = hsdp_mesh(shape)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=CONFIG)
  assert (schedule.num_devices, schedule.replicas) == (shape[1], shape[0])
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  sharded = zjax.shard(params, schedule, mesh)
  value, grads = step(sharded, batch)
  ref_value, ref_grads = reference(loss, params, batch)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_trees_close(zjax.unshard(grads, schedule), ref_grads)

  report = schedule.report()
  executed = zjax.hlo.executed(step.lower(sharded, batch).compile().as_text())
  for kind in ("all_gather", "reduce_scatter"):
    assert (executed.get(f"{kind}_count", 0), executed.get(f"{kind}_bytes", 0)) == \
        (report[f"{kind}_count"], report[f"{kind}_bytes"]), kind
  assert report["replica_all_reduce_bytes"] == report["reduce_scatter_bytes"] // shape[1] > 0
  expected = report["replica_all_reduce_bytes"] + report["persistent_grad_all_reduce_bytes"]
  assert expected < executed["all_reduce_bytes"] <= expected + 16  # + the loss


def test_all_gathers_and_reduce_scatters_stay_inside_a_shard_group():
  loss, params, batch = gpt_setup()
  mesh = hsdp_mesh((2, 4))
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=CONFIG)
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  text = step.lower(zjax.shard(params, schedule, mesh), batch).compile().as_text()
  groups = {kind: set() for kind in ("all-gather", "reduce-scatter", "all-reduce")}
  for line in text.splitlines():
    for kind in groups:
      if f" {kind}(" in line or f" {kind}-start(" in line:
        groups[kind].add(line.split("replica_groups=")[1].split(", ")[0].split(" ")[0])
  fsdp_groups = {(0, 1, 2, 3), (4, 5, 6, 7)}  # device ids of the two shard groups
  for kind in ("all-gather", "reduce-scatter"):
    for text_groups in groups[kind]:
      assert _parse_groups(text_groups) == fsdp_groups, (kind, text_groups)
  assert any(_parse_groups(g) == {(0, 4), (1, 5), (2, 6), (3, 7)} for g in groups["all-reduce"])


def _parse_groups(text):
  """HLO replica groups, explicit ({{0,1},{2,3}}) or iota ([2,4]<=[8] / [4,2]<=[2,4]T(1,0))."""
  if text.startswith("{"):
    return {tuple(int(x) for x in g.split(",")) for g in text.strip("{}").split("},{")}
  shape, rest = text[1:].split("]<=[")
  dims, perm = rest.split("]")[0], rest.split("T(")[1].rstrip(")") if "T(" in rest else None
  ids = np.arange(int(np.prod([int(d) for d in dims.split(",")]))).reshape(
      [int(d) for d in dims.split(",")])
  if perm:
    ids = ids.transpose([int(p) for p in perm.split(",")])
  rows, cols = (int(d) for d in shape.split(","))
  return {tuple(int(x) for x in row) for row in ids.reshape(rows, cols)}


@pytest.fixture(scope="module")
def gpt_reference():
  loss, params, batch = gpt_setup()
  return loss, params, batch, reference_run(loss, ADAMW, params, [batch] * 5)


@pytest.mark.parametrize("shape", SHAPES)
def test_five_adamw_steps_equal_optax_and_flat_zero3(gpt_reference, shape):
  loss, params, batch, (ref_params, ref_losses) = gpt_reference
  mesh = hsdp_mesh(shape)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=CONFIG)
  trainer = zjax.zero3(loss, ADAMW, schedule, mesh=mesh)
  state, losses = trainer.init(params), []
  for _ in range(5):
    state, metrics = trainer.step(state, batch)
    losses.append(metrics["loss"])
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(trainer.gather_params(state), ref_params, rtol=1e-5, atol=PARAM_ATOL)
  # 1/S of each sharded parameter per device (+ the persistent ones), as the report says
  assert zjax.per_device_bytes(state.params) == schedule.report()["state_bytes_per_device"]

  flat_mesh = mesh_of(8)
  flat_config = dataclasses.replace(CONFIG, replicate_axes=())
  flat = zjax.zero3(loss, ADAMW, zjax.compile_schedule(loss, params, batch, mesh=flat_mesh,
                                                      config=flat_config), mesh=flat_mesh)
  flat_state = flat.init(params)
  for _ in range(5):
    flat_state, _ = flat.step(flat_state, batch)
  assert_trees_close(trainer.gather_params(state), flat.gather_params(flat_state),
                     rtol=1e-5, atol=PARAM_ATOL)


def test_checkpoints_move_between_flat_and_hsdp_bitwise(tmp_path):
  loss, params, batch = gpt_setup()
  flat_mesh, hsdp, half = mesh_of(8), hsdp_mesh((2, 4)), mesh_of(4)
  flat_config = dataclasses.replace(CONFIG, replicate_axes=())

  def trainer(mesh, config):
    return zjax.zero3(loss, ADAMW, zjax.compile_schedule(loss, params, batch, mesh=mesh,
                                                         config=config), mesh=mesh)

  flat, hybrid, four = trainer(flat_mesh, flat_config), trainer(hsdp, CONFIG), \
      trainer(half, flat_config)
  state, _ = flat.step(flat.init(params), batch)
  expected = jax.tree.map(np.asarray, flat.gather_params(state))
  ckpt = zjax.CheckpointManager(tmp_path / "a", flat)
  ckpt.save(1, state)
  ckpt.wait_until_finished()
  on_hsdp = ckpt.restore(hybrid)
  ckpt.close()
  assert_trees_close(hybrid.gather_params(on_hsdp), expected, rtol=0, atol=0)
  on_hsdp, _ = hybrid.step(on_hsdp, batch)
  ckpt = zjax.CheckpointManager(tmp_path / "b", hybrid)
  ckpt.save(2, on_hsdp)
  ckpt.wait_until_finished()
  on_four = ckpt.restore(four)
  ckpt.close()
  assert_trees_close(four.gather_params(on_four),
                     jax.tree.map(np.asarray, hybrid.gather_params(on_hsdp)), rtol=0, atol=0)
  assert int(on_four.step) == 2


def test_bad_hsdp_input_is_named():
  loss, params, batch = mlp()
  mesh = hsdp_mesh((2, 4))
  with pytest.raises(ValueError, match="replicate_axes names 'fsdp', the axis parameters"):
    zjax.ZeroConfig(replicate_axes=("fsdp",))
  with pytest.raises(ValueError, match="replicate_axes names 'data' twice"):
    zjax.ZeroConfig(replicate_axes=("data", "data"))
  with pytest.raises(ValueError, match="must be a tuple of mesh axis names"):
    zjax.ZeroConfig(replicate_axes="data")
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=CONFIG)
  with pytest.raises(zjax.ZjaxError, match=r"not divisible by the 8 devices of the data axes "
                     r"\('data', 'fsdp'\)"):
    zjax.value_and_grad(loss, schedule, mesh=mesh)(zjax.shard(params, schedule, mesh),
                                                   jax.tree.map(lambda x: x[:12], batch))
  with pytest.raises(zjax.ZjaxError, match="replicates over 'data', an axis this mesh"):
    zjax.value_and_grad(loss, schedule, mesh=mesh_of(4))
  with pytest.raises(zjax.ZjaxError, match="Mesh axis 'data' has size 1, but the schedule "
                     "was planned with it as a replicate axis of size 2"):
    zjax.value_and_grad(loss, schedule, mesh=jax.make_mesh((1, 4), ("data", "fsdp"),
                                                           devices=jax.devices()[:4]))
  with pytest.raises(zjax.ZjaxError, match="Mesh axis 'data' has size 2, but the schedule "
                     "does not use it"):
    flat = zjax.compile_schedule(loss, params, batch, num_devices=4)
    zjax.value_and_grad(loss, flat, mesh=mesh)


def test_clipping_accumulation_sub_groups_and_frozen_params_under_hsdp():
  """The global gradient norm counts each element once (not once per replica); clipping,
  gradient accumulation, sub-groups and frozen parameters give single-device optax's
  result."""
  loss, params, batch = mlp(num_layers=3, batch=32)
  frozen_loss = lambda p, b: loss(dict(p, layer1=jax.lax.stop_gradient(p["layer1"])), b)
  ref_norm = float(optax.tree.norm(jax.grad(frozen_loss)(params, batch)))
  optimizer = optax.chain(optax.clip_by_global_norm(ref_norm / 10), optax.adam(1e-2, eps=1e-6))
  ref_params, ref_losses = reference_run(frozen_loss, optimizer, params, [batch] * 3)
  mesh = hsdp_mesh((2, 4))
  config = dataclasses.replace(CONFIG, sub_group_size=100)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config,
                                   frozen=lambda path: path.startswith("['layer1']"))
  trainer = zjax.zero3(loss, optimizer, schedule, mesh=mesh, accumulation_steps=2)
  state, metrics = trainer.init(params), []
  for _ in range(3):
    state, m = trainer.step(state, batch)
    metrics.append(m)
  np.testing.assert_allclose(metrics[0]["grad_norm"], ref_norm, rtol=1e-5)
  np.testing.assert_allclose([m["loss"] for m in metrics], ref_losses, rtol=1e-5)
  trained = trainer.gather_params(state)
  assert_trees_close(trained, ref_params, rtol=1e-5, atol=PARAM_ATOL)
  np.testing.assert_array_equal(trained["layer1"]["kernel"], params["layer1"]["kernel"])


def test_bf16_compute_under_hsdp_equals_flat_bf16():
  """Each device computes the same share in bf16 as on a flat 8-device mesh (the data axis
  is major); only the fp32 summation order of the gradients differs."""
  loss, params, batch = gpt_setup()
  bf16 = dataclasses.replace(CONFIG, compute_dtype=jnp.bfloat16)
  results = []
  for mesh, config in ((hsdp_mesh((2, 4)), bf16),
                       (mesh_of(8), dataclasses.replace(bf16, replicate_axes=()))):
    schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
    value, grads = zjax.value_and_grad(loss, schedule, mesh=mesh)(
        zjax.shard(params, schedule, mesh), batch)
    results.append((value, zjax.unshard(grads, schedule)))
  np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
  assert_trees_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_outside_style_models_under_hsdp(name):
  """tests/real_models.py on a 2x4 mesh; the ResNet synchronises BatchNorm over both data
  axes (axis_name=("data", "fsdp")), which equals full-batch BatchNorm."""
  case = resnet_syncbn(axis_name=("data", "fsdp")) if name == "resnet_syncbn" else \
      CASES[name]()
  mesh = hsdp_mesh((2, 4))
  config = dataclasses.replace(CONFIG, param_persistence_threshold=0)
  schedule = zjax.compile_schedule(case.loss_fn, case.params, case.batch, mesh=mesh,
                                   config=config, extra=case.extra)
  sharded = zjax.shard(case.params, schedule, mesh)
  args = (sharded, case.batch) if case.extra is None else (sharded, case.batch, case.extra)
  out, grads = zjax.value_and_grad(case.loss_fn, schedule, mesh=mesh)(*args)
  ref_out, ref_grads = case_reference(case)
  assert_same_outputs(case, out, ref_out)
  assert_trees_close(zjax.unshard(grads, schedule), ref_grads)
