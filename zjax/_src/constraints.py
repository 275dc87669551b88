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
TraceError that says what to change.
"""

import contextlib

import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from zjax._src import tensor_specs
from zjax._src.errors import TraceError


def abstract_mesh(mesh, data_axes) -> AbstractMesh:
  """The mesh as zjax's shard_map sees it (data axes Manual, the others Auto): of the mesh it
  runs on (a jax Mesh), or of a shape (name -> size, mesh order) when planned analytically."""
  if isinstance(mesh, dict):
    mesh = AbstractMesh(tuple(mesh.values()), tuple(mesh),
                        axis_types=(AxisType.Auto,) * len(mesh))
  else:
    mesh = mesh.abstract_mesh
  return mesh.update_axis_types({a: AxisType.Manual if a in data_axes else AxisType.Auto
                                 for a in mesh.axis_names})


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
    return original(x, jax.tree.map(lambda s: _without_data_axes(s, data_axes, x, notes),
                                    shardings, is_leaf=_is_sharding))

  jax.lax.with_sharding_constraint = constrain
  try:
    with jax.sharding.use_abstract_mesh(mesh):
      yield
  except ValueError as e:
    if "Auto axes" not in str(e) and "not found in mesh" not in str(e):
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


def _is_sharding(s) -> bool:
  return isinstance(s, (P, NamedSharding))


def _without_data_axes(sharding, data_axes, x, notes: list[str]):
  """`sharding` as a PartitionSpec of the context mesh without the data axes (a
  NamedSharding's own mesh is the user's, whose data axes are not manual); anything else
  (None, a layout) as given."""
  if not _is_sharding(sharding):
    return sharding
  spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
  dropped = [n for entry in spec if entry is not None
             for n in (entry if isinstance(entry, tuple) else (entry,)) if n in data_axes]
  if not dropped and isinstance(sharding, P):
    return sharding
  if dropped:
    shape = getattr(x, "shape", None)
    on = "" if shape is None else f" on a {'x'.join(map(str, shape)) or 'scalar'} value"
    note = (f"sharding constraint {spec}{on}: data axes {sorted(set(dropped))} dropped "
            f"(zjax splits the batch over them)")
    if note not in notes:
      notes.append(note)
  return tensor_specs.filtered_spec(spec, lambda a: a not in data_axes)
