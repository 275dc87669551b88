"""Optimizer offload (ZeRO-Offload): fp32 masters and optimizer state in host memory
("pinned_host"), updated on the device sub-group by sub-group, parameter copies in the
compute dtype on the device, or with parameter offload (ZeRO-Infinity) on the host, each
brought to the device by its gather. Bitwise equal to training without offload; the
arrays' memory kinds and per-device bytes as predicted; checkpoints across offloaded and
not; bad input."""

import contextlib
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from helpers import mesh_of
from real_models import CASES
from test_rolling import ADAMW, ROLL, UNROLL, gpt
from zjax._src.execute import offload_stream
from zjax._src.train import offload
from zjax._src.train.train import plan_sub_groups

BF16 = dataclasses.replace(ROLL, compute_dtype=jnp.bfloat16)
HPZ = dataclasses.replace(ROLL, replicate_axes=("data",), secondary_partition=True)
PARAM_OFFLOAD_CASES = {  # devices, config, mesh
  "fp32-4-subgroups": (4, dataclasses.replace(ROLL, sub_group_size=500), None),
  "bf16-8-subgroups": (8, dataclasses.replace(BF16, sub_group_size=3000), None),
  "fp32-8-unrolled-qwz": (8, dataclasses.replace(UNROLL, gather_quantization="int8"), None),
  "hpz-2x4": (8, HPZ, ((2, 4), ("data", "fsdp"))),
}


def _mesh(n, shape):
  return mesh_of(n) if shape is None else jax.make_mesh(*shape)


def _run(config, n, offload_optimizer, steps=5, optimizer=ADAMW, batch=None, mesh=None, **kw):
  loss, params, default_batch = gpt(2)
  batch = default_batch if batch is None else batch
  mesh = mesh or mesh_of(n)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  trainer = zjax.zero3(
    loss, optimizer, schedule, mesh=mesh, offload_optimizer=offload_optimizer, **kw
  )
  state, losses = trainer.init(params), []
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    losses.append(float(metrics["loss"]))
  return trainer, state, losses


_PLAIN_RUNS = {}


def _plain_run(config, n, shape=None):
  """_run without offload (5 default steps), shared by the tests that compare with it."""
  key = (config, n, shape)
  if key not in _PLAIN_RUNS:
    _PLAIN_RUNS[key] = _run(config, n, False, mesh=_mesh(n, shape))
  return _PLAIN_RUNS[key]


