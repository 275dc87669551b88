"""Automatic layer rolling: an unrolled model's identical layers run as one loop step.

Parity against plain JAX / optax and against the same model not rolled; the compiled
program's while bodies against the schedule; what is rolled and what is not (and why);
checkpoints across rolled and unrolled schedules; schedule files."""

import dataclasses
import functools
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import real_models
import zjax
from helpers import (
  assert_parity,
  assert_report_matches,
  assert_trees_close,
  init,
  mesh_of,
  run_zjax,
  steps_like_optax,
)
from test_train import reference_run
from zjax._src.schedule import ir
from zjax._src.xla import hlo
from zjax.models.gpt import GPT, GPTConfig, make_loss_fn

ROLL = zjax.ZeroConfig(param_persistence_threshold=1024)
UNROLL = dataclasses.replace(ROLL, roll_layers=False)
# After Adam steps, rolled or not: Adam's m / (sqrt(v) + eps) turns a reduction-order
# difference dg of a near-zero gradient element into up to lr * dg / eps per step. With
# dg ~ 1e-9 (float32 sums of ~1e-2 terms) and 5 steps: 5e-5 at eps 1e-6, which CI's CPU
# exceeded once (5.9e-5 on one element of 1024); eps 1e-5 bounds it at 5e-6, a tenth of
# the tolerance. Gradients are compared at atol 1e-6 (test_rolling's parity tests),
# losses at rtol 1e-5.
ADAMW = optax.adamw(1e-2, eps=1e-5)
PARAM_ATOL = 5e-5


def gpt(n_layer, d_model=32, **kw):
  cfg = GPTConfig(n_layer=n_layer, d_model=d_model, n_head=4, d_ff=4 * d_model, seq_len=16, **kw)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
  return make_loss_fn(model), init(model, jax.random.key(1), tokens[:, :-1]), {"tokens": tokens}


def loops(schedule):
  return [st for st in schedule.forward if st.op == ir.LOOP_OP]


def rolled_lengths(schedule):
  return [st.length for st in loops(schedule)]


class Block(nn.Module):
  width: int
  rate: float = 0.0

  @nn.compact
  def __call__(self, x, shared):
    h = nn.gelu(nn.Dense(self.width, name="up")(nn.LayerNorm()(x)))
    h = nn.Dropout(self.rate, deterministic=False)(h)
    return x + nn.Dense(x.shape[-1], name="down")(h) + 0.1 * jnp.tanh(x @ shared)


class Net(nn.Module):
  """Unrolled blocks sharing one weight (a loop const), with input and head layers."""

  widths: tuple = (64, 64, 64, 64)
  rate: float = 0.0
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    shared = self.param("shared", nn.initializers.normal(0.1), (32, 32))
    x = nn.Dense(32, name="inp")(x)
    block = nn.remat(Block) if self.remat else Block
    for i, width in enumerate(self.widths):
      x = block(width, self.rate, name=f"block_{i}")(x, shared)
    return nn.Dense(8, name="head")(x)


def net(**kw):
  model = Net(**kw)
  x = jax.random.normal(jax.random.key(0), (16, 32))
  y = jax.random.normal(jax.random.key(1), (16, 8))
  params = init(model, {"params": jax.random.key(2)}, x)["params"]

  def loss(p, b):
    out = model.apply({"params": p}, b["x"], rngs={"dropout": b["key"]})
    return jnp.mean((out - b["y"]) ** 2)

  return loss, params, {"x": x, "y": y, "key": jax.random.key(5)}


NET = zjax.ZeroConfig(param_persistence_threshold=100)


def assert_rolled_equals_unrolled(loss, params, batch, config, rtol=1e-5, atol=1e-6):
  rolled = run_zjax(loss, params, batch, config=config)
  unrolled = run_zjax(loss, params, batch, config=dataclasses.replace(config, roll_layers=False))
  assert loops(rolled[0]) and not loops(unrolled[0])
  np.testing.assert_allclose(rolled[1], unrolled[1], rtol=rtol, atol=atol)
  assert_trees_close(rolled[2], unrolled[2], rtol=rtol, atol=atol)
  return rolled[0]


