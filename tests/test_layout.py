"""shard / unshard: the flat, zero-padded, 1/N layout and its exact inverse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zjax
from helpers import mesh_of

PARAMS = {
  "odd": np.arange(257 * 3, dtype=np.float32).reshape(257, 3),
  "scalar": np.float32(3.5),
  "empty": np.zeros((0, 5), np.float32),
  "ids": np.arange(40, dtype=np.int32),
  "half": (np.arange(100) / 7).astype(jnp.bfloat16),
  "small": np.ones(3, np.float32),
}


def loss(p, x):
  return (
    (x @ p["odd"].T).sum() * p["scalar"]
    + p["empty"].sum()
    + p["ids"].sum()
    + p["half"].astype(jnp.float32).sum()
    + p["small"].sum()
  )


def schedule_for(n, threshold=0):
  return zjax.compile_schedule(
    loss,
    PARAMS,
    jnp.ones((8, 3)),
    num_devices=n,
    config=zjax.ZeroConfig(param_persistence_threshold=threshold),
  )


@pytest.mark.parametrize("n", [8, 4, 1])
@pytest.mark.parametrize("explicit", [True, False])
def test_round_trip_is_bitwise(n, explicit):
  mesh = mesh_of(n, explicit)
  s = schedule_for(n)
  sharded = zjax.shard(PARAMS, s, mesh)
  back = zjax.unshard(sharded, s)
  for key, value in PARAMS.items():
    assert back[key].dtype == value.dtype and back[key].shape == value.shape
    np.testing.assert_array_equal(np.asarray(back[key]), value)


def test_layout_is_flat_padded_and_split():
  mesh = mesh_of(8)
  s = schedule_for(8, threshold=4)
  sharded = zjax.shard(PARAMS, s, mesh)
  odd = sharded["odd"]
  assert odd.shape == (776,)  # 771 padded to a multiple of 8
  assert odd.sharding.spec == jax.sharding.PartitionSpec("fsdp")
  assert [sh.data.shape for sh in odd.addressable_shards] == [(97,)] * 8
  np.testing.assert_array_equal(np.asarray(odd)[771:], 0)  # padding is zero
  assert sharded["small"].shape == (3,)  # persistent: replicated, natural shape
  assert sharded["small"].sharding.spec == jax.sharding.PartitionSpec()
  assert sharded["scalar"].shape == ()  # 1 element <= threshold
  assert sharded["empty"].shape == (0, 5)  # empty: always persistent


def test_accepts_jax_arrays_on_any_placement():
  mesh = mesh_of(8)
  s = schedule_for(8)
  on_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[3]), PARAMS)
  back = zjax.unshard(zjax.shard(on_device, s, mesh), s)
  np.testing.assert_array_equal(np.asarray(back["odd"]), PARAMS["odd"])


def test_errors_name_the_problem():
  mesh = mesh_of(8)
  s = schedule_for(8)
  with pytest.raises(zjax.ZjaxError, match=r"missing: \[\"\['small'\]\"\]"):
    zjax.shard({k: v for k, v in PARAMS.items() if k != "small"}, s, mesh)
  with pytest.raises(zjax.ZjaxError, match=r"Parameter \['odd'\] is float32\[257, 4\]"):
    zjax.shard({**PARAMS, "odd": np.zeros((257, 4), np.float32)}, s, mesh)
  with pytest.raises(zjax.ZjaxError, match="planned for 8 devices but the mesh axis 'fsdp' has 4"):
    zjax.shard(PARAMS, s, mesh_of(4))
  with pytest.raises(zjax.ZjaxError, match="shards over 'fsdp'"):
    zjax.shard(PARAMS, s, jax.make_mesh((8,), ("data",)))
  with pytest.raises(zjax.ZjaxError, match=r"\['odd'\] has shape \(771,\)"):
    zjax.unshard({**zjax.shard(PARAMS, s, mesh), "odd": jnp.zeros(771)}, s)