def assert_bitwise(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
@pytest.mark.parametrize(
  "n, config",
  [
    (8, ROLL),
    (4, dataclasses.replace(ROLL, sub_group_size=500)),
    (8, BF16),
    (8, dataclasses.replace(BF16, sub_group_size=3000)),
  ],
  ids=["fp32-8", "fp32-4-subgroups", "bf16-8", "bf16-8-subgroups"],
)
def test_offloaded_training_equals_training_on_the_device(n, config):
  """5 adamw steps; offloaded: the masters (fp32) and the adam moments in pinned_host, the
  device copies in the compute dtype. Per device: 12 bytes per fp32 parameter / N without
  offload (parameter, adam's two moments), 4 (fp32) or 2 (bf16 copies) on the device with
  it, the 12 in host memory."""
  plain, plain_state, plain_losses = _plain_run(config, n)
  trainer, state, losses = _run(config, n, True)
  assert losses == plain_losses
  assert_bitwise(trainer.gather_params(state), plain.gather_params(plain_state))
  assert_bitwise(state.opt_state, plain_state.opt_state)
  kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}  # noqa: E731
  assert kinds(state.opt_state) == kinds(state.masters) == {"pinned_host"}
  assert kinds(state.params) == {"device"}
  compute = config.compute_dtype or jnp.float32
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(compute)}
  assert {x.dtype for x in jax.tree.leaves(state.masters)} == {jnp.dtype(jnp.float32)}
  share = trainer.schedule.report()["state_bytes_per_device"]  # fp32 shards + replicated
  everything = (plain_state.params, plain_state.opt_state)
  assert zjax.per_device_bytes(everything, "device") == pytest.approx(3 * share, rel=1e-3)
  assert zjax.per_device_bytes(everything, "pinned_host") == 0
  offloaded = (state.params, state.opt_state, state.masters)
  assert zjax.per_device_bytes(offloaded, "device") == share * jnp.dtype(compute).itemsize // 4
  assert zjax.per_device_bytes(offloaded, "pinned_host") == pytest.approx(3 * share, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("case", PARAM_OFFLOAD_CASES)
def test_offloaded_params_train_like_the_device(case):
  """offload_params (ZeRO-Infinity): the parameter copies live in host memory too, and the
  device holds no parameter or optimizer bytes between steps. 5 adamw steps bitwise equal
  to training on the device: rolled and unrolled, bf16 compute, qwZ, hpZ, sub-groups."""
  n, config, shape = PARAM_OFFLOAD_CASES[case]
  plain, plain_state, plain_losses = _plain_run(config, n, shape)
  trainer, state, losses = _run(config, n, True, mesh=_mesh(n, shape), offload_params=True)
  assert losses == plain_losses
  assert_bitwise(trainer.gather_params(state), plain.gather_params(plain_state))
  assert_bitwise(state.opt_state, plain_state.opt_state)
  everything = (state.params, state.opt_state, state.masters)
  assert {x.sharding.memory_kind for x in jax.tree.leaves(everything)} == {"pinned_host"}
  assert zjax.per_device_bytes(everything, "device") == 0
  plan = trainer.offload_plan
  assert plan["device_bytes"] == 0 and plan["params_on_host"]
  share = trainer.schedule.report()["state_bytes_per_device"]  # fp32 shards + replicated
  copies = share * jnp.dtype(config.compute_dtype or jnp.float32).itemsize // 4
  measured = zjax.per_device_bytes(everything, "pinned_host")
  assert measured == pytest.approx(3 * share + copies, rel=1e-3)
  assert 0 < measured - plan["host_bytes"] <= 16  # + the optimizer's step counts


def _moves_from_the_host(jaxpr, times=1, found=None):
  """(bytes moved host -> device, times their loops run; for every all-gather: whether its
  operand was moved from the host after an optimization barrier) in a traced program."""
  found = found if found is not None else {"bytes": 0, "gathers": []}
  made_by = {v: e for e in jaxpr.eqns for v in e.outvars}

  def from_host_after_barrier(var, seen):
    eqn = made_by.get(var)
    if eqn is None or id(eqn) in seen:
      return False
    seen.add(id(eqn))
    if eqn.primitive.name == "device_put" and _is_host(eqn.invars[0]):
      source = made_by.get(eqn.invars[0])
      return source is not None and source.primitive.name == "optimization_barrier"
    if eqn.primitive.name == "optimization_barrier":  # identity, position by position
      return from_host_after_barrier(eqn.invars[eqn.outvars.index(var)], seen)
    return any(
      from_host_after_barrier(v, seen)
      for v in eqn.invars
      if not isinstance(v, jax.extend.core.Literal)
    )

  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "device_put" and _is_host(eqn.invars[0]):
      found["bytes"] += times * sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.outvars)
    if eqn.primitive.name == "all_gather":
      found["gathers"].append(from_host_after_barrier(eqn.invars[0], set()))
    for inner in jax.extend.core.jaxprs_in_params(eqn.params):
      _moves_from_the_host(
        getattr(inner, "jaxpr", inner), times * eqn.params.get("length", 1), found
      )
  return found


def _is_host(var):
  return getattr(var.aval, "memory_space", None) == jax.memory.Space.Host