# ---- parity -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_unrolled_gpt_rolls_and_its_gradients_equal_plain_jax(n):
  schedule, _ = assert_parity(*gpt(4), n=n, config=ROLL)
  assert rolled_lengths(schedule) == [4]
  assert schedule.rolling == (
    "rolled ops [8, 344): 4 layers of 84 ops (['params']['block_0'] .. ['params']['block_3'])",
  )
  # the tied embedding (read before and after the blocks) stays a regular bucket
  embed = schedule.param("['params']['embed']['embedding']")
  assert not schedule.buckets[embed.bucket].stacked
  rolled = [b for b in schedule.buckets if b.layers]
  assert len(rolled) == 3 and all(len(b.layers) == 4 for b in rolled)
  # attn/out (32 x 32) is persistent: stacked whole per layer, not gathered
  assert schedule.param("['params']['block_2']['attn']['out']['kernel']").persistent
  assert rolled[0].layers[3] == ("['params']['block_3']['attn']['qkv']['kernel']",)


@pytest.mark.slow
@pytest.mark.parametrize("n_layer", [4, 16])
def test_gpt_trains_like_optax_rolled_or_not(n_layer):
  loss, params, batch = gpt(n_layer)
  batches = [batch] * 5
  ref_params, ref_losses = reference_run(loss, ADAMW, params, batches)
  for config in (ROLL, UNROLL):
    mesh = mesh_of(8)
    schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
    assert rolled_lengths(schedule) == ([n_layer] if config.roll_layers else [])
    trainer = zjax.zero3(loss, ADAMW, schedule, mesh=mesh)
    state, losses = trainer.init(params), []
    for b in batches:
      state, metrics = trainer.step(state, b)
      losses.append(metrics["loss"])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(trainer.gather_params(state), ref_params, rtol=1e-5, atol=PARAM_ATOL)


