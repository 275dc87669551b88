"""Checkpoints: bitwise resume, restore on other device counts and schedules, export, faults.

Restores that only move data (same or other layout) are compared bitwise; training that
continues on another device count is compared at fp32 tolerances (reduction order differs).
"""

import functools
import gc
import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import zjax
from helpers import assert_trees_close, mesh_of
from zjax._src.layout import layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig, abstract_setup  # noqa: E402

CFG = GPTConfig(d_model=32, n_layer=2, n_head=2, d_ff=64, seq_len=16)
LOSS, SHAPES, BATCH_SHAPES = abstract_setup(CFG, batch_size=8)
OPTIMIZER = optax.adamw(1e-2, eps=1e-6)
SGD = optax.sgd(0.1, momentum=0.9)


@functools.lru_cache(maxsize=None)  # trainers are pure functions: reuse their compilations
def trainer_for(n, threshold=100, optimizer=OPTIMIZER, cfg=CFG, from_json=False):
  loss, shapes, batch_shapes = (
    (LOSS, SHAPES, BATCH_SHAPES) if cfg is CFG else abstract_setup(cfg, batch_size=8)
  )
  mesh = mesh_of(n)
  schedule = zjax.compile_schedule(
    loss,
    shapes,
    batch_shapes,
    mesh=mesh,
    config=zjax.ZeroConfig(param_persistence_threshold=threshold),
  )
  if from_json:  # a schedule read from a file does not know the params' pytree type
    schedule = zjax.Schedule.from_json(schedule.to_json())
  return zjax.zero3(loss, optimizer, schedule, mesh=mesh)


def batch_of(i):
  return {"tokens": jax.random.randint(jax.random.key(100 + i), (8, CFG.seq_len + 1), 0, 257)}


INIT = GPT(CFG).init


def fresh_state(trainer):
  tokens = jnp.zeros((8, CFG.seq_len), jnp.int32)
  return trainer.init_from(INIT, jax.random.key(0), tokens)


def natural_state(state, trainer):
  """(params, opt_state) on the host, every layout-dependent leaf in natural shape: the
  optimizer state as {path: value}, a leaf mirroring a rolled stack given per layer (under
  its prefix + the layer's parameter path), so that any two layouts compare."""
  schedule = trainer.schedule
  opt = {}
  for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
    path, x = jax.tree_util.keystr(path), np.asarray(jax.device_get(x))
    index = layout.mirrored_storage(path, x.shape, schedule)
    if index is None:
      opt[path] = x
      continue
    leaf = schedule.storage[index]
    prefix = path[: len(path) - len(leaf.path)]
    natural = np.asarray(layout.natural_from_storage(x, leaf.entry))
    for i, value in zip(leaf.members, layout.members_of_natural(natural, leaf)):
      opt[prefix + schedule.params[i].path] = np.asarray(value)
  params = jax.device_get(trainer.gather_params(state))
  return params, opt


def assert_bitwise(a, b):
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


def test_save_restore_continue_is_bitwise(tmp_path):
  trainer = trainer_for(8)
  state = fresh_state(trainer)
  for i in range(2):
    state, _ = trainer.step(state, batch_of(i))
  with zjax.CheckpointManager(tmp_path, trainer) as ckpt:
    ckpt.save(2, state)
    losses = []
    for i in range(2, 5):  # continues at once: the state is donated while writing
      state, metrics = trainer.step(state, batch_of(i))
      losses.append(float(metrics["loss"]))
    ckpt.wait_until_finished()
  resumed_trainer = trainer_for(8)
  resumed = zjax.CheckpointManager(tmp_path).restore(resumed_trainer)
  assert int(resumed.step) == 2
  resumed_losses = []
  for i in range(2, 5):
    resumed, metrics = resumed_trainer.step(resumed, batch_of(i))
    resumed_losses.append(float(metrics["loss"]))
  assert resumed_losses == losses
  assert_bitwise(natural_state(resumed, resumed_trainer), natural_state(state, trainer))
  assert_bitwise(resumed.step, state.step)


def test_save_right_after_init(tmp_path):
  trainer = trainer_for(8)
  state = fresh_state(trainer)
  expected = natural_state(state, trainer)
  with zjax.CheckpointManager(tmp_path, trainer, max_to_keep=2) as ckpt:
    ckpt.save(0, state)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [0] and ckpt.latest_step() == 0
    restored = ckpt.restore()
  assert_bitwise(natural_state(restored, trainer), expected)
  assert int(restored.step) == 0


