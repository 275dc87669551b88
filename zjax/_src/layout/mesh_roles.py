"""What each mesh axis does, and its size: one value that the planner, the schedule, the
executor and the report read, instead of names derived in each of them.

Roles: the batch is split over the *data* axes, the replicate axes then the shard axes
(device order is row-major over them). Parameters are stored sharded over the *storage*
axes: the shard axes, or under hpZ (secondary_partition) every data axis. HSDP averages
each reduce-scattered gradient shard over the replicate axes (*averaged*; none under hpZ,
whose storage spans them). Tensor parallelism splits the layers over the *tensor* axes.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MeshRoles:
  replicate_axes: tuple[str, ...]
  shard_axes: tuple[str, ...]
  tensor_axes: tuple[str, ...] = ()
  secondary_partition: bool = False
  # every axis's size (data axes, then tensor axes), or () where only the names are known
  sizes: tuple[tuple[str, int], ...] = ()

  @classmethod
  def of(cls, config, sizes: dict[str, int] | None = None) -> "MeshRoles":
    """The roles `config` gives the axes; `sizes`: the size of every axis it names."""
    axes = (*config.replicate_axes, *config.shard_axes, *config.tensor_axes)
    return cls(
      tuple(config.replicate_axes),
      tuple(config.shard_axes),
      tuple(config.tensor_axes),
      config.secondary_partition,
      tuple((a, int(sizes[a])) for a in axes) if sizes else (),
    )

  # ---- names -----------------------------------------------------------------------------
  @property
  def data_axes(self) -> tuple[str, ...]:
    """Every axis the batch is split over: the replicate axes, then the shard axes."""
    return (*self.replicate_axes, *self.shard_axes)

  @property
  def mesh_axes(self) -> tuple[str, ...]:
    """Every axis the config names: the data axes, then the tensor axes."""
    return (*self.data_axes, *self.tensor_axes)

  @property
  def storage_axes(self) -> tuple[str, ...]:
    """The axes parameter storage is sharded over: the shard axes, or with a secondary
    partition (hpZ) every data axis."""
    return self.data_axes if self.secondary_partition else self.shard_axes

  @property
  def averaged_axes(self) -> tuple[str, ...]:
    """Axes a reduce-scattered gradient shard is then averaged over (HSDP's replicas)."""
    return () if self.secondary_partition else self.replicate_axes

  def collective_axes(self, op: str, phase: str) -> dict:
    """What a step's collective spans: {"axes": [...]} (gather, reduce_scatter), plus
    {"mean_over": [...]} for HSDP's reduce-scatter (then averaged over the replicas)."""
    if op == "gather":
      from_secondary = phase == "backward" and self.secondary_partition
      return {"axes": list(self.shard_axes if from_secondary else self.storage_axes)}
    if op == "reduce_scatter":
      out = {"axes": list(self.storage_axes)}
      if self.averaged_axes:
        out["mean_over"] = list(self.averaged_axes)
      return out
    return {}

  # ---- sizes -----------------------------------------------------------------------------
  def size_of(self, axes) -> tuple[int, ...]:
    """The sizes of `axes`, in their order."""
    sizes = dict(self.sizes)
    return tuple(sizes[a] for a in axes)

  @property
  def axis_sizes(self) -> dict[str, int]:
    """Size of every data axis, replicate axes first (the row-major device order)."""
    return dict(zip(self.data_axes, self.size_of(self.data_axes)))

  @property
  def tensor_axis_sizes(self) -> dict[str, int]:
    """Size of every tensor axis (tensor parallelism; empty without)."""
    return dict(zip(self.tensor_axes, self.size_of(self.tensor_axes)))

  @property
  def replicas(self) -> int:
    """R: how many sharded copies (1 without replicate axes)."""
    return _product(self.size_of(self.replicate_axes))

  @property
  def shards(self) -> int:
    """S: devices along the shard axes (one sharded copy, or one secondary partition)."""
    return _product(self.size_of(self.shard_axes))

  @property
  def data_parallel_size(self) -> int:
    """Devices the batch is split over: R x S."""
    return self.replicas * self.shards

  @property
  def storage_size(self) -> int:
    """N: devices one parameter's storage is split over (S, or R x S under hpZ)."""
    return _product(self.size_of(self.storage_axes))


def _product(sizes) -> int:
  return int(np.prod(sizes, dtype=np.int64))