class NNXNet(nnx.Module):
  def __init__(self, rngs, widths=(48, 48, 48)):
    self.inp = nnx.Linear(16, 48, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(48, w, rngs=rngs) for w in widths])
    self.norms = nnx.List([nnx.LayerNorm(w, rngs=rngs) for w in widths])
    self.out = nnx.Linear(48, 4, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for layer, norm in zip(self.layers, self.norms):
      x = x + jax.nn.tanh(norm(layer(x)))
    return self.out(x)


@pytest.mark.slow
def test_nnx_unrolled_layers_roll():
  model = NNXNet(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p, b):
    return jnp.mean((nnx.merge(graphdef, p, rest)(b["x"]) - b["y"]) ** 2)

  batch = {
    "x": jax.random.normal(jax.random.key(0), (16, 16)),
    "y": jax.random.normal(jax.random.key(1), (16, 4)),
  }
  for n in (8, 4):
    schedule, _ = assert_parity(loss, params, batch, n=n, config=NET)
    assert rolled_lengths(schedule) == [3]


@pytest.mark.slow
def test_only_the_identical_layers_roll():
  loss, params, batch = net(widths=(64, 64, 64, 128))
  schedule, _ = assert_parity(loss, params, batch, config=NET)
  assert rolled_lengths(schedule) == [3]
  assert any("not rolled" in note and "['block_3']" in note for note in schedule.rolling)
  loss, params, batch = net(widths=(64, 64, 128, 64, 64, 64))
  schedule, _ = assert_parity(loss, params, batch, n=4, config=NET)
  assert rolled_lengths(schedule) == [2, 3]


@pytest.mark.slow
@pytest.mark.parametrize(
  "own_tables,n", [(True, 8), (False, 4)], ids=["tables-per-layer", "tables-shared"]
)
def test_llama_style_layers_all_roll(own_tables, n):
  """Rotary tables computed once before the layers, or (as Hugging Face's Flax Llama) each
  layer's own numpy constant of equal values: every layer rolls, gradients equal plain
  JAX's and the compiled collectives the report."""
  case = real_models.llama(own_tables=own_tables)
  schedule, compiled = assert_parity(case.loss_fn, case.params, case.batch, n=n, config=ROLL)
  assert rolled_lengths(schedule) == [3], schedule.rolling
  assert schedule.rolling[0].endswith("(['layers_0'] .. ['layers_2'])")
  report, compiled = schedule.report(), hlo.summarize(compiled)
  for kind in ("all_gather", "reduce_scatter"):
    assert (compiled[f"{kind}_count"], compiled[f"{kind}_bytes"]) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind


@pytest.mark.slow
def test_t5_style_stacks_roll_after_the_layer_holding_the_position_bias():
  """T5: the first layer of each stack holds the relative position bias and hands it to
  the others; layers 1..L-1 of the encoder and of the decoder roll (dropout on: zjax
  rolled against zjax unrolled, which draw the same masks), report == HLO."""
  case = real_models.t5(batch_size=8)
  rolled = run_zjax(case.loss_fn, case.params, case.batch, config=ROLL)
  unrolled = run_zjax(case.loss_fn, case.params, case.batch, config=UNROLL)
  np.testing.assert_allclose(rolled[1], unrolled[1], rtol=1e-5)
  assert_trees_close(rolled[2], unrolled[2], rtol=1e-5, atol=1e-6)
  schedule = rolled[0]
  assert rolled_lengths(schedule) == [2, 2], schedule.rolling
  assert [
    note.endswith(f"(['{stack}_1'] .. ['{stack}_2'])")
    for note, stack in zip(schedule.rolling, ("encoder", "decoder"))
  ] == [True, True]
  report, compiled = schedule.report(), hlo.summarize(rolled[3])
  for kind in ("all_gather", "reduce_scatter"):
    assert (compiled[f"{kind}_count"], compiled[f"{kind}_bytes"]) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind


@pytest.mark.slow
def test_griffin_style_remat_custom_vjp_scan_layers_roll():
  case = real_models.griffin(batch_size=8)
  schedule, _ = assert_parity(case.loss_fn, case.params, case.batch, config=ROLL)
  assert rolled_lengths(schedule) == [3], schedule.rolling


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_shared_weight_and_remat_blocks(remat):
  schedule, _ = assert_parity(*net(remat=remat), config=NET)
  assert rolled_lengths(schedule) == [4]
  shared = schedule.param("['shared']")
  assert not schedule.buckets[shared.bucket].stacked  # a loop const: gathered once


@pytest.mark.slow
def test_dropout_blocks_draw_the_same_masks_rolled_or_not():
  """Flax folds a hash of each block's name into its dropout key: a per-layer constant
  that the loop takes as a per-iteration input."""
  schedule = assert_rolled_equals_unrolled(*net(rate=0.3), NET)
  assert rolled_lengths(schedule) == [4]


@pytest.mark.slow
def test_bf16_compute_rolled_equals_unrolled():
  config = dataclasses.replace(ROLL, compute_dtype=jnp.bfloat16)
  assert_rolled_equals_unrolled(*gpt(4), config, rtol=2e-2, atol=2e-3)


@pytest.mark.slow
def test_frozen_blocks_split_the_run():
  loss, params, batch = net(widths=(64,) * 6)
  config = NET
  mesh = mesh_of(8)
  frozen = lambda path: "block_2" in path  # noqa: E731
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config, frozen=frozen)
  assert rolled_lengths(schedule) == [2, 3]
  assert any("frozen flag" in note for note in schedule.rolling)
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  got, grads = step(zjax.shard(params, schedule, mesh), batch)
  want, ref = jax.jit(jax.value_and_grad(loss))(params, batch)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  ref = jax.tree_util.tree_map_with_path(
    lambda path, g: jnp.zeros_like(g) if frozen(jax.tree_util.keystr(path)) else g, ref
  )
  assert_trees_close(zjax.unshard(grads, schedule), ref)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "hpz"])
