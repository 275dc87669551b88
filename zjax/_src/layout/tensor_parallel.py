"""Tensor parallelism: the tensor axis is left to GSPMD inside zjax's shard_map (manual over
the data axes only), so the user's global-view model gets Megatron's collectives from
GSPMD; zjax's own gathers and reduce-scatters run in a nested region that is manual over
the tensor axis too. There every device holds its TP slice of each parameter, and the
data-axis collectives move TP-local slices: nothing of parameter storage crosses the tensor
axis (a plain all-gather over the data axes of a value GSPMD shards over the tensor axis
would first gather it over the tensor axis: T times the bytes).

Storage of a tensor-parallel leaf: [T, padded slice], row t = slice t along its tensor
dimension, flat and zero-padded to a multiple of N, split over the data (storage) axes;
spec P(tensor, storage axes). A persistent one is stored natural, split over the tensor
axis on its dimension.
"""

import dataclasses

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from zjax._src.errors import ZjaxError
from zjax._src.layout import tensor_specs as specs_lib


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """What the planner needs: the tensor axes' sizes and each parameter's tensor dim."""

  sizes: tuple[int, ...] = ()  # of config.tensor_axes
  dims: tuple[int | None, ...] | None = None  # per parameter leaf; None: no tensor axis

  @property
  def size(self) -> int:
    """T: the tensor axis's size (1 without)."""
    return self.sizes[0] if self.sizes else 1

  @property
  def any(self) -> bool:
    return self.dims is not None and any(d is not None for d in self.dims)

  def dim(self, i: int) -> int | None:
    return None if self.dims is None else self.dims[i]


NONE = TensorParallel()


def resolve(params, config, mesh, axis_sizes, tensor_specs, logical_axis_rules) -> TensorParallel:
  """The tensor axes' sizes (from the mesh or axis_sizes) and every leaf's tensor dim."""
  if not config.tensor_axes:
    if tensor_specs is not None:
      raise ZjaxError(
        "tensor_specs were given, but ZeroConfig.tensor_axes is empty: name "
        "the mesh's tensor axis, e.g. ZeroConfig(tensor_axes=('tensor',))."
      )
    return NONE
  (axis,) = config.tensor_axes
  if mesh is not None:
    if axis not in mesh.shape:
      raise ZjaxError(
        f"ZeroConfig.tensor_axes names {axis!r}, but the mesh has axes {tuple(mesh.shape)}."
      )
    if mesh.axis_types[mesh.axis_names.index(axis)] != AxisType.Auto:
      raise ZjaxError(
        f"Mesh axis {axis!r} is a tensor axis (ZeroConfig.tensor_axes) and "
        f"must be AxisType.Auto (GSPMD partitions the model over it inside "
        f"zjax's program); it is {mesh.axis_types[mesh.axis_names.index(axis)]}."
        f" Make it with jax.make_mesh(..., axis_types=...) naming it Auto."
      )
    size, known = int(mesh.shape[axis]), tuple(mesh.axis_names)
  else:
    size, known = axis_sizes[axis], tuple(axis_sizes)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise ZjaxError(f"The size of axis {axis!r} must be a positive int, got {size!r}.")
  specs = specs_lib.mesh_specs(params, tensor_specs, logical_axis_rules)
  dims = specs_lib.tensor_dims(specs_lib.unbox(params), specs, {axis: size}, known)
  return TensorParallel(sizes=(size,), dims=tuple(dims))


def per_layer(trace, tensor: TensorParallel, stacked: dict) -> TensorParallel:
  """The tensor dims with those of scanned (stacked) parameters counted from one layer's
  dimensions (what a loop gathers: ir.ParamEntry.layer_shape); their layer axis itself may
  not be split."""
  if not tensor.any or not stacked:
    return tensor
  dims = list(tensor.dims)
  for i in stacked:
    if dims[i] == 0:
      raise ZjaxError(
        f"Parameter {trace.params[i].path} is stacked along a scanned layer "
        f"axis (nn.scan / lax.scan), and that axis (dim 0) is split over the "
        f"tensor axis: split a dimension of the layer instead (name the "
        f"scan axis, e.g. nn.scan(..., metadata_params={{nn.PARTITION_NAME: "
        f"'layers'}}), and leave 'layers' out of the rules)."
      )
    if dims[i] is not None:
      dims[i] -= 1
  return dataclasses.replace(tensor, dims=tuple(dims))


def tp_spec(entry, tensor_axis) -> P:
  """The natural parameter's PartitionSpec over the tensor axis (P() if replicated)."""
  if entry.tensor_dim is None:
    return P()
  return P(*[tensor_axis if d == entry.tensor_dim else None for d in range(len(entry.shape))])


def nested(
  fn, entries, tensor_axis, inputs: str, outputs: str, ranked_in: int = 0, ranked_out: int = 0
):
  """Run `fn` (on per-device TP-local values) manual over the tensor axis too.

  `inputs`/`outputs` say how each side is laid out: "storage" (one storage chunk per entry:
  a tensor-parallel entry's [T, c] value arrives as its own row [c]), "natural" (one
  natural value per entry: a tensor-parallel one arrives as its TP slice) or "none" (no
  value per entry). Values of entries without a tensor dim are the same on every tensor
  rank. After those come `ranked_in` inputs / `ranked_out` outputs that differ per tensor
  rank whatever their members (a bucket's gathered wire buffer, its hpZ secondary): outside
  they have a leading axis of one row per rank, inside the rank's row.
  """
  specs = {
    "storage": lambda e: P(tensor_axis) if e.tensor_dim is not None else P(),
    "natural": lambda e: tp_spec(e, tensor_axis),
  }
  in_entries = [] if inputs == "none" else list(entries)
  out_entries = [] if outputs == "none" else list(entries)

  def local(values):
    per_entry = [
      v[0] if inputs == "storage" and e.tensor_dim is not None else v
      for v, e in zip(values, in_entries)
    ]
    out = fn(per_entry + [v[0] for v in values[len(in_entries) :]])
    return [
      v[None] if outputs == "storage" and e.tensor_dim is not None else v
      for v, e in zip(out, out_entries)
    ] + [v[None] for v in out[len(out_entries) :]]

  return jax.shard_map(
    local,
    mesh=jax.sharding.get_abstract_mesh(),
    in_specs=([specs[inputs](e) for e in in_entries] + [P(tensor_axis)] * ranked_in,),
    out_specs=([specs[outputs](e) for e in out_entries] + [P(tensor_axis)] * ranked_out),
    axis_names={tensor_axis},
    check_vma=False,
  )


def slice_entry(entry):
  """The entry as one device's TP slice (what the data-axis collectives see)."""
  if entry.tensor_dim is None:
    return entry
  return dataclasses.replace(entry, shape=entry.slice_shape, tensor_dim=None, tensor_size=1)


def rank_chunk(chunk, entry):
  """The shape of one tensor rank's part of a storage chunk (a tensor-parallel entry's
  [T, c] chunk: its row [c]; any other entry's chunk is the same on every rank)."""
  shape = tuple(chunk.shape)[1:] if entry.tensor_dim is not None else tuple(chunk.shape)
  return jax.ShapeDtypeStruct(shape, chunk.dtype)
