import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import zjax
from zjax._src.layout.mesh_roles import MeshRoles


def test_defaults_are_deepspeeds():
  cfg = zjax.ZeroConfig()
  assert cfg.prefetch_bucket_size == 50_000_000
  assert cfg.max_live_parameters == 1_000_000_000
  assert cfg.max_reuse_distance == 1_000_000_000
  assert cfg.param_persistence_threshold == 100_000
  assert cfg.sub_group_size == 1_000_000_000
  assert cfg.compute_dtype is None and cfg.reduce_dtype is None
  assert cfg.axis_name == "fsdp"


def test_frozen_and_keyword_only():
  cfg = zjax.ZeroConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.max_live_parameters = 3
  with pytest.raises(TypeError):
    zjax.ZeroConfig(5)  # positional


def test_accepts_deepspeed_style_floats():
  cfg = zjax.ZeroConfig(prefetch_bucket_size=5e7, sub_group_size=1e9)
  assert cfg.prefetch_bucket_size == 50_000_000 and isinstance(cfg.prefetch_bucket_size, int)


@pytest.mark.parametrize(
  "field,value,rule",
  [
    ("prefetch_bucket_size", -1, ">= 0"),
    ("max_live_parameters", 0, "> 0"),
    ("max_live_parameters", -5, "> 0"),
    ("max_reuse_distance", -1, ">= 0"),
    ("param_persistence_threshold", -1, ">= 0"),
    ("sub_group_size", 0, "> 0"),
    ("sub_group_size", "big", "number of parameter elements"),
    ("prefetch_bucket_size", 1.5, "whole number"),
    ("max_live_parameters", float("inf"), "whole number"),
    ("max_reuse_distance", True, "number of parameter elements"),
    ("compute_dtype", jnp.int32, "floating dtype"),
    ("compute_dtype", "not-a-dtype", "floating dtype"),
    ("reduce_dtype", jnp.int8, "floating dtype"),
    ("axis_name", "", "non-empty string"),
    ("axis_name", 3, "non-empty string"),
    ("gather_quantization", "int4", "one of ['int8']"),
    ("reduce_quantization", "fp8", "one of ['int8', 'int4']"),
    ("quantization_block", 0, "positive number of values per scale"),
    ("quantization_block", -8, "positive number of values per scale"),
    ("quantization_block", 2.5, "positive number of values per scale"),
    ("gather_quantization_phases", ("fwd",), "'forward' and/or 'backward'"),
    ("gather_quantization_phases", (), "'forward' and/or 'backward'"),
  ],
)
def test_invalid_values_name_field_and_rule(field, value, rule):
  with pytest.raises(ValueError) as e:
    zjax.ZeroConfig(**{field: value})
  assert field in str(e.value) and rule in str(e.value)


def test_zero_allowed_where_meaningful():
  cfg = zjax.ZeroConfig(prefetch_bucket_size=0, max_reuse_distance=0, param_persistence_threshold=0)
  assert (cfg.prefetch_bucket_size, cfg.max_reuse_distance, cfg.param_persistence_threshold) == (
    0,
    0,
    0,
  )


def test_dict_round_trip_and_unknown_field():
  cfg = zjax.ZeroConfig(compute_dtype=jnp.bfloat16, max_reuse_distance=7)
  data = cfg.to_dict()
  assert data["compute_dtype"] == "bfloat16"
  assert zjax.ZeroConfig.from_dict(data) == cfg
  with pytest.raises(ValueError, match="prefetch_bucket_sizes"):
    zjax.ZeroConfig.from_dict({"prefetch_bucket_sizes": 1})


def test_quantization_knobs():
  cfg = zjax.ZeroConfig(
    gather_quantization="int8",
    gather_quantization_phases="backward",
    reduce_quantization="int4",
    quantization_block=64,
  )
  assert cfg.gather_quantization_phases == ("backward",)
  assert zjax.ZeroConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(ValueError, match="under hpZ .* both phases or neither"):
    zjax.ZeroConfig(
      replicate_axes=("r",),
      secondary_partition=True,
      gather_quantization="int8",
      gather_quantization_phases=("forward",),
    )


# ---- the mesh's roles ----------------------------------------------------------------------


@pytest.mark.parametrize(
  "config, storage, gather_backward, mean_over",
  [
    (zjax.ZeroConfig(), ("fsdp",), ["fsdp"], None),
    (zjax.ZeroConfig(replicate_axes=("data",)), ("fsdp",), ["fsdp"], ["data"]),
    (
      zjax.ZeroConfig(replicate_axes=("data",), secondary_partition=True),
      ("data", "fsdp"),
      ["fsdp"],
      None,
    ),
  ],
  ids=["flat", "hsdp", "hpz"],
)
def test_mesh_roles_derive_every_axis_group_once(config, storage, gather_backward, mean_over):
  """Flat, HSDP and hpZ: which axes store, gather and average, and the sizes that follow,
  from one value (config.roles without sizes; a schedule's with them)."""
  sizes = {"data": 2, "fsdp": 4}
  roles = MeshRoles.of(config, {a: sizes[a] for a in config.data_axes})
  assert roles == MeshRoles.of(config, {a: sizes[a] for a in config.data_axes})
  assert roles.storage_axes == storage == config.storage_axes
  assert roles.collective_axes("gather", "forward") == {"axes": list(storage)}
  assert roles.collective_axes("gather", "backward") == {"axes": gather_backward}
  scatter = roles.collective_axes("reduce_scatter", "backward")
  assert scatter.get("mean_over") == mean_over and scatter["axes"] == list(storage)
  assert roles.storage_size == int(np.prod([sizes[a] for a in storage]))
  assert roles.data_parallel_size == int(np.prod([sizes[a] for a in config.data_axes]))
  assert roles.replicas * roles.shards == roles.data_parallel_size


def test_a_schedule_with_sizes_that_do_not_fit_its_axes_is_refused():
  s = zjax.compile_schedule(
    lambda p, x: (x @ p["w"]).mean(), {"w": jnp.ones((64, 64))}, jnp.ones((8, 64)), num_devices=8
  )
  assert s.roles.axis_sizes == {"fsdp": 8} == s.axis_sizes
  data = json.loads(s.to_json())
  data["shard_sizes"] = [4, 2]
  with pytest.raises(zjax.ScheduleError, match=r"shard_sizes \[4, 2\] must give one positive"):
    zjax.Schedule.from_json(json.dumps(data))
