"""Trained parameters that the loss reads only where no gradient flows (trace.gradient_free):
through `lax.stop_gradient`, in a comparison (`jnp.where(p > 0, ...)`) or through `round`.
Their gradient is zero and XLA deletes a reduction of zeros, so the schedule reduces none
(`zero_gradient` entries and buckets): the report counted one all-reduce or reduce-scatter
that the compiled program does not run. The optimizer still updates them (weight decay).

Checked: which parameters are marked; gradients equal plain single-device JAX (fp32 rtol
1e-5) on 8 and 4 devices, with every parameter persistent and with every one sharded, and
the report equal to the compiled program's collectives; a parameter read both ways keeps
its gradient; AdamW steps equal optax's; the schedule file round-trips the flag.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import zjax
from helpers import (
  assert_parity,
  assert_report_matches,
  assert_trees_close,
  mesh_of,
  steps_like_optax,
)

PERSISTENT = zjax.ZeroConfig()  # every leaf here is under the persistence threshold
SHARDED = zjax.ZeroConfig(param_persistence_threshold=0)
READS = {
  "stop_gradient": lambda h, s: h * lax.stop_gradient(s),
  "comparison": lambda h, s: jnp.where(s > 0.5, h, 0.0),
  "round": lambda h, s: h * jnp.round(s),
  "both ways": lambda h, s: h * lax.stop_gradient(s) + s,  # (a gradient flows)
  # through complex values (a gradient flows)
  "complex": lambda h, s: jnp.real(jnp.fft.ifft(jnp.fft.fft(h * s))),
}
FLOWS = ("both ways", "complex")


def make_loss(read):
  def loss(p, batch):
    h = READS[read](batch["x"] @ p["w"], p["scale"])
    return jnp.mean((jnp.tanh(h) @ p["v"]) ** 2)

  return loss


def case():
  k = jax.random.split(jax.random.key(0), 4)
  params = {
    "scale": 1.0 + jax.random.normal(k[0], (32,)) / 4,
    "v": jax.random.normal(k[1], (32, 4)) / 5,
    "w": jax.random.normal(k[2], (16, 32)) / 4,
  }
  return params, {"x": jax.random.normal(k[3], (16, 16))}


def zero_gradient_paths(schedule):
  return sorted(p.path for p in schedule.params if p.zero_gradient)


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
@pytest.mark.parametrize("config", [PERSISTENT, SHARDED], ids=["persistent", "sharded"])
@pytest.mark.parametrize("read", list(READS))
def test_gradients_and_collectives_match(read, config, n):
  params, batch = case()
  schedule, compiled = assert_parity(make_loss(read), params, batch, n=n, config=config)
  assert zero_gradient_paths(schedule) == ([] if read in FLOWS else ["['scale']"])
  assert_report_matches(schedule, compiled)


@pytest.mark.parametrize("config", [PERSISTENT, SHARDED], ids=["persistent", "sharded"])
def test_adamw_still_decays_a_zero_gradient_parameter(config):
  params, batch = case()
  loss, mesh = make_loss("stop_gradient"), mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  optimizer = optax.adamw(1e-2, weight_decay=0.5)
  trainer = zjax.zero3(loss, optimizer, schedule, mesh=mesh)
  state, ref = steps_like_optax(trainer, trainer.init(params), loss, optimizer, params, batch, 2)
  trained = jax.device_get(trainer.gather_params(state))
  assert_trees_close(trained, ref)
  assert not jnp.allclose(trained["scale"], params["scale"])  # decayed, not skipped


def test_the_schedule_file_keeps_the_flag(tmp_path):
  params, batch = case()
  loss, mesh = make_loss("comparison"), mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARDED)
  (bucket,) = [b for b in schedule.buckets if "['scale']" in b.params]
  assert bucket.zero_gradient and bucket.params == ("['scale']",)
  path = tmp_path / "schedule.json"
  schedule.save(path)
  loaded = zjax.Schedule.load(path)
  assert loaded == schedule
  assert zero_gradient_paths(loaded) == ["['scale']"]
  assert loaded.buckets[bucket.id].zero_gradient
  # other parameters' entries and buckets are written as before the flag existed
  assert path.read_text().count('"zero_gradient"') == 2


def residual_stack(p, batch):
  """Four identical residual layers, each scaling by a stop_gradient'ed vector."""
  h = batch["x"]
  for i in range(4):
    layer = p[f"layer{i}"]
    h = jnp.tanh(h @ layer["w"]) * lax.stop_gradient(layer["scale"]) + h
  return jnp.mean(h**2)


@pytest.mark.parametrize("n", [8, 4])
def test_rolled_layers_gather_but_do_not_reduce_a_zero_gradient(n):
  k = jax.random.split(jax.random.key(1), 9)
  params = {
    f"layer{i}": {
      "w": jax.random.normal(k[i], (32, 32)) / 6,
      "scale": 1 + jax.random.normal(k[4 + i], (32,)) / 5,
    }
    for i in range(4)
  }
  batch = {"x": jax.random.normal(k[8], (16, 32))}
  schedule, compiled = assert_parity(residual_stack, params, batch, n=n, config=SHARDED)
  rolled = [b for b in schedule.buckets if b.layers]
  assert sorted((len(b.layers), b.zero_gradient) for b in rolled) == [(4, False), (4, True)]
  assert schedule.report()["reduce_scatter_count"] == 4  # the weights' only, once per layer
  assert_report_matches(schedule, compiled)