def test_rolled_layers_on_a_two_axis_mesh(layout):
  config = dataclasses.replace(ROLL, replicate_axes=("data",), secondary_partition=layout == "hpz")
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  loss, params, batch = gpt(4)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  assert rolled_lengths(schedule) == [4]
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  got, grads = step(zjax.shard(params, schedule, mesh), batch)
  want, ref = jax.jit(jax.value_and_grad(loss))(params, batch)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert_trees_close(zjax.unshard(grads, schedule), ref)
  compiled = hlo.compile_for_analysis(step.lower(zjax.shard(params, schedule, mesh), batch))
  executed, report = hlo.executed(compiled.as_text()), schedule.report()
  for kind in ("all_gather", "reduce_scatter"):
    assert executed[f"{kind}_count"] == report[f"{kind}_count"], kind
  if layout == "hpz":  # every layer's secondary kept: it costs memory, as predicted
    flat = dataclasses.replace(ROLL, shard_axes=("data", "fsdp"))
    flat_schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=flat)
    flat_temp = hlo.compile_for_analysis(
      zjax.value_and_grad(loss, flat_schedule, mesh=mesh).lower(
        zjax.shard(params, flat_schedule, mesh), batch
      )
    ).memory_analysis()
    temp = compiled.memory_analysis().temp_size_in_bytes
    predicted = (
      report["peak_live_param_bytes"] + report["peak_live_grad_bytes"] + report["secondary_bytes"]
    )
    assert 0 < report["secondary_bytes"] and flat_temp.temp_size_in_bytes < temp <= predicted


# ---- the compiled program ----------------------------------------------------------------


@pytest.mark.slow
def test_while_bodies_hold_one_layers_collectives():
  schedule, _, _, compiled = run_zjax(*gpt(4), config=ROLL)
  text, report = compiled.as_text(), schedule.report()
  bodies = hlo.while_loops(text)
  in_bodies = {}
  for c in hlo.collectives(text):
    if c.computation in bodies:
      in_bodies.setdefault(c.computation, []).append(c.kind)
  expected = sorted(
    (
      loop["length"] - loop["prefetch"],
      loop["all_gather_count_per_iteration"],
      loop["reduce_scatter_count_per_iteration"],
    )
    for loop in report["loops"]
  )
  found = sorted(
    (bodies[b], kinds.count("all_gather"), kinds.count("reduce_scatter"))
    for b, kinds in in_bodies.items()
  )
  assert found == expected and [x[1] for x in found] == [3, 3]  # one layer's 3 kernels
  executed = hlo.executed(text)
  for kind in ("all_gather", "reduce_scatter"):
    assert executed[f"{kind}_count"] == report[f"{kind}_count"], kind
    assert executed[f"{kind}_bytes"] == report[f"{kind}_bytes"], kind


@functools.lru_cache(maxsize=None)  # shared by the tests of the compiled program
def _compiled(n_layer, config):
  mesh = mesh_of(8)
  loss, params, batch = gpt(n_layer)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  sharded = zjax.shard(params, schedule, mesh)
  return hlo.compile_for_analysis(
    zjax.value_and_grad(loss, schedule, mesh=mesh).lower(sharded, batch)
  )


@pytest.mark.slow
def test_program_does_not_grow_with_depth_and_temp_stays_below_unrolled():
  """What makes compile time flat: the rolled program's text holds the same collectives at
  any depth. Per-device temp: rolled <= unrolled."""
  shallow, deep = _compiled(4, ROLL), _compiled(12, ROLL)
  count = lambda c: len(hlo.collectives(c.as_text()))  # noqa: E731
  assert count(shallow) == count(deep)
  unrolled = _compiled(12, UNROLL)
  assert count(unrolled) > count(deep)
  temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
  assert temp(deep) <= temp(unrolled)


def _entry_parameters(compiled) -> int:
  entry = next(line for line in compiled.as_text().splitlines() if line.startswith("ENTRY"))
  return entry.count(": ")  # "name: shape" per parameter


