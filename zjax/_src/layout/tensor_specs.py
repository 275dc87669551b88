"""Which parameter dimension tensor parallelism splits: from a pytree of PartitionSpecs, from
`(path regex, PartitionSpec)` rules, or from Flax partitioning metadata (linen
`nn.with_logical_partitioning` / `nn.with_partitioning` boxes, NNX variables with sharding
names) mapped through logical axis rules.

Only the tensor axes of a spec matter: zjax shards every leaf flat over the data axes
anyway, so a data axis in a spec (MaxText's `embed -> fsdp`) is ignored. The result is one
dimension (or None) per parameter leaf, checked: one tensor dimension at most, divisible by
the tensor axis's size, no axis the mesh lacks.
"""

import re
from typing import Any

import jax
from flax import linen as nn
from flax.core import meta
from jax.sharding import PartitionSpec as P

from zjax._src.errors import ZjaxError


def filtered_spec(spec, keep, empty=None) -> P:
  """`spec` with each dimension's mesh axes filtered by `keep(axis)`; `empty` where none is
  left (None: unsharded, P.UNCONSTRAINED: left to the partitioner)."""
  out = []
  for part in spec:
    names = tuple(
      a for a in (part if isinstance(part, tuple) else (part,)) if a is not None and keep(a)
    )
    out.append(empty if not names else names[0] if len(names) == 1 else names)
  return P(*out)


def is_box(x) -> bool:
  """A Flax partitioning box (linen LogicallyPartitioned / Partitioned)."""
  return isinstance(x, meta.AxisMetadata)


def unbox(params: Any) -> Any:
  """The params without Flax's partitioning boxes (plain arrays; other trees unchanged)."""
  if not any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
    return params
  return meta.unbox(params)


def mesh_specs(
  params: Any, tensor_specs: Any = None, logical_axis_rules: Any = None
) -> list[P | None]:
  """One mesh-axis PartitionSpec (or None) per leaf of (unboxed) `params`, in leaf order:
  from `tensor_specs` if given, else from the params' Flax metadata, else all None."""
  key_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(unbox(params))[0]]
  paths = [jax.tree_util.keystr(p) for p in key_paths]
  if tensor_specs is not None:
    if _is_rule_list(tensor_specs):
      return _from_rules(tensor_specs, key_paths)
    return _from_pytree(tensor_specs, paths)
  return _from_metadata(params, logical_axis_rules, paths)


def tensor_dims(
  plain_params: Any, specs: list, tensor_sizes: dict[str, int], known_axes: tuple[str, ...]
) -> list[int | None]:
  """The dimension of each leaf of (unboxed) `plain_params` split over the (one) tensor
  axis, or None; every error names the parameter."""
  out = []
  for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(plain_params)[0], specs):
    out.append(
      _tensor_dim(jax.tree_util.keystr(path), tuple(leaf.shape), spec, tensor_sizes, known_axes)
    )
  return out


def _tensor_dim(path, shape, spec, tensor_sizes, known_axes):
  if spec is None:
    return None
  if not isinstance(spec, P):
    raise ZjaxError(
      f"The tensor spec of parameter {path} is {spec!r}; expected a "
      f"jax.sharding.PartitionSpec or None."
    )
  if len(spec) > len(shape):
    raise ZjaxError(
      f"The tensor spec {spec} of parameter {path} has {len(spec)} entries, "
      f"but the parameter has shape {list(shape)}."
    )
  dims = []
  for d, part in enumerate(spec):
    axes = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    for axis in axes:
      if axis not in known_axes:
        raise ZjaxError(
          f"The tensor spec {spec} of parameter {path} names mesh axis "
          f"{axis!r}, which the mesh lacks (axes: {list(known_axes)}). Fix "
          f"the spec or the logical axis rules."
        )
    if any(a in tensor_sizes for a in axes):
      dims.append(d)
  if len(dims) > 1:
    raise ZjaxError(
      f"Parameter {path} has dims {dims} split over the tensor axis (spec "
      f"{spec}); at most one dimension of a parameter may be tensor-parallel."
    )
  if not dims:
    return None
  d = dims[0]
  ((axis, size),) = tensor_sizes.items()
  if shape[d] % size:
    raise ZjaxError(
      f"{path} dim {d} (size {shape[d]}) is split over {axis!r} ({size}) but "
      f"does not divide: pad the width or leave it replicated."
    )
  return d


