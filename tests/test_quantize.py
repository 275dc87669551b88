"""ZeRO++ quantized communication: qwZ (int8 weight gathers) and qgZ (int8 / int4 gradient
all-to-all). The block-wise error bound on random and adversarial blocks; the quantized
all-gather equal to dequantize(quantize(...)) of each device's chunk; the quantized
reduction within the bound of the exact mean; compiled collectives equal to the report;
training that tracks fp32; non-finite values never hidden."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax
from helpers import mesh_of, reference, run_zjax
from test_rolling import ADAMW, ROLL, edge_blocks, gpt
from zjax._src.execute import collectives, quantize
from zjax._src.execute.quantize import Quantization
from zjax._src.layout import layout
from zjax._src.schedule import ir
from zjax._src.xla import hlo

QWZ = dataclasses.replace(ROLL, gather_quantization="int8")
QGZ = dataclasses.replace(ROLL, reduce_quantization="int8")
BOTH = dataclasses.replace(QWZ, reduce_quantization="int8")
TINY_NORMAL = np.finfo(np.float32).tiny  # smallest normal float32, ~1.2e-38


def round_trip(x, q):
  x = jnp.asarray(x, jnp.float32)
  return np.asarray(quantize.unpack(quantize.pack(x, q), q, x.shape[-1], jnp.float32))


def block_scales(x, q):
  """Each element's block scale, max|x| / Q over its block, by numpy."""
  x = np.asarray(x, np.float32)
  n = x.shape[-1]
  blocks = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, q.blocks(n) * q.block - n)])
  blocks = blocks.reshape(x.shape[:-1] + (-1, q.block))
  scale = np.max(np.abs(blocks), axis=-1) / np.float32(q.levels)
  return np.repeat(scale, q.block, axis=-1)[..., :n]


# ---- the block-wise bound ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("n, block", [(1000, 256), (37, 16), (37, 5), (3, 256)])
def test_error_within_the_block_bound(dtype, stochastic, n, block):
  """|x - dq(q(x))| <= scale / 2 (nearest) or < scale (stochastic), scale = max|x| / Q per
  block, up to float32 rounding of the product; odd lengths and odd blocks (int4 packs two
  per byte: padded, not refused)."""
  q = Quantization(dtype, block, stochastic)
  x = np.asarray(jax.random.normal(jax.random.key(n), (3, n))) * np.array([[1e-3], [1], [1e4]])
  got = round_trip(x, q)
  bound = block_scales(x, q) * (1.0 if stochastic else 0.5)
  assert np.all(np.abs(got - x) <= bound * (1 + 1e-6) + np.abs(x) * 2e-7)
  assert quantize.pack(jnp.asarray(x), q).shape == (3, q.wire_bytes(n))


def test_adversarial_blocks():
  q = Quantization("int8", 4)
  zeros, outlier = [0.0] * 4, [1e30, 1.0, -2.0, 3.0]
  denormal = [1e-40, -3e-41, 0.0, 5e-42]
  x = np.array(
    [
      zeros
      + outlier
      + denormal
      + [1.0, np.inf, 2.0, 3.0]
      + [np.nan, 1, 2, 3]
      + [0.5, -0.25, 0.125, 1.0]
    ],
    np.float32,
  )
  got = round_trip(x, q)[0]
  assert np.array_equal(got[:4], np.zeros(4))  # exactly zero: no 0/0
  assert got[4] == pytest.approx(1e30, rel=1e-6)  # the outlier keeps the block's scale:
  assert np.all(np.abs(got[5:8] - x[0, 5:8]) <= 1e30 / 127 / 2)  # small values -> 0
  assert np.all(np.abs(got[8:12] - x[0, 8:12]) <= TINY_NORMAL)  # below normal: ~0
  assert not np.any(np.isfinite(got[12:20]))  # a block with inf or nan: all non-finite
  assert np.all(np.abs(got[20:] - x[0, 20:]) <= 1.0 / 127 / 2 * (1 + 1e-6))  # others intact


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
  """Values 0.3 of a step above a level: nearest always rounds down (a bias of -0.3 steps,
  the same at every step of training); stochastic rounding averages out."""
  q = Quantization("int8", 128)
  step = 1.0 / 127
  x = np.full((2000, 128), 10.3 * step, np.float32)
  x[:, 0] = 1.0  # sets the scale to one step
  near = Quantization("int8", 128, stochastic=False)
  sto = Quantization("int8", 128, stochastic=True)
  near_bias = np.mean(round_trip(x, near)[:, 1:] - x[:, 1:]) / step
  sto_bias = np.mean(round_trip(x, sto)[:, 1:] - x[:, 1:]) / step
  assert near_bias == pytest.approx(-0.3, abs=1e-3)
  assert abs(sto_bias) < 0.01, sto_bias  # 254k draws: std of the mean ~0.001 steps
  assert q.wire_bytes(128) == 128 + 4 and Quantization("int4", 128).wire_bytes(129) == 65 + 8


