"""The zero3 trainer against a plain single-device optax loop on the full batch.

Tolerances: losses rtol 1e-5 every step; parameters after 10 steps rtol 1e-5 with atol 1e-5,
because Adam's m/sqrt(v) amplifies the last-bit gradient differences of the 8-device
reduction order in elements whose gradient is near zero (a few elements per layer).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from helpers import assert_trees_close, compiles_logged, init, mesh_of, mlp

PARAM_ATOL = 1e-5
# Adam with eps=1e-8 is ill-conditioned for near-zero gradients (a dead GELU unit): their
# ~1% reduction-order noise becomes a 1e-4 parameter difference after 10 steps, in any
# implementation that sums over devices in another order. eps=1e-6 keeps Adam's update
# well-conditioned there; the comparison itself stays at fp32 tolerances.
ADAMW = optax.adamw(1e-2, eps=1e-6)
SHARD_ALL = zjax.ZeroConfig(param_persistence_threshold=0, max_reuse_distance=0)


def reference_run(loss_fn, optimizer, params, batches):
  """Plain optax on one device, full batch."""

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state, losses = optimizer.init(params), []
  for batch in batches:
    params, state, loss = step(params, state, batch)
    losses.append(loss)
  return params, losses


def zjax_run(loss_fn, optimizer, params, batches, *, n=8, config=SHARD_ALL, **kw):
  mesh = mesh_of(n)
  schedule = zjax.compile_schedule(loss_fn, params, batches[0], mesh=mesh, config=config)
  trainer = zjax.zero3(loss_fn, optimizer, schedule, mesh=mesh, **kw)
  state = trainer.init(params)
  metrics = []
  for batch in batches:
    state, m = trainer.step(state, batch)
    metrics.append(m)
  return trainer, state, metrics


def assert_training_parity(loss_fn, optimizer, params, batches, param_atol=PARAM_ATOL, **kw):
  ref_params, ref_losses = reference_run(loss_fn, optimizer, params, batches)
  trainer, state, metrics = zjax_run(loss_fn, optimizer, params, batches, **kw)
  np.testing.assert_allclose([m["loss"] for m in metrics], ref_losses, rtol=1e-5)
  assert_trees_close(trainer.gather_params(state), ref_params, rtol=1e-5, atol=param_atol)
  return trainer, state, metrics


def same_batch(batch, steps=10):
  return [batch] * steps


@pytest.mark.slow
def test_gpt_adamw_10_steps():
  from test_execute import gpt_setup

  loss, params, batch = gpt_setup()
  # Adam amplifies the rounding of near-zero gradients: plain JAX on one device, summing the
  # batch in 8 parts as zjax's 8 devices do, already ends these 10 steps up to ~1e-4 away
  # from the full-batch run (measured here, 2026-12-03: 2 parts 8e-6, 4 parts 1.3e-4, 8
  # parts 9.6e-5; the CPU's code generation moves it). The bound is that measured noise.
  full, _ = reference_run(loss, ADAMW, params, same_batch(batch))
  in_parts, _ = reference_run(
    lambda p, b: sum(loss(p, {"tokens": t}) for t in jnp.split(b["tokens"], 8)) / 8,
    ADAMW,
    params,
    same_batch(batch),
  )
  noise = max(
    float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(in_parts))
  )
  _, state, _ = assert_training_parity(
    loss,
    ADAMW,
    params,
    same_batch(batch),
    param_atol=2 * max(noise, 1e-5),
    config=zjax.ZeroConfig(param_persistence_threshold=256),
  )
  assert int(state.step) == 10


@pytest.mark.slow
def test_nnx_adamw_10_steps():
  from nnx_mlp import make_model, split_model

  loss, params = split_model(make_model(d_in=16, d_hidden=32, n_classes=10, n_layers=2))
  batch = {"x": jax.random.normal(jax.random.key(0), (16, 16)), "y": jnp.arange(16) % 10}
  assert_training_parity(
    loss, ADAMW, params, same_batch(batch), config=zjax.ZeroConfig(param_persistence_threshold=64)
  )


@pytest.mark.slow
def test_cnn_adamw_10_steps():
  from test_execute import CNN

  model = CNN()
  images = jax.random.normal(jax.random.key(0), (16, 8, 8, 3))
  params = init(model, jax.random.key(1), images)

  def loss(p, b):
    logits = model.apply(p, b["x"])
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1).mean()

  assert_training_parity(
    loss,
    ADAMW,
    params,
    same_batch({"x": images, "y": jnp.arange(16) % 10}),
    config=zjax.ZeroConfig(param_persistence_threshold=100),
  )


@pytest.mark.slow
def test_clipping_active_and_exact():
  loss, params, batch = mlp(num_layers=3)
  ref_norm = optax.tree.norm(jax.jit(jax.grad(loss))(params, batch))
  threshold = float(ref_norm) / 100  # clipping is active every step
  opt = optax.chain(optax.clip_by_global_norm(threshold), optax.adam(1e-2))
  _, _, metrics = assert_training_parity(loss, opt, params, same_batch(batch))
  np.testing.assert_allclose(metrics[0]["grad_norm"], ref_norm, rtol=1e-5)
  assert all(float(m["grad_norm"]) > threshold for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("by", ["name", "layer"])
def test_masks_and_labels_by_path(by):
  """Masks and labels by parameter name hold on rolled layers (the same for every layer of
  a stack); labels by layer (e.g. layer-wise learning rates) need roll_layers=False."""
  loss, params, batch = mlp(num_layers=3)
  decay_kernels = lambda p: jax.tree_util.tree_map_with_path(
    lambda path, _: path[-1].key == "kernel", p
  )
  slow = (
    (lambda path: path[0].key == "layer0")
    if by == "layer"
    else (lambda path: path[-1].key == "bias")
  )
  labels = lambda p: jax.tree_util.tree_map_with_path(
    lambda path, _: "slow" if slow(path) else "fast", p
  )
  opt = optax.chain(
    optax.masked(optax.add_decayed_weights(0.1), decay_kernels),
    optax.multi_transform(
      {"slow": optax.sgd(1e-3), "fast": optax.adam(1e-2), "matches_nothing": optax.lion(1.0)},
      labels,
    ),
  )
  config = dataclasses.replace(SHARD_ALL, roll_layers=by == "name")
  assert_training_parity(loss, opt, params, same_batch(batch, 5), config=config)
  if by == "layer":
    with pytest.raises(zjax.ZjaxError, match=r"\['layer[12]'\].*roll_layers=False"):
      zjax_run(loss, opt, params, [batch])


@pytest.mark.slow
def test_lamb_trust_ratios_are_exact():
  """Per-leaf trust ratios: exact on per-layer leaves (on rolled stacks they are refused,
  test_rolling.py)."""
  loss, params, batch = mlp(num_layers=2)
  assert_training_parity(
    loss,
    optax.lamb(1e-2),
    params,
    same_batch(batch, 5),
    config=dataclasses.replace(SHARD_ALL, roll_layers=False),
  )


@pytest.mark.parametrize(
  "optimizer",
  [
    optax.adafactor(1e-2, min_dim_size_to_factor=8),
    optax.contrib.muon(1e-2),
  ],
)
def test_shape_dependent_optimizers_are_refused(optimizer):
  loss, params, batch = mlp(num_layers=2)
  with pytest.raises(zjax.ZjaxError, match=r"not shard-compatible|cannot run on the sharded") as e:
    zjax_run(loss, optimizer, params, [batch])
  assert "['layer" in str(e.value) or "sharded layout" in str(e.value)


def test_gradient_accumulation_equals_the_big_batch():
  loss, params, batch = mlp(num_layers=2, batch=32)
  ref_params, ref_losses = reference_run(loss, optax.adamw(1e-2), params, same_batch(batch, 3))
  trainer, state, metrics = zjax_run(
    loss, optax.adamw(1e-2), params, same_batch(batch, 3), accumulation_steps=4
  )
  np.testing.assert_allclose([m["loss"] for m in metrics], ref_losses, rtol=1e-5)
  assert_trees_close(trainer.gather_params(state), ref_params, rtol=1e-5, atol=PARAM_ATOL)


def _classifier():
  """A linear classifier whose cross-entropy picks each label's log-probability with
  take_along_axis: at one example per device JAX drops a reshape from that gather, so its
  program depends on the batch size."""
  params = {"w": jax.random.normal(jax.random.key(0), (12, 5)) / 4, "b": jnp.zeros((5,))}
  batch = {
    "x": jax.random.normal(jax.random.key(1), (16, 12)),
    "label": jax.random.randint(jax.random.key(2), (16,), 0, 5),
  }

  def loss(p, b):
    logp = jax.nn.log_softmax(b["x"] @ p["w"] + p["b"])
    return -jnp.mean(jnp.take_along_axis(logp, b["label"][:, None], axis=1))

  return loss, params, batch


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_accumulation_runs_the_schedule_of_one_micro_batch(n):
  """Micro-batches of one example per device: a schedule compiled on the whole batch is
  another program (refused, saying to compile on a micro-batch); one compiled on a
  micro-batch trains as plain optax does on the whole batch."""
  loss, params, batch = _classifier()
  k = 16 // n
  mesh = mesh_of(n)
  config = zjax.ZeroConfig(param_persistence_threshold=0)
  whole = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  trainer = zjax.zero3(loss, optax.sgd(0.5), whole, mesh=mesh, accumulation_steps=k)
  with pytest.raises(zjax.ScheduleMismatchError, match=rf"accumulation_steps={k}.*micro-batch"):
    trainer.step(trainer.init(params), batch)
  micro = jax.tree.map(lambda x: x[: len(x) // k], batch)
  schedule = zjax.compile_schedule(loss, params, micro, mesh=mesh, config=config)
  trainer = zjax.zero3(loss, optax.sgd(0.5), schedule, mesh=mesh, accumulation_steps=k)
  state = trainer.init(params)
  for _ in range(2):
    state, metrics = trainer.step(state, batch)
  ref_params, ref_losses = reference_run(loss, optax.sgd(0.5), params, same_batch(batch, 2))
  np.testing.assert_allclose(metrics["loss"], ref_losses[-1], rtol=1e-5)
  assert_trees_close(trainer.gather_params(state), ref_params, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_accumulation_folds_the_micro_batch_index_into_keys():
  """Micro-batch i sees fold_in(key, i) (then each device folds in its position): the step
  equals the mean of value_and_grad over the micro-batches with those keys."""
  base, params, batch = mlp(num_layers=2, batch=32)
  loss = lambda p, b: base(
    p, {"x": jax.random.bernoulli(b["key"], 0.7, b["x"].shape) * b["x"], "y": b["y"]}
  )
  batch = dict(batch, key=jax.random.key(5))
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL)
  trainer = zjax.zero3(loss, optax.sgd(1.0), schedule, mesh=mesh, accumulation_steps=2)
  state, metrics = trainer.step(trainer.init(params), batch)
  grad_fn = zjax.value_and_grad(loss, schedule, mesh=mesh)
  micro = [
    dict(
      x=batch["x"][16 * i : 16 * (i + 1)],
      y=batch["y"][16 * i : 16 * (i + 1)],
      key=jax.random.fold_in(batch["key"], i),
    )
    for i in range(2)
  ]
  results = [grad_fn(zjax.shard(params, schedule, mesh), b) for b in micro]
  np.testing.assert_allclose(metrics["loss"], np.mean([value for value, _ in results]), rtol=1e-6)
  grads = zjax.unshard(jax.tree.map(lambda a, b: (a + b) / 2, *[g for _, g in results]), schedule)
  assert_trees_close(
    trainer.gather_params(state),
    jax.tree.map(lambda p, g: p - g, params, grads),
    rtol=1e-6,
    atol=1e-7,
  )


def test_steps_do_not_recompile_and_state_is_donated():
  loss, params, batch = mlp(num_layers=2)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL)
  trainer = zjax.zero3(loss, optax.adam(1e-2), schedule, mesh=mesh)
  state = trainer.init(params)
  state, _ = trainer.step(state, batch)
  with compiles_logged() as compiled:
    for _ in range(2):
      old = state
      state, _ = trainer.step(state, batch)
      assert all(x.is_deleted() for x in jax.tree.leaves(old.params))  # donated
  assert not compiled
  # the trainer is plain data (issue 45): functions as fields, none patched onto another;
  # `lower` is the step's own program (the cached jit: lowering it compiles nothing new)
  assert not hasattr(trainer.step, "lower")
  assert isinstance(trainer.lower(state, batch), jax.stages.Lowered)
  with compiles_logged() as compiled:
    trainer.lower(state, batch).compile()
  assert not compiled


def test_nonfinite_steps_leave_the_state_unchanged():
  loss, params, batch = mlp(num_layers=2)
  bad = {**batch, "x": batch["x"].at[0, 0].set(jnp.nan)}
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL)
  trainer = zjax.zero3(loss, optax.adam(1e-2), schedule, mesh=mesh)
  state = trainer.init(params)
  before = jax.tree.map(np.asarray, trainer.gather_params(state))
  state, metrics = trainer.step(state, bad)
  assert not bool(metrics["finite"]) and int(state.step) == 0
  assert_trees_close(trainer.gather_params(state), before, rtol=0, atol=0)
  raising = zjax.zero3(loss, optax.adam(1e-2), schedule, mesh=mesh, on_nonfinite="raise")
  with pytest.raises(zjax.NonFiniteError, match="not finite") as e:
    raising.step(raising.init(params), bad)
  assert int(e.value.state.step) == 0
  state, metrics = trainer.step(state, batch)  # and training goes on
  assert bool(metrics["finite"]) and int(state.step) == 1


def test_max_consecutive_skips_stops_with_the_last_good_state():
  """Skips in a row are counted (a finite step resets the count); the K-th raises, naming
  what to check, with the last good state and the step's metrics."""
  loss, params, batch = mlp(num_layers=2)
  bad = {**batch, "x": batch["x"].at[0, 0].set(jnp.inf)}
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL)
  trainer = zjax.zero3(loss, optax.adam(1e-2), schedule, mesh=mesh, max_consecutive_skips=3)
  state = trainer.init(params)
  for b in (bad, bad, batch, bad, bad):  # never 3 in a row
    state, metrics = trainer.step(state, b)
  assert int(state.step) == 1
  good = jax.tree.map(np.asarray, trainer.gather_params(state))
  with pytest.raises(zjax.NonFiniteError, match="3 steps in a row.*learning rate") as e:
    trainer.step(state, bad)
  assert int(e.value.state.step) == 1 and not bool(e.value.metrics["finite"])
  assert_trees_close(trainer.gather_params(e.value.state), good, rtol=0, atol=0)
  for wrong in (0, -1, True, 2.5, "3"):
    with pytest.raises(ValueError, match="max_consecutive_skips"):
      zjax.zero3(loss, optax.adam(1e-2), schedule, mesh=mesh, max_consecutive_skips=wrong)


