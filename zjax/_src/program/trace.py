"""The trace pass: loss function -> jaxpr -> ordered table of parameter uses.

The program is the loss function's jaxpr flattened into numbered ops (see program.py); the
executor runs the same list, so op numbers are shared by the trace, schedule and executor.

A parameter is *used* by an op that consumes it (or a value derived from it only through
layout ops such as reshape, transpose or a dtype cast, which are applied lazily at the use).
Higher-order ops (scan, cond, while, remat, custom_jvp/vjp, shard_map) are single ops: a
parameter flowing into one is used there, and the table records where inside it is used.
"""

import contextlib
import dataclasses
import re
from typing import Any, Callable

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

# JAX has no public dead-code elimination (nor a public way to bind an axis name while
# tracing outside shard_map); these are what jit and make_jaxpr(axis_env=) use.
from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe

from zjax._src.errors import TraceError
from zjax._src.program import constraints
from zjax._src.program.program import INLINED_PRIMITIVES, FlatProgram, flatten_program
from zjax._src.schedule import ir

# Ops that only change a value's layout or dtype: a parameter seen through them is still
# "the parameter", and its real use is the op that consumes the result.
LAYOUT_PRIMITIVES = frozenset(
  {"reshape", "transpose", "convert_element_type", "squeeze", "expand_dims", "copy", "copy_p"}
)


@dataclasses.dataclass(frozen=True)
class ParamUse:
  """One use of a parameter: which top-level op, and where inside it."""

  op: int
  primitive: str  # innermost primitive that consumes the parameter
  context: str  # nesting inside the op, e.g. "scan(length=4) > cond[branch 1]"; "" at top level
  module: str  # name stack of the op (the module that used it), "" if unknown


@dataclasses.dataclass(frozen=True)
class ParamInfo:
  """A parameter leaf and all its uses in program order."""

  index: int
  path: str  # jax.tree_util.keystr of the leaf's path in params
  keys: tuple[str, ...]  # the path as plain names, e.g. ("params", "Dense_0", "kernel")
  shape: tuple[int, ...]
  dtype: np.dtype
  uses: tuple[ParamUse, ...]

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def owner(self) -> str:
    """The module that owns the leaf: its path without the leaf name (and NNX's `.value`).
    A leaf at the top of the params tree is a unit of its own."""
    keys = self.keys[:-1] if len(self.keys) > 1 and self.keys[-1] == "value" else self.keys
    return "/".join(keys[:-1] if len(keys) > 1 else keys)

  @property
  def is_float(self) -> bool:
    return bool(np.issubdtype(self.dtype, np.inexact) or self.dtype.name == "bfloat16")


@dataclasses.dataclass(frozen=True)
class OpInfo:
  primitive: str
  module: str


@dataclasses.dataclass(frozen=True)
class ProgramTrace:
  """Result of the trace pass: parameters with their uses, the op list, and the flattened
  program itself (what the executor runs)."""

  params: tuple[ParamInfo, ...]
  ops: tuple[OpInfo, ...]
  treedef: Any
  program: FlatProgram = dataclasses.field(compare=False, repr=False, default=None)
  # what the trace changed in the loss (tensor parallelism: data axes dropped from its
  # sharding constraints, constraints.py)
  notes: tuple[str, ...] = ()


def trace_program(loss_fn: Callable, params: Any, batch: Any, extra: Any = None) -> ProgramTrace:
  """Trace `loss_fn(params, batch)` and return every parameter leaf's uses in program order.

  `params` and `batch` may hold concrete arrays or `jax.ShapeDtypeStruct`s. With `extra`
  (non-parameter state such as batch statistics) the loss is `loss_fn(params, batch,
  extra) -> (loss, new_extra)`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> p = {"w": jnp.ones((3, 2))}
    >>> t = trace_program(lambda p, x: (x @ p["w"]).sum(), p, jnp.ones((4, 3)))
    >>> [u.primitive for u in t.params[0].uses]
    ['dot_general']
  """
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  for path, leaf in path_leaves:
    _check_leaf(path, leaf)
  args = (params, batch) if extra is None else (params, batch, extra)
  try:
    closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(*args)
  except NameError as e:
    unbound = re.search(r"unbound axis name: ([^\s]+?)\.?(\s|$)", str(e))
    if unbound is None:
      raise
    raise _UnboundAxisError(unbound.group(1)) from None
  _check_loss_output(closed, out_shape, extra)
  program = flatten_program(without_dead_code(closed))
  uses = _find_uses(program, len(path_leaves))
  infos = tuple(
    ParamInfo(
      index=i,
      path=jax.tree_util.keystr(path),
      keys=_key_names(path),
      shape=tuple(int(d) for d in leaf.shape),
      dtype=np.dtype(leaf.dtype),
      uses=tuple(uses.get(i, ())),
    )
    for i, (path, leaf) in enumerate(path_leaves)
  )
  ops = tuple(OpInfo(primitive=op.primitive, module=op.module) for op in program.ops)
  return ProgramTrace(params=infos, ops=ops, treedef=treedef, program=program)


