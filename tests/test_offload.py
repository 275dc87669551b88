"""Optimizer offload (ZeRO-Offload): fp32 masters and optimizer state in host memory
("pinned_host"), the update on the host, parameter copies in the compute dtype on the
device. Bitwise equal to training without offload; the arrays' memory kinds and per-device
bytes as predicted; checkpoints across offloaded and not; bad input."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_of
from test_rolling import ADAMW, ROLL, gpt

import zjax
from zjax._src import offload

BF16 = dataclasses.replace(ROLL, compute_dtype=jnp.bfloat16)


def _run(config, n, offload_optimizer, steps=5, optimizer=ADAMW, batch=None, **kw):
  loss, params, default_batch = gpt(2)
  batch = default_batch if batch is None else batch
  mesh = mesh_of(n)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  trainer = zjax.zero3(loss, optimizer, schedule, mesh=mesh,
                       offload_optimizer=offload_optimizer, **kw)
  state, losses = trainer.init(params), []
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    losses.append(float(metrics["loss"]))
  return trainer, state, losses


def assert_bitwise(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("n, config", [
    (8, ROLL), (4, dataclasses.replace(ROLL, sub_group_size=500)), (8, BF16),
], ids=["fp32-8", "fp32-4-subgroups", "bf16-8"])
def test_offloaded_training_equals_training_on_the_device(n, config):
  """5 adamw steps; offloaded: the masters (fp32) and the adam moments in pinned_host, the
  device copies in the compute dtype. Per device: 12 bytes per fp32 parameter / N without
  offload (parameter, adam's two moments), 4 (fp32) or 2 (bf16 copies) on the device with
  it, the 12 in host memory."""
  plain, plain_state, plain_losses = _run(config, n, False)
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
  assert zjax.per_device_bytes(offloaded, "device") == \
      share * jnp.dtype(compute).itemsize // 4
  assert zjax.per_device_bytes(offloaded, "pinned_host") == pytest.approx(3 * share, rel=1e-3)


def test_clipping_accumulation_and_nonfinite_steps_offloaded():
  loss, params, _ = gpt(2)
  batch = {"tokens": jax.random.randint(jax.random.key(3), (16, 17), 0, 257)}
  opt = optax.chain(optax.clip_by_global_norm(0.1), ADAMW)
  runs = [_run(ROLL, 8, off, steps=2, optimizer=opt, batch=batch, accumulation_steps=2)
          for off in (False, True)]
  assert runs[0][2] == runs[1][2]
  assert_bitwise(runs[0][0].gather_params(runs[0][1]), runs[1][0].gather_params(runs[1][1]))
  trainer, state, _ = runs[1]
  bad = {"tokens": batch["tokens"].at[0, 0].set(10_000)}  # out of vocabulary: nan loss
  before = jax.tree.map(np.asarray, (state.masters, state.opt_state, state.params))
  state, metrics = trainer.step(state, bad)
  assert not bool(metrics["finite"]) and int(state.step) == 2
  assert_bitwise((state.masters, state.opt_state, state.params), before)
  raising = zjax.zero3(*gpt(2)[:1], opt, trainer.schedule, mesh=trainer.mesh,
                       offload_optimizer=True, on_nonfinite="raise")
  with pytest.raises(zjax.NonFiniteError):
    raising.step(raising.init(params), bad)


def test_checkpoints_move_between_offloaded_and_not(tmp_path):
  """Saved from host memory, restored into it (on another device count), and across:
  bitwise the same parameters and optimizer state, the same next step."""
  loss, params, batch = gpt(2)
  trainers = {(n, off): zjax.zero3(loss, ADAMW, zjax.compile_schedule(
      loss, params, batch, mesh=mesh_of(n), config=BF16), mesh=mesh_of(n),
      offload_optimizer=off) for n, off in ((8, True), (4, False), (4, True))}
  state, _ = trainers[8, True].step(trainers[8, True].init(params), batch)
  with zjax.CheckpointManager(tmp_path / "a", trainers[8, True]) as ckpt:
    ckpt.save(1, state)
  plain = zjax.CheckpointManager(tmp_path / "a").restore(trainers[4, False])
  assert plain.masters is None
  assert_bitwise(trainers[4, False].gather_params(plain), trainers[8, True].gather_params(state))
  with zjax.CheckpointManager(tmp_path / "b", trainers[4, False]) as ckpt:
    ckpt.save(1, plain)
  back = zjax.CheckpointManager(tmp_path / "b").restore(trainers[4, True])
  assert {x.sharding.memory_kind for x in jax.tree.leaves((back.masters, back.opt_state))} \
      == {"pinned_host"}
  assert_bitwise(back.masters, plain.params)
  assert_bitwise(back.opt_state, plain.opt_state)
  assert offload.bytes_by_kind(back.params) == {"device": zjax.per_device_bytes(back.params)}
  _, m1 = trainers[4, False].step(plain, batch)
  _, m2 = trainers[4, True].step(back, batch)
  assert float(m1["loss"]) == float(m2["loss"])


def test_bad_input():
  loss, params, batch = gpt(1)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=ROLL)
  with pytest.raises(ValueError, match="offload_optimizer must be True or False"):
    zjax.zero3(loss, ADAMW, schedule, mesh=mesh, offload_optimizer="cpu")
  no_host = types.SimpleNamespace(platform="tpu", addressable_memories=lambda: [
      types.SimpleNamespace(kind="device")])
  fake_mesh = types.SimpleNamespace(devices=np.array([no_host]))
  with pytest.raises(zjax.ZjaxError, match="needs host memory of kind 'pinned_host', but "
                                           "the tpu backend's devices offer \\['device'\\]"):
    offload.check_host_memory(fake_mesh)
