"""ZeroConfig: the knobs of a ZeRO-3 schedule, with DeepSpeed's names, units and defaults."""

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
  """Knobs of the ZeRO-3 schedule. Sizes are counts of parameter elements, as in DeepSpeed.

  Attributes:
    prefetch_bucket_size: elements of upcoming buckets that may be gathered ahead of need
      (0 disables prefetch).
    max_live_parameters: cap on gathered (full-form) parameter elements alive at once.
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
    axis_name: name of the mesh axis that parameters are sharded over and the batch is
      split over. The loss may use collectives over it (`lax.pmean`, `axis_index`,
      `nn.BatchNorm(axis_name=...)` for synchronised batch statistics).
    replicate_axes: mesh axes over which parameters, gradients and optimizer state are
      replicated rather than sharded (HSDP, PyTorch FSDP2's hybrid sharding): each group of
      devices along `axis_name` holds one sharded copy; the batch is split over these axes
      and `axis_name` together, and each bucket's gradient shard is reduce-scattered within
      the group, then averaged over the replicas (an all-reduce of 1/N of it).
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
  axis_name: str = "fsdp"
  replicate_axes: tuple[str, ...] = ()
  gradient_reduction: str = "once"
  fold_rng_keys: bool = True

  def __post_init__(self):
    for name in _ELEMENT_KNOBS:
      object.__setattr__(self, name, _check_element_count(name, getattr(self, name)))
    for name in ("compute_dtype", "reduce_dtype"):
      object.__setattr__(self, name, _check_float_dtype(name, getattr(self, name)))
    if not isinstance(self.axis_name, str) or not self.axis_name:
      raise ValueError(
          f"ZeroConfig.axis_name must be a non-empty string naming a mesh axis, "
          f"got {self.axis_name!r}.")
    object.__setattr__(self, "replicate_axes", _check_replicate_axes(self.replicate_axes,
                                                                     self.axis_name))
    if self.gradient_reduction not in GRADIENT_REDUCTIONS:
      raise ValueError(f"ZeroConfig.gradient_reduction must be one of "
                       f"{list(GRADIENT_REDUCTIONS)}, got {self.gradient_reduction!r}.")
    if not isinstance(self.fold_rng_keys, bool):
      raise ValueError(f"ZeroConfig.fold_rng_keys must be True or False, got "
                       f"{self.fold_rng_keys!r}.")

  def to_dict(self) -> dict:
    """JSON-serialisable form (dtype as its name)."""
    out = dataclasses.asdict(self)
    for name in ("compute_dtype", "reduce_dtype"):
      out[name] = None if out[name] is None else out[name].name
    out["replicate_axes"] = list(self.replicate_axes)
    return out

  @property
  def data_axes(self) -> tuple[str, ...]:
    """Every axis the batch is split over: the replicate axes, then the sharding axis."""
    return (*self.replicate_axes, self.axis_name)

  @classmethod
  def from_dict(cls, data: dict) -> "ZeroConfig":
    """Inverse of `to_dict`; unknown keys are an error naming them."""
    if not isinstance(data, dict):
      raise ValueError(f"ZeroConfig.from_dict expects a dict, got {type(data).__name__}.")
    known = {f.name for f in dataclasses.fields(cls)}
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
        f"got {value!r} of type {type(value).__name__}.")
  if not np.isfinite(value) or value != int(value):
    raise ValueError(f"ZeroConfig.{name} must be a whole number of elements, got {value!r}.")
  value = int(value)
  if value < 0 or (value == 0 and name in _POSITIVE_KNOBS):
    raise ValueError(f"ZeroConfig.{name} {rule}, got {value}.")
  return value


def _check_replicate_axes(value: Any, axis_name: str) -> tuple[str, ...]:
  if isinstance(value, str) or not isinstance(value, (tuple, list)) or not all(
      isinstance(a, str) and a for a in value):
    raise ValueError(f"ZeroConfig.replicate_axes must be a tuple of mesh axis names, got "
                     f"{value!r}.")
  for i, axis in enumerate(value):
    if axis == axis_name:
      raise ValueError(f"ZeroConfig.replicate_axes names {axis!r}, the axis parameters are "
                       f"sharded over (axis_name): an axis either shards or replicates.")
    if axis in value[:i]:
      raise ValueError(f"ZeroConfig.replicate_axes names {axis!r} twice.")
  return tuple(value)


def _check_float_dtype(name: str, value: Any):
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise ValueError(
        f"ZeroConfig.{name} must be None or a floating dtype such as jnp.bfloat16, "
        f"got {value!r}.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
        f"ZeroConfig.{name} must be a floating dtype (e.g. bfloat16, float32), "
        f"got {dtype.name}.")
  return dtype
