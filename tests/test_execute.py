"""value_and_grad: same loss and gradients as plain single-device JAX (fp32 rtol 1e-5), on 8,
4 and 1 devices, for real models and every case the trace pass supports."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zjax
from helpers import (
  assert_parity,
  assert_report_matches,
  assert_trees_close,
  compiles_logged,
  custom_vjp_matmul,
  init,
  mesh_of,
  mlp,
  run_zjax,
)

SHARD_ALL = zjax.ZeroConfig(
  param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0
)


@pytest.mark.parametrize("n", [8, 4, 1])
def test_mlp(n):
  schedule, compiled = assert_parity(*mlp(), n=n, config=SHARD_ALL)
  if n == 1:
    assert zjax.hlo.summarize(compiled)["all_gather_count"] == 0


@pytest.mark.parametrize("n,roll", [(8, True), (4, False)], ids=["8-rolled", "4-unrolled"])
def test_a_module_above_max_live_parameters_is_gathered_parameter_by_parameter(n, roll):
  """A Dense layer's kernel and bias (4,160 elements) under max_live_parameters of one kernel
  (4,096): its bucket is split per parameter and the segment cut between the matmul and
  the bias add, as DeepSpeed fetches parameter by parameter (this was refused, naming the
  bucket). Gradients equal plain JAX, the report equals the compiled program, and no more
  than the cap is ever gathered."""
  loss, params, batch = mlp(num_layers=3)
  cap = 64 * 64
  config = zjax.ZeroConfig(param_persistence_threshold=0, max_live_parameters=cap, roll_layers=roll)
  schedule, compiled = assert_parity(loss, params, batch, n=n, config=config)
  assert_report_matches(schedule, compiled)
  assert all(len(b.params) == 1 for b in schedule.buckets)  # kernel and bias apart
  assert any(b.layers for b in schedule.buckets) == roll  # rolled: 3 layers, cut into parts
  assert schedule.report()["peak_live_param_bytes"] == cap * 4


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
    return nn.Dense(10)(x.mean(axis=(1, 2)))


@pytest.mark.slow
def test_cnn():
  model = CNN()
  images = jax.random.normal(jax.random.key(0), (16, 8, 8, 3))
  labels = jnp.arange(16) % 10
  params = init(model, jax.random.key(1), images)

  def loss(p, b):
    logits = model.apply(p, b["x"])
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1).mean()

  assert_parity(
    loss,
    params,
    {"x": images, "y": labels},
    config=zjax.ZeroConfig(param_persistence_threshold=100),
  )


def gpt_setup(n_layer=2):
  from gpt import GPT, GPTConfig, make_loss_fn

  cfg = GPTConfig(d_model=64, n_layer=n_layer, n_head=4, d_ff=128, seq_len=16)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
  params = init(model, jax.random.key(1), tokens[:, :-1])
  return make_loss_fn(model), params, {"tokens": tokens}


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_gpt_tied_embeddings_odd_vocab(n):
  loss, params, batch = gpt_setup()
  assert params["params"]["embed"]["embedding"].shape[0] % 8 != 0
  schedule, _ = assert_parity(
    loss,
    params,
    batch,
    n=n,
    config=zjax.ZeroConfig(
      param_persistence_threshold=256, max_reuse_distance=5000, prefetch_bucket_size=5000
    ),
  )
  embedding = schedule.param("['params']['embed']['embedding']")
  assert not embedding.persistent and len(embedding.uses) == 2


@pytest.mark.slow
def test_nnx():
  from nnx_mlp import make_model, split_model

  loss, params = split_model(make_model(d_in=16, d_hidden=32, n_classes=10, n_layers=2))
  batch = {"x": jax.random.normal(jax.random.key(0), (16, 16)), "y": jnp.arange(16) % 10}
  assert_parity(loss, params, batch, config=zjax.ZeroConfig(param_persistence_threshold=64))


@pytest.mark.slow
def test_tied_and_reused_weights_sum_their_gradients():
  params = {
    "emb": jax.random.normal(jax.random.key(0), (32, 16)),
    "w": jax.random.normal(jax.random.key(1), (16, 16)) / 4,
  }

  def loss(p, b):
    h = b["x"] @ p["emb"]
    for _ in range(3):  # one layer applied three times
      h = jnp.tanh(h @ p["w"])
    return jnp.mean((h @ p["emb"].T - b["x"]) ** 2)

  batch = {"x": jax.random.normal(jax.random.key(2), (8, 32))}
  for reuse in (0, 10**9):  # released and re-gathered between uses, or kept
    assert_parity(
      loss, params, batch, config=dataclass_replace(SHARD_ALL, max_reuse_distance=reuse)
    )


def dataclass_replace(cfg, **kw):
  import dataclasses

  return dataclasses.replace(cfg, **kw)


class _Decoder(nn.Module):
  @nn.compact
  def __call__(self, h, w):
    return h @ w.T


class _Tied(nn.Module):
  def setup(self):
    self.enc = nn.Dense(16)
    self.dec = _Decoder()

  def __call__(self, x):
    return self.dec(jnp.tanh(self.enc(x)), self.enc.variables["params"]["kernel"])


def test_param_used_outside_its_module():
  model = _Tied()
  x = jax.random.normal(jax.random.key(0), (8, 16))
  params = init(model, jax.random.key(1), x)
  assert_parity(lambda p, b: jnp.mean((model.apply(p, b) - b) ** 2), params, x, config=SHARD_ALL)


@pytest.mark.slow
def test_unused_zero_sized_scalar_odd_and_int_leaves():
  params = {
    "unused": jnp.ones((5, 7)),
    "empty": jnp.ones((0, 4)),
    "scale": jnp.float32(1.5),
    "odd": jax.random.normal(jax.random.key(0), (13, 7)) / 4,
    "perm": jnp.array([3, 1, 0, 2, 6, 5, 4], jnp.int32),
  }

  def loss(p, b):
    h = jnp.tanh(b @ p["odd"]) * p["scale"] + p["empty"].sum()
    return jnp.mean(h[:, p["perm"]] ** 3)

  batch = jax.random.normal(jax.random.key(2), (8, 13))
  schedule, _ = assert_parity(loss, params, batch, config=SHARD_ALL)
  assert not schedule.param("['unused']").persistent
  assert schedule.param("['empty']").persistent
  assert not schedule.param("['perm']").persistent  # int leaves are sharded and gathered too
  _, _, grads, _ = run_zjax(loss, params, batch, config=SHARD_ALL)
  np.testing.assert_array_equal(grads["unused"], 0)
  np.testing.assert_array_equal(grads["perm"], 0)
  assert grads["perm"].dtype == jnp.int32


def test_bf16_leaves():
  params = {
    f"w{i}": (jax.random.normal(jax.random.key(i), (16, 16)) / 4).astype(jnp.bfloat16)
    for i in range(3)
  }

  def loss(p, x):
    h = x.astype(jnp.bfloat16)
    for i in range(3):
      h = jnp.tanh(h @ p[f"w{i}"])
    return jnp.mean(h.astype(jnp.float32) ** 2)

  x = jax.random.normal(jax.random.key(5), (8, 16))
  schedule, _, grads, _ = run_zjax(loss, params, x, config=SHARD_ALL)
  assert all(b.dtype == "bfloat16" for b in schedule.buckets)
  from helpers import reference

  ref_loss, ref = reference(loss, params, x)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  # same bf16 computation; bf16 rounding differs with the per-device batch split
  assert_trees_close(grads, ref, rtol=2e-2, atol=1e-3)


COND_PARAMS = {k: jax.random.normal(jax.random.key(i), (16, 16)) / 4 for i, k in enumerate("abc")}


def cond_loss(p, b):
  h = jax.lax.cond(b["flag"] > 0, lambda h: jnp.tanh(h @ p["a"]), lambda h: h @ p["b"], b["x"])
  i = jnp.clip(b["choice"], 0, 2)
  h = jax.lax.switch(i, [lambda h: h, lambda h: jnp.sin(h @ p["c"]), lambda h: -h], h)
  return jnp.mean(h**2)


@pytest.mark.parametrize("flag,choice", [(1.0, 1), (-1.0, 0), (1.0, 2)])
def test_cond_and_switch_branches(flag, choice):
  x = jax.random.normal(jax.random.key(10), (8, 16))
  batch = {"x": x, "flag": jnp.float32(flag), "choice": jnp.int32(choice)}  # replicated
  _, compiled = assert_parity(cond_loss, COND_PARAMS, batch, config=SHARD_ALL)
  assert_no_collective_in_branches(compiled.as_text())


@pytest.mark.slow
def test_devices_taking_different_branches_do_not_deadlock():
  """Per-example predicates: devices take different branches. All gathers happen outside
  the branches, so the step completes and equals the mean of per-device computations."""
  x = jax.random.normal(jax.random.key(11), (8, 16))
  batch = {
    "x": x,
    "flag": jnp.where(x[:, 0] > 0, 1.0, -1.0),
    "choice": jnp.arange(8, dtype=jnp.int32) % 3,
  }
  loss = lambda p, b: cond_loss(p, {"x": b["x"], "flag": b["flag"][0], "choice": b["choice"][0]})
  _, zloss, grads, compiled = run_zjax(loss, COND_PARAMS, batch, config=SHARD_ALL)
  device_grad = jax.jit(jax.value_and_grad(loss))
  per_device = [
    device_grad(COND_PARAMS, jax.tree.map(lambda a: a[i : i + 1], batch)) for i in range(8)
  ]
  assert (
    len(
      {float(b["flag"][0]) for b in [jax.tree.map(lambda a: a[i : i + 1], batch) for i in range(8)]}
    )
    == 2
  )
  np.testing.assert_allclose(zloss, np.mean([value for value, _ in per_device]), rtol=1e-5)
  assert_trees_close(grads, jax.tree.map(lambda *g: sum(g) / 8, *[g for _, g in per_device]))
  assert_no_collective_in_branches(compiled.as_text())


def assert_no_collective_in_branches(hlo_text):
  import re

  branches = set()
  for m in re.finditer(r"branch_computations=\{([^}]*)\}", hlo_text):
    branches.update(name.strip().lstrip("%") for name in m.group(1).split(","))
  for m in re.finditer(r"true_computation=%?([\w.\-]+).*false_computation=%?([\w.\-]+)", hlo_text):
    branches.update(m.groups())
  colls = zjax.hlo.collectives(hlo_text)
  assert colls and not [c for c in colls if c.computation in branches]


def test_remat_blocks():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.Dense(16)(jnp.tanh(nn.Dense(16)(x)))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(2):
        x = nn.remat(Block)()(x)
      return x

  model = Model()
  x = jax.random.normal(jax.random.key(0), (8, 16))
  params = init(model, jax.random.key(1), x)
  assert_parity(lambda p, b: jnp.mean(model.apply(p, b) ** 2), params, x, config=SHARD_ALL)


@pytest.mark.slow
@pytest.mark.parametrize("fold", [True, False])
def test_dropout_with_rng_in_batch(fold):
  """A 0-d key in the batch reaches device d as fold_in(key, d) (ZeroConfig.fold_rng_keys):
  each device draws its own masks. Opted out, every device sees the key as given. The
  reference is the mean over devices of the same per-device computation."""

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, key):
      h = nn.Dense(16)(x)
      h = nn.Dropout(0.5, deterministic=False)(h, rng=key)
      return nn.Dense(4)(h)

  model = Model()
  x = jax.random.normal(jax.random.key(0), (8, 16))
  params = init(model, jax.random.key(1), x, jax.random.key(2))
  loss = lambda p, b: jnp.mean(model.apply(p, b["x"], b["key"]) ** 2)
  batch = {"x": x, "key": jax.random.key(3)}
  config = dataclasses.replace(SHARD_ALL, fold_rng_keys=fold)
  _, zloss, grads, _ = run_zjax(loss, params, batch, config=config)
  keys = [jax.random.fold_in(batch["key"], i) if fold else batch["key"] for i in range(8)]
  slices = [{"x": x[i : i + 1], "key": keys[i]} for i in range(8)]
  device_grad = jax.jit(jax.value_and_grad(loss))
  per_device = [device_grad(params, b) for b in slices]
  np.testing.assert_allclose(zloss, np.mean([value for value, _ in per_device]), rtol=1e-5)
  mean_grads = jax.tree.map(lambda *g: sum(g) / 8, *[g for _, g in per_device])
  assert_trees_close(grads, mean_grads)


@pytest.mark.parametrize("n", [8, 4, 1])
def test_devices_draw_different_masks_deterministically(n):
  """The gradient of sum(mask * x * w) over w is the mean of the devices' masks: with
  folded keys it equals mean_d bernoulli(fold_in(key, d)) exactly, and differs from any
  one device's mask; the same key gives the same result again."""
  rows = 2
  loss = lambda p, b: jnp.sum(jax.random.bernoulli(b["key"], 0.5, b["x"].shape) * b["x"] * p["w"])
  params = {"w": jnp.zeros((rows, 64))}
  batch = {"x": jnp.ones((rows * n, 64)), "key": jax.random.key(7)}
  _, _, grads, _ = run_zjax(loss, params, batch, n=n, config=SHARD_ALL)
  masks = [
    jax.random.bernoulli(jax.random.fold_in(batch["key"], d), 0.5, (rows, 64)) for d in range(n)
  ]
  np.testing.assert_array_equal(grads["w"], np.mean(masks, axis=0, dtype=np.float32))
  assert n == 1 or not np.array_equal(masks[0], masks[1])
  _, _, again, _ = run_zjax(loss, params, batch, n=n, config=SHARD_ALL)
  np.testing.assert_array_equal(grads["w"], again["w"])