@pytest.mark.slow
@pytest.mark.parametrize("n, explicit", [(1, True), (2, True), (4, True), (8, True), (8, False)])
def test_state_bytes_per_device_match_the_schedule_and_scale(n, explicit):
  """Also on an Auto mesh, where jit would replicate adam's moments unless told."""
  from gpt import GPTConfig, abstract_setup

  cfg = GPTConfig(d_model=64, n_layer=2, n_head=4, d_ff=128, seq_len=16)
  loss, shapes, batch_shapes = abstract_setup(cfg, batch_size=8)
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), shapes)
  mesh = mesh_of(n, explicit=explicit)
  schedule = zjax.compile_schedule(
    loss, shapes, batch_shapes, mesh=mesh, config=zjax.ZeroConfig(param_persistence_threshold=256)
  )
  state = zjax.zero3(loss, optax.adam(1e-3), schedule, mesh=mesh).init(params)
  param_bytes = zjax.per_device_bytes(state.params)
  assert param_bytes == schedule.report()["state_bytes_per_device"]
  assert zjax.per_device_bytes(state.opt_state) in range(2 * param_bytes, 2 * param_bytes + 64)
  full = sum(x.size * 4 for x in jax.tree.leaves(params))
  persistent = sum(np.prod(p.shape) * 4 for p in schedule.params if p.persistent)
  assert param_bytes <= (full - persistent) / n + persistent + 4 * 8 * len(schedule.params)


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_init_from_never_holds_the_whole_model(n):
  from gpt import GPT, GPTConfig, abstract_setup

  cfg = GPTConfig(d_model=128, n_layer=2, n_head=4, d_ff=512, seq_len=16)  # vocab 257: uneven
  model = GPT(cfg)
  loss, shapes, batch_shapes = abstract_setup(cfg, batch_size=8)
  mesh = mesh_of(n)
  schedule = zjax.compile_schedule(
    loss, shapes, batch_shapes, mesh=mesh, config=zjax.ZeroConfig(param_persistence_threshold=1024)
  )
  tokens = jnp.zeros((8, cfg.seq_len), jnp.int32)
  memory = zjax.hlo.compile_for_analysis(
    zjax.sharded_init(model.init, schedule, mesh).lower(jax.random.key(0), tokens)
  ).memory_analysis()
  share = schedule.report()["state_bytes_per_device"]
  largest_bucket = max(schedule.bucket_elements()) * 4
  # outputs = this device's share (+ a pointer per leaf in the output tuple)
  assert 0 <= memory.output_size_in_bytes - share <= 8 * len(schedule.params)
  # the bound: per-device peak below the largest bucket plus the local share
  assert memory.temp_size_in_bytes + memory.output_size_in_bytes < largest_bucket + share + 8 * len(
    schedule.params
  )
  trainer = zjax.zero3(loss, optax.adam(1e-3), schedule, mesh=mesh)
  state = trainer.init_from(model.init, jax.random.key(0), tokens)
  expected = jax.jit(model.init)(jax.random.key(0), tokens)
  assert_trees_close(trainer.gather_params(state), expected, rtol=0, atol=1e-7)


