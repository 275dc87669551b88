"""ZeroConfig: the knobs of a ZeRO-3 schedule, with DeepSpeed's names, units and defaults."""

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from zjax._src.layout.mesh_roles import MeshRoles

# Knobs measured in parameter elements, as in DeepSpeed's `zero_optimization` section.
_ELEMENT_KNOBS = {
  "prefetch_bucket_size": "must be >= 0 (0 disables prefetch)",
  "max_live_parameters": "must be > 0",
  "max_reuse_distance": "must be >= 0 (0 releases after every use)",
  "param_persistence_threshold": "must be >= 0 (0 shards every non-empty parameter)",
  "sub_group_size": "must be > 0",
}
_POSITIVE_KNOBS = ("max_live_parameters", "sub_group_size")
GRADIENT_REDUCTIONS = ("once", "per_gather")
GATHER_QUANTIZATIONS = ("int8",)
REDUCE_QUANTIZATIONS = ("int8", "int4")
PHASES = ("forward", "backward")


@dataclasses.dataclass(frozen=True, kw_only=True, init=False)
class ZeroConfig:
  """Knobs of the ZeRO-3 schedule. Sizes are counts of parameter elements, as in DeepSpeed.

  Attributes:
    prefetch_bucket_size: elements of upcoming buckets that may be gathered ahead of need
      (0 disables prefetch).
    max_live_parameters: cap on gathered (full-form) parameter elements alive at once (a
      module whose parameters exceed it is gathered parameter by parameter).
    max_reuse_distance: keep a gathered bucket instead of releasing and gathering it again
      when its next use is at most this many elements of work away.
    param_persistence_threshold: parameters with at most this many elements are replicated,
      never sharded or gathered.
    sub_group_size: elements per optimizer sub-group (the unit of the optimizer step).
    compute_dtype: dtype parameters are gathered and used in (None: their own dtype; e.g.
      ``jnp.bfloat16`` for mixed precision). Only floating-point parameters are cast; the
      stored shards keep the parameters' own dtype (they are the fp32 masters).
    reduce_dtype: dtype gradients are reduce-scattered and averaged in (None: the
      parameters' own dtype, e.g. fp32 under bf16 compute; ``jnp.bfloat16`` halves it).
    shard_axes: the mesh axes parameters are sharded over (S devices: the product of their
      sizes), in mesh order; default ``(axis_name,)``. The batch is split over these and
      the replicate axes. The loss may use collectives over any of them (`lax.pmean`,
      `axis_index`, `nn.BatchNorm(axis_name=...)` for synchronised batch statistics).
    axis_name: shorthand: ``ZeroConfig(axis_name="batch")`` is ``shard_axes=("batch",)``
      (given, it overrides shard_axes); read back, the one shard axis's name (their tuple
      when there are several).
    replicate_axes: mesh axes over which parameters, gradients and optimizer state are
      replicated rather than sharded (HSDP, PyTorch FSDP2's hybrid sharding, DeepSpeed
      MiCS): each group of S devices along the shard axes holds one sharded copy; each
      bucket's gradient is reduce-scattered within the group, then averaged over the R
      replicas (an all-reduce of 1/S of it).
    secondary_partition: ZeRO++ hpZ (DeepSpeed ``zero_hpz_partition_size`` = S, the size of
      the shard axes), with replicate axes only: storage stays sharded over *every* data
      axis (1/(R*S) per device, like flat ZeRO-3) and forward gathers and reduce-scatters
      span them all, but each forward gather also leaves the device a secondary 1/S shard
      of the bucket, from which backward re-gathers it over the shard axes alone (never
      across the replicate axes, e.g. never leaving the node).
    gradient_reduction: when a bucket gathered several times in forward (a tied embedding,
      a weight reused after max_reuse_distance released it) has its gradient
      reduce-scattered: "once" (default, as DeepSpeed: one reduce-scatter per step, after
      its last backward use; the full gradient stays live between its backward uses) or
      "per_gather" (after each gathered instance's backward uses: less live gradient
      memory, one reduce-scatter per forward gather).
    fold_rng_keys: fold each device's position on the axis into every 0-d PRNG key leaf of
      the batch (`jax.random.fold_in(key, device)`), so that devices draw independent
      randomness (dropout masks) for their shares of the batch; deterministic for a given
      key and device count. With gradient accumulation the micro-batch index is folded in
      too. False: every device (and micro-batch) sees the key as given.
    roll_layers: run consecutive identical layers of an unrolled model (a Python ``for``
      over blocks) as one loop, as if written with ``nn.scan``: one layer's gathers,
      compute and reduce-scatters per iteration, so compile time and gathered-weight
      memory stop growing with depth. Parameters keep their per-layer leaves and paths.
      The schedule's ``rolling`` notes say what was rolled and why other repeats were not.
    gather_quantization: ZeRO++ qwZ (DeepSpeed ``zero_quantized_weights``): None, or
      "int8": each device quantizes its chunk of a floating-point bucket block-wise
      (symmetric, round-to-nearest, one float32 scale per ``quantization_block`` values),
      the int8 values and scales are all-gathered and dequantized to the compute dtype.
      The stored shards (the masters) are untouched.
    gather_quantization_phases: which gathers are quantized: ("forward", "backward")
      (default), ("forward",) or ("backward",). Under hpZ backward re-gathers move the
      forward gather's secondary, so both or neither.
    reduce_quantization: ZeRO++ qgZ (DeepSpeed ``zero_quantized_gradients``): None, "int8"
      or "int4" (two per byte): each device quantizes the chunk of a bucket's gradient
      destined for each device block-wise (stochastic rounding: zero-mean error), one
      all-to-all exchanges them, and the receiver dequantizes, sums in float32 and divides
      by N. Persistent parameters' gradients are all-reduced unquantized.
    quantization_block: values per scale for both (default 256).
    tensor_axes: mesh axes for tensor parallelism (default ``()``; one axis in this
      version, e.g. ``("tensor",)``). Each parameter given a tensor spec (compile_schedule's
      ``tensor_specs``, or Flax partitioning metadata) is split along one dimension over it
      and zjax shards each slice over the data axes: 1/(S*T) per device. The axis must be
      ``AxisType.Auto``: inside zjax's shard_map it is left to GSPMD, which inserts the
      tensor-parallel collectives into the unchanged global-view model. The batch is split
      over the data axes only and replicated over the tensor axis.

  Example:
    >>> cfg = ZeroConfig(prefetch_bucket_size=0, param_persistence_threshold=1e4)
    >>> cfg.prefetch_bucket_size
    0
  """

  prefetch_bucket_size: int = int(5e7)
  max_live_parameters: int = int(1e9)
  max_reuse_distance: int = int(1e9)
  param_persistence_threshold: int = int(1e5)
  sub_group_size: int = int(1e9)
  compute_dtype: Any = None
  reduce_dtype: Any = None
  shard_axes: tuple[str, ...] = ("fsdp",)
  replicate_axes: tuple[str, ...] = ()
  secondary_partition: bool = False
  gradient_reduction: str = "once"
  fold_rng_keys: bool = True
  roll_layers: bool = True
  gather_quantization: str | None = None
  gather_quantization_phases: tuple[str, ...] = PHASES
  reduce_quantization: str | None = None
  quantization_block: int = 256
  tensor_axes: tuple[str, ...] = ()

  def __init__(self, *, axis_name: Any = None, **values):
    # axis_name is an alias, not a field: dataclasses.replace(cfg, shard_axes=...) then
    # never meets a stale axis_name, and replace(cfg, axis_name=...) overrides shard_axes.
    fields = {f.name: f for f in dataclasses.fields(self)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
      raise TypeError(
        f"ZeroConfig got unknown field(s) {unknown}; fields: {sorted(fields)} (and axis_name)."
      )
    if axis_name is not None:  # checked here, so that an error names the field given
      values["shard_axes"] = _axis_tuple("axis_name", axis_name, False)
    for name, f in fields.items():
      object.__setattr__(self, name, values.get(name, f.default))
    self.__post_init__()

  @property
  def axis_name(self):
    """The one shard axis's name (a tuple of names when there are several)."""
    return self.shard_axes[0] if len(self.shard_axes) == 1 else self.shard_axes

  def __post_init__(self):
    for name in _ELEMENT_KNOBS:
      object.__setattr__(self, name, _check_element_count(name, getattr(self, name)))
    for name in ("compute_dtype", "reduce_dtype"):
      object.__setattr__(self, name, _check_float_dtype(name, getattr(self, name)))
    shard_axes = _axis_tuple("shard_axes", self.shard_axes, False)
    object.__setattr__(self, "shard_axes", shard_axes)
    object.__setattr__(
      self, "replicate_axes", _check_replicate_axes(self.replicate_axes, shard_axes)
    )
    data_axes = (*self.replicate_axes, *shard_axes)
    object.__setattr__(self, "tensor_axes", _check_tensor_axes(self.tensor_axes, data_axes))
    if not isinstance(self.secondary_partition, bool):
      raise ValueError(
        f"ZeroConfig.secondary_partition must be True or False, got {self.secondary_partition!r}."
      )
    if self.secondary_partition and not self.replicate_axes:
      raise ValueError(
        "ZeroConfig.secondary_partition (hpZ) needs replicate_axes: the "
        "secondary shard spans the shard axes inside each replica group (e.g. "
        "a node); without a replicate axis set replicate_axes=('replica',) "
        "on a 2-D mesh, or leave secondary_partition False."
      )
    if self.gradient_reduction not in GRADIENT_REDUCTIONS:
      raise ValueError(
        f"ZeroConfig.gradient_reduction must be one of "
        f"{list(GRADIENT_REDUCTIONS)}, got {self.gradient_reduction!r}."
      )
    for name in ("fold_rng_keys", "roll_layers"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"ZeroConfig.{name} must be True or False, got {getattr(self, name)!r}.")
    self._check_quantization()

  def _check_quantization(self):
    for name, known in (
      ("gather_quantization", GATHER_QUANTIZATIONS),
      ("reduce_quantization", REDUCE_QUANTIZATIONS),
    ):
      value = getattr(self, name)
      if value is not None and value not in known:
        raise ValueError(f"ZeroConfig.{name} must be None or one of {list(known)}, got {value!r}.")
    block = self.quantization_block
    if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
      raise ValueError(
        f"ZeroConfig.quantization_block must be a positive number of values "
        f"per scale, got {block!r}."
      )
    object.__setattr__(self, "quantization_block", int(block))
    phases = self.gather_quantization_phases
    phases = (phases,) if isinstance(phases, str) else phases
    if (
      not isinstance(phases, (tuple, list))
      or not phases
      or any(p not in PHASES for p in phases)
      or len(set(phases)) != len(phases)
    ):
      raise ValueError(
        f"ZeroConfig.gather_quantization_phases must name 'forward' and/or "
        f"'backward' (each once), got {self.gather_quantization_phases!r}."
      )
    phases = tuple(p for p in PHASES if p in phases)
    object.__setattr__(self, "gather_quantization_phases", phases)
    if self.secondary_partition and self.gather_quantization and phases != PHASES:
      raise ValueError(
        f"ZeroConfig.gather_quantization_phases is {list(phases)}, but under "
        f"hpZ (secondary_partition) backward re-gathers move the forward "
        f"gather's secondary shard: quantize both phases or neither."
      )

  def to_dict(self) -> dict:
    """JSON-serialisable form (dtype as its name)."""
    out = dataclasses.asdict(self)
    for name in ("compute_dtype", "reduce_dtype"):
      out[name] = None if out[name] is None else out[name].name
    out["replicate_axes"] = list(self.replicate_axes)
    out["shard_axes"] = list(self.shard_axes)
    out["gather_quantization_phases"] = list(self.gather_quantization_phases)
    out["tensor_axes"] = list(self.tensor_axes)
    if not self.tensor_axes:  # files stay as they were before tensor parallelism
      del out["tensor_axes"]
    return out

  @property
  def roles(self) -> MeshRoles:
    """What each axis the config names does (mesh_roles.py; sizes come with a mesh)."""
    return MeshRoles.of(self)

  @property
  def data_axes(self) -> tuple[str, ...]:
    """Every axis the batch is split over: the replicate axes, then the shard axes."""
    return self.roles.data_axes

  @property
  def mesh_axes(self) -> tuple[str, ...]:
    """Every axis the config names: the data axes, then the tensor axes."""
    return self.roles.mesh_axes

  @property
  def storage_axes(self) -> tuple[str, ...]:
    """The axes parameter storage is sharded over: the shard axes, or with a secondary
    partition (hpZ) every data axis."""
    return self.roles.storage_axes

  @property
  def averaged_axes(self) -> tuple[str, ...]:
    """Axes a reduce-scattered gradient shard is then averaged over (HSDP's replicas)."""
    return self.roles.averaged_axes

  @classmethod
  def from_dict(cls, data: dict) -> "ZeroConfig":
    """Inverse of `to_dict`; unknown keys are an error naming them."""
    if not isinstance(data, dict):
      raise ValueError(f"ZeroConfig.from_dict expects a dict, got {type(data).__name__}.")
    known = {f.name for f in dataclasses.fields(cls)} | {"axis_name"}
    unknown = sorted(set(data) - known)
    if unknown:
      raise ValueError(f"Unknown ZeroConfig field(s) {unknown}; known fields: {sorted(known)}.")
    return cls(**data)


def _check_element_count(name: str, value: Any) -> int:
  """Accept ints and integral floats (DeepSpeed configs write 5e7); return an int."""
  rule = _ELEMENT_KNOBS[name]
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(
      f"ZeroConfig.{name} must be a number of parameter elements ({rule}), "
      f"got {value!r} of type {type(value).__name__}."
    )
  if not np.isfinite(value) or value != int(value):
    raise ValueError(f"ZeroConfig.{name} must be a whole number of elements, got {value!r}.")
  value = int(value)
  if value < 0 or (value == 0 and name in _POSITIVE_KNOBS):
    raise ValueError(f"ZeroConfig.{name} {rule}, got {value}.")
  return value


def _axis_tuple(field: str, given: Any, allow_empty: bool) -> tuple[str, ...]:
  value = (given,) if isinstance(given, str) else given
  if (
    not isinstance(value, (tuple, list))
    or not all(isinstance(a, str) and a for a in value)
    or not (value or allow_empty)
  ):
    raise ValueError(
      f"ZeroConfig.{field} must be a non-empty string naming a mesh axis, or a "
      f"tuple of them, got {given!r}."
    )
  for i, axis in enumerate(value):
    if axis in value[:i]:
      raise ValueError(f"ZeroConfig.{field} names {axis!r} twice.")
  return tuple(value)


def _check_replicate_axes(value: Any, shard_axes: tuple[str, ...]) -> tuple[str, ...]:
  value = _axis_tuple("replicate_axes", value, True) if value != () else ()
  for axis in value:
    if axis in shard_axes:
      raise ValueError(
        f"ZeroConfig.replicate_axes names {axis!r}, an axis parameters are "
        f"sharded over (shard_axes): an axis either shards or replicates."
      )
  return value


def _check_tensor_axes(value: Any, data_axes: tuple[str, ...]) -> tuple[str, ...]:
  value = _axis_tuple("tensor_axes", value, True) if value != () else ()
  for axis in value:
    if axis in data_axes:
      raise ValueError(
        f"ZeroConfig.tensor_axes names {axis!r}, a data axis (shard_axes or "
        f"replicate_axes): an axis splits either the batch or the tensors."
      )
  if len(value) > 1:
    raise ValueError(
      f"ZeroConfig.tensor_axes names {len(value)} axes {value}; this version "
      f"supports one tensor axis. Merge them into one mesh axis."
    )
  return value


def _check_float_dtype(name: str, value: Any):
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise ValueError(
      f"ZeroConfig.{name} must be None or a floating dtype such as jnp.bfloat16, got {value!r}."
    ) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"ZeroConfig.{name} must be a floating dtype (e.g. bfloat16, float32), got {dtype.name}."
    )
  return dtype
