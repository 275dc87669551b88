"""Collectives inside the loss over zjax's data axis (psum / pmean / axis_index): traced with
the axis bound, run inside the executor's shard_map, differentiated as data parallelism
does; collectives over any other axis are refused with an error naming it."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import zjax
from helpers import assert_trees_close, init, mesh_of, mlp, run_zjax

SHARD_ALL = zjax.ZeroConfig(param_persistence_threshold=0, max_reuse_distance=0)


@pytest.mark.parametrize("n", [8, 4])
def test_loss_normalised_by_a_global_count_equals_the_full_batch(n):
  """sum over my rows / psum of the number of valid rows: every device's loss is the global
  mean, and zjax's gradient is exactly the full-batch one."""
  base_loss, params, batch = mlp(num_layers=2)
  batch = dict(batch, valid=(jnp.arange(16) % 3 != 0).astype(jnp.float32))

  def per_row(p, b):
    x = b["x"]
    for i in range(2):
      x = jnp.tanh(x @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"])
    return jnp.mean((x - b["y"]) ** 2, axis=-1) * b["valid"]

  loss = lambda p, b: lax.psum(per_row(p, b).sum(), "fsdp") / lax.psum(b["valid"].sum(), "fsdp")
  full = lambda p, b: per_row(p, b).sum() / b["valid"].sum()
  _, zloss, grads, _ = run_zjax(loss, params, batch, n=n, config=SHARD_ALL)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(full))(params, batch)
  np.testing.assert_allclose(zloss, ref_loss, rtol=1e-5)
  assert_trees_close(grads, ref_grads)


@pytest.mark.slow
def test_axis_index_and_pmean_of_a_metric():
  loss_fn, params, batch = mlp(num_layers=2)

  def loss(p, b):
    scale = 1.0 + 0.25 * lax.axis_index("fsdp")
    metric = lax.pmean(jnp.abs(b["x"]).mean(), "fsdp")  # a constant: no gradient
    return loss_fn(p, b) * scale + 0.0 * metric

  _, zloss, grads, _ = run_zjax(loss, params, batch, n=4, config=SHARD_ALL)
  slices = [jax.tree.map(lambda a: a[4 * d : 4 * (d + 1)], batch) for d in range(4)]
  per_device = [
    jax.value_and_grad(lambda p, b, d=d: loss_fn(p, b) * (1 + 0.25 * d))(params, b)
    for d, b in enumerate(slices)
  ]
  np.testing.assert_allclose(zloss, np.mean([value for value, _ in per_device]), rtol=1e-5)
  assert_trees_close(grads, jax.tree.map(lambda *g: sum(g) / 4, *[g for _, g in per_device]))


class _Net(nn.Module):
  axis_name: str | None

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    h = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(h)
    return nn.Dense(4)(nn.relu(h))


def _bn_case(axis_name):
  model = _Net(axis_name)
  x = jax.random.normal(jax.random.key(0), (16, 8))
  variables = init(_Net(None), jax.random.key(1), x)
  extra = {"batch_stats": variables["batch_stats"]}

  def make_loss(m):
    def loss_fn(p, b, e):
      out, updates = m.apply({"params": p, **e}, b["x"], mutable=["batch_stats"])
      return jnp.mean(out**2), {"batch_stats": updates["batch_stats"]}

    return loss_fn

  return make_loss(model), make_loss(_Net(None)), variables["params"], {"x": x}, extra


@pytest.mark.slow
def test_batchnorm_on_the_models_own_axis_name_via_config():
  """nn.BatchNorm(axis_name="batch"): name zjax's axis "batch" (config and mesh)."""
  loss, full, params, batch, extra = _bn_case("batch")
  mesh = jax.make_mesh((8,), ("batch",))
  config = dataclasses.replace(SHARD_ALL, axis_name="batch")
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config, extra=extra)
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  (zloss, new_extra), grads = step(zjax.shard(params, schedule, mesh), batch, extra)
  (ref_loss, ref_extra), ref_grads = jax.jit(jax.value_and_grad(full, has_aux=True))(
    params, batch, extra
  )
  np.testing.assert_allclose(zloss, ref_loss, rtol=1e-5)
  assert_trees_close(new_extra, ref_extra)
  assert_trees_close(zjax.unshard(grads, schedule), ref_grads)


@pytest.mark.parametrize("axis", ["batch", "data"])
def test_collectives_over_an_axis_zjax_does_not_own_are_named(axis):
  loss, _, params, batch, extra = _bn_case(axis)
  with pytest.raises(
    zjax.TraceError,
    match=rf"over the axis '{axis}'.*data axis 'fsdp'.*"
    rf"ZeroConfig\(axis_name='{axis}'\)",
  ) as e:
    zjax.compile_schedule(loss, params, batch, mesh=mesh_of(8), config=SHARD_ALL, extra=extra)
  assert "NameError" not in str(e.value)
  plain, params, batch = mlp()
  with pytest.raises(zjax.TraceError, match=rf"'{axis}'"):
    zjax.compile_schedule(lambda p, b: lax.pmean(plain(p, b), axis), params, batch, num_devices=8)