@pytest.mark.slow
@pytest.mark.parametrize("case", PARAM_OFFLOAD_CASES)
def test_each_gather_brings_its_shards_from_the_host(case):
  """Given shards in host memory, the executor moves each bucket's shards to the device
  where the schedule gathers it (after the barrier that ties the gather to the step before
  it, so the schedule's prefetch covers the copy), and the persistent leaves once: the
  bytes moved per step are the plan's param_transfer_bytes. The gradients are the same
  bits as from shards on the device. hpZ's backward gathers read the secondary shards on
  the device: nothing moves for them. (CPU compiles the moves away, so this is checked on
  the traced program.)"""
  n, config, shape = PARAM_OFFLOAD_CASES[case]
  loss, params, batch = gpt(2)
  mesh = _mesh(n, shape)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  on_device = zjax.shard(params, schedule, mesh)
  dtypes = [
    jnp.dtype(x.dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating)
    else jnp.dtype(config.compute_dtype or x.dtype)
    for x in jax.tree.leaves(on_device)
  ]
  on_device = offload.device_copies(on_device, dtypes)
  on_host = jax.tree.map(
    lambda x: jax.device_put(x, offload.with_kind(x.sharding, offload.HOST)), on_device
  )
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  found = _moves_from_the_host(jax.make_jaxpr(step)(on_host, batch).jaxpr)
  if config.secondary_partition:  # forward from the host, backward from the secondary
    assert any(found["gathers"]) and not all(found["gathers"])
  else:
    assert found["gathers"] and all(found["gathers"])
  assert found["bytes"] == offload_stream.param_transfer_bytes(schedule) > 0
  assert not _moves_from_the_host(jax.make_jaxpr(step)(on_device, batch).jaxpr)["bytes"]
  assert_bitwise(step(on_host, batch), step(on_device, batch))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet_syncbn", "nnx_gqa"])
def test_outside_style_models_train_offloaded_like_on_the_device(name):
  """Models not written for zjax (tests/real_models.py): a ResNet with synchronised
  BatchNorm statistics (non-parameter state) and an NNX GQA model (rolled runs of layers):
  3 adamw steps with clipping, optimizer and parameter offload streamed in sub-groups,
  bitwise those on the device."""
  case = CASES[name]()
  mesh = mesh_of(8)
  config = zjax.ZeroConfig(param_persistence_threshold=256, sub_group_size=200)
  schedule = zjax.compile_schedule(
    case.loss_fn, case.params, case.batch, mesh=mesh, config=config, extra=case.extra
  )
  opt = optax.chain(optax.clip_by_global_norm(1.0), ADAMW)
  runs = []
  for off in (False, True):
    trainer = zjax.zero3(
      case.loss_fn, opt, schedule, mesh=mesh, offload_optimizer=off, offload_params=off
    )
    state, losses = trainer.init(case.params, extra=case.extra), []
    for _ in range(3):
      state, metrics = trainer.step(state, case.batch)
      losses.append(float(metrics["loss"]))
    runs.append((losses, trainer.gather_params(state), state.extra))
  assert trainer.offload_plan["sub_groups"] > 1
  assert runs[0][0] == runs[1][0]
  assert_bitwise(runs[1][1:], runs[0][1:])


@pytest.mark.slow
def test_clipping_accumulation_and_nonfinite_steps_offloaded():
  loss, params, _ = gpt(2)
  batch = {"tokens": jax.random.randint(jax.random.key(3), (16, 17), 0, 257)}
  opt = optax.chain(optax.clip_by_global_norm(0.1), ADAMW)
  runs = [
    _run(
      ROLL, 8, off, steps=2, optimizer=opt, batch=batch, accumulation_steps=2, offload_params=params
    )
    for off, params in ((False, False), (True, False), (True, True))
  ]
  for trainer, state, losses in runs[1:]:
    assert losses == runs[0][2]
    assert_bitwise(trainer.gather_params(state), runs[0][0].gather_params(runs[0][1]))
    bad = {"tokens": batch["tokens"].at[0, 0].set(10_000)}  # out of vocabulary: nan loss
    before = jax.tree.map(np.asarray, (state.masters, state.opt_state, state.params))
    state, metrics = trainer.step(state, bad)
    assert not bool(metrics["finite"]) and int(state.step) == 2
    assert_bitwise((state.masters, state.opt_state, state.params), before)
  raising = zjax.zero3(
    *gpt(2)[:1],
    opt,
    trainer.schedule,
    mesh=trainer.mesh,
    offload_optimizer=True,
    on_nonfinite="raise",
  )
  with pytest.raises(zjax.NonFiniteError):
    raising.step(raising.init(params), bad)


