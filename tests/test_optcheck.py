"""The optimizer shard-compatibility check: one representative per distinct shape, cached,
with a fallback to the whole tree for optimizers that need the params' own structure."""

import jax
import numpy as np
import optax
import pytest

import zjax
from helpers import mesh_of, mlp
from test_train import SHARD_ALL, assert_training_parity, same_batch
from zjax._src.train import optcheck


def _schedule(n=8, layers=4):
  loss, params, batch = mlp(num_layers=layers)
  mesh = mesh_of(n)
  return (
    loss,
    params,
    batch,
    mesh,
    zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL),
  )


def test_one_representative_per_distinct_shape_and_layout():
  *_, schedule = _schedule(layers=6)
  reps = optcheck.representatives(schedule, [True] * len(schedule.storage))
  assert len(schedule.params) == 12
  assert [r.path for r in reps] == ["['layer0']['bias']", "['layer0']['kernel']"]
  assert optcheck.representatives(schedule, [False] * len(schedule.storage)) == []


@pytest.mark.parametrize("n", [8, 2])
def test_probe_runs_once_per_optimizer_and_layout(n, monkeypatch):
  loss, params, _, mesh, schedule = _schedule(n)
  calls = []
  monkeypatch.setattr(optcheck, "_cache", {})  # (another test may have probed adamw(1e-3))
  real = optcheck._find_error
  monkeypatch.setattr(optcheck, "_find_error", lambda *a, **k: calls.append(1) or real(*a, **k))
  optimizer = optax.adamw(1e-3)
  trainer = zjax.zero3(loss, optimizer, schedule, mesh=mesh)
  trainer.init(params)
  trainer.init(params)
  zjax.zero3(loss, optimizer, schedule, mesh=mesh).init(params)
  assert len(calls) == 1
  # the same code and settings in another object (a rebuilt trainer, a sweep): not again
  zjax.zero3(loss, optax.adamw(1e-3), schedule, mesh=mesh).init(params)
  assert len(calls) == 1
  for other in (optax.adamw(2e-3), optax.adam(1e-3), optax.adamw(np.float32(1e-3))):
    zjax.zero3(loss, other, schedule, mesh=mesh).init(params)
  assert len(calls) == 4


def test_optimizers_are_keyed_by_code_and_settings():
  key = lambda optimizer: optcheck._structure(optimizer, ())  # noqa: E731
  clip = lambda n: optax.chain(optax.clip_by_global_norm(n), optax.adamw(1e-3))  # noqa: E731
  assert key(clip(1.0)) == key(clip(1.0)) != key(clip(2.0))
  sched = lambda n: optax.adamw(optax.cosine_decay_schedule(1e-3, n))  # noqa: E731
  assert key(sched(100)) == key(sched(100)) != key(sched(200))
  masked = lambda skip: optax.masked(optax.adam(1e-3), lambda p: {k: k != skip for k in p})  # noqa: E731
  assert key(masked("a")) != key(masked("b"))  # the same lambda, another captured value
  # a plain global the optimizer's code reads is part of its settings
  scope = {"optax": optax, "RATE": 1e-3}
  exec("def rate(step):\n  return RATE\n", scope)
  before = key(optax.sgd(scope["rate"]))
  scope["RATE"] = 2e-3
  assert key(optax.sgd(scope["rate"])) != before
  with pytest.raises(TypeError):  # an array is not compared by value: keyed by the object
    key(optax.adam(jax.numpy.asarray(1e-3)))


def test_refusal_is_cached_and_names_the_parameter():
  loss, params, _, mesh, schedule = _schedule()
  muon = optax.contrib.muon(1e-2)
  for _ in range(2):
    with pytest.raises(
      zjax.ZjaxError, match=r"not shard-compatible.*\['layer0'\]\['(kernel|bias)'\]"
    ):
      zjax.zero3(loss, muon, schedule, mesh=mesh).init(params)


@pytest.mark.slow
def test_label_pytree_falls_back_to_the_whole_tree():
  """A multi_transform whose labels are a pytree shaped like the params cannot run on the
  representatives' smaller tree: the check probes every leaf in the params' structure."""
  loss, params, batch = mlp(num_layers=3)
  labels = {k: {"kernel": "adam", "bias": "sgd"} for k in params}
  opt = optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2)}, labels)
  assert_training_parity(loss, opt, params, same_batch(batch, 3))
  labels["layer2"]["kernel"] = "muon"
  bad = optax.multi_transform(
    {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2), "muon": optax.contrib.muon(1e-2)}, labels
  )
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=SHARD_ALL)
  with pytest.raises(zjax.ZjaxError, match=r"\['layer2'\]\['kernel'\]"):
    zjax.zero3(loss, bad, schedule, mesh=mesh).init(params)


@pytest.mark.parametrize("limit", [optcheck.ONE_DEVICE_PROBE_BYTES, 0], ids=["one", "sharded"])
def test_small_probes_run_on_one_device_large_ones_over_the_mesh(limit, monkeypatch):
  """Both placements judge alike: adamw passes, Muon (shape-dependent) is refused naming a
  parameter; the probe's leaves live on one device or are sharded over all eight."""
  loss, params, _, mesh, schedule = _schedule()
  monkeypatch.setattr(optcheck, "ONE_DEVICE_PROBE_BYTES", limit)
  monkeypatch.setattr(optcheck, "_cache", {})
  placed = []
  random_leaves = optcheck._random_leaves
  monkeypatch.setattr(
    optcheck, "_random_leaves", lambda *a: placed.append(random_leaves(*a)) or placed[-1]
  )
  zjax.zero3(loss, optax.adamw(1e-3), schedule, mesh=mesh).init(params)
  with pytest.raises(zjax.ZjaxError, match=r"not shard-compatible.*\['layer0'\]"):
    zjax.zero3(loss, optax.contrib.muon(1e-2), schedule, mesh=mesh).init(params)
  devices = {len(x.sharding.device_set) for leaves in placed for x in leaves}
  assert devices == ({1} if limit else {8}), devices


def test_probe_leaves_are_sharded_over_the_mesh():
  *_, mesh, schedule = _schedule()
  auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,))
  leaves = optcheck._random_leaves(list(schedule.params), schedule, auto, 0)
  kernel = leaves[1]
  assert kernel.shape == (64, 64)
  assert {s.data.shape for s in kernel.addressable_shards} == {(8, 64)}
  assert np.std(np.asarray(kernel)) > 0.5