def _is_rule_list(x) -> bool:
  return (
    isinstance(x, list)
    and all(isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str) for r in x)
    and bool(x)
  )


def slash_path(path) -> str:
  """A key path as "params/Dense_0/kernel" (what tensor_specs rules are matched against)."""
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _from_rules(rules, key_paths) -> list:
  for i, (pattern, spec) in enumerate(rules):
    try:
      re.compile(pattern)
    except re.error as e:
      raise ZjaxError(
        f"tensor_specs rule {i} has the pattern {pattern!r}, not a regular expression ({e})."
      ) from None
    if spec is not None and not isinstance(spec, P):
      raise ZjaxError(
        f"tensor_specs rule {i} ({pattern!r}) maps to {spec!r}; expected a PartitionSpec or None."
      )
  names = [slash_path(path) for path in key_paths]
  unmatched = [
    f"{i} ({pattern!r})"
    for i, (pattern, _) in enumerate(rules)
    if not any(re.search(pattern, name) for name in names)
  ]
  if unmatched:
    raise ZjaxError(
      f"tensor_specs rule{'s' if len(unmatched) > 1 else ''} "
      f"{', '.join(unmatched)} match{'' if len(unmatched) > 1 else 'es'} no "
      f"parameter (the paths look like {names[:3]}): a misspelt rule would "
      f"leave its weights replicated over the tensor axis. Fix the pattern or "
      f"drop the rule."
    )
  return [
    next((spec for pattern, spec in rules if re.search(pattern, name)), None) for name in names
  ]


def _from_pytree(tensor_specs, paths) -> list:
  leaf = lambda x: x is None or isinstance(x, P)  # noqa: E731
  flat = jax.tree_util.tree_flatten_with_path(tensor_specs, is_leaf=leaf)[0]
  by_path = {jax.tree_util.keystr(p): s for p, s in flat}
  unknown = sorted(set(by_path) - set(paths))
  if unknown:
    raise ZjaxError(
      f"tensor_specs names {unknown[:3]}, not parameters of the params pytree "
      f"(e.g. {paths[:2]}); give a pytree with the params' structure (None "
      f"where replicated) or a list of (path regex, PartitionSpec) rules."
    )
  return [by_path.get(p) for p in paths]


def _from_metadata(params, rules, paths) -> list:
  """Flax linen boxes or NNX variables' sharding names, through the logical rules."""
  rules = nn.get_logical_axis_rules() if rules is None else rules
  if any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):

    def spec(x):
      if isinstance(x, nn.LogicallyPartitioned):
        return P(*nn.logical_to_mesh_axes(x.names, tuple(rules) or None))
      return P(*x.names) if isinstance(x, nn.Partitioned) else None

    return [spec(x) for x in jax.tree.leaves(params, is_leaf=is_box)]
  names = _nnx_sharding_names(params)
  if names is None:
    return [None] * len(paths)
  return [
    None if n is None else P(*nn.logical_to_mesh_axes(n, tuple(rules) or None)) if rules else P(*n)
    for n in names
  ]


def _nnx_sharding_names(params):
  """NNX state whose variables carry sharding names: one tuple (or None) per leaf."""
  from flax import nnx

  if not isinstance(params, nnx.State):
    return None
  variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  if not variables or not all(isinstance(v, nnx.Variable) for v in variables):
    return None
  out = []
  for v in variables:
    metadata = v.get_metadata()
    names = next(
      (
        metadata[k]
        for k in ("out_sharding", "sharding_names", "sharding")
        if metadata.get(k) is not None
      ),
      None,
    )
    out.append(tuple(names) if names is not None else None)
  return out if any(n is not None for n in out) else None