@pytest.mark.slow
def test_checkpoints_move_between_offloaded_and_not(tmp_path):
  """Saved from host memory, restored into it (on another device count), and across:
  bitwise the same parameters and optimizer state, the same next step."""
  loss, params, batch = gpt(2)
  trainers = {
    (n, off): zjax.zero3(
      loss,
      ADAMW,
      zjax.compile_schedule(loss, params, batch, mesh=mesh_of(n), config=BF16),
      mesh=mesh_of(n),
      offload_optimizer=bool(off),
      offload_params=off == "params",
    )
    for n, off in ((8, True), (4, False), (4, True), (4, "params"))
  }
  state, _ = trainers[8, True].step(trainers[8, True].init(params), batch)
  with zjax.CheckpointManager(tmp_path / "a", trainers[8, True]) as ckpt:
    ckpt.save(1, state)
  plain = zjax.CheckpointManager(tmp_path / "a").restore(trainers[4, False])
  assert plain.masters is None
  assert_bitwise(trainers[4, False].gather_params(plain), trainers[8, True].gather_params(state))
  with zjax.CheckpointManager(tmp_path / "b", trainers[4, False]) as ckpt:
    ckpt.save(1, plain)
  back = zjax.CheckpointManager(tmp_path / "b").restore(trainers[4, True])
  assert {x.sharding.memory_kind for x in jax.tree.leaves((back.masters, back.opt_state))} == {
    "pinned_host"
  }
  assert_bitwise(back.masters, plain.params)
  assert_bitwise(back.opt_state, plain.opt_state)
  assert offload.bytes_by_kind(back.params) == {"device": zjax.per_device_bytes(back.params)}
  copies = jax.tree.map(np.asarray, back.params)  # (the steps donate their states)
  _, m1 = trainers[4, False].step(plain, batch)
  _, m2 = trainers[4, True].step(back, batch)
  assert float(m1["loss"]) == float(m2["loss"])
  # parameter offload: restored into host memory, saved from it, back to the device
  hosted = zjax.CheckpointManager(tmp_path / "b").restore(trainers[4, "params"])
  assert {
    x.sharding.memory_kind
    for x in jax.tree.leaves((hosted.params, hosted.masters, hosted.opt_state))
  } == {"pinned_host"}
  assert_bitwise(hosted.params, copies)
  hosted, m3 = trainers[4, "params"].step(hosted, batch)
  assert float(m3["loss"]) == float(m1["loss"])
  with zjax.CheckpointManager(tmp_path / "c", trainers[4, "params"]) as ckpt:
    ckpt.save(2, hosted)
  again = zjax.CheckpointManager(tmp_path / "c").restore(trainers[8, True])
  assert_bitwise(
    trainers[8, True].gather_params(again), trainers[4, "params"].gather_params(hosted)
  )


def test_bad_input():
  loss, params, batch = gpt(1)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=ROLL)
  with pytest.raises(ValueError, match="offload_optimizer must be True or False"):
    zjax.zero3(loss, ADAMW, schedule, mesh=mesh, offload_optimizer="cpu")
  with pytest.raises(ValueError, match="offload_params must be True or False"):
    zjax.zero3(loss, ADAMW, schedule, mesh=mesh, offload_optimizer=True, offload_params=1)
  with pytest.raises(ValueError, match="offload_params=True needs offload_optimizer=True"):
    zjax.zero3(loss, ADAMW, schedule, mesh=mesh, offload_params=True)
  no_host = types.SimpleNamespace(
    platform="tpu", addressable_memories=lambda: [types.SimpleNamespace(kind="device")]
  )
  fake_mesh = types.SimpleNamespace(devices=np.array([no_host]))
  with pytest.raises(
    zjax.ZjaxError,
    match="needs host memory of kind 'pinned_host', but "
    "the tpu backend's devices offer \\['device'\\]",
  ):
    offload.check_host_memory(fake_mesh)