def without_dead_code(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
  """The program minus everything the loss (and new extra state) does not depend on, as
  XLA will delete it: a parameter read only by dead code (an unused head, a dead concat of
  kernels) is then unused, and no collective is planned for work that never runs. Every
  input is kept, so parameter and batch positions stay as they are."""
  jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
  return jex.ClosedJaxpr(jaxpr, closed.consts)


@contextlib.contextmanager
def data_axis_bound(axis_sizes: dict[str, int]):
  """Trace as inside the executor's shard_map: the data axes (name -> size) are bound, so
  that a loss may use lax.psum / pmean / axis_index over them (sync BatchNorm)."""
  with jax_core.extend_axis_env_nd(list(axis_sizes.items())):
    yield


def trace_for_schedule(
  loss_fn, params, batch, config, axis_sizes: dict[str, int], extra=None, mesh=None
):
  """Trace as the executor runs: on one device's share of the batch, with the data axes
  (`axis_sizes`: name -> size) bound and floating-point parameters in the compute dtype.
  The table keeps each parameter's own (storage) dtype. With tensor axes, `mesh` (a jax
  Mesh, or every axis's size in mesh order) is the mesh the model's sharding constraints
  refer to."""
  if config.tensor_axes and mesh is None:
    raise ValueError("Tracing a tensor-parallel schedule needs the mesh (or its shape).")
  mesh = constraints.abstract_mesh(mesh, config.data_axes) if config.tensor_axes else None
  as_computed = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), ir.gather_dtype(x.dtype, config.compute_dtype)),
    params,
  )
  share = int(np.prod(list(axis_sizes.values()), dtype=np.int64))
  device_batch = per_device_batch(batch, share)
  stored = [np.dtype(x.dtype) for x in jax.tree.leaves(params)]
  key = _trace_key(loss_fn, as_computed, device_batch, extra, axis_sizes, stored, mesh)
  if key is not None and key in _TRACES:
    return _TRACES[key][1]
  trace = _trace_bound(loss_fn, as_computed, device_batch, extra, axis_sizes, config, mesh)
  trace = dataclasses.replace(
    trace, params=tuple(dataclasses.replace(p, dtype=d) for p, d in zip(trace.params, stored))
  )
  if key is not None:
    if len(_TRACES) >= _MAX_TRACES:
      _TRACES.pop(next(iter(_TRACES)))
    _TRACES[key] = (loss_fn, trace)  # the function kept alive: its id stays unique
  return trace


# Traces by (loss function, shapes): `compile_schedule` and the executor's lowering trace
# the same program; a deep unrolled model's Python tracing (Flax's, mostly) then runs once,
# not twice. Keyed on the function's identity, as jax.jit's own cache is.
_TRACES: dict = {}
_MAX_TRACES = 4


def _trace_key(loss_fn, params, batch, extra, axis_sizes, stored, mesh):
  def shapes(tree):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in leaves)

  try:
    key = (
      id(loss_fn),
      shapes(params),
      shapes(batch),
      shapes(extra),
      tuple(axis_sizes.items()),
      tuple(stored),
      mesh,
    )
    hash(key)
  except TypeError:  # an unhashable treedef (custom nodes): no caching
    return None
  return key


def _trace_bound(loss_fn, as_computed, device_batch, extra, axis_sizes, config, mesh):
  notes = []
  with data_axis_bound(axis_sizes), constraints.tracing_mesh(mesh, config.data_axes, notes):
    try:
      trace = dataclasses.replace(
        trace_program(loss_fn, as_computed, device_batch, extra), notes=tuple(notes)
      )
    except _UnboundAxisError as e:
      if e.axis in config.tensor_axes:
        raise TraceError(
          f"{e} {e.axis!r} is a tensor axis (ZeroConfig.tensor_axes): GSPMD partitions "
          f"the model over it, so the loss may not call collectives over it outside a "
          f"shard_map of its own. Drop the call (GSPMD inserts the tensor collectives), "
          f"or wrap that code in jax.shard_map(..., axis_names={{{e.axis!r}}})."
        ) from None
      axes = tuple(axis_sizes)
      bound = f"its data axis {axes[0]!r}" if len(axes) == 1 else f"the data axes {axes}"
      raise TraceError(
        f"{e} zjax binds {bound} (ZeroConfig.shard_axes / axis_name and "
        f"replicate_axes), over which it splits the batch: name "
        f"the model's axis {axes[-1]!r} (e.g. nn.BatchNorm(axis_name="
        f"{axes[-1]!r})), or set ZeroConfig(axis_name={e.axis!r}) and name "
        f"the mesh axis {e.axis!r}."
      ) from None
  return trace


