"""XLA's partitioner warnings, held back from the user's terminal while compiling baselines.

GSPMD baselines (`zjax bench`, examples/activation_memory.py) make XLA's SPMD partitioner
log one "Involuntary full rematerialization" warning per resharding it cannot do cheaply,
pages of them per model, written by XLA's C++ logging straight to file descriptor 2 (so
Python's `warnings` and `logging` never see them). While compiling, descriptor 2 goes to a
temporary file; after, the partitioner's lines are counted and everything else is written
back to stderr as it came.
"""

import contextlib
import os
import sys
import tempfile

_PARTITIONER = ("Involuntary full rematerialization", "spmd_partitioner")


class Held:
  """What `partitioner_warnings_held` kept back: `count` lines of XLA's SPMD partitioner."""

  def __init__(self):
    self.count = 0

  def summary(self, what: str = "compiling the GSPMD baselines") -> str:
    return (
      f"XLA's SPMD partitioner warned {self.count} times while {what} "
      f"(involuntary full rematerialization: the baseline reshards whole tensors); "
      f"not shown"
      if self.count
      else ""
    )


@contextlib.contextmanager
def partitioner_warnings_held(held: Held):
  """Inside, what is written to file descriptor 2 is held; on exit XLA's SPMD partitioner
  lines are counted into `held.count` and the rest goes to stderr."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield held
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      text = caught.read().decode(errors="replace")
      kept = []
      for line in text.splitlines(keepends=True):
        if any(mark in line for mark in _PARTITIONER):
          held.count += 1
        else:
          kept.append(line)
      sys.stderr.write("".join(kept))
      sys.stderr.flush()