def _wide_mlp(layers=6, width=256):
  """Weights dominate (a small batch): the optimizer state is most of the step's memory."""
  params = {
    f"layer{i}": {"w": jax.random.normal(jax.random.key(i), (width, width)) / 16}
    for i in range(layers)
  }
  batch = {"x": jax.random.normal(jax.random.key(99), (8, width))}

  def loss(p, b):
    h = b["x"]
    for i in range(layers):
      h = jnp.tanh(h @ p[f"layer{i}"]["w"])
    return jnp.mean(h**2)

  return loss, params, batch


@pytest.mark.slow
def test_the_update_streams_sub_group_by_sub_group():
  """Sub-groups of one weight each: bitwise the same training as one group and as no
  offload (clipping: a global norm); the plan's bytes; group g moves to the device only
  after group g-2 is updated (its transfer depends on that group's inputs). CPU erases the
  memory-space moves when it compiles (one physical memory): what the device then holds
  cannot be measured here."""
  loss, params, batch = _wide_mlp()
  mesh = mesh_of(8)
  opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
  found = {}
  for name, size, off in (
    ("plain", 10**9, False),
    ("whole", 10**9, True),
    ("streamed", 8192, True),
  ):
    config = zjax.ZeroConfig(sub_group_size=size, roll_layers=False, param_persistence_threshold=64)
    schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
    trainer = zjax.zero3(loss, opt, schedule, mesh=mesh, offload_optimizer=off)
    state = trainer.init(params)
    for _ in range(3):
      state, _ = trainer.step(state, batch)
    found[name] = (trainer, state)
  trainer, state = found["streamed"]
  groups = plan_sub_groups(trainer.schedule)
  assert len(groups) == 6 and all(len(g) == 1 for g in groups)
  plan = trainer.offload_plan
  assert plan["sub_groups"] == 6
  assert plan["stream_device_bytes"] == 2 * 256 * 256 // 8 * 12  # two weights' masters+adam
  assert plan["whole_state_bytes"] == found["whole"][0].offload_plan["stream_device_bytes"]
  assert plan["device_bytes"] == zjax.per_device_bytes(state.params)
  shared = sum(
    x.nbytes
    for x, owner in zip(
      jax.tree.leaves(state.opt_state),  # step counts
      offload_stream.state_owners(state.opt_state, state.masters),
    )
    if owner is None
  )
  assert 0 < shared <= 16
  assert (
    plan["host_bytes"]
    == zjax.per_device_bytes((state.masters, state.opt_state), "pinned_host") - shared
  )
  want = found["plain"][0].gather_params(found["plain"][1])
  for name in ("whole", "streamed"):
    assert_bitwise(found[name][0].gather_params(found[name][1]), want)
    assert_bitwise(found[name][1].opt_state, found["plain"][1].opt_state)
  # g after g-2 (so after g-4, ...): never waiting for g-1, whose update it overlaps
  assert _transfer_order(state, groups) == [set(range(g - 2, -1, -2)) for g in range(6)]


def _transfer_order(state, groups):
  """For each group's first move to the device: the other groups whose masters it waits
  for (offload_stream.streamed_update traced on the state's shapes)."""
  update = lambda grads, opt_state, masters, finite, groups=None: (  # noqa: E731
    jax.tree.map(lambda m, g: m - g, masters, grads),
    opt_state,
  )

  def stream(masters, opt_state):
    return offload_stream.streamed_update(
      update,
      masters,
      opt_state,
      masters,
      masters,
      groups,
      jnp.bool_(True),
      [x.dtype for x in jax.tree.leaves(masters)],
    )

  shapes = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state.masters, state.opt_state)
  )
  jaxpr = jax.make_jaxpr(stream)(*shapes).jaxpr
  read = offload_stream.dependency_reader(jaxpr, ordering=True)
  group_of = {i: g for g, group in enumerate(groups) for i in group}
  moves = [
    e
    for e in jaxpr.eqns
    if e.primitive.name == "device_put" and "Device" in str(e.params.get("devices"))
  ]
  order = []
  for g, group in enumerate(groups):
    first = next(e for e in moves if read(e.invars[0]) & set(group))
    order.append({group_of[i] for i in read(first.invars[0]) if i in group_of} - {g})
  return order