def per_device_batch(batch, num_devices: int):
  """Shapes of one device's share of the global batch (0-d leaves are replicated), or the
  batch's own shapes when a leading dimension does not divide by `num_devices`."""
  leaves = jax.tree.leaves(batch)
  if any(np.ndim(x) and np.shape(x)[0] % num_devices for x in leaves):
    return batch
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      (np.shape(x)[0] // num_devices,) + tuple(np.shape(x)[1:]) if np.ndim(x) else (), x.dtype
    ),
    batch,
  )


# Ops whose gradient with respect to their inputs is zero.
_ZERO_GRADIENT_PRIMITIVES = frozenset({"stop_gradient", "floor", "ceil", "round", "sign"})


def gradient_free(program: FlatProgram, num_params: int) -> frozenset[int]:
  """Indices of the parameters that the loss (the program's first result) reads only where
  no gradient flows back: through `stop_gradient` (or floor, round, sign...), or into a
  value that is neither floating point nor complex (a comparison, an integer conversion).
  Their gradient is zero, and XLA deletes a reduction of zeros. A higher-order op (scan,
  cond, custom rule) passes gradients to all its inexact inputs: the answer errs towards a
  gradient."""

  def is_inexact(v):  # floating or complex: a gradient flows through an FFT too
    dtype = getattr(program.avals[v], "dtype", None)  # (a token has none)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))

  reached = {program.output_ids[0]} if isinstance(program.output_ids[0], int) else set()
  for op in reversed(program.ops):
    if op.primitive in _ZERO_GRADIENT_PRIMITIVES or not any(
      o in reached and is_inexact(o) for o in op.outputs
    ):
      continue
    reached.update(a for a in op.inputs if isinstance(a, int) and is_inexact(a))
  return frozenset(i for i in range(num_params) if program.input_ids[i] not in reached)


def param_views(program: FlatProgram, num_params: int) -> dict[int, frozenset]:
  """Value id -> indices of the parameters it is a layout view of (the parameters'
  own ids included). Ops that make such views are not uses: they are applied lazily."""
  views = {program.input_ids[i]: frozenset([i]) for i in range(num_params)}
  for op in program.ops:
    origins = _view_origins(op.inputs, views)
    if origins and op.primitive in LAYOUT_PRIMITIVES:
      views.update((out, origins) for out in op.outputs)
  return views


def _view_origins(inputs, views) -> frozenset:
  out = frozenset()
  for i in inputs:
    if isinstance(i, int) and i in views:
      out |= views[i]
  return out


def _find_uses(program: FlatProgram, num_params: int) -> dict[int, list[ParamUse]]:
  views = param_views(program, num_params)
  uses: dict[int, list[ParamUse]] = {}
  for index, op in enumerate(program.ops):
    if op.primitive in LAYOUT_PRIMITIVES or not _view_origins(op.inputs, views):
      continue
    by_var = {
      v: views[i] for v, i in zip(op.eqn.invars, op.inputs) if isinstance(i, int) and i in views
    }
    for param, primitive, context in _uses_inside(op.eqn, by_var):
      uses.setdefault(param, []).append(
        ParamUse(op=index, primitive=primitive, context=context, module=op.module)
      )
  return uses


def _uses_inside(eqn, derived) -> list[tuple[int, str, str]]:
  """(param, innermost primitive, context) for each parameter `eqn` consumes, deduplicated.

  A parameter passed into a higher-order op is used by that op even if no branch reads it:
  the op still needs its value, so the schedule must gather it before the op.
  """
  origins = _origins(eqn.invars, derived)
  if not origins:
    return []
  found = []
  subs = sub_jaxprs(eqn)
  for label, sub, outer_atoms in subs:
    inner = {
      iv: derived[v]
      for v, iv in zip(outer_atoms, sub.invars)
      if isinstance(v, jex.Var) and v in derived
    }
    for param, primitive, context in _uses_in_body(sub, inner):
      found.append((param, primitive, label + (" > " + context if context else "")))
  seen = {p for p, _, _ in found}
  label = subs[0][0] if subs else ""
  for param in sorted(origins - seen):
    found.append((param, eqn.primitive.name if not subs else "(passed through)", label))
  return _first_per_param(found)


