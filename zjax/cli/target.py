"""Resolve `PATH_OR_MODULE:FUNCTION` into the (loss_fn, params, batch[, config[,
tensor_specs]]) it returns."""

import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

from zjax._src.config import ZeroConfig


class TargetError(ValueError):
  """The command-line target cannot be loaded or returned the wrong thing."""


@dataclasses.dataclass(frozen=True)
class Target:
  loss_fn: Callable
  params: Any
  batch: Any
  config: ZeroConfig | None
  tensor_specs: Any = None  # as compile_schedule(tensor_specs=...), with config.tensor_axes


def load_target(spec: str) -> Target:
  """Import `spec` = "path/to/file.py:function" or "package.module:function" and call it."""
  where, sep, func_name = spec.rpartition(":")
  if not sep or not where or not func_name:
    raise TargetError(
      f"Target {spec!r} must look like PATH.py:FUNCTION or MODULE:FUNCTION, "
      f"e.g. examples/gpt.py:inspect_gpt."
    )
  module = _import(where)
  func = getattr(module, func_name, None)
  if not callable(func):
    available = sorted(
      n
      for n, v in vars(module).items()
      if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
    )
    raise TargetError(
      f"{where} has no function {func_name!r}. Functions defined there: "
      f"{', '.join(available) or 'none'}."
    )
  return _check_result(spec, func())


def _import(where: str):
  if where.endswith(".py") or os.sep in where or os.path.exists(where):
    if not os.path.isfile(where):
      raise TargetError(f"File {where} does not exist.")
    name = "_zjax_target_" + os.path.splitext(os.path.basename(where))[0]
    spec = importlib.util.spec_from_file_location(name, where)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(where)))  # its sibling imports
    try:
      spec.loader.exec_module(module)
    finally:
      sys.path.pop(0)
    return module
  try:
    return importlib.import_module(where)
  except ModuleNotFoundError as e:
    raise TargetError(
      f"Cannot import module {where!r} ({e}); pass a file path or a module on PYTHONPATH."
    ) from None


def _check_result(spec: str, result) -> Target:
  if not isinstance(result, tuple) or len(result) not in (3, 4, 5):
    raise TargetError(
      f"{spec} must return (loss_fn, params, batch), (loss_fn, params, "
      f"batch, ZeroConfig) or (loss_fn, params, batch, ZeroConfig, "
      f"tensor_specs); it returned {type(result).__name__}"
      + (f" of length {len(result)}" if isinstance(result, tuple) else "")
      + "."
    )
  loss_fn, params, batch = result[:3]
  config = result[3] if len(result) >= 4 else None
  tensor_specs = result[4] if len(result) == 5 else None
  if not callable(loss_fn):
    raise TargetError(
      f"{spec}: the first item must be the loss function, got {type(loss_fn).__name__}."
    )
  if config is not None and not isinstance(config, ZeroConfig):
    raise TargetError(
      f"{spec}: the fourth item must be a zjax.ZeroConfig, got {type(config).__name__}."
    )
  return Target(loss_fn, params, batch, config, tensor_specs)