def test_bad_arguments():
  loss, params, batch = mlp(num_layers=2)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL)
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    zjax.zero3(loss, "adam", schedule, mesh=mesh)
  with pytest.raises(ValueError, match="accumulation_steps"):
    zjax.zero3(loss, optax.adam(1e-3), schedule, mesh=mesh, accumulation_steps=0)
  with pytest.raises(ValueError, match="on_nonfinite"):
    zjax.zero3(loss, optax.adam(1e-3), schedule, mesh=mesh, on_nonfinite="ignore")
  for k in (3, 4):  # 16 examples: not divisible by 3; micro-batches of 4 on 8 devices
    trainer = zjax.zero3(loss, optax.adam(1e-3), schedule, mesh=mesh, accumulation_steps=k)
    with pytest.raises(zjax.ZjaxError, match=rf"\['x'\] .* 16: accumulation_steps={k} .* {8 * k}"):
      trainer.step(trainer.init(params), batch)


def test_bf16_compute_trains_close_to_fp32():
  """compute_dtype=bf16: bf16 gathers and math, fp32 master shards, fp32 optimizer state."""
  loss, params, batch = mlp(num_layers=3)
  batches = same_batch(batch, 5)
  ref_params, ref_losses = reference_run(loss, ADAMW, params, batches)
  config = dataclasses.replace(SHARD_ALL, compute_dtype=jnp.bfloat16)
  trainer, state, metrics = zjax_run(loss, ADAMW, params, batches, config=config)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(state.opt_state))
  np.testing.assert_allclose([m["loss"] for m in metrics], ref_losses, rtol=2e-2)
  # bf16 tolerance per leaf, as a relative L2 error: Adam turns bf16 noise in a few
  # near-zero-gradient elements into visible element-wise differences
  for a, b in zip(jax.tree.leaves(trainer.gather_params(state)), jax.tree.leaves(ref_params)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)