def test_key_array_with_a_batch_dimension_is_refused():
  loss, params, batch = mlp()
  batch = dict(batch, key=jax.random.split(jax.random.key(0), 16))
  with pytest.raises(
    zjax.ZjaxError,
    match=r"\['key'\] is an array of PRNG keys of shape "
    r"\(16,\).*jax.random.key\(seed\)",
  ):
    run_zjax(lambda p, b: loss(p, {"x": b["x"], "y": b["y"]}), params, batch, config=SHARD_ALL)


@pytest.mark.parametrize("explicit", [True, False])
def test_explicit_and_auto_meshes_and_numpy_batch(explicit):
  loss, params, batch = mlp(num_layers=2)
  mesh = mesh_of(8, explicit)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL)
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  numpy_batch = jax.tree.map(np.asarray, batch)
  value, g = step(zjax.shard(params, schedule, mesh), numpy_batch)
  ref_value, ref_g = jax.jit(jax.value_and_grad(loss))(params, batch)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_trees_close(zjax.unshard(g, schedule), ref_g)


@pytest.mark.slow
def test_numerics_do_not_depend_on_the_knobs():
  loss, params, batch = gpt_setup()
  configs = [
    zjax.ZeroConfig(param_persistence_threshold=0, prefetch_bucket_size=0, max_reuse_distance=0),
    zjax.ZeroConfig(param_persistence_threshold=0, prefetch_bucket_size=10**9),
    zjax.ZeroConfig(
      param_persistence_threshold=1000,
      max_live_parameters=40_000,
      max_reuse_distance=3000,
      prefetch_bucket_size=9000,
    ),
    zjax.ZeroConfig(),  # default threshold: everything of this small model persistent
  ]
  results = [run_zjax(loss, params, batch, config=c)[1:3] for c in configs]
  for loss_value, grads in results[1:]:
    np.testing.assert_allclose(loss_value, results[0][0], rtol=1e-6)
    assert_trees_close(grads, results[0][1], rtol=1e-6, atol=1e-7)