@pytest.mark.slow
def test_restore_on_8_4_1_8_devices_and_other_schedules(tmp_path):
  reference = trainer_for(8)
  ref_state = fresh_state(reference)
  ref_after = []
  for i in range(4):
    ref_state, _ = reference.step(ref_state, batch_of(i))
    ref_after.append(natural_state(ref_state, reference))

  # (devices, persistence threshold, schedule from JSON): every hop changes the layout
  hops = [(8, 100, False), (4, 5000, False), (1, 100, True), (8, 0, False)]
  trainer = trainer_for(*hops[0][:2])
  state = fresh_state(trainer)
  for i, hop in enumerate(hops):
    state, _ = trainer.step(state, batch_of(i))
    saved = natural_state(state, trainer)
    if i == len(hops) - 1:
      break
    with zjax.CheckpointManager(tmp_path / str(i), trainer) as ckpt:
      ckpt.save(i + 1, state)
    trainer = trainer_for(hops[i + 1][0], hops[i + 1][1], from_json=hops[i + 1][2])
    state = zjax.CheckpointManager(tmp_path / str(i)).restore(trainer)
    assert int(state.step) == i + 1
    assert_bitwise(natural_state(state, trainer), saved)  # restore only moves data
    assert (
      zjax.per_device_bytes(state.params) == trainer.schedule.report()["state_bytes_per_device"]
    )
  # continued training on other device counts matches the uninterrupted 8-device run
  assert_trees_close(saved, ref_after[-1], rtol=1e-5, atol=1e-5)


SCAN_CFG = GPTConfig(d_model=32, n_layer=3, n_head=2, d_ff=64, seq_len=16, scan_layers=True)


@pytest.mark.slow
def test_scanned_model_restores_on_8_4_1_8_devices(tmp_path):
  """Stacked (per-layer) storage: 8 -> 4 re-pads each row, 4 -> 1 reads rows into
  replicated natural leaves, 1 -> 8 lays natural leaves out per layer again."""
  trainer = trainer_for(8, 100, cfg=SCAN_CFG)
  assert any(p.stacked for p in trainer.schedule.params)
  state = trainer.init_from(
    GPT(SCAN_CFG).init, jax.random.key(0), jnp.zeros((8, CFG.seq_len), jnp.int32)
  )
  for i, n in enumerate([4, 1, 8]):
    state, _ = trainer.step(state, batch_of(i))
    saved = natural_state(state, trainer)
    with zjax.CheckpointManager(tmp_path / str(i), trainer) as ckpt:
      ckpt.save(i + 1, state)
    trainer = trainer_for(n, 100, cfg=SCAN_CFG)
    state = zjax.CheckpointManager(tmp_path / str(i)).restore(trainer)
    assert_bitwise(natural_state(state, trainer), saved)
  exported = zjax.export_params(tmp_path / "2")
  assert_bitwise(exported, jax.device_get(trainer.gather_params(state)))


@pytest.mark.slow
def test_restore_between_scanned_and_unrolled_use_of_the_same_params(tmp_path):
  """The same params, used by a scan (stacked storage) or by an unrolled loop (flat
  storage): a checkpoint of either restores into the other; and stacked rows re-padded
  (15 x 15 = 225 elements per layer: 232 stored on 8 devices, 228 on 4)."""
  params = {"w": jax.random.normal(jax.random.key(0), (3, 15, 15)) / 4}
  batch = jax.random.normal(jax.random.key(1), (8, 15))

  def scanned(p, x):
    return jnp.mean(jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, p["w"])[0] ** 2)

  def unrolled(p, x):
    for i in range(3):
      x = jnp.tanh(x @ p["w"][i])
    return jnp.mean(x**2)

  def trainer(loss, n=8):
    mesh = mesh_of(n)
    schedule = zjax.compile_schedule(
      loss, params, batch, mesh=mesh, config=zjax.ZeroConfig(param_persistence_threshold=0)
    )
    return zjax.zero3(loss, OPTIMIZER, schedule, mesh=mesh)

  first, second = trainer(scanned), trainer(unrolled)
  assert first.schedule.param("['w']").stacked and not second.schedule.param("['w']").stacked
  for i, (source, target) in enumerate(
    [(first, second), (second, first), (first, trainer(scanned, 4))]
  ):
    state, _ = source.step(source.init(params), batch)
    with zjax.CheckpointManager(tmp_path / str(i), source) as ckpt:
      ckpt.save(1, state)
    restored = zjax.CheckpointManager(tmp_path / str(i)).restore(target)
    assert_bitwise(natural_state(restored, target), natural_state(state, source))
    target.step(restored, batch)  # and it trains on