@pytest.mark.slow
def test_frozen_params_are_gathered_but_not_reduced_or_optimized():
  loss, params, batch = mlp(num_layers=3)
  frozen = lambda path: path.startswith("['layer1']")
  mesh = mesh_of(8)
  plain = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL, frozen=frozen)
  layer1 = schedule.param("['layer1']['kernel']").bucket
  assert schedule.buckets[layer1].frozen
  assert any(st.op == "gather" and st.bucket == layer1 for st in schedule.forward)
  assert not any(st.op == "reduce_scatter" and st.bucket == layer1 for st in schedule.backward)
  assert schedule.report()["reduce_scatter_count"] == plain.report()["reduce_scatter_count"] - 1
  # the compiled program does what the schedule says
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  sharded = zjax.shard(params, schedule, mesh)
  hlo = zjax.hlo.summarize(zjax.hlo.compile_for_analysis(step.lower(sharded, batch)))
  assert hlo["reduce_scatter_count"] == schedule.report()["reduce_scatter_count"]
  assert hlo["all_gather_count"] == schedule.report()["all_gather_count"]
  _, grads = step(sharded, batch)
  grads = zjax.unshard(grads, schedule)
  ref = jax.jit(jax.grad(loss))(params, batch)
  np.testing.assert_array_equal(grads["layer1"]["kernel"], 0)
  assert_trees_close(grads["layer2"], ref["layer2"])
  assert_trees_close(grads["layer0"], ref["layer0"])
  # training leaves them unchanged and keeps no optimizer state for them
  trainer = zjax.zero3(loss, optax.adam(1e-2), schedule, mesh=mesh)
  state = trainer.init(params)
  for _ in range(2):
    state, _ = trainer.step(state, batch)
  trained = trainer.gather_params(state)
  np.testing.assert_array_equal(trained["layer1"]["kernel"], params["layer1"]["kernel"])
  assert not np.allclose(trained["layer0"]["kernel"], params["layer0"]["kernel"])
  full_state = zjax.zero3(loss, optax.adam(1e-2), plain, mesh=mesh).init(params)
  assert zjax.per_device_bytes(state.opt_state) < zjax.per_device_bytes(full_state.opt_state)
  with pytest.raises(ValueError, match="frozen must be"):
    zjax.compile_schedule(loss, params, batch, mesh=mesh, frozen={"layer1": True})


