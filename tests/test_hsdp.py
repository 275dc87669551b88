"""Meshes with two axes: HSDP (parameters sharded over the shard axis, replicated over
`ZeroConfig.replicate_axes`), hpZ (storage over both axes, backward re-gathers from a
secondary partition within the shard axis) and flat ZeRO-3 over both axes; the batch is
split over both. Results equal plain single-device JAX on the full batch (fp32 rtol 1e-5)
and flat 8-device zjax; the compiled collectives equal the report, per mesh axis (replica
groups included)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from helpers import assert_trees_close, init, mesh_of, mlp, reference
from real_models import CASES, resnet_syncbn
from test_execute import COND_PARAMS, cond_loss, gpt_setup
from test_real_models import assert_same_outputs
from test_real_models import reference as case_reference
from test_train import reference_run

SHAPES = [(2, 4), (4, 2)]
# After Adam steps: Adam's m/sqrt(v) turns the last-bit reduction-order differences of
# near-zero gradient elements (a few per layer; HSDP sums over the group, then averages over
# the replicas) into ~3e-5 parameter differences (see test_train.py). Gradients themselves
# are compared at atol 1e-6 above, losses at rtol 1e-5.
PARAM_ATOL = 5e-5
# One such element, measured (the scanned GPT's proj kernel [0, 82, 47], 2026-12-02, on an
# Intel Xeon without AVX-512): gradient -2.0e-7 (typical 5e-3), within Adam's eps=1e-6,
# where the update is lr * g / (|g| + eps) and a 3% reduction-order difference of g moves
# the parameter by 5.2e-5 after 5 steps. eps=1e-5 keeps those updates linear in g.
ADAMW = optax.adamw(1e-2, eps=1e-5)
CONFIG = zjax.ZeroConfig(
  param_persistence_threshold=64, max_reuse_distance=0, replicate_axes=("data",)
)
HPZ = dataclasses.replace(CONFIG, secondary_partition=True)
FLAT_2D = dataclasses.replace(CONFIG, shard_axes=("data", "fsdp"), replicate_axes=())
LAYOUTS = {"hsdp": CONFIG, "hpz": HPZ, "flat2d": FLAT_2D}


def hsdp_mesh(shape):
  return jax.make_mesh(shape, ("data", "fsdp"))


def scanned_gpt_setup():
  from gpt import GPT, GPTConfig, make_loss_fn

  cfg = GPTConfig(d_model=64, n_layer=2, n_head=4, d_ff=128, seq_len=16, scan_layers=True)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
  return make_loss_fn(model), init(model, jax.random.key(1), tokens[:, :-1]), {"tokens": tokens}


def tied_cond_setup():
  """A weight used twice (tied) and branches (cond/switch) on a replicated flag."""
  x = jax.random.normal(jax.random.key(10), (8, 16))
  batch = {"x": x, "flag": jnp.float32(1.0), "choice": jnp.int32(1)}
  loss = lambda p, b: cond_loss(p, b) + jnp.mean((b["x"] @ p["a"] @ p["a"].T) ** 2)
  return loss, COND_PARAMS, batch


MODELS = {
  "mlp": mlp,
  "gpt": gpt_setup,
  "scanned_gpt": scanned_gpt_setup,
  "tied_cond": tied_cond_setup,
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_equal_the_full_batch_and_the_report_the_program(name, shape, layout):
  loss, params, batch = MODELS[name]()
  mesh = hsdp_mesh(shape)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=LAYOUTS[layout])
  storage = {"hsdp": shape[1], "hpz": 8, "flat2d": 8}[layout]
  replicas = {"hsdp": shape[0], "hpz": shape[0], "flat2d": 1}[layout]
  assert (schedule.num_devices, schedule.replicas, schedule.shards) == (
    storage,
    replicas,
    8 // replicas,
  )
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  sharded = zjax.shard(params, schedule, mesh)
  value, grads = step(sharded, batch)
  ref_value, ref_grads = reference(loss, params, batch)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_trees_close(zjax.unshard(grads, schedule), ref_grads)

  report = schedule.report()
  text = zjax.hlo.compile_for_analysis(step.lower(sharded, batch)).as_text()
  executed = zjax.hlo.executed(text)
  for kind in ("all_gather", "reduce_scatter"):
    assert (executed.get(f"{kind}_count", 0), executed.get(f"{kind}_bytes", 0)) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind
  if layout == "hsdp":
    assert report["replica_all_reduce_bytes"] == report["reduce_scatter_bytes"] // shape[1] > 0
  else:
    assert report["replica_all_reduce_bytes"] == 0
  expected = report["replica_all_reduce_bytes"] + report["persistent_grad_all_reduce_bytes"]
  assert expected < executed["all_reduce_bytes"] <= expected + 16  # + the loss

  # per mesh axis, from the compiled program's replica groups
  by_axis = zjax.hlo.executed_by_axis(text, dict(mesh.shape))
  assert by_axis["all_gather"] == report["all_gather_bytes_by_axis"]
  assert by_axis["reduce_scatter"] == report["reduce_scatter_bytes_by_axis"]
  reduced = dict(by_axis["all_reduce"])
  reduced["data+fsdp"] -= 4  # the loss's mean, not in the report
  assert {k: v for k, v in reduced.items() if v} == report["all_reduce_bytes_by_axis"]
  if layout == "hpz":  # forward gathers span both axes, backward re-gathers the shard axis
    assert set(report["all_gather_bytes_by_axis"]) == {"data+fsdp", "fsdp"}
    assert report["secondary_bytes"] > 0
  else:
    assert report["secondary_bytes"] == 0


@pytest.mark.parametrize("layout", ["hsdp", "hpz"])
def test_replica_groups_of_every_collective(layout):
  """HSDP: gathers and reduce-scatters inside a shard group, one all-reduce per gradient
  shard across the groups. hpZ: forward gathers and reduce-scatters over all 8 devices,
  backward re-gathers inside a shard group only."""
  loss, params, batch = gpt_setup()
  mesh = hsdp_mesh((2, 4))
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=LAYOUTS[layout])
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  text = zjax.hlo.compile_for_analysis(
    step.lower(zjax.shard(params, schedule, mesh), batch)
  ).as_text()
  shard_groups = {(0, 1, 2, 3), (4, 5, 6, 7)}  # device ids along "fsdp"
  everyone = {tuple(range(8))}
  found = {"all_gather": [], "reduce_scatter": [], "all_reduce": []}
  for c in zjax.hlo.collectives(text):
    found[c.kind].append(set(c.groups) or everyone)
  if layout == "hsdp":
    assert all(g == shard_groups for g in found["all_gather"] + found["reduce_scatter"])
    assert {(0, 4), (1, 5), (2, 6), (3, 7)} in found["all_reduce"]
  else:  # as executed: a collective in a while body once per iteration
    assert all(g == everyone for g in found["reduce_scatter"] + found["all_reduce"])
    trips = zjax.hlo.while_loops(text)
    gathers = [
      (set(c.groups) == shard_groups, trips.get(c.computation, 1))
      for c in zjax.hlo.collectives(text)
      if c.kind == "all_gather"
    ]
    assert (
      sum(n for inside, n in gathers if inside)
      == schedule.report()["backward_all_gather_count"]
      > 0
    )
    assert (
      sum(n for inside, n in gathers if not inside) == schedule.report()["forward_all_gather_count"]
    )


def train_five_steps(loss, params, batch, mesh, config):
  """(schedule, trainer, state after 5 adamw steps on `batch`, the 5 losses)."""
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  trainer = zjax.zero3(loss, ADAMW, schedule, mesh=mesh)
  state, losses = trainer.init(params), []
  for _ in range(5):
    state, metrics = trainer.step(state, batch)
    losses.append(metrics["loss"])
  return schedule, trainer, state, losses


@pytest.fixture(scope="module")
def gpt_reference():
  """The GPT example after 5 adamw steps: single-device optax, and flat 8-device zjax."""
  loss, params, batch = gpt_setup()
  flat_mesh = mesh_of(8)
  flat_config = dataclasses.replace(CONFIG, replicate_axes=())
  _, flat, flat_state, _ = train_five_steps(loss, params, batch, flat_mesh, flat_config)
  return (
    loss,
    params,
    batch,
    reference_run(loss, ADAMW, params, [batch] * 5),
    flat.gather_params(flat_state),
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "layout,shape",
  [("hsdp", (2, 4)), ("hsdp", (4, 2)), ("hpz", (2, 4)), ("hpz", (4, 2)), ("flat2d", (2, 4))],
)
def test_five_adamw_steps_equal_optax_and_flat_zero3(gpt_reference, layout, shape):
  loss, params, batch, (ref_params, ref_losses), flat_params = gpt_reference
  mesh = hsdp_mesh(shape)
  schedule, trainer, state, losses = train_five_steps(loss, params, batch, mesh, LAYOUTS[layout])
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(trainer.gather_params(state), ref_params, rtol=1e-5, atol=PARAM_ATOL)
  # HSDP: 1/S of each sharded parameter per device; hpZ and flat: 1/(R*S), as flat 8-device
  # ZeRO-3 (+ the persistent ones), as the report says
  assert zjax.per_device_bytes(state.params) == schedule.report()["state_bytes_per_device"]
  assert_trees_close(trainer.gather_params(state), flat_params, rtol=1e-5, atol=PARAM_ATOL)


@pytest.mark.slow
def test_checkpoints_move_between_flat_hsdp_and_hpz_bitwise(tmp_path):
  """flat 8 -> HSDP 2x4 -> hpZ 4x2 -> flat 4, a step on each."""
  loss, params, batch = gpt_setup()
  flat_mesh, hsdp, half = mesh_of(8), hsdp_mesh((2, 4)), mesh_of(4)
  flat_config = dataclasses.replace(CONFIG, replicate_axes=())

  def trainer(mesh, config):
    return zjax.zero3(
      loss, ADAMW, zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config), mesh=mesh
    )

  flat, hybrid, four = (
    trainer(flat_mesh, flat_config),
    trainer(hsdp, CONFIG),
    trainer(half, flat_config),
  )
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
  hpz = trainer(hsdp_mesh((4, 2)), HPZ)
  on_hpz = ckpt.restore(hpz)
  ckpt.close()
  assert_trees_close(
    hpz.gather_params(on_hpz),
    jax.tree.map(np.asarray, hybrid.gather_params(on_hsdp)),
    rtol=0,
    atol=0,
  )
  on_hpz, _ = hpz.step(on_hpz, batch)
  ckpt = zjax.CheckpointManager(tmp_path / "c", hpz)
  ckpt.save(3, on_hpz)
  ckpt.wait_until_finished()
  on_four = ckpt.restore(four)
  ckpt.close()
  assert_trees_close(
    four.gather_params(on_four), jax.tree.map(np.asarray, hpz.gather_params(on_hpz)), rtol=0, atol=0
  )
  assert int(on_four.step) == 3


def test_bad_hsdp_input_is_named():
  loss, params, batch = mlp()
  mesh = hsdp_mesh((2, 4))
  with pytest.raises(
    ValueError, match="replicate_axes names 'fsdp', an axis parameters are sharded over"
  ):
    zjax.ZeroConfig(replicate_axes=("fsdp",))
  with pytest.raises(ValueError, match="replicate_axes names 'data' twice"):
    zjax.ZeroConfig(replicate_axes=("data", "data"))
  with pytest.raises(
    ValueError, match="replicate_axes must be a non-empty string naming a mesh axis"
  ):
    zjax.ZeroConfig(replicate_axes=("data", ""))
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=CONFIG)
  with pytest.raises(
    zjax.ZjaxError,
    match=r"not divisible by the 8 devices of the data axes "
    r"\('data', 'fsdp'\)",
  ):
    zjax.value_and_grad(loss, schedule, mesh=mesh)(
      zjax.shard(params, schedule, mesh), jax.tree.map(lambda x: x[:12], batch)
    )
  with pytest.raises(
    zjax.ZjaxError,
    match=r"replicates over 'data' \(ZeroConfig."
    r"replicate_axes\), an axis this mesh lacks",
  ):
    zjax.value_and_grad(loss, schedule, mesh=mesh_of(4))
  with pytest.raises(
    zjax.ZjaxError,
    match="Mesh axis 'data' has size 1, but the schedule "
    "was planned with it as a replicate axis of size 2",
  ):
    zjax.value_and_grad(
      loss, schedule, mesh=jax.make_mesh((1, 4), ("data", "fsdp"), devices=jax.devices()[:4])
    )
  with pytest.raises(
    zjax.ZjaxError, match="Mesh axis 'data' has size 2, but the schedule does not use it"
  ):
    flat = zjax.compile_schedule(loss, params, batch, num_devices=4)
    zjax.value_and_grad(loss, flat, mesh=mesh)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "hpz"])
def test_clipping_accumulation_sub_groups_and_frozen_params(layout):
  """The global gradient norm counts each element once (not once per replica); clipping,
  gradient accumulation, sub-groups and frozen parameters give single-device optax's
  result."""
  loss, params, batch = mlp(num_layers=3, batch=32)
  frozen_loss = lambda p, b: loss(dict(p, layer1=jax.lax.stop_gradient(p["layer1"])), b)
  ref_norm = float(optax.tree.norm(jax.jit(jax.grad(frozen_loss))(params, batch)))
  optimizer = optax.chain(optax.clip_by_global_norm(ref_norm / 10), optax.adam(1e-2, eps=1e-6))
  ref_params, ref_losses = reference_run(frozen_loss, optimizer, params, [batch] * 3)
  mesh = hsdp_mesh((2, 4))
  config = dataclasses.replace(LAYOUTS[layout], sub_group_size=100)
  schedule = zjax.compile_schedule(
    loss, params, batch, mesh=mesh, config=config, frozen=lambda path: path.startswith("['layer1']")
  )
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


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "hpz"])
def test_bf16_compute_equals_flat_bf16(layout):
  """Each device computes the same share in bf16 as on a flat 8-device mesh (the data axis
  is major); only the fp32 summation order of the gradients differs. hpZ's secondary holds
  the bf16 wire buffer: backward re-gathers are bitwise the forward's. Unrolled on both
  meshes: rolled, hpZ gathers whole layers and the flat mesh part by part (knobs inside a
  layer), and the two loops round bf16 in different places (rolled hpZ: test_rolling.py)."""
  loss, params, batch = gpt_setup()
  bf16 = dataclasses.replace(LAYOUTS[layout], compute_dtype=jnp.bfloat16, roll_layers=False)
  results = []
  for mesh, config in (
    (hsdp_mesh((2, 4)), bf16),
    (mesh_of(8), dataclasses.replace(bf16, replicate_axes=(), secondary_partition=False)),
  ):
    schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
    value, grads = zjax.value_and_grad(loss, schedule, mesh=mesh)(
      zjax.shard(params, schedule, mesh), batch
    )
    results.append((value, zjax.unshard(grads, schedule)))
  np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
  assert_trees_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_outside_style_models_under_hsdp(name):
  """tests/real_models.py on a 2x4 mesh; the ResNet synchronises BatchNorm over both data
  axes (axis_name=("data", "fsdp")), which equals full-batch BatchNorm."""
  case = resnet_syncbn(axis_name=("data", "fsdp")) if name == "resnet_syncbn" else CASES[name]()
  mesh = hsdp_mesh((2, 4))
  config = dataclasses.replace(CONFIG, param_persistence_threshold=0)
  schedule = zjax.compile_schedule(
    case.loss_fn, case.params, case.batch, mesh=mesh, config=config, extra=case.extra
  )
  sharded = zjax.shard(case.params, schedule, mesh)
  args = (sharded, case.batch) if case.extra is None else (sharded, case.batch, case.extra)
  out, grads = zjax.value_and_grad(case.loss_fn, schedule, mesh=mesh)(*args)
  ref_out, ref_grads = case_reference(case)
  assert_same_outputs(case, out, ref_out)
  assert_trees_close(zjax.unshard(grads, schedule), ref_grads)


def test_hpz_schedule_shows_and_checks_its_secondary_partition():
  """The secondary partition is its own steps with its bytes; an edited file that breaks
  it (or the axes a collective spans) is refused, naming the step."""
  import json

  loss, params, batch = mlp()
  schedule = zjax.compile_schedule(
    loss,
    params,
    batch,
    axis_sizes={"data": 2, "fsdp": 4},
    config=dataclasses.replace(HPZ, roll_layers=False),
  )
  assert (schedule.num_devices, schedule.shards, schedule.replicas) == (8, 4, 2)
  kept = [st.bucket for st in schedule.forward if st.op == "keep_secondary"]
  dropped = [st.bucket for st in schedule.backward if st.op == "drop_secondary"]
  regathered = [st.bucket for st in schedule.backward if st.op == "gather"]
  assert sorted(kept) == sorted(dropped) == sorted(set(regathered)) and kept
  sim = schedule._simulation  # each re-gathered bucket's gathered bytes, 1/S of them kept
  assert schedule.report()["secondary_bytes"] == sum(sim.bucket_bytes[b] // 4 for b in kept)
  table = str(schedule)
  assert "keep secondary" in table and "drop secondary" in table
  assert "hpZ" in table and "data+fsdp" in table
  assert zjax.Schedule.from_json(schedule.to_json()) == schedule

  def edited(change):
    data = json.loads(schedule.to_json())
    change(data)
    return json.dumps(data)

  def drop_keeps(d):
    d["forward"] = [st for st in d["forward"] if st["op"] != "keep_secondary"]

  def widen_regather(d):
    next(st for st in d["backward"] if st["op"] == "gather")["axes"] = ["data", "fsdp"]

  def plain_config(d):
    d["config"]["secondary_partition"] = False
    d["num_devices"] = 4
    for st in d["forward"] + d["backward"]:
      st.pop("axes", None)

  for change, message in (
    (drop_keeps, "none is kept: add keep_secondary"),
    (
      widen_regather,
      r"gather runs over axes \['fsdp'\] under this "
      r"config",
    ),
    (plain_config, "config has no secondary partition"),
  ):
    with pytest.raises(zjax.ScheduleError, match=message):
      zjax.Schedule.from_json(edited(change))
  with pytest.raises(ValueError, match=r"secondary_partition \(hpZ\) needs replicate_axes"):
    zjax.ZeroConfig(secondary_partition=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "scanned_gpt"])
def test_memory_of_each_layout_as_predicted(name):
  """Per-device state: HSDP 1/S, flat and hpZ 1/(R*S) of each sharded parameter (+ the
  persistent ones), from the arrays and from the compiled program's arguments; hpZ's extra
  temp memory over flat is its secondary partition (within 30%: XLA's buffer assignment;
  the layers not rolled, so that the unrolled program is measured). The scanned GPT's scan
  is a loop whose peak XLA places where part of the secondaries no longer counts, so there
  the secondaries bound the extra from above only (as for rolled loops: test_rolling.py)."""
  loss, params, batch = MODELS[name]()
  mesh = hsdp_mesh((2, 4))
  found = {}
  for layout, config in LAYOUTS.items():
    config = dataclasses.replace(config, roll_layers=False)
    schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
    sharded = zjax.shard(params, schedule, mesh)
    memory = zjax.hlo.compile_for_analysis(
      zjax.value_and_grad(loss, schedule, mesh=mesh).lower(sharded, batch)
    ).memory_analysis()
    report = schedule.report()
    assert zjax.per_device_bytes(sharded) == report["state_bytes_per_device"]
    found[layout] = (report, memory)
  batch_share = {m.argument_size_in_bytes - r["state_bytes_per_device"] for r, m in found.values()}
  assert len(batch_share) == 1  # the arguments are the state and the same batch share
  persistent = sum(p.size * 4 for p in schedule.params if p.persistent)
  state = {k: r["state_bytes_per_device"] - persistent for k, (r, _) in found.items()}
  assert state["hpz"] == state["flat2d"] and 1.9 < state["hsdp"] / state["flat2d"] <= 2
  secondary = found["hpz"][0]["secondary_bytes"]
  extra = found["hpz"][1].temp_size_in_bytes - found["flat2d"][1].temp_size_in_bytes
  assert 0 < extra <= 1.25 * secondary, (extra, secondary)
  if name == "gpt":  # unrolled: every secondary is live at the peak (forward -> backward)
    assert 0.7 * secondary <= extra, (extra, secondary)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "hpz"])
@pytest.mark.parametrize("name", ["scanned_gpt", "tied_cond"])
def test_five_adamw_steps_of_the_scanned_and_tied_models(name, layout):
  loss, params, batch = MODELS[name]()
  ref_params, ref_losses = reference_run(loss, ADAMW, params, [batch] * 5)
  mesh = hsdp_mesh((2, 4))
  _, trainer, state, losses = train_five_steps(loss, params, batch, mesh, LAYOUTS[layout])
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(trainer.gather_params(state), ref_params, rtol=1e-5, atol=PARAM_ATOL)
