"""The planner: layout, buckets, segments, steps, and every knob's documented effect."""

import jax
import jax.numpy as jnp
import pytest

import zjax

D = 64  # a layer's kernel has D*D = 4096 elements
KERNEL = D * D


def mlp(num_layers=4, dtype=jnp.float32):
  """Params (as shapes) of an MLP: kernel (D*D) + bias (D) per layer."""
  params = {
    f"layer{i}": {
      "kernel": jax.ShapeDtypeStruct((D, D), dtype),
      "bias": jax.ShapeDtypeStruct((D,), dtype),
    }
    for i in range(num_layers)
  }

  def loss(p, x):
    for i in range(num_layers):
      x = jnp.tanh(x @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"])
    return x.astype(jnp.float32).mean()

  return loss, params, jax.ShapeDtypeStruct((8, D), dtype)


def plan(model=None, n=8, platform=None, **knobs):
  knobs.setdefault("param_persistence_threshold", D)  # biases replicated, kernels sharded
  knobs.setdefault("roll_layers", False)  # the unrolled planner (rolling: test_rolling.py)
  loss, params, batch = model or mlp()
  return zjax.compile_schedule(
    loss, params, batch, num_devices=n, platform=platform, config=zjax.ZeroConfig(**knobs)
  )


def ops(steps, op):
  return [s for s in steps if s.op == op]


def test_layout_persistent_and_sharded():
  s = plan()
  for p in s.params:
    assert p.persistent == p.path.endswith("['bias']")
    assert (p.bucket is None) == p.persistent
  assert len(s.buckets) == 4
  assert all(len(b.params) == 1 and b.params[0].endswith("['kernel']") for b in s.buckets)


def test_buckets_group_by_module_in_first_use_order():
  s = plan(param_persistence_threshold=0)  # biases sharded too: one bucket per layer
  assert [b.module for b in s.buckets] == [f"layer{i}" for i in range(4)]
  assert all(len(b.params) == 2 for b in s.buckets)


def test_buckets_hold_one_dtype():
  params = {
    "m": {
      "w": jax.ShapeDtypeStruct((D, D), jnp.float32),
      "v": jax.ShapeDtypeStruct((D, D), jnp.bfloat16),
    }
  }
  loss = lambda p, x: (x @ p["m"]["w"] + (x.astype(jnp.bfloat16) @ p["m"]["v"])).mean()
  s = zjax.compile_schedule(
    loss,
    params,
    jax.ShapeDtypeStruct((8, D), jnp.float32),
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  assert sorted(b.dtype for b in s.buckets) == ["bfloat16", "float32"]
  assert all(b.module == "m" for b in s.buckets)


def test_every_use_preceded_by_gather_in_both_phases():
  s = plan(prefetch_bucket_size=0, max_reuse_distance=0)
  live = set()
  for phase, steps in (("forward", s.forward), ("backward", s.backward)):
    for step in steps:
      if step.op == "gather":
        live.add(step.bucket)
      elif step.op == "release":
        live.remove(step.bucket)
      elif step.op == "compute":
        seg = s.segments[step.segment]
        assert set(seg.buckets if phase == "forward" else seg.backward_buckets) <= live
  assert not live


def test_backward_buckets_are_what_the_vjp_reads():
  """d(x @ W)/dW needs x only: the first layer (input = batch) never needs W in backward;
  later layers need W for the activation cotangent."""
  s = plan()
  first, *rest = [seg for seg in s.segments if seg.buckets]
  assert first.buckets == (0,) and first.backward_buckets == ()
  assert all(seg.backward_buckets == seg.buckets for seg in rest)


def test_prefetch_zero_means_no_prefetch():
  s = plan(prefetch_bucket_size=0)
  assert not any(step.prefetch for step in s.forward + s.backward)
  assert s.report()["prefetch_count"] == 0
  # each gather comes right before the compute that needs it
  for i, step in enumerate(s.forward):
    if step.op == "gather":
      nxt = s.forward[i + 1]
      assert nxt.op == "gather" or step.bucket in s.segments[nxt.segment].buckets


def test_prefetch_window_is_bounded_by_prefetch_bucket_size():
  one = plan(prefetch_bucket_size=KERNEL, max_reuse_distance=0)
  two = plan(prefetch_bucket_size=2 * KERNEL, max_reuse_distance=0)
  assert one.report()["prefetch_count"] > 0
  # with room for one bucket ahead, at most one bucket is gathered but not yet needed
  assert one.report()["peak_live_param_bytes"] == 2 * KERNEL * 4
  assert two.report()["peak_live_param_bytes"] == 3 * KERNEL * 4
  huge = plan(prefetch_bucket_size=10**9, max_reuse_distance=0)
  assert [st.op for st in huge.forward[:4]] == ["gather"] * 4  # everything up front


def test_huge_persistence_threshold_means_nothing_gathered():
  s = plan(param_persistence_threshold=10**9)
  r = s.report()
  assert r["all_gather_count"] == r["reduce_scatter_count"] == r["num_buckets"] == 0
  assert all(p.persistent for p in s.params)
  assert [st.op for st in s.forward] == ["compute"] * len(s.segments)


def test_persistence_threshold_zero_shards_every_nonempty_param():
  params = {
    "w": jax.ShapeDtypeStruct((D, D), jnp.float32),
    "s": jax.ShapeDtypeStruct((), jnp.float32),
    "e": jax.ShapeDtypeStruct((0, 3), jnp.float32),
  }
  loss = lambda p, x: (x @ p["w"] * p["s"]).mean() + p["e"].sum()
  s = zjax.compile_schedule(
    loss,
    params,
    jax.ShapeDtypeStruct((8, D), jnp.float32),
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  by_path = {p.path: p for p in s.params}
  assert not by_path["['w']"].persistent and not by_path["['s']"].persistent
  assert by_path["['e']"].persistent  # zero-sized: nothing to shard
  # a scalar pads to N elements: gathered bucket of 8
  assert s.bucket_elements()[by_path["['s']"].bucket] == 8


def test_max_reuse_distance_controls_backward_regathers():
  keep_all = plan(max_reuse_distance=10**9)
  release_all = plan(max_reuse_distance=0)
  assert keep_all.report()["backward_all_gather_count"] == 0
  # layer 3 is used right at the turn (distance 0) and stays; layer 0's backward reads no
  # weights; layers 1 and 2 are gathered again
  assert release_all.report()["backward_all_gather_count"] == 2
  # layer i's forward use and its backward use are 2*(3-i) kernels of work apart
  some = plan(max_reuse_distance=2 * KERNEL)
  assert some.report()["backward_all_gather_count"] == 1
  regathered = [st.bucket for st in some.backward if st.op == "gather"]
  assert regathered == [1]


def test_reuse_distance_for_tied_weights():
  params = {
    "emb": jax.ShapeDtypeStruct((D, D), jnp.float32),
    **{f"l{i}": jax.ShapeDtypeStruct((D, D), jnp.float32) for i in range(3)},
  }

  def loss(p, x):
    h = x @ p["emb"]
    for i in range(3):
      h = jnp.tanh(h @ p[f"l{i}"])
    return (h @ p["emb"].T).mean()

  batch = jax.ShapeDtypeStruct((8, D), jnp.float32)
  kept = zjax.compile_schedule(
    loss, params, batch, num_devices=8, config=zjax.ZeroConfig(param_persistence_threshold=0)
  )
  split = zjax.compile_schedule(
    loss,
    params,
    batch,
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0, max_reuse_distance=KERNEL),
  )
  emb = kept.param("['emb']").bucket
  assert sum(st.bucket == emb for st in ops(kept.forward, "gather")) == 1
  assert sum(st.bucket == emb for st in ops(kept.backward, "reduce_scatter")) == 1
  assert sum(st.bucket == emb for st in ops(split.forward, "gather")) == 2
  # one reduction per step by default (DeepSpeed), after the last backward use
  scatters = ops(split.backward, "reduce_scatter")
  assert sum(st.bucket == emb for st in scatters) == 1
  assert split.backward.index(scatters[-1]) > max(
    i
    for i, st in enumerate(split.backward)
    if st.op == "compute" and emb in split.segments[st.segment].buckets
  )
  per_gather = zjax.compile_schedule(
    loss,
    params,
    batch,
    num_devices=8,
    config=zjax.ZeroConfig(
      param_persistence_threshold=0, max_reuse_distance=KERNEL, gradient_reduction="per_gather"
    ),
  )
  assert sum(st.bucket == emb for st in ops(per_gather.backward, "reduce_scatter")) == 2
  # the trade: one reduction fewer, the embedding's full gradient live across the layers
  once, each = split.report(), per_gather.report()
  assert once["reduce_scatter_bytes"] == each["reduce_scatter_bytes"] - D * D * 4
  assert once["peak_live_grad_bytes"] > each["peak_live_grad_bytes"]


def test_max_live_parameters_caps_live_elements():
  cap = 2 * KERNEL
  s = plan(max_live_parameters=cap)
  assert s.report()["peak_live_param_bytes"] <= cap * 4
  loose = plan()
  assert loose.report()["peak_live_param_bytes"] > cap * 4


def test_bucket_larger_than_cap_is_named():
  with pytest.raises(zjax.ScheduleError, match=r"layer0.*max_live_parameters=100"):
    plan(max_live_parameters=100)


def test_one_device_has_no_collectives():
  r = plan(n=1).report()
  assert r["all_gather_count"] == r["reduce_scatter_count"] == r["num_buckets"] == 0


def test_report_counts_match_the_steps():
  s = plan(prefetch_bucket_size=KERNEL, max_reuse_distance=KERNEL)
  r = s.report()
  gathers = ops(s.forward + s.backward, "gather")
  assert r["all_gather_count"] == len(gathers)
  assert r["all_gather_bytes"] == len(gathers) * KERNEL * 4
  assert r["reduce_scatter_count"] == len(ops(s.backward, "reduce_scatter")) == 4
  assert r["reduce_scatter_bytes"] == 4 * KERNEL * 4
  assert r["state_bytes_per_device"] == 4 * (KERNEL // 8 + D) * 4
  assert r["persistent_grad_all_reduce_bytes"] == 4 * D * 4
  assert r["num_devices"] == 8


def test_padding_to_multiple_of_n():
  params = {"w": jax.ShapeDtypeStruct((257, 3), jnp.float32)}  # 771 elements
  s = zjax.compile_schedule(
    lambda p, x: (x @ p["w"]).mean(),
    params,
    jax.ShapeDtypeStruct((2, 257), jnp.float32),
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  assert s.bucket_elements() == [776]
  assert s.report()["state_bytes_per_device"] == 97 * 4


def test_compute_dtype_halves_gather_bytes():
  fp32 = plan()
  bf16 = plan(compute_dtype=jnp.bfloat16)
  assert bf16.report()["all_gather_bytes"] * 2 == fp32.report()["all_gather_bytes"]
  # gradients are reduced in the parameters' own dtype (fp32) unless reduce_dtype says so
  assert bf16.report()["reduce_scatter_bytes"] == fp32.report()["reduce_scatter_bytes"]
  both = plan(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16, platform="gpu")
  assert both.report()["reduce_scatter_bytes"] * 2 == fp32.report()["reduce_scatter_bytes"]
  # XLA's CPU collectives reduce 16-bit floats in f32: the CPU executor widens them itself
  on_cpu = plan(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16, platform="cpu")
  assert on_cpu.report()["reduce_scatter_bytes"] == fp32.report()["reduce_scatter_bytes"]
  # the stored shards are the fp32 masters; the bf16 copy exists only while gathered
  assert bf16.report()["state_bytes_per_device"] == fp32.report()["state_bytes_per_device"]


def test_sixteen_bit_gathers_are_counted_as_packed_words():
  """bf16 travels two values per 32-bit word; an odd local length pads one value."""
  params = {"w": jax.ShapeDtypeStruct((8, 3), jnp.float32)}  # 24 elements: 3 per device
  s = zjax.compile_schedule(
    lambda p, x: (x @ p["w"]).mean(),
    params,
    jax.ShapeDtypeStruct((8, 8), jnp.float32),
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0, compute_dtype=jnp.bfloat16),
  )
  assert s.report()["all_gather_bytes"] == s.report()["all_gather_count"] * 8 * 2 * 4


def test_int_params_are_gathered_but_never_reduce_scattered():
  params = {
    "w": jax.ShapeDtypeStruct((D, D), jnp.float32),
    "perm": jax.ShapeDtypeStruct((D * 4,), jnp.int32),
  }
  loss = lambda p, x: (x @ p["w"])[:, p["perm"] % D].mean()
  s = zjax.compile_schedule(
    loss,
    params,
    jax.ShapeDtypeStruct((8, D), jnp.float32),
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  perm = s.param("['perm']").bucket
  assert any(st.bucket == perm for st in ops(s.forward, "gather"))
  assert not any(st.bucket == perm for st in ops(s.backward, "reduce_scatter"))
  assert s.report()["reduce_scatter_count"] == 1


def test_unused_param_is_sharded_but_never_gathered():
  params = {
    "w": jax.ShapeDtypeStruct((D, D), jnp.float32),
    "unused": jax.ShapeDtypeStruct((D, D), jnp.float32),
  }
  s = zjax.compile_schedule(
    lambda p, x: (x @ p["w"]).mean(),
    params,
    jax.ShapeDtypeStruct((8, D), jnp.float32),
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  unused = s.param("['unused']")
  assert not unused.persistent and unused.bucket is None and unused.uses == ()


def test_cond_params_are_gathered_outside_the_branch():
  params = {
    "a": jax.ShapeDtypeStruct((D, D), jnp.float32),
    "b": jax.ShapeDtypeStruct((D, D), jnp.float32),
  }
  loss = lambda p, x: jax.lax.cond(
    x.sum() > 0, lambda h: h @ p["a"], lambda h: h @ p["b"], x
  ).mean()
  s = zjax.compile_schedule(
    loss,
    params,
    jax.ShapeDtypeStruct((8, D), jnp.float32),
    num_devices=8,
    config=zjax.ZeroConfig(param_persistence_threshold=0),
  )
  (seg,) = [g for g in s.segments if g.buckets]
  assert sorted(seg.buckets) == [0, 1]  # both branches' params, before the cond op


def test_compile_schedule_with_mesh():
  loss, params, batch = mlp()
  mesh8 = jax.make_mesh((8,), ("fsdp",))
  mesh4 = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  assert zjax.compile_schedule(loss, params, batch, mesh=mesh8).num_devices == 8
  assert zjax.compile_schedule(loss, params, batch, mesh=mesh4).num_devices == 4
  mesh2d = jax.make_mesh((2, 4), ("data", "fsdp"))
  hsdp = zjax.compile_schedule(
    loss, params, batch, mesh=mesh2d, config=zjax.ZeroConfig(replicate_axes=("data",))
  )
  assert (hsdp.num_devices, hsdp.replica_sizes, hsdp.data_parallel_size) == (4, (2,), 8)
  with pytest.raises(ValueError, match="Mesh axis 'data' is neither a shard axis"):
    zjax.compile_schedule(loss, params, batch, mesh=mesh2d)
  with pytest.raises(ValueError, match="replicate_axes names 'replica', but the mesh has"):
    zjax.compile_schedule(
      loss, params, batch, mesh=mesh2d, config=zjax.ZeroConfig(replicate_axes=("data", "replica"))
    )
  with pytest.raises(ValueError, match="shard_axes/axis_name names 'fsdp', but the mesh has axes"):
    zjax.compile_schedule(loss, params, batch, mesh=jax.make_mesh((8,), ("x",)))
  with pytest.raises(ValueError, match="exactly one of mesh"):
    zjax.compile_schedule(loss, params, batch)
  with pytest.raises(ValueError, match="num_devices must be a positive int"):
    zjax.compile_schedule(loss, params, batch, num_devices=0)
  with pytest.raises(TypeError, match="ZeroConfig"):
    zjax.compile_schedule(loss, params, batch, num_devices=8, config={"x": 1})


def test_planning_is_analytic_for_many_devices():
  s = plan(n=1024)
  assert s.report()["num_devices"] == 1024
  assert s.bucket_elements() == [4096] * 4
  assert s.report()["state_bytes_per_device"] == 4 * (4 + D) * 4


def test_str_is_a_reviewable_table():
  text = str(plan(prefetch_bucket_size=KERNEL, max_reuse_distance=0))
  lines = text.splitlines()
  assert lines[0].startswith("zjax schedule v3: 8 device(s)")
  assert lines[1].split() == ["step", "phase", "op", "bucket", "what", "bytes", "live", "after"]
  for word in (
    "gather (prefetch)",
    "compute",
    "release",
    "re-gather",
    "compute_vjp",
    "reduce_scatter",
  ):
    assert any(f" {word} " in line for line in lines), word
  assert "layer2 [kernel]" in text and "16.0 KiB" in text
