"""The mesh a tensor-parallel model is traced under.

zjax replays the traced program inside its shard_map, which is manual over the data axes
and leaves the tensor axis to GSPMD. So the program is traced under that view of the mesh
(data axes Manual, tensor axis Auto): every value's type and the context of every op are
then what the replay sees, and the model's own `with_sharding_constraint` /
`nn.with_logical_constraint` calls may name the tensor axis.

A constraint naming a data axis (MaxText's rules map the batch dimension to `data` /
`fsdp`) would be refused by JAX there: those axes are manual. zjax has split the batch over
them already, so the constraint's meaning on one device's share is the same spec without
the data axes, and that is what is traced (the schedule's notes say which constraints lost
which axes). The rewrite is at `jax.lax.with_sharding_constraint`, which Flax's logical
constraints call too; code that imported the function by name before zjax traced it gets a
TraceError that says what to change. Sharding in types is traced the same way:
`jax.sharding.auto_axes(..., out_sharding=)` (nnx.Embed's `out_sharding=`) and
`jax.sharding.reshard` become such constraints on their outputs; an op's own out_sharding
(nnx.Linear's) cannot name manual axes, and gets a TraceError naming the call.
"""

import contextlib
import os
import sysconfig
import traceback

import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zjax._src.errors import TraceError
from zjax._src.layout import tensor_specs


def abstract_mesh(mesh, data_axes) -> AbstractMesh:
  """The mesh as zjax's shard_map sees it (data axes Manual, the others Auto): of the mesh it
  runs on (a jax Mesh), or of a shape (name -> size, mesh order) when planned analytically."""
  if isinstance(mesh, dict):
    mesh = AbstractMesh(tuple(mesh.values()), tuple(mesh), axis_types=(AxisType.Auto,) * len(mesh))
  else:
    mesh = mesh.abstract_mesh
  return mesh.update_axis_types(
    {a: AxisType.Manual if a in data_axes else AxisType.Auto for a in mesh.axis_names}
  )


@contextlib.contextmanager
def tracing_mesh(mesh: AbstractMesh | None, data_axes, notes: list[str] | None = None):
  """Trace under `mesh` (tensor parallelism; nothing when None), with the data axes dropped
  from the loss's sharding constraints (each drop described in `notes`); a constraint that
  still names a data axis becomes a TraceError that says what to change."""
  if mesh is None:
    yield
    return
  notes = [] if notes is None else notes
  original = jax.lax.with_sharding_constraint

  def constrain(x, shardings):
    return original(
      x,
      jax.tree.map(
        lambda s: _without_data_axes(s, data_axes, x, notes), shardings, is_leaf=_is_sharding
      ),
    )

  def auto_axes(fun=None, /, *, axes=None, out_sharding=None):
    return _as_constraint(fun, out_sharding, constrain, notes)

  def reshard(xs, out_shardings):
    _note_types(notes, "jax.sharding.reshard")
    return constrain(xs, out_shardings)

  patched = {"auto_axes": auto_axes, "reshard": reshard}
  saved = {name: getattr(jax.sharding, name) for name in patched}
  jax.lax.with_sharding_constraint = constrain
  for name, fn in patched.items():
    setattr(jax.sharding, name, fn)
  try:
    with jax.sharding.use_abstract_mesh(mesh):
      yield
  except (ValueError, NotImplementedError) as e:
    if _typed_sharding_refused(e):
      raise TraceError(
        f"The loss asks for a sharding in types that zjax cannot trace under tensor "
        f"parallelism ({str(e).splitlines()[0]}){_user_call_site(e)}. zjax traces the loss "
        f"with the data axes "
        f"{list(data_axes)} manual (it splits the batch over them) and the tensor axis "
        f"Auto, so an op's out_sharding= (e.g. nnx.Linear(...)(x, out_sharding=...), "
        f"jnp.dot(..., out_sharding=...)) cannot name them. Drop that out_sharding and "
        f"constrain the output instead: jax.lax.with_sharding_constraint(y, P(...)) or "
        f"nn.with_logical_constraint (zjax keeps the tensor axis and drops the data "
        f"axes); out_sharding= of nnx.Embed and jax.sharding.reshard are rewritten so "
        f"already."
      ) from None
    if not isinstance(e, ValueError) or (
      "Auto axes" not in str(e) and "not found in mesh" not in str(e)
    ):
      raise
    named = [a for a in data_axes if a in str(e)]
    raise TraceError(
      f"A sharding constraint in the loss names a data axis {named or list(data_axes)} "
      f"({str(e).splitlines()[0]}). Under tensor parallelism zjax splits the batch over "
      f"the data axes {list(data_axes)} itself and drops them from the constraints that "
      f"call jax.lax.with_sharding_constraint while it traces; this one bypassed that "
      f"(imported by name before tracing?): call it as jax.lax.with_sharding_constraint, "
      f"or drop the data axes from the logical axis rules the loss uses (e.g. "
      f"('activation_batch', None) instead of ('activation_batch', ('data', 'fsdp')))."
    ) from None
  finally:
    jax.lax.with_sharding_constraint = original
    for name, fn in saved.items():
      setattr(jax.sharding, name, fn)