# ---- the collectives on N devices ----------------------------------------------------------


def _local_rows(x, n):
  """Each device's chunk of a flat, zero-padded leaf: [N, chunk]."""
  flat = np.pad(np.ravel(x), (0, ir.padded_size(x.size, n) - x.size))
  return flat.reshape(n, -1)


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_quantized_all_gather_equals_each_chunk_dequantized(n):
  q = Quantization("int8", 64)
  mesh = mesh_of(n, explicit=False)
  w = np.asarray(jax.random.normal(jax.random.key(0), (37, 29)), np.float32)  # odd: padded
  entry = ir.ParamEntry("w", w.shape, "float32", False, 0, (0,))
  stored = jax.device_put(
    layout.storage_from_natural(w, entry, n, np), NamedSharding(mesh, P("fsdp"))
  )
  gather = jax.jit(
    jax.shard_map(
      lambda chunk: collectives.all_gather_bucket([chunk], [entry], n, "fsdp", q)[0],
      mesh=mesh,
      in_specs=P("fsdp"),
      out_specs=P(),
      check_vma=False,
    )
  )
  got = np.asarray(gather(stored))
  rows = _local_rows(w, n)
  want = np.concatenate([round_trip(row, q) for row in rows])[: w.size].reshape(w.shape)
  np.testing.assert_array_equal(got, want)
  assert np.max(np.abs(got - w)) <= np.max(np.abs(w)) / 127 / 2 * (1 + 1e-6)