@pytest.mark.slow
def test_export_params_equals_gather_params_and_loads_without_zjax(tmp_path):
  trainer = trainer_for(8)
  state, _ = trainer.step(fresh_state(trainer), batch_of(0))
  with zjax.CheckpointManager(tmp_path / "ckpt", trainer) as ckpt:
    ckpt.save(1, state)
  exported = zjax.export_params(tmp_path / "ckpt", save_to=tmp_path / "plain")
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(exported))
  assert_bitwise(exported, trainer.gather_params(state))
  plain = ocp.StandardCheckpointer().restore(tmp_path / "plain")  # no zjax involved
  logits = GPT(CFG).apply(plain, batch_of(0)["tokens"][:, :-1])
  expected = GPT(CFG).apply(trainer.gather_params(state), batch_of(0)["tokens"][:, :-1])
  np.testing.assert_array_equal(logits, expected)
  with pytest.raises(zjax.CheckpointError, match="exists; nothing was written"):
    zjax.export_params(tmp_path / "ckpt", save_to=tmp_path / "plain")


_KILLED_SAVER = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = [{tests!r}, {examples!r}]
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import test_checkpoint as t, zjax
    trainer = t.trainer_for(8)
    state = t.fresh_state(trainer)
    ckpt = zjax.CheckpointManager({directory!r}, trainer)
    state, _ = trainer.step(state, t.batch_of(0))
    ckpt.save(1, state)
    ckpt.wait_until_finished()
    state, _ = trainer.step(state, t.batch_of(1))
    ckpt.save(2, state)  # returns while the files are written in the background
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.slow
def test_export_holds_one_parameter_beyond_its_output(tmp_path):
  """Peak host memory of export_params in a fresh process: the output, plus the parameter
  being read, plus tensorstore's runtime (a constant ~8 MiB: thread pools, first-read
  setup), nothing that grows with the model. 8 leaves of 2 MiB; the earlier version (orbax
  restore per leaf, whole-array checksum temporaries) grew 30.2 MiB for these 16 MiB."""
  from checkpointing import export_in_fresh_process

  params = {f"w{i}": jnp.full((512, 1024), i, jnp.float32) for i in range(8)}
  batch = jnp.ones((8, 512))
  loss = lambda p, x: sum(jnp.mean(x @ w) for w in p.values())
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(
    loss, params, batch, mesh=mesh, config=zjax.ZeroConfig(param_persistence_threshold=0)
  )
  trainer = zjax.zero3(loss, optax.sgd(0.1), schedule, mesh=mesh)
  with zjax.CheckpointManager(tmp_path, trainer) as ckpt:
    ckpt.save(1, trainer.init(params))
  grown, exported = export_in_fresh_process(str(tmp_path))
  largest = 2 * 2**20
  assert exported == 16 * 2**20
  assert grown <= exported + largest + 12 * 2**20, (grown - exported) / 2**20


