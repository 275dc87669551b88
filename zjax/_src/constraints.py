"""The mesh a tensor-parallel model is traced under.

zjax replays the traced program inside its shard_map, which is manual over the data axes
and leaves the tensor axis to GSPMD. So the program is traced under that view of the mesh
(data axes Manual, tensor axis Auto): every value's type and the context of every op are
then what the replay sees, and the model's own `with_sharding_constraint` /
`nn.with_logical_constraint` calls may name the tensor axis. A constraint naming a data
axis is refused by JAX there; the error says to drop the data axes from the rules (zjax
splits the batch over them anyway).
"""

import contextlib

import jax
from jax.sharding import AbstractMesh, AxisType

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
def tracing_mesh(mesh: AbstractMesh | None, data_axes):
  """Trace under `mesh` (tensor parallelism; nothing when None); a sharding constraint on a
  data axis becomes a TraceError that says what to change."""
  if mesh is None:
    yield
    return
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
        f"the data axes {list(data_axes)} itself and the model may constrain only the "
        f"tensor axis: drop the data axes from the logical axis rules the loss uses (e.g. "
        f"('activation_batch', None) instead of ('activation_batch', ('data', 'fsdp')))."
    ) from None