def test_rolled_layers_are_one_stacked_leaf_and_the_program_keeps_its_size_with_depth():
  """Stacked storage: each per-layer parameter's L layers are one [L, padded layer] leaf at
  layer 0's path (None at the others), so the compiled step has as many inputs and outputs
  (and fusions: each leaf's slice or copy is one) at 12 layers as at 4."""
  mesh = mesh_of(8)
  loss, params, batch = gpt(4)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=ROLL)
  sharded = zjax.shard(params, schedule, mesh)
  qkv = "['params']['block_0']['attn']['qkv']['kernel']"
  stack = schedule.storage[[leaf.path for leaf in schedule.storage].index(qkv)]
  assert stack.rolled and [schedule.params[i].path for i in stack.members] == [
    qkv.replace("block_0", f"block_{i}") for i in range(4)
  ]
  assert sharded["params"]["block_0"]["attn"]["qkv"]["kernel"].shape == (4, 32 * 96)
  assert sharded["params"]["block_2"]["attn"]["qkv"]["kernel"] is None
  assert {
    s.data.shape for s in sharded["params"]["block_0"]["attn"]["qkv"]["kernel"].addressable_shards
  } == {(4, 32 * 96 // 8)}
  for a, b in zip(jax.tree.leaves(zjax.unshard(sharded, schedule)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  unrolled = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=UNROLL)
  assert (
    zjax.per_device_bytes(sharded)
    == zjax.per_device_bytes(zjax.shard(params, unrolled, mesh))
    == schedule.report()["state_bytes_per_device"]
  )
  shallow, deep = _compiled(4, ROLL), _compiled(12, ROLL)
  assert _entry_parameters(shallow) == _entry_parameters(deep) == len(schedule.storage) + 1
  fusions = lambda c: c.as_text().count(" fusion(")  # noqa: E731
  assert fusions(deep) == fusions(shallow)


@pytest.mark.slow
def test_trainer_on_stacked_storage_inits_steps_and_groups_like_optax():
  """init_from builds each stack row by row; sub-groups split at stacks; clipping by the
  global norm works across the stacked leaves (it matches optax, see the parity tests)."""
  mesh = mesh_of(8)
  cfg = GPTConfig(n_layer=4, d_model=32, n_head=4, d_ff=128, seq_len=16)
  model = GPT(cfg)
  loss, params, batch = gpt(4)
  config = dataclasses.replace(ROLL, sub_group_size=600)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  opt = optax.chain(optax.clip_by_global_norm(0.05), ADAMW)
  trainer = zjax.zero3(loss, opt, schedule, mesh=mesh)
  built = trainer.init_from(model.init, jax.random.key(1), batch["tokens"][:, :-1])
  state = trainer.init(params)
  assert jax.tree.structure(built) == jax.tree.structure(state)
  assert_trees_close(trainer.gather_params(built), params, rtol=0, atol=1e-7)  # as jit(init)
  groups = zjax._src.train.train.plan_sub_groups(schedule)
  local = [ir.local_elements(leaf.entry, 8) for leaf in schedule.storage]
  big = [k for k, leaf in enumerate(schedule.storage) if leaf.rolled and local[k] > 600]
  assert len(big) == 4 and all([k] in groups for k in big)  # out (replicated), qkv, fc, proj
  assert all(len(g) == 1 or sum(local[k] for k in g) <= 600 for g in groups)
  state, ref_params = steps_like_optax(trainer, state, loss, opt, params, batch, 3)
  assert_trees_close(trainer.gather_params(state), ref_params, atol=PARAM_ATOL)


@pytest.mark.slow
def test_per_leaf_statistics_are_refused_on_stacks_and_work_unrolled():
  """LAMB's trust ratio is a per-leaf norm: on a rolled stack it would span every layer,
  so zero3 refuses it, naming the parameter and the fix; unrolled it trains."""
  loss, params, batch = gpt(2)
  mesh = mesh_of(8)
  lamb = optax.lamb(1e-3)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=ROLL)
  with pytest.raises(zjax.ZjaxError, match=r"block_\d.*roll_layers=False"):
    zjax.zero3(loss, lamb, schedule, mesh=mesh).init(params)
  unrolled = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=UNROLL)
  trainer = zjax.zero3(loss, lamb, unrolled, mesh=mesh)
  state, metrics = trainer.step(trainer.init(params), batch)
  assert np.isfinite(metrics["loss"])


def test_edited_stacks_are_refused():
  schedule = zjax.compile_schedule(*gpt(3), num_devices=8, config=ROLL)
  data = json.loads(schedule.to_json())
  layered = [p for p in data["params"] if p.get("stack")]
  assert layered and all(
    p["stack"].replace("block_0", f"block_{p['layer']}") == p["path"] for p in layered
  )
  layered[-1]["layer"] = 0
  with pytest.raises(zjax.ScheduleError, match="holds layers|lists .* as layer"):
    zjax.Schedule.from_json(json.dumps(data))
  del layered[-1]["stack"], layered[-1]["layer"]
  with pytest.raises(zjax.ScheduleError, match="says it is layer 0 of the stack of|holds 2 la"):
    zjax.Schedule.from_json(json.dumps(data))


# ---- what is not rolled, files, checkpoints --------------------------------------------


def test_nothing_repeats_says_so():
  params = {"a": jnp.ones((64, 32)), "b": jnp.ones((32, 16))}
  schedule = zjax.compile_schedule(
    lambda p, x: jnp.mean(jnp.tanh(x @ p["a"]) @ p["b"]),
    params,
    jnp.ones((8, 64)),
    num_devices=8,
    config=NET,
  )
  assert schedule.rolling == ("no repeated layers",) and not loops(schedule)
  off = zjax.compile_schedule(*gpt(2), num_devices=8, config=UNROLL)
  assert off.rolling == ("layer rolling is off (ZeroConfig.roll_layers=False)",)
  with pytest.raises(ValueError, match="ZeroConfig.roll_layers must be True or False"):
    zjax.ZeroConfig(roll_layers="yes")


def test_a_layer_reading_another_layers_weight_is_not_rolled():
  k = jax.random.split(jax.random.key(0), 5)
  params = {f"w{i}": jax.random.normal(k[i], (32, 32)) / 6 for i in range(4)}

  def loss(p, x):  # layer i also reads layer i-1's weight: not a loop
    for i in range(4):
      x = jnp.tanh(x @ p[f"w{i}"]) + (0.1 * x @ p[f"w{i - 1}"] if i else 0.0)
    return jnp.mean(x**2)

  x = jax.random.normal(k[4], (16, 32))
  schedule, _ = assert_parity(loss, params, x, config=NET)
  assert not any(note.startswith("rolled") for note in schedule.rolling)
  assert any(
    "is also read outside this layer (by another layer" in note for note in schedule.rolling
  ), schedule.rolling


def test_schedule_file_round_trip_and_edited_layers():
  schedule = zjax.compile_schedule(*gpt(3), num_devices=8, config=ROLL)
  again = zjax.Schedule.from_json(schedule.to_json())
  assert again == schedule and again.rolling == schedule.rolling
  data = json.loads(schedule.to_json())
  rolled = next(b for b in data["buckets"] if b["layers"])
  rolled["layers"][2] = rolled["layers"][1]
  with pytest.raises(zjax.ScheduleError, match="lists a parameter in two layers"):
    zjax.Schedule.from_json(json.dumps(data))


@pytest.mark.slow
def test_checkpoint_saved_rolled_restores_unrolled_and_back(tmp_path):
  loss, params, batch = gpt(4)
  mesh = mesh_of(8)
  trainers = {
    c.roll_layers: zjax.zero3(
      loss, ADAMW, zjax.compile_schedule(loss, params, batch, mesh=mesh, config=c), mesh=mesh
    )
    for c in (ROLL, UNROLL)
  }
  for saved, restored in ((True, False), (False, True)):
    state, _ = trainers[saved].step(trainers[saved].init(params), batch)
    with zjax.CheckpointManager(tmp_path / str(saved), trainers[saved]) as ckpt:
      ckpt.save(1, state)
    back = zjax.CheckpointManager(tmp_path / str(saved)).restore(trainers[restored])
    for a, b in zip(
      jax.tree.leaves(trainers[saved].gather_params(state)),
      jax.tree.leaves(trainers[restored].gather_params(back)),
    ):
      np.testing.assert_array_equal(a, b)
    _, m1 = trainers[saved].step(state, batch)
    _, m2 = trainers[restored].step(back, batch)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)