def _user_call_site(e) -> str:
  """' at FILE:LINE (FUNCTION)' for the innermost frame of `e`'s traceback in the user's own
  code (not JAX, Flax, zjax or the standard library), so the error names the call to change
  whatever JAX's own source note picked; '' when there is none."""
  library_dirs = tuple(os.path.dirname(m.__file__) + os.sep for m in _library_modules())
  library_dirs += (sysconfig.get_paths()["stdlib"] + os.sep,)
  user = [
    f
    for f in traceback.extract_tb(e.__traceback__)
    if not os.path.abspath(f.filename).startswith(library_dirs)
  ]
  if not user:
    return ""
  frame = user[-1]
  return f", called at {frame.filename}:{frame.lineno} ({frame.name})"


def _library_modules():
  import flax
  import jaxlib

  import zjax

  return (jax, jaxlib, flax, zjax)


def _typed_sharding_refused(e) -> bool:
  """JAX's refusal of an op's out_sharding over manual or Auto axes."""
  text = str(e)
  return (
    "cannot contain axis names that are of type Auto or Manual" in text
    or "Going from `Manual` AxisType" in text
  )


def _as_constraint(fun, out_sharding, constrain, notes):
  """`jax.sharding.auto_axes(fun, out_sharding=...)` as zjax traces it: `fun` on the axes
  as they are (the tensor axis is Auto already; the data axes are manual and may not turn
  Auto), its output under the constraint `out_sharding` less the data axes. Flax NNX's
  `out_sharding=` arguments (nnx.Embed, nnx.Linear, ...) call it."""

  def wrap(f):
    def run(*args, **kwargs):
      out = f(*args, **kwargs)
      if out_sharding is None:
        return out
      _note_types(notes, "an out_sharding (jax.sharding.auto_axes)")
      return constrain(out, out_sharding)

    return run

  return wrap if fun is None else wrap(fun)


def _note_types(notes, what):
  note = (
    f"{what}: traced as a sharding constraint (zjax traces the loss with the data "
    f"axes manual and the tensor axis Auto)"
  )
  if note not in notes:
    notes.append(note)


def _is_sharding(s) -> bool:
  return isinstance(s, (P, NamedSharding))


def _without_data_axes(sharding, data_axes, x, notes: list[str]):
  """`sharding` as a PartitionSpec of the context mesh without the data axes (a
  NamedSharding's own mesh is the user's, whose data axes are not manual); anything else
  (None, a layout) as given."""
  if not _is_sharding(sharding):
    return sharding
  spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
  dropped = [
    n
    for entry in spec
    if entry is not None
    for n in (entry if isinstance(entry, tuple) else (entry,))
    if n in data_axes
  ]
  if not dropped and isinstance(sharding, P):
    return sharding
  if dropped:
    shape = getattr(x, "shape", None)
    on = "" if shape is None else f" on a {'x'.join(map(str, shape)) or 'scalar'} value"
    note = (
      f"sharding constraint {spec}{on}: data axes {sorted(set(dropped))} dropped "
      f"(zjax splits the batch over them)"
    )
    if note not in notes:
      notes.append(note)
  return tensor_specs.filtered_spec(spec, lambda a: a not in data_axes)