def _uses_in_body(jaxpr, derived) -> list[tuple[int, str, str]]:
  found = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    origins = _origins(eqn.invars, derived)
    if not origins:
      continue
    if name in LAYOUT_PRIMITIVES:
      for out in eqn.outvars:
        derived[out] = origins
    elif name in INLINED_PRIMITIVES:
      sub = _closed_jaxpr_param(eqn)
      inner = {
        iv: derived[v]
        for v, iv in zip(eqn.invars, sub.invars)
        if isinstance(v, jex.Var) and v in derived
      }
      found.extend(_uses_in_body(sub, inner))
      for out, inner_out in zip(eqn.outvars, sub.outvars):
        if isinstance(inner_out, jex.Var) and inner_out in inner:
          derived[out] = inner[inner_out]
    else:
      found.extend(_uses_inside(eqn, derived))
  return found


def sub_jaxprs(eqn) -> list[tuple[str, jex.Jaxpr, list]]:
  """(label, body jaxpr, outer atoms aligned with the body's invars) for a higher-order op."""
  name, params = eqn.primitive.name, eqn.params
  if name == "cond":
    return [
      (f"cond[branch {i}]", br.jaxpr, list(eqn.invars[1:]))
      for i, br in enumerate(params["branches"])
    ]
  if name == "while":
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    carry = list(eqn.invars[nc + nb :])
    return [
      ("while[cond]", params["cond_jaxpr"].jaxpr, list(eqn.invars[:nc]) + carry),
      ("while[body]", params["body_jaxpr"].jaxpr, list(eqn.invars[nc:])),
    ]
  label = f"scan(length={params['length']})" if name == "scan" else name
  subs = []
  for sub in jex.jaxprs_in_params(params):
    if len(sub.invars) == len(eqn.invars):
      subs.append((label, sub, list(eqn.invars)))
  return subs[:1]


def _first_per_param(found):
  out, seen = [], set()
  for item in found:
    if item[0] not in seen:
      seen.add(item[0])
      out.append(item)
  return out


def _origins(atoms, derived) -> frozenset:
  out = frozenset()
  for a in atoms:
    if isinstance(a, jex.Var) and a in derived:
      out |= derived[a]
  return out


def _closed_jaxpr_param(eqn) -> jex.Jaxpr:
  sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  return sub.jaxpr if hasattr(sub, "jaxpr") else sub


class _UnboundAxisError(TraceError):
  """The loss uses a collective over an axis that no one bound while tracing."""

  def __init__(self, axis: str):
    super().__init__(
      f"loss_fn uses a collective over the axis {axis!r} (lax.psum / pmean / axis_index, "
      f"or e.g. nn.BatchNorm(axis_name={axis!r})), which is not bound while tracing."
    )
    self.axis = axis


def _key_names(path) -> tuple[str, ...]:
  names = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        names.append(str(getattr(k, attr)))
        break
    else:
      names.append(str(k))
  return tuple(names)


def _check_leaf(path, leaf):
  if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
    raise TraceError(
      f"Parameter {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an array: "
      f"every params leaf must be an array or a jax.ShapeDtypeStruct. Move constants out of "
      f"the params pytree (close over them in loss_fn instead)."
    )


def _check_loss_output(closed, out_shape, extra):
  outs = closed.out_avals
  if extra is not None:
    expected = jax.tree_util.tree_structure((0.0, extra))
    if jax.tree_util.tree_structure(out_shape) != expected:
      raise TraceError(
        f"With extra state, loss_fn(params, batch, extra) must return (loss, new_extra) with "
        f"new_extra shaped like extra; it returned {jax.tree_util.tree_structure(out_shape)}"
        f", expected {expected}."
      )
    outs = outs[:1]
  if (
    len(outs) != 1
    or outs[0].shape != ()
    or not np.issubdtype(outs[0].dtype, np.inexact)
    and outs[0].dtype.name != "bfloat16"
  ):
    found = ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in outs) or "nothing"
    raise TraceError(
      f"loss_fn(params, batch) must return one scalar floating-point loss; it returned "
      f"{found}. Reduce the loss to a scalar (e.g. .mean()) and return auxiliary outputs "
      f"separately."
    )