def _state_wide_scale():
  """An optimizer whose update for one parameter reads every parameter's state."""

  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(updates, state, params=None):
    total = sum(jnp.sum(jnp.abs(s)) for s in jax.tree.leaves(state))
    state = jax.tree.map(lambda s, u: s + u, state, updates)
    return jax.tree.map(lambda u: -0.1 * u / (1 + total), updates), state

  return optax.GradientTransformation(init, update)


def test_an_optimizer_mixing_leaves_moves_the_whole_state_with_a_warning():
  loss, params, batch = _wide_mlp(layers=3, width=64)
  mesh = mesh_of(4)
  config = zjax.ZeroConfig(sub_group_size=1024, roll_layers=False, param_persistence_threshold=64)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  runs = {}
  for off in (False, True):
    trainer = zjax.zero3(loss, _state_wide_scale(), schedule, mesh=mesh, offload_optimizer=off)
    state = trainer.init(params)
    with (
      pytest.warns(
        UserWarning,
        match=r"moves the whole state at once, not sub-group by "
        r"sub-group: the new master \['layer0'\]\['w'\] depends on another "
        r"sub-group's leaf",
      )
      if off
      else contextlib.nullcontext()
    ):
      for _ in range(2):
        state, _ = trainer.step(state, batch)
    runs[off] = trainer.gather_params(state)
  assert_bitwise(runs[True], runs[False])


def test_dependencies_follow_calls_and_state_owners_follow_paths():
  def f(a, b, c):
    return jax.jit(lambda x: x * 2)(a) + b, jnp.sum(c), jnp.float32(1)

  x = jnp.ones(3)
  deps = offload_stream.dependencies(jax.make_jaxpr(f)(x, x, x).jaxpr)
  assert deps == [frozenset({0, 1}), frozenset({2}), frozenset()]
  params = {"a": jnp.ones(4), "b": {"a": jnp.ones(2)}}
  state = optax.adam(1e-3).init(params)
  owners = offload_stream.state_owners(state, params)
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  named = {jax.tree_util.keystr(p): o for (p, _), o in zip(leaves, owners)}
  assert named == {
    "[0].count": None,
    "[0].mu['a']": 0,
    "[0].mu['b']['a']": 1,
    "[0].nu['a']": 0,
    "[0].nu['b']['a']": 1,
  }


@pytest.mark.slow
def test_offload_memory_script_runs():
  """examples/offload_memory.py at tiny size (structure only; its numbers are in the
  docs/offload.md): every run's bytes per parameter / N, the offloaded ones' masters on the host."""
  import pathlib
  import subprocess
  import sys

  root = pathlib.Path(__file__).resolve().parents[1]
  done = subprocess.run(
    [
      sys.executable,
      str(root / "examples/offload_memory.py"),
      "--layers",
      "1",
      "--d-model",
      "32",
      "--rounds",
      "1",
      "--devices",
      "4",
      "--sub-group-size",
      "500",
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  rows = {line[:20].strip(): line[20:].split() for line in done.stdout.splitlines()[2:]}
  assert list(rows) == [
    f"{p}{m}" for p in ("fp32", "bf16") for m in ("", " offloaded", " offl. streamed", " + params")
  ]
  for precision, copy_bytes in (("fp32", 4), ("bf16", 2)):
    device, host = (float(x) for x in rows[precision][:2])
    assert host == 0 and device > 12  # + replicated small leaves, whole on every device
    device, host = (float(x) for x in rows[f"{precision} offloaded"][:2])
    assert host > 12 and device == pytest.approx(host * copy_bytes / 12, rel=0.02)
    device, params_host = (float(x) for x in rows[f"{precision} + params"][:2])
    assert device == 0 and params_host == pytest.approx(host * (12 + copy_bytes) / 12, rel=0.02)
    assert int(rows[f"{precision} + params"][2]) > 1  # sub-groups
