"""Preemption costs no work: on SIGTERM a run finishes its step, saves it, exits 0, and the
rerun resumes there with the losses of an uninterrupted run, bit for bit. In one process
(zjax.CheckpointManager.save_if_preempted, zjax train) and across two processes of one
jax.distributed run (zjax launch passes the signal on; JAX's preemption service has both
save the same step)."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import zjax
from helpers import mesh_of, mlp
from test_job import TINY
from zjax._src.checkpoint import preemption

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "distributed_gpt.py")


@pytest.fixture
def restore_sigterm():
  previous = signal.getsignal(signal.SIGTERM)
  yield
  signal.signal(signal.SIGTERM, previous)
  preemption._sigterm.installed = preemption._sigterm.received = False


def test_save_if_preempted_in_one_process(tmp_path, restore_sigterm):
  loss, params, batch = mlp(num_layers=2)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh)
  trainer = zjax.zero3(loss, optax.sgd(0.1), schedule, mesh=mesh)
  state = trainer.init(params)
  with zjax.CheckpointManager(tmp_path / "ck", trainer) as ckpt:
    state, _ = trainer.step(state, batch)
    assert not ckpt.save_if_preempted(1, state) and ckpt.all_steps() == []
    os.kill(os.getpid(), signal.SIGTERM)  # handled: the process goes on
    state, _ = trainer.step(state, batch)
    assert ckpt.reached_preemption(2)
    assert ckpt.save_if_preempted(2, state) and ckpt.all_steps() == [2]
    assert ckpt.save_if_preempted(2, state)  # saved already: nothing written twice
    restored = ckpt.restore()
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _run_until(command, line_pattern, cwd=None):
  """Start `command`, send SIGTERM once a line matches `line_pattern`, -> (code, output)."""
  proc = subprocess.Popen(
    command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd
  )
  lines, sent = [], False
  for line in proc.stdout:
    lines.append(line)
    if not sent and re.search(line_pattern, line):
      proc.send_signal(signal.SIGTERM)
      sent = True
  assert sent, "".join(lines)[-3000:]
  return proc.wait(timeout=600), "".join(lines)


def _cli(*args):
  return [sys.executable, "-m", "zjax.cli.main", *args]


@pytest.mark.slow
@pytest.mark.whole_machine
def test_zjax_train_saves_on_sigterm_and_resumes_exactly(tmp_path):
  args = ["train", *TINY, "--steps", "30", "--lr", "1e-2", "--log-every", "1"]
  code, output = _run_until(_cli(*args, "--out-dir", str(tmp_path / "cut")), r"step 6/30")
  assert code == 0, output[-3000:]
  stopped = int(re.search(r"preempted \(SIGTERM\): saved step (\d+) to", output).group(1))
  assert 6 <= stopped < 30, output[-2000:]
  assert stopped in zjax.CheckpointManager(tmp_path / "cut" / "checkpoints").all_steps()
  again = subprocess.run(
    _cli(*args, "--out-dir", str(tmp_path / "cut")), capture_output=True, text=True, timeout=900
  )
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"resumed from step {stopped}" in again.stdout
  whole = subprocess.run(
    _cli(*args, "--out-dir", str(tmp_path / "whole")), capture_output=True, text=True, timeout=900
  )
  assert whole.returncode == 0, whole.stderr[-3000:]
  cut, uncut = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("cut", "whole"))
  assert [r["step"] for r in cut["train"]] == list(range(1, 31))
  assert cut["train"] == uncut["train"]  # every step's loss, bit for bit
  assert cut["validation"] == uncut["validation"]


def _launch(*args):
  return _cli(
    "launch",
    "--nproc",
    "2",
    "--devices-per-process",
    "4",
    "--timeout",
    "60",
    "--",
    sys.executable,
    SCRIPT,
    *args,
  )


@pytest.mark.slow
@pytest.mark.whole_machine
def test_two_processes_save_the_same_step_on_sigterm_and_resume_exactly(tmp_path):
  args = ["--steps", "24", "--checkpoint", str(tmp_path / "ck")]
  code, output = _run_until(
    _launch(*args, "--out", str(tmp_path / "first.json")), r"\[p0\] step 3:"
  )
  assert code == 0, output[-3000:]
  assert "zjax launch: SIGTERM: passed on to the 2 processes" in output
  saved = {int(s) for s in re.findall(r"\[p\d\] preempted: saved step (\d+)", output)}
  assert len(saved) == 1 and len(re.findall(r"preempted: saved step", output)) == 2, output
  stopped = saved.pop()
  assert 4 <= stopped < 24
  rest = subprocess.run(
    _launch(*args, "--out", str(tmp_path / "rest.json")),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert rest.returncode == 0, rest.stdout[-3000:]
  whole = subprocess.run(
    _launch("--steps", "24", "--out", str(tmp_path / "whole.json")),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert whole.returncode == 0, whole.stdout[-3000:]
  first, second, uncut = (
    json.loads((tmp_path / f"{n}.json").read_text()) for n in ("first", "rest", "whole")
  )
  assert first["preempted_at"] == stopped and second["first_step"] == stopped
  assert first["losses"] + second["losses"] == uncut["losses"]  # bit for bit
  assert second["params"] == uncut["params"]