def mlp_step():
  """(loss, batch, mesh, schedule, step, sharded params) of a 2-layer MLP on 8 devices."""
  loss, params, batch = mlp(num_layers=2)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL)
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  return loss, params, batch, mesh, schedule, step, zjax.shard(params, schedule, mesh)


def test_second_call_does_not_recompile():
  _, _, batch, _, _, step, sharded = mlp_step()
  step(sharded, batch)
  with compiles_logged() as compiled:
    step(sharded, batch)
  assert not compiled


def test_bad_batch_and_mismatched_schedule():
  loss, params, batch, mesh, schedule, step, sharded = mlp_step()
  bad = {"x": batch["x"][:12], "y": batch["y"][:12]}
  with pytest.raises(zjax.ZjaxError, match=r"Batch leaf \['x'\] .* 12, not divisible by the 8"):
    step(sharded, bad)
  bare = lambda p, x: jnp.mean(x @ p["layer0"]["kernel"])  # noqa: E731 (a bare-array batch)
  with pytest.raises(zjax.ZjaxError, match=r"^The batch has leading .* 12, not divisible"):
    zjax.value_and_grad(bare, schedule, mesh=mesh)(sharded, batch["x"][:12])
  other_loss = lambda p, b: jnp.mean(jax.nn.relu(b["x"] @ p["layer0"]["kernel"]))
  with pytest.raises(zjax.ScheduleMismatchError):
    zjax.value_and_grad(other_loss, schedule, mesh=mesh)(sharded, batch)
  with pytest.raises(zjax.ZjaxError, match="planned for 8 devices"):
    zjax.value_and_grad(loss, schedule, mesh=mesh_of(4))