@pytest.mark.slow
@pytest.mark.parametrize("roll", [False, True], ids=["unrolled", "rolled"])
def test_sub_groups_give_identical_results(roll):
  from zjax._src.train.train import plan_sub_groups

  loss, params, batch = mlp(num_layers=3)
  base = dataclasses.replace(SHARD_ALL, roll_layers=roll)
  one = zjax_run(loss, ADAMW, params, same_batch(batch, 3), config=base)
  small = dataclasses.replace(base, sub_group_size=100)
  many = zjax_run(loss, ADAMW, params, same_batch(batch, 3), config=small)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=small)
  groups = plan_sub_groups(schedule)
  # 520 elements per layer and device; rolled: a kernel stack (3 x 512) and a bias stack
  assert len(groups) == (2 if roll else 6) and all(len(g) == 1 for g in groups)
  assert (
    len(plan_sub_groups(zjax.compile_schedule(loss, params, batch, mesh=mesh, config=base))) == 1
  )
  # same math; the barriers between groups change XLA's fusion, hence ulp-level rounding
  assert_trees_close(
    many[0].gather_params(many[1]), one[0].gather_params(one[1]), rtol=1e-6, atol=1e-7
  )


class _BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(32, use_bias=False)(x)  # a bias before BatchNorm has zero gradient
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.Dense(4)(nn.relu(x))


