"""Error types raised by zjax on bad input.

All are ValueError subclasses so that callers who catch ValueError keep working.
"""

import jax


class ZjaxError(ValueError):
  """Base class of every error zjax raises about user input."""


class TraceError(ZjaxError):
  """The loss function or its example inputs cannot be traced into a schedule."""


class ScheduleError(ZjaxError):
  """A schedule is illegal: it is malformed, inconsistent, or breaks a limit of its config."""


class ScheduleMismatchError(ZjaxError):
  """A schedule was made for another model (parameter structure or use order differ)."""


def batch_leaf(path) -> str:
  """How an error names a batch leaf: "Batch leaf ['x']", or "The batch" for a bare array."""
  return f"Batch leaf {jax.tree_util.keystr(path)}" if path else "The batch"