def test_inspect_and_train_flags(tmp_path, capsys):
  from zjax.cli.main import build_parser, main

  for flag, rolled in (("--roll-layers", True), ("--no-roll-layers", False)):
    path = tmp_path / f"{rolled}.json"
    target = str(pathlib.Path(__file__).resolve().parents[1] / "examples/gpt.py")
    assert (
      main(
        [
          "inspect",
          target + ":inspect_gpt",
          "--devices",
          "8",
          "--summary",
          "--save",
          str(path),
          flag,
        ]
      )
      == 0
    )
    notes = json.loads(path.read_text())["rolling"]
    assert notes[0].startswith("rolled ops") == rolled
  capsys.readouterr()
  args = build_parser().parse_args(["train", "--no-roll-layers"])
  assert args.roll_layers is False


def edge_blocks(num_layers=4, d=12):
  """Blocks with the leaves FSDP tests like: an odd-shaped kernel (d*d not a multiple of
  8), a bf16 kernel, an unused leaf, an integer leaf, an empty leaf, a kernel read twice
  and inside a cond's branch."""
  keys = jax.random.split(jax.random.key(0), 2 * num_layers + 1)
  params = {
    f"b{i}": {
      "w": jax.random.normal(keys[2 * i], (d, d)) / 4,
      "v": (jax.random.normal(keys[2 * i + 1], (d, d)) / 4).astype(jnp.bfloat16),
      "unused": jnp.ones((3,)),
      "count": jnp.array(i, jnp.int32),
      "empty": jnp.zeros((0,)),
    }
    for i in range(num_layers)
  }

  def loss(p, b):
    x = b["x"]
    for i in range(num_layers):
      q = p[f"b{i}"]
      h = jnp.tanh(x @ q["w"]) + 0.5 * (x.astype(jnp.bfloat16) @ q["v"]).astype(jnp.float32)
      h = jax.lax.cond(jnp.sum(q["w"]) > 0, lambda h: h * 1.1, lambda h: h @ q["w"].T * 0.9, h)
      x = x + h + q["empty"].sum() + 0.01 * q["count"].astype(jnp.float32)
    return jnp.mean(x**2)

  return loss, params, {"x": jax.random.normal(keys[-1], (24, d))}


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 3])
def test_odd_mixed_unused_integer_empty_and_cond_leaves_roll(n):
  loss, params, batch = edge_blocks()
  config = zjax.ZeroConfig(param_persistence_threshold=0)
  schedule, compiled = assert_parity(loss, params, batch, n=n, config=config, rtol=2e-2, atol=2e-3)
  assert rolled_lengths(schedule) == [4]
  # the integer leaf's bucket is not re-gathered in backward (the vjp does not read it),
  # and the report counts exactly the collectives XLA keeps
  (loop,) = [st for st in schedule.backward if st.op == ir.LOOP_OP]
  regathered = {schedule.buckets[st.bucket].dtype for st in loop.body if st.op == "gather"}
  assert "int32" not in regathered
  report, compiled = schedule.report(), hlo.summarize(compiled)
  for kind in ("all_gather", "reduce_scatter"):
    assert (compiled[f"{kind}_count"], compiled[f"{kind}_bytes"]) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind
  # bf16 leaves and their gradients round where XLA fuses, which differs inside a loop (one
  # bf16 ulp): bf16 tolerances, as against plain JAX above
  assert_rolled_equals_unrolled(loss, params, batch, config, rtol=2e-2, atol=2e-3)