@pytest.mark.slow
def test_batch_statistics_as_extra_state():
  """loss_fn(params, batch, extra) -> (loss, new_extra): each device normalises with its own
  share of the batch (data parallel BatchNorm) and the new statistics are averaged."""
  model = _BNNet()
  x = jax.random.normal(jax.random.key(0), (16, 8))
  batch = {"x": x, "y": jax.random.normal(jax.random.key(1), (16, 4))}
  variables = init(model, jax.random.key(2), x, train=False)
  params, extra = variables["params"], {"batch_stats": variables["batch_stats"]}

  def loss_fn(p, b, e):
    out, updates = model.apply({"params": p, **e}, b["x"], train=True, mutable=["batch_stats"])
    return jnp.mean((out - b["y"]) ** 2), {"batch_stats": updates["batch_stats"]}

  n, opt = 4, optax.adam(1e-2)

  @jax.jit
  def reference_step(p, s, e):  # data parallel by hand: per-device slices, averaged
    slices = [jax.tree.map(lambda a: a[i * 4 : (i + 1) * 4], batch) for i in range(n)]
    results = [jax.value_and_grad(loss_fn, has_aux=True)(p, b, e) for b in slices]
    mean = lambda *xs: sum(xs) / n
    loss = mean(*[value for (value, _), _ in results])
    new_e = jax.tree.map(mean, *[a for (_, a), _ in results])
    grads = jax.tree.map(mean, *[g for _, g in results])
    u, s = opt.update(grads, s, p)
    return optax.apply_updates(p, u), s, new_e, loss

  mesh = mesh_of(n)
  schedule = zjax.compile_schedule(
    loss_fn,
    params,
    batch,
    mesh=mesh,
    extra=extra,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  trainer = zjax.zero3(loss_fn, opt, schedule, mesh=mesh)
  state = trainer.init(params, extra=extra)
  ref_p, ref_s, ref_e = params, opt.init(params), extra
  for _ in range(3):
    state, metrics = trainer.step(state, batch)
    ref_p, ref_s, ref_e, ref_loss = reference_step(ref_p, ref_s, ref_e)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
  assert_trees_close(state.extra, ref_e, rtol=1e-5, atol=1e-6)
  assert_trees_close(trainer.gather_params(state), ref_p, rtol=1e-5, atol=PARAM_ATOL)
  with pytest.raises(zjax.TraceError, match="must return \\(loss, new_extra\\)"):
    zjax.compile_schedule(
      lambda p, b, e: loss_fn(p, b, e)[0], params, batch, mesh=mesh, extra=extra
    )


def test_nnx_batch_stats_recipe_from_the_readme():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(8, 32, use_bias=False, rngs=rngs)
      self.bn = nnx.BatchNorm(32, rngs=rngs)
      self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.bn(self.l1(x))))

  graphdef, params, stats, rest = nnx.split(Net(nnx.Rngs(0)), nnx.Param, nnx.BatchStat, ...)

  def loss_fn(p, b, e):
    m = nnx.merge(graphdef, p, e, rest)
    out = m(b["x"])
    _, _, new_e, _ = nnx.split(m, nnx.Param, nnx.BatchStat, ...)
    return jnp.mean((out - b["y"]) ** 2), new_e

  batch = {"x": jax.random.normal(jax.random.key(0), (16, 8)), "y": jnp.ones((16, 4))}
  mesh = mesh_of(4)
  schedule = zjax.compile_schedule(
    loss_fn,
    params,
    batch,
    mesh=mesh,
    extra=stats,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  trainer = zjax.zero3(loss_fn, optax.adam(1e-2), schedule, mesh=mesh)
  state = trainer.init(params, extra=stats)
  losses = []
  for _ in range(3):
    state, metrics = trainer.step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]
  mean = jax.tree.leaves(state.extra)[0]
  assert float(jnp.abs(mean).max()) > 0  # running statistics were updated


@pytest.mark.slow
def test_state_memory_script_runs():
  """examples/state_memory.py at tiny size (structure only)."""
  import pathlib
  import subprocess
  import sys

  root = pathlib.Path(__file__).resolve().parents[1]
  done = subprocess.run(
    [
      sys.executable,
      str(root / "examples/state_memory.py"),
      "--devices",
      "1",
      "2",
      "--layers",
      "1",
      "--d-model",
      "32",
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  lines = done.stdout.splitlines()
  assert lines[0].startswith("GPT:") and lines[1].startswith("N=1:") and lines[2].startswith("N=2:")