@pytest.mark.slow
def test_scanned_gpt_gathers_the_stack_before_the_scan():
  from gpt import GPT, GPTConfig, make_loss_fn

  cfg = GPTConfig(d_model=64, n_layer=3, n_head=4, d_ff=128, seq_len=16, scan_layers=True)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
  params = init(model, jax.random.key(1), tokens[:, :-1])
  schedule, _ = assert_parity(
    make_loss_fn(model),
    params,
    {"tokens": tokens},
    config=zjax.ZeroConfig(param_persistence_threshold=1024),
  )
  stacked = [p for p in schedule.params if "'layers'" in p.path and not p.persistent]
  assert stacked and all(p.shape[0] == 3 for p in stacked)


@pytest.mark.slow
def test_lax_scan_fori_and_custom_derivatives():
  """(lax.while_loop is traced, but JAX cannot reverse-differentiate it: no parity test.)"""
  keys = jax.random.split(jax.random.key(0), 5)
  params = {
    "stack": jax.random.normal(keys[0], (3, 16, 16)) / 4,
    "loop": jax.random.normal(keys[1], (16, 16)) / 4,
    "vjp": jax.random.normal(keys[2], (16, 16)) / 4,
    "jvp": jax.random.normal(keys[3], (16,)),
  }

  matmul = custom_vjp_matmul

  @jax.custom_jvp
  def scaled(x, s):
    return x * s

  scaled.defjvp(lambda p, t: (scaled(*p), t[0] * p[1] + p[0] * t[1]))

  @jax.jit
  def loss(p, x):
    x, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["stack"])
    x = jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ p["loop"]), x)
    x = scaled(matmul(x, p["vjp"]), p["jvp"])
    return jnp.mean(x**2)

  x = jax.random.normal(keys[4], (8, 16))
  assert_parity(loss, params, x, config=SHARD_ALL)