@pytest.mark.slow
def test_the_bench_model_trains_rolled_on_the_cpu_runtime():
  """The bench's default GPT (8 layers, d_model 128), rolled, 3 adamw steps like optax. A
  regression test for XLA CPU's collectives: ordering the loop's first gather after the
  collective before the loop aborted this program in the first step ("Check failed: id <
  num_threads" in the all-gather rendezvous)."""
  from zjax.bench.run import gpt_model

  model = gpt_model(8, 128, 16)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(
    model.loss_fn, model.params, model.batch, mesh=mesh, config=model.config
  )
  assert rolled_lengths(schedule) == [8]
  trainer = zjax.zero3(model.loss_fn, ADAMW, schedule, mesh=mesh)
  state, losses = trainer.init(model.params), []
  for _ in range(3):
    state, metrics = trainer.step(state, model.batch)
    losses.append(float(metrics["loss"]))

  @jax.jit
  def reference_step(params, opt_state):
    loss, grads = jax.value_and_grad(model.loss_fn)(params, model.batch)
    updates, opt_state = ADAMW.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params, opt_state, want = model.params, ADAMW.init(model.params), []
  for _ in range(3):
    params, opt_state, loss = reference_step(params, opt_state)
    want.append(float(loss))
  np.testing.assert_allclose(losses, want, rtol=1e-5)


