"""The program: a loss function's jaxpr flattened into one numbered list of ops.

`jit` calls are inlined (with fresh value ids per call, so a jitted function called twice is
two sets of ops) so that a jitted model still exposes its layers. Every other equation is
one op; higher-order ops (scan, cond, while, remat, custom_jvp/vjp, shard_map) stay whole.
The trace pass and the executor both work on this list, so op numbers mean the same to the
schedule and to the code that runs it.
"""

import dataclasses
from typing import Any

import jax.extend.core as jex

# Calls inlined into the program so that the ops inside them are visible and schedulable.
INLINED_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})


@dataclasses.dataclass(frozen=True, eq=False)
class FlatOp:
  eqn: Any  # the original equation: primitive, params, source info
  inputs: tuple  # a value id (int) or a jex.Literal per operand
  outputs: tuple[int, ...]
  module: str  # name stack, including that of inlined call sites

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name


@dataclasses.dataclass(frozen=True, eq=False)
class FlatProgram:
  ops: tuple[FlatOp, ...]
  input_ids: tuple[int, ...]  # the function's flattened arguments, in order
  const_ids: tuple[int, ...]
  consts: tuple
  output_ids: tuple  # id or Literal per result
  avals: dict  # value id -> abstract value (shape, dtype)


def flatten_program(closed: jex.ClosedJaxpr) -> FlatProgram:
  return _Flattener().run(closed)


class _Flattener:
  def __init__(self):
    self.num_ids = 0
    self.ops: list[FlatOp] = []
    self.const_ids: list[int] = []
    self.consts: list = []
    self.avals: dict = {}

  def run(self, closed) -> FlatProgram:
    frame = self._frame_with_consts(closed)
    input_ids = tuple(self._define(frame, v) for v in closed.jaxpr.invars)
    self._walk(closed.jaxpr, frame, "")
    outputs = tuple(_read(frame, a) for a in closed.jaxpr.outvars)
    return FlatProgram(
      tuple(self.ops), input_ids, tuple(self.const_ids), tuple(self.consts), outputs, self.avals
    )

  def _walk(self, jaxpr, frame, scope):
    for eqn in jaxpr.eqns:
      module = join_scope(scope, str(eqn.source_info.name_stack))
      inputs = tuple(_read(frame, a) for a in eqn.invars)
      if eqn.primitive.name in INLINED_PRIMITIVES:
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        inner = self._frame_with_consts(sub)
        inner.update(zip(sub.jaxpr.invars, inputs))
        self._walk(sub.jaxpr, inner, module)
        frame.update((v, _read(inner, a)) for v, a in zip(eqn.outvars, sub.jaxpr.outvars))
        continue
      outputs = tuple(self._define(frame, v) for v in eqn.outvars)
      self.ops.append(FlatOp(eqn, inputs, outputs, module))

  def _frame_with_consts(self, closed) -> dict:
    frame = {}
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
      frame[v] = self._new_id()
      self.const_ids.append(frame[v])
      self.consts.append(c)
      self.avals[frame[v]] = v.aval
    return frame

  def _define(self, frame, var) -> int:
    frame[var] = self._new_id()
    self.avals[frame[var]] = var.aval
    return frame[var]

  def _new_id(self) -> int:
    self.num_ids += 1
    return self.num_ids - 1


def _read(frame, atom):
  return atom if isinstance(atom, jex.Literal) else frame[atom]


def join_scope(outer: str, inner: str) -> str:
  """Name stacks inside a jit are relative to the call site."""
  return f"{outer}/{inner}" if outer and inner else outer or inner