@pytest.mark.slow
def test_bf16_compute_halves_all_gather_bytes_and_stays_close():
  """Mixed precision: bf16 gathers and compute, fp32 gradient reduction and fp32 grads."""
  loss, params, batch = gpt_setup()
  base = dict(param_persistence_threshold=256, max_reuse_distance=0)
  s32, _, _, c32 = run_zjax(loss, params, batch, config=zjax.ZeroConfig(**base))
  s16, loss16, grads16, c16 = run_zjax(
    loss, params, batch, config=zjax.ZeroConfig(compute_dtype=jnp.bfloat16, **base)
  )
  h32, h16 = zjax.hlo.summarize(c32), zjax.hlo.summarize(c16)
  assert h16["all_gather_bytes"] * 2 == h32["all_gather_bytes"]
  assert h16["all_gather_bytes"] == s16.report()["all_gather_bytes"]
  assert h16["reduce_scatter_bytes"] == h32["reduce_scatter_bytes"]  # fp32 reduction
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads16))
  from helpers import reference

  ref_loss, ref_grads = reference(loss, params, batch)
  np.testing.assert_allclose(loss16, ref_loss, rtol=2e-3)
  for g, r in zip(jax.tree.leaves(grads16), jax.tree.leaves(ref_grads)):
    scale = float(np.max(np.abs(r))) + 1e-12
    assert float(np.max(np.abs(np.asarray(g) - np.asarray(r)))) <= 0.03 * scale  # bf16


def test_while_loop_over_batch_values_is_not_differentiated():
  """Like jax.value_and_grad, only values that depend on trained parameters are
  differentiated: a while_loop over batch values (not reverse-differentiable) is fine."""
  params = {"w": jax.random.normal(jax.random.key(0), (16, 16)) / 4}

  def loss(p, b):
    _, x = jax.lax.while_loop(
      lambda c: c[0] < b["n"], lambda c: (c[0] + 1.0, c[1] * 0.9), (0.0, b["x"])
    )
    return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

  batch = {"x": jax.random.normal(jax.random.key(1), (8, 16)), "n": jnp.float32(3.0)}
  assert_parity(loss, params, batch, config=SHARD_ALL)