# ---- a per-layer index into a value from before the layers ---------------------------------


class HeadMaskedLayer(nn.Module):
  """A BERT-style layer scaling its attention heads by a per-layer row of a mask built
  before the layers (Hugging Face's Flax BERT: head_mask[i] for layer i)."""

  @nn.compact
  def __call__(self, x, head_mask):
    b, s, d = x.shape
    heads = lambda n: nn.Dense(d, name=n)(x).reshape(b, s, 4, d // 4)  # noqa: E731
    q, k, v = heads("query"), heads("key"), heads("value")
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // 4), -1)
    w = w * head_mask[None, :, None, None]
    out = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, d)
    x = nn.LayerNorm(name="attention_norm")(x + nn.Dense(d, name="attention_out")(out))
    h = nn.gelu(nn.Dense(4 * d, name="intermediate")(x))
    return nn.LayerNorm(name="output_norm")(x + nn.Dense(d, name="output")(h))


INDEX_STYLES = {  # layer i's row of the mask
  "static slice": lambda mask, i: mask[i],
  "dynamic_slice": lambda mask, i: jax.lax.dynamic_index_in_dim(mask, i, keepdims=False),
  "gather": lambda mask, i: jnp.take(mask, i, axis=0),
}


class HeadMaskedNet(nn.Module):
  style: str
  layers: int = 3

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(37, 32)(tokens)
    mask = jnp.linspace(0.5, 1.0, self.layers * 4).reshape(self.layers, 4)
    for i in range(self.layers):
      x = HeadMaskedLayer(name=f"layer_{i}")(x, INDEX_STYLES[self.style](mask, i))
    return jnp.mean(x**2)


@pytest.mark.slow
@pytest.mark.parametrize(
  "style,n", [("static slice", 8), ("static slice", 4), ("dynamic_slice", 8), ("gather", 8)]
)
def test_a_per_layer_index_rolls(style, n):
  """Each layer reads its own row of a mask built before the layers; the layers roll, the
  index read per iteration (a static slice: a dynamic slice at the iteration's offset)."""
  model = HeadMaskedNet(style)
  tokens = jax.random.randint(jax.random.key(0), (16, 8), 0, 37)
  params = init(model, jax.random.key(1), tokens)
  config = zjax.ZeroConfig(param_persistence_threshold=0)
  schedule, compiled = assert_parity(
    lambda p, b: model.apply(p, b), params, tokens, n=n, config=config
  )
  assert rolled_lengths(schedule) == [3], schedule.rolling
  assert_report_matches(schedule, compiled)


def test_layers_that_differ_in_one_op_are_named():
  class Layer(nn.Module):
    odd: bool

    @nn.compact
    def __call__(self, x):
      y = nn.Dense(x.shape[-1], name="fc")(nn.LayerNorm()(x))
      y = 2.0 * y if self.odd else jnp.tanh(y)
      return x + nn.Dense(x.shape[-1], name="out")(y)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(3):
        x = Layer(i == 1, name=f"layer_{i}")(x)
      return jnp.mean(x)

  model, x = Net(), jnp.ones((16, 512))
  schedule = zjax.compile_schedule(
    lambda p, b: model.apply(p, b),
    init(model, jax.random.key(0), x),
    x,
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  assert not loops(schedule)
  (note,) = schedule.rolling
  assert "layer_0" in note and "(tanh)" in note and "(mul)" in note, note