@pytest.mark.parametrize("n, dtype", [(8, "int8"), (4, "int4")])
def test_quantized_reduce_scatter_within_the_bound_of_the_exact_mean(n, dtype):
  """Device d holds its own gradient g_d; its chunk of the result differs from the exact
  mean over devices by less than the mean over devices of each sender's block scale."""
  q = Quantization(dtype, 32, stochastic=True)
  mesh = mesh_of(n, explicit=False)
  shape = (23, 11)
  grads = np.array(jax.random.normal(jax.random.key(1), (n,) + shape), np.float32)
  grads *= np.arange(1, n + 1, dtype=np.float32)[:, None, None]  # unequal scales
  entry = ir.ParamEntry("g", shape, "float32", False, 0, (0,))
  chunk = ir.padded_size(int(np.prod(shape)), n) // n

  def reduce(g):
    return collectives.reduce_scatter_bucket(
      [g[0]], [entry], n, "fsdp", jnp.float32, quantization=q
    )[0]

  run = jax.jit(
    jax.shard_map(reduce, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"), check_vma=False)
  )
  got = np.asarray(run(jax.device_put(grads, NamedSharding(mesh, P("fsdp")))))
  exact = _local_rows(grads.mean(axis=0), n).reshape(-1)
  # sender d quantizes its row r (destination r) block-wise: the scale of each element
  scales = np.stack([block_scales(_local_rows(g, n), q) for g in grads])  # [N, N, chunk]
  bound = scales.mean(axis=0).reshape(-1)
  assert got.shape == (n * chunk,)
  assert np.all(np.abs(got - exact) <= bound * (1 + 1e-5) + 1e-7)
  assert np.all(got[grads[0].size :] == 0)  # the padding stays exactly zero


# ---- the compiled program against the report -----------------------------------------------


def _executed(compiled):
  return hlo.executed(compiled.as_text())


@pytest.mark.slow
@pytest.mark.parametrize(
  "config",
  [
    BOTH,
    dataclasses.replace(BOTH, reduce_quantization="int4", roll_layers=False),
    dataclasses.replace(QWZ, gather_quantization_phases=("backward",), max_reuse_distance=0),
  ],
  ids=["qwz-qgz-rolled", "qwz-int4-unrolled", "qwz-backward-only"],
)
def test_compiled_collectives_equal_the_report_and_move_a_quarter(config):
  loss, params, batch = gpt(4)
  schedule, got, _, compiled = run_zjax(loss, params, batch, config=config)
  report, executed = schedule.report(), _executed(compiled)
  for kind in ("all_gather", "reduce_scatter", "all_to_all"):
    assert executed.get(f"{kind}_count", 0) == report[f"{kind}_count"], kind
    assert executed.get(f"{kind}_bytes", 0) == report[f"{kind}_bytes"], kind
  want, _ = reference(loss, params, batch)
  np.testing.assert_allclose(got, want, rtol=2e-3)  # int8 weights: a 1e-3 loss change
  # unquantized, as predicted (and compiled: test_truthful.py checks they are equal)
  plain = zjax.compile_schedule(
    loss,
    params,
    batch,
    num_devices=8,
    config=dataclasses.replace(config, gather_quantization=None, reduce_quantization=None),
  ).report()
  plain_bytes = plain["all_gather_bytes"] + plain["reduce_scatter_bytes"]
  moved = sum(executed.get(f"{k}_bytes", 0) for k in ("all_gather", "reduce_scatter", "all_to_all"))
  assert moved / plain_bytes == pytest.approx(report["quantization"]["bytes_vs_unquantized"])
  if config is BOTH:  # int8 values + one fp32 scale per 256: (1 + 4/256) / 4 = 0.2539
    assert moved / plain_bytes <= 0.3
    assert report["quantization"]["gather"]["scale_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", ["hsdp", "hpz"])
def test_quantized_on_a_two_axis_mesh(layout_name):
  """HSDP: gathers and all-to-alls within the shard group, shards then averaged over the
  replicas; hpZ: the secondary keeps the quantized wire, backward re-gathers it."""
  config = dataclasses.replace(
    BOTH, replicate_axes=("data",), secondary_partition=layout_name == "hpz"
  )
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  loss, params, batch = gpt(2)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  sharded = zjax.shard(params, schedule, mesh)
  got, grads = step(sharded, batch)
  want, ref = jax.jit(jax.value_and_grad(loss))(params, batch)
  np.testing.assert_allclose(got, want, rtol=2e-3)
  for g, r in zip(jax.tree.leaves(zjax.unshard(grads, schedule)), jax.tree.leaves(ref)):
    assert np.max(np.abs(g - r)) <= 0.1 * np.max(np.abs(r)) + 1e-6
  report = schedule.report()
  executed = hlo.executed_by_axis(
    hlo.compile_for_analysis(step.lower(sharded, batch)).as_text(), mesh.shape
  )
  assert executed["all_gather"] == report["all_gather_bytes_by_axis"]
  assert executed["all_to_all"] == report["all_to_all_bytes_by_axis"]
  if layout_name == "hpz":  # the secondary keeps the quantized wire: a quarter
    plain = zjax.compile_schedule(
      loss,
      params,
      batch,
      mesh=mesh,
      config=dataclasses.replace(config, gather_quantization=None, reduce_quantization=None),
    )
    assert 0 < report["secondary_bytes"] < 0.3 * plain.report()["secondary_bytes"]


@pytest.mark.slow
def test_odd_mixed_frozen_and_tiny_leaves():
  """Odd-shaped, bf16, unused, integer, empty leaves and a cond, in rolled blocks, on 3
  devices, some blocks frozen, int4 gradients: runs, and the program equals the report."""
  loss, params, batch = edge_blocks()
  mesh = mesh_of(3)
  config = zjax.ZeroConfig(
    param_persistence_threshold=0,
    gather_quantization="int8",
    reduce_quantization="int4",
    quantization_block=7,
  )
  schedule = zjax.compile_schedule(
    loss, params, batch, mesh=mesh, config=config, frozen=lambda path: "'b3'" in path
  )
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  sharded = zjax.shard(params, schedule, mesh)
  got, grads = step(sharded, batch)
  want, ref = reference(loss, params, batch)
  np.testing.assert_allclose(got, want, rtol=0.05)
  natural = zjax.unshard(grads, schedule)
  assert np.all(np.asarray(natural["b3"]["w"]) == 0) and natural["b0"]["count"] == 0
  assert np.all(np.isfinite(np.asarray(natural["b0"]["w"], np.float32)))
  report, executed = (
    schedule.report(),
    _executed(hlo.compile_for_analysis(step.lower(sharded, batch))),
  )
  assert executed["all_to_all_bytes"] == report["all_to_all_bytes"]
  # the integer leaf's value is not read by the per-iteration vjp: the rolled loop's
  # backward does not re-gather it (XLA would delete the gather), and the report is exact
  assert executed["all_gather_bytes"] == report["all_gather_bytes"]


# ---- training -------------------------------------------------------------------------------


def _train(config, steps, loss, params, batch, accumulation_steps=1, optimizer=ADAMW):
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  trainer = zjax.zero3(loss, optimizer, schedule, mesh=mesh, accumulation_steps=accumulation_steps)
  state, losses = trainer.init(params), []
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    losses.append(float(metrics["loss"]))
  return trainer, state, losses


@pytest.mark.slow
def test_training_tracks_fp32_and_padding_stays_zero():
  loss, params, batch = gpt(2)
  _, _, fp32 = _train(ROLL, 6, loss, params, batch)
  trainer, state, quantized = _train(
    dataclasses.replace(BOTH, quantization_block=64), 6, loss, params, batch
  )
  np.testing.assert_allclose(quantized, fp32, rtol=0.02)
  assert quantized[-1] < quantized[0] - 0.5  # it learns
  for x, leaf in zip(
    layout.stored_leaves(state.params, trainer.schedule, "params"), trainer.schedule.storage
  ):
    assert not np.any(layout.storage_padding(np.asarray(x), leaf.entry))


@pytest.mark.slow
def test_a_nonfinite_weight_is_never_hidden():
  """A NaN in a weight makes its whole quantization block NaN: the loss is not finite and
  the step is skipped (on_nonfinite="skip"), as without quantization."""
  loss, params, batch = gpt(2)
  params = jax.tree.map(lambda x: x, params)
  kernel = params["params"]["block_1"]["mlp"]["fc"]["kernel"]
  params["params"]["block_1"]["mlp"]["fc"]["kernel"] = kernel.at[3, 5].set(jnp.nan)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=BOTH)
  trainer = zjax.zero3(loss, ADAMW, schedule, mesh=mesh)
  state = trainer.init(params)
  before = jax.tree.map(np.asarray, trainer.gather_params(state))
  state, metrics = trainer.step(state, batch)
  assert not bool(metrics["finite"]) and int(state.step) == 0
  for a, b in zip(jax.tree.leaves(trainer.gather_params(state)), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_accumulated_micro_batches_do_not_add_up_quantization_error():
  """zjax reduces each micro-batch's gradient (as DeepSpeed ZeRO-3 does), so qgZ quantizes
  once per micro-batch; the step's gradient is their mean, whose zero-mean, independent
  (stochastically rounded) errors average: each micro-batch gradient is noisier (its block
  scales larger) than the whole batch's, but the mean of 4 is within 1.5x of one
  full-batch reduction's error, far from the 4x of errors that add up."""
  loss, params, _ = gpt(2)
  batch = {"tokens": jax.random.randint(jax.random.key(7), (32, 17), 0, 257)}  # 4 x 8
  sgd = optax.sgd(1.0)  # the update is minus the gradient
  _, grad_exact = jax.jit(jax.value_and_grad(loss))(params, batch)

  def step_gradient(k):
    trainer, state, _ = _train(QGZ, 1, loss, params, batch, accumulation_steps=k, optimizer=sgd)
    after = trainer.gather_params(state)
    return jax.tree.map(lambda p, a: np.asarray(p) - np.asarray(a), params, after)

  def error(g):  # relative L2 distance over all parameters
    pairs = list(zip(jax.tree.leaves(g), jax.tree.leaves(grad_exact)))
    return float(
      np.sqrt(sum(np.sum((a - b) ** 2) for a, b in pairs) / sum(np.sum(b**2) for _, b in pairs))
    )

  one, four = error(step_gradient(1)), error(step_gradient(4))
  assert 0 < one < 0.05 and four <= one * 1.5, (one, four)
