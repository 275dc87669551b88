"""Preemption: a job told to stop (SIGTERM, what cluster schedulers and spot instances send
before they kill it) saves at a step every process agrees on, then exits.

Several processes (`jax.distributed`): JAX's preemption service catches the signal on any
process, and `multihost_utils.reached_preemption_sync_point(step)` is True on every process
at the same step (orbax uses the same). One process: JAX has no service there, so a SIGTERM
handler, installed on the first question, records the signal; the answer is True at the
first step asked after it. From then on SIGTERM no longer ends the process by itself: the
training loop must ask every step (as JAX's service requires too).
"""

import signal
import threading

import jax
from jax.experimental import multihost_utils


class _Sigterm:
  installed = False
  received = False


_sigterm = _Sigterm()


def reached(step: int) -> bool:
  """Whether to save at `step` and stop: the same answer on every process."""
  if jax.process_count() > 1:
    try:
      return bool(multihost_utils.reached_preemption_sync_point(int(step)))
    except RuntimeError:  # the service is off (jax_enable_preemption_service=False)
      return False
  _install()
  return _sigterm.received


def _install() -> None:
  # signal handlers can only be set from the main thread; elsewhere SIGTERM keeps its action
  if not _sigterm.installed and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_sigterm)
    _sigterm.installed = True


def _on_sigterm(signum, frame) -> None:
  del signum, frame
  _sigterm.received = True