@pytest.mark.slow
def test_killed_save_leaves_the_previous_checkpoint(tmp_path):
  here = os.path.dirname(os.path.abspath(__file__))
  script = _KILLED_SAVER.format(
    tests=here, examples=os.path.join(here, "..", "examples"), directory=str(tmp_path)
  )
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  trainer = trainer_for(8)
  ckpt = zjax.CheckpointManager(tmp_path, trainer)
  assert ckpt.all_steps() in ([1], [1, 2])  # 2 only if it was committed whole
  for step in ckpt.all_steps():  # every listed step restores, and to the right values
    state = ckpt.restore(step=step)
    expected = fresh_state(trainer)
    for i in range(step):
      expected, _ = trainer.step(expected, batch_of(i))
    assert_bitwise(natural_state(state, trainer), natural_state(expected, trainer))
  state, _ = trainer.step(ckpt.restore(step=1), batch_of(1))  # the next run resumes
  ckpt.save(2 if ckpt.latest_step() == 1 else 3, state)
  ckpt.wait_until_finished()
  ckpt.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A checkpoint of step 1 and the state it holds (host copy)."""
  directory = tmp_path_factory.mktemp("saved")
  trainer = trainer_for(8)
  state, _ = trainer.step(fresh_state(trainer), batch_of(0))
  with zjax.CheckpointManager(directory, trainer) as ckpt:
    ckpt.save(1, state)
  return directory, trainer, natural_state(state, trainer)


def _damaged_copies(saved_dir, tmp_path, damage):
  """For each data file of the checkpoint: a copy with that file damaged."""
  files = sorted(glob.glob(str(saved_dir / "1" / "state" / "**" / "d" / "*"), recursive=True))
  assert files
  for i, path in enumerate(files):
    copy = tmp_path / f"copy{i}"
    shutil.copytree(saved_dir, copy)
    damage(str(copy / os.path.relpath(path, saved_dir)))
    yield copy


def _truncate(path):
  os.truncate(path, os.path.getsize(path) // 2)


def _flip_bytes(path):
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    chunk = f.read(16)
    f.seek(os.path.getsize(path) // 2)
    f.write(bytes(b ^ 0xFF for b in chunk))


# orbax's background reads of a damaged file fail again after the error was raised
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@pytest.mark.parametrize("damage", [_truncate, _flip_bytes])
def test_damaged_files_fail_clearly_never_silently(saved, tmp_path, damage):
  directory, trainer, expected = saved
  failures = 0
  for copy in _damaged_copies(directory, tmp_path, damage):
    ckpt = zjax.CheckpointManager(copy)
    try:
      state = ckpt.restore(trainer)
    except zjax.CheckpointError as e:
      failures += 1
      message = str(e)
      assert str(copy) in message and "step 1" in message
      assert "parameter" in message.lower() or "leaf" in message, message
    else:  # bytes orbax never reads: the state must still be exactly right
      assert_bitwise(natural_state(state, trainer), expected)
    finally:
      ckpt.close()
      gc.collect()  # finalise orbax's failed reads here, not in a later test
  assert failures > 0


def test_missing_and_unknown_checkpoints(saved, tmp_path):
  directory, trainer, _ = saved
  with pytest.raises(zjax.CheckpointError, match="No checkpoint in"):
    zjax.CheckpointManager(tmp_path / "empty").restore(trainer)
  with pytest.raises(zjax.CheckpointError, match=r"No step 7 .* holds steps \[1\]"):
    zjax.CheckpointManager(directory).restore(trainer, step=7)
  copy = tmp_path / "nomanifest"
  shutil.copytree(directory, copy)
  shutil.rmtree(copy / "1" / "zjax")
  with pytest.raises(zjax.CheckpointError, match="step 1 .* no readable zjax manifest"):
    zjax.CheckpointManager(copy).restore(trainer)
  with pytest.raises(zjax.CheckpointError, match="needs the zero3 trainer"):
    zjax.CheckpointManager(directory).restore()


def test_incompatible_model_or_optimizer(saved):
  directory, _, _ = saved
  wider = trainer_for(8, cfg=GPTConfig(d_model=48, n_layer=2, n_head=2, d_ff=64, seq_len=16))
  with pytest.raises(
    zjax.CheckpointError,
    match=r"Parameter \['params'\]\['block_0'\].* float32\[32.* different model",
  ):
    zjax.CheckpointManager(directory).restore(wider)
  deeper = trainer_for(8, cfg=GPTConfig(d_model=32, n_layer=3, n_head=2, d_ff=64, seq_len=16))
  with pytest.raises(zjax.CheckpointError, match=r"no parameter \['params'\]\['block_2'\]"):
    zjax.CheckpointManager(directory).restore(deeper)
  sgd = trainer_for(8, optimizer=SGD)
  with pytest.raises(zjax.CheckpointError, match="optimizer state .* differs"):
    zjax.CheckpointManager(directory).restore(sgd)


def test_failed_saves_change_nothing(saved, tmp_path):
  directory, trainer, expected = saved
  before = {p: os.path.getmtime(p) for p in glob.glob(str(directory / "**"), recursive=True)}
  state = zjax.CheckpointManager(directory).restore(trainer)
  with zjax.CheckpointManager(directory, trainer) as ckpt:
    with pytest.raises(zjax.CheckpointError, match="Step 1 already exists .* nothing was"):
      ckpt.save(1, state)
    with pytest.raises(zjax.CheckpointError, match="non-negative int"):
      ckpt.save(-1, state)
  after = {p: os.path.getmtime(p) for p in glob.glob(str(directory / "**"), recursive=True)}
  assert after == before
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(zjax.CheckpointError, match="Cannot use checkpoint directory .*a_file"):
    zjax.CheckpointManager(blocker / "ckpt", trainer)


@pytest.mark.slow
def test_checkpointing_script_runs(tmp_path):
  """examples/checkpointing.py at tiny size (structure only, never speed)."""
  root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
  done = subprocess.run(
    [
      sys.executable,
      os.path.join(root, "examples", "checkpointing.py"),
      "--layers",
      "1",
      "--d-model",
      "32",
      "--steps",
      "1",
      "--dir",
      str(tmp_path / "ckpt"),
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  lines = done.stdout.splitlines()
  assert [line.split(":")[0] for line in lines] == [
    "GPT 1 layers, d_model 32",
    "save",
    "restore on 8 devices",
    "restore on 4 devices",
    "export (fresh process, no mesh)",
    "export equals gather_params",
  ]
  assert lines[-1].endswith("True")
