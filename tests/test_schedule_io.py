"""Schedule as data: JSON round trip, files, fingerprints, and rejection of illegal edits."""

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zjax

D = 64


def model(num_layers=3, width=D):
  params = {
    f"layer{i}": {
      "kernel": jax.ShapeDtypeStruct((width, width), jnp.float32),
      "bias": jax.ShapeDtypeStruct((width,), jnp.float32),
    }
    for i in range(num_layers)
  }

  def loss(p, x):
    for i in range(num_layers):
      x = jnp.tanh(x @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"])
    return x.mean()

  return loss, params, jax.ShapeDtypeStruct((8, width), jnp.float32)


CONFIG = zjax.ZeroConfig(
  param_persistence_threshold=D, prefetch_bucket_size=D * D, max_reuse_distance=0, roll_layers=False
)  # steps of the unrolled planner


@pytest.fixture
def schedule():
  return zjax.compile_schedule(*model(), num_devices=8, config=CONFIG)


def edited(schedule, edit):
  data = json.loads(schedule.to_json())
  edit(data)
  return json.dumps(data)


def test_json_round_trip_is_textually_equal(schedule):
  text = schedule.to_json()
  again = zjax.Schedule.from_json(text)
  assert again.to_json() == text
  assert again == schedule and again.report() == schedule.report()
  assert str(again) == str(schedule)


def test_json_is_versioned_and_diff_friendly(schedule):
  text = schedule.to_json()
  data = json.loads(text)
  assert data["format"] == "zjax-schedule" and data["version"] == 3
  assert len(data["fingerprint"]) == 64
  # one step per line: a moved gather is a one-line diff
  assert text.count('{"op": ') == len(schedule.forward) + len(schedule.backward)
  assert list(data) == [
    "format",
    "version",
    "fingerprint",
    "num_devices",
    "platform",
    "replica_sizes",
    "shard_sizes",
    "config",
    "program",
    "params",
    "buckets",
    "segments",
    "rolling",
    "forward",
    "backward",
  ]
  assert data["rolling"] == ["layer rolling is off (ZeroConfig.roll_layers=False)"]


def test_planning_is_deterministic():
  a = zjax.compile_schedule(*model(), num_devices=8, config=CONFIG)
  b = zjax.compile_schedule(*model(), num_devices=8, config=CONFIG)
  assert a.to_json() == b.to_json()


def test_save_and_load(tmp_path, schedule):
  path = tmp_path / "s.json"
  schedule.save(path)
  assert zjax.Schedule.load(path) == schedule
  assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temp files left behind


def test_failed_save_keeps_the_old_file(tmp_path, schedule, monkeypatch):
  path = tmp_path / "s.json"
  schedule.save(path)
  before = path.read_text()

  def broken(self):
    raise RuntimeError("disk full")

  monkeypatch.setattr(zjax.Schedule, "to_json", broken)
  with pytest.raises(RuntimeError):
    schedule.save(path)
  assert path.read_text() == before
  assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_missing_and_truncated_files(tmp_path, schedule):
  with pytest.raises(zjax.ScheduleError, match="does not exist"):
    zjax.Schedule.load(tmp_path / "nope.json")
  path = tmp_path / "cut.json"
  path.write_text(schedule.to_json()[:500])
  with pytest.raises(zjax.ScheduleError, match=r"cut.json is not valid JSON .*truncated"):
    zjax.Schedule.load(path)


def test_wrong_format_or_version(schedule):
  with pytest.raises(zjax.ScheduleError, match="'version' is 99"):
    zjax.Schedule.from_json(edited(schedule, lambda d: d.update(version=99)))
  with pytest.raises(zjax.ScheduleError, match="'format' must be"):
    zjax.Schedule.from_json(edited(schedule, lambda d: d.update(format="pickle")))
  with pytest.raises(zjax.ScheduleError, match="top level must be a JSON object"):
    zjax.Schedule.from_json("[1, 2]")


def test_wrong_types_and_missing_fields(schedule):
  with pytest.raises(zjax.ScheduleError, match=r"forward step 0: field 'bucket' has the wrong"):
    zjax.Schedule.from_json(edited(schedule, lambda d: d["forward"][0].update(bucket="0")))
  with pytest.raises(zjax.ScheduleError, match=r"segments\[1\]: missing field 'end'"):
    zjax.Schedule.from_json(edited(schedule, lambda d: d["segments"][1].pop("end")))
  with pytest.raises(zjax.ScheduleError, match="'config'.*max_live_parameters"):
    zjax.Schedule.from_json(edited(schedule, lambda d: d["config"].update(max_live_parameters=0)))


def test_edited_parameter_table_breaks_the_fingerprint(schedule):
  def grow(d):
    d["params"][1]["shape"] = [D, D + 1]

  with pytest.raises(zjax.ScheduleError, match="fingerprint .* does not match"):
    zjax.Schedule.from_json(edited(schedule, grow))


def first(steps, op, bucket=None):
  return next(
    i
    for i, s in enumerate(steps)
    if s["op"] == op and (bucket is None or s.get("bucket") == bucket)
  )


def test_use_before_gather_names_step_and_params(schedule):
  def drop_first_gather(d):
    d["forward"].pop(first(d["forward"], "gather", 0))

  with pytest.raises(zjax.ScheduleError) as e:
    zjax.Schedule.from_json(edited(schedule, drop_first_gather), source="my.json")
  msg = str(e.value)
  assert msg.startswith("my.json: forward step") and "use before gather" in msg
  assert "['layer0']['kernel']" in msg


def test_release_before_last_use(schedule):
  def early_release(d):
    fwd = d["forward"]
    i = first(fwd, "release", 1)
    step = fwd.pop(i)
    fwd.insert(first(fwd, "compute"), step)  # before the first compute: layer1 is needed later

  with pytest.raises(zjax.ScheduleError, match=r"release before last use|not gathered"):
    zjax.Schedule.from_json(edited(schedule, early_release))


def test_unknown_parameter_in_bucket(schedule):
  with pytest.raises(zjax.ScheduleError, match=r"unknown parameter \['layer9'\]"):
    zjax.Schedule.from_json(
      edited(schedule, lambda d: d["buckets"][0].update(params=["['layer9']['kernel']"]))
    )


def test_bucket_mismatch_in_segment(schedule):
  def swap(d):
    seg = next(s for s in d["segments"] if s["buckets"])
    seg["buckets"] = [(seg["buckets"][0] + 1) % len(d["buckets"])]

  with pytest.raises(zjax.ScheduleError, match="bucket mismatch"):
    zjax.Schedule.from_json(edited(schedule, swap))


def test_cap_is_enforced_on_hand_edits(schedule):
  with pytest.raises(zjax.ScheduleError, match="above max_live_parameters=10"):
    zjax.Schedule.from_json(edited(schedule, lambda d: d["config"].update(max_live_parameters=10)))


def test_missing_reduce_scatter_and_double_gather(schedule):
  def drop_rs(d):
    i = first(d["backward"], "reduce_scatter")
    d["backward"].pop(i)

  with pytest.raises(zjax.ScheduleError, match="never reduce-scattered after its last backward"):
    zjax.Schedule.from_json(edited(schedule, drop_rs))

  def double(d):
    i = first(d["forward"], "gather")
    d["forward"].insert(i, dict(d["forward"][i]))

  with pytest.raises(zjax.ScheduleError, match="already gathered"):
    zjax.Schedule.from_json(edited(schedule, double))


def test_unknown_op_and_out_of_order_compute(schedule):
  with pytest.raises(zjax.ScheduleError, match="unknown op 'eval'"):
    zjax.Schedule.from_json(edited(schedule, lambda d: d["forward"][0].update(op="eval")))

  def reorder(d):
    computes = [i for i, s in enumerate(d["forward"]) if s["op"] == "compute"]
    a, b = computes[0], computes[1]
    d["forward"][a], d["forward"][b] = d["forward"][b], d["forward"][a]

  with pytest.raises(zjax.ScheduleError, match="segments run in program order"):
    zjax.Schedule.from_json(edited(schedule, reorder))


def test_legal_hand_edit_is_accepted(schedule):
  """Moving a gather one step earlier (a manual prefetch) is legal and changes the report."""

  def prefetch_more(d):
    fwd = d["forward"]
    i = first(fwd, "gather", 2)
    step = fwd.pop(i)
    step["prefetch"] = True
    fwd.insert(i - 1, step)

  s = zjax.Schedule.from_json(edited(schedule, prefetch_more))
  assert s.report()["prefetch_count"] >= schedule.report()["prefetch_count"]


def test_verify_accepts_the_model_and_rejects_others(schedule):
  loss, params, batch = model()
  schedule.verify(loss, params, batch)
  with pytest.raises(
    zjax.ScheduleMismatchError, match=r"\['layer0'\]\['bias'\] differs.*shape \[72\]"
  ):
    schedule.verify(*model(width=D + 8)[:2], jax.ShapeDtypeStruct((8, D + 8), jnp.float32))
  with pytest.raises(zjax.ScheduleMismatchError, match="lacks"):
    schedule.verify(*model(num_layers=2))
  with pytest.raises(zjax.ScheduleMismatchError, match="not in the schedule"):
    schedule.verify(*model(num_layers=4))

  def other_activation(p, x):
    for i in range(3):
      x = jax.nn.relu(x @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"])
    return x.mean()

  with pytest.raises(zjax.ScheduleMismatchError):
    schedule.verify(other_activation, params, batch)


def test_fingerprint_depends_on_model_not_on_knobs():
  a = zjax.compile_schedule(*model(), num_devices=8, config=CONFIG)
  b = zjax.compile_schedule(*model(), num_devices=4, config=zjax.ZeroConfig())
  c = zjax.compile_schedule(*model(num_layers=4), num_devices=8, config=CONFIG)
  assert a.fingerprint == b.fingerprint != c.fingerprint


def test_files_from_before_gradient_reduction_and_platform_still_load():
  """Older files lack `platform` and `gradient_reduction`; they reduce-scattered once per
  forward gather, which is what loading them assumes."""
  params = {
    "emb": jax.ShapeDtypeStruct((D, D), jnp.float32),
    "mid": jax.ShapeDtypeStruct((D, D), jnp.float32),
  }
  loss = lambda p, x: (jnp.tanh(x @ p["emb"]) @ p["mid"] @ p["emb"].T).mean()
  config = zjax.ZeroConfig(
    param_persistence_threshold=0, max_reuse_distance=0, gradient_reduction="per_gather"
  )
  new = zjax.compile_schedule(
    loss, params, jax.ShapeDtypeStruct((8, D), jnp.float32), num_devices=8, config=config
  )
  assert sum(st.op == "reduce_scatter" for st in new.backward) == 3  # emb twice, mid once

  def old_format(data):
    del data["platform"], data["replica_sizes"], data["config"]["replicate_axes"]
    del data["shard_sizes"], data["config"]["shard_axes"], data["config"]["secondary_partition"]
    data["config"]["axis_name"] = "fsdp"
    for step in data["forward"] + data["backward"]:  # no axes named before meshes had two
      step.pop("axes", None), step.pop("mean_over", None)
    del data["config"]["gradient_reduction"], data["config"]["fold_rng_keys"]

  old = zjax.Schedule.from_json(edited(new, old_format))
  assert old.config.gradient_reduction == "per_gather" and old.platform == ""
  assert old.report()["reduce_scatter_count"] == 3


def test_quantized_steps_in_the_file_follow_the_config():
  """qwZ / qgZ steps name their format in the file and the table; an edited format is
  refused (the config decides it, as it decides a step's axes)."""
  config = zjax.ZeroConfig(
    param_persistence_threshold=D,
    gather_quantization="int8",
    reduce_quantization="int4",
    quantization_block=128,
  )
  quantized = zjax.compile_schedule(*model(), num_devices=8, config=config)
  data = json.loads(quantized.to_json())
  flat = lambda steps: [b for st in steps for b in st.get("body", [st])]  # noqa: E731
  gather = next(st for st in flat(data["forward"]) if st["op"] == "gather")
  assert gather["quantized"] == {
    "dtype": "int8",
    "block": 128,
    "scale_dtype": "float32",
    "rounding": "nearest",
    "collective": "all_gather",
  }
  reduce = next(st for st in flat(data["backward"]) if st["op"] == "reduce_scatter")
  assert reduce["quantized"]["rounding"] == "stochastic"
  assert reduce["quantized"]["collective"] == "all_to_all"
  assert zjax.Schedule.from_json(quantized.to_json()) == quantized
  table = str(quantized)
  assert re.search(r"gather[^\n]* int8", table) and "reduce (all-to-all) int4" in table

  def edit(data):
    next(st for st in flat(data["forward"]) if st["op"] == "gather")["quantized"]["block"] = 64

  with pytest.raises(zjax.ScheduleError, match="is quantized as .* under this config"):
    zjax.Schedule.from_json(edited(quantized, edit))
  report = quantized.report()
  assert report["all_to_all_count"] == 3 and report["reduce_scatter_count"] == 0  # 3 layers
  assert report["quantization"]["reduce"]["dtype"] == "int4"


# ---- version 2: whole-layer loop bodies -----------------------------------------------------

V2_FILES = pathlib.Path(__file__).parent / "data" / "schedules_v2"


def _v2_cases() -> dict:
  """Each file under tests/data/schedules_v2 and how it was made (by zjax at d847ee1, format
  version 2, whose whole-layer loop bodies compute their segment without parts)."""
  from test_loops import scan_stack, scans_with_integer_leaves

  hpz = dict(replicate_axes=("data",), secondary_partition=True)
  mesh_2x4 = lambda: jax.make_mesh((2, 4), ("data", "fsdp"))  # noqa: E731
  config = zjax.ZeroConfig
  return {
    "scan_prefetch.json": lambda: zjax.compile_schedule(
      *scan_stack(), num_devices=8, config=config(param_persistence_threshold=100)
    ),
    "scan_unread.json": lambda: zjax.compile_schedule(
      *scans_with_integer_leaves(), num_devices=8, config=config(param_persistence_threshold=0)
    ),
    "scan_hpz.json": lambda: zjax.compile_schedule(
      *scan_stack(), mesh=mesh_2x4(), config=config(param_persistence_threshold=100, **hpz)
    ),
    "rolled_no_prefetch.json": lambda: zjax.compile_schedule(
      *model(4),
      num_devices=4,
      config=config(param_persistence_threshold=D, prefetch_bucket_size=0),
    ),
    "rolled_hpz.json": lambda: zjax.compile_schedule(
      *model(4), mesh=mesh_2x4(), config=config(param_persistence_threshold=D, **hpz)
    ),
  }


@pytest.mark.parametrize("name", sorted(p.name for p in V2_FILES.glob("*.json")))
def test_version_2_loops_load_as_the_one_part_bodies_planned_now(name):
  """A version-2 whole-layer loop body (gathers, compute, reduce-scatters, releases; its
  gathers prefetching the next layer or none) reads as the one-part body this version
  plans: the same schedule as planning the model now, the same report. The files cover
  scans and rolled layers, with and without prefetch, hpZ, and a bucket backward leaves
  out (an integer leaf it does not read)."""
  text = (V2_FILES / name).read_text()
  assert json.loads(text)["version"] == 2
  old = zjax.Schedule.from_json(text, source=name)
  now = _v2_cases()[name]()
  assert old == now and old.report() == now.report()
  loops = [st for st in old.forward + old.backward if st.op == "loop"]
  assert loops and all(not st.parts for st in loops)
  bodies = [[(x.op, x.part) for x in st.body if x.part is not None] for st in loops]
  assert bodies[: len(bodies) // 2] == [[("compute", 0)]] * (len(bodies) // 2)
  assert bodies[len(bodies) // 2 :] == [[("recompute", 0), ("compute", 0)]] * (len(bodies) // 2)


def test_a_version_2_scan_runs_as_planned_now():
  """The loaded version-2 scan runs: gradients equal plain JAX's (fp32, rtol 1e-5)."""
  from test_loops import scan_stack

  loss, params, batch = scan_stack()
  old = zjax.Schedule.load(V2_FILES / "scan_prefetch.json")
  mesh = jax.make_mesh((8,), ("fsdp",))
  value, grads = zjax.value_and_grad(loss, old, mesh=mesh)(zjax.shard(params, old, mesh), batch)
  want_value, want = jax.value_and_grad(loss)(params, batch)
  got = zjax.unshard(grads, old)
  assert jnp.allclose(value, want_value, rtol=1e-5)
  for path, g in jax.tree_util.tree_leaves_with_path(want):
    np.testing.assert_allclose(
      np.asarray(_at(got, path)), np.asarray(g), rtol=1e-5, atol=1e-6, err_msg=str(path)
    )


def _at(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def test_ahead_gathers_are_checked():
  """A gather issued one iteration ahead must open its bucket's use in the body, before any
  compute, and only loop bodies have them; the next layer counts against the cap."""
  s = _v2_cases()["scan_prefetch.json"]()
  loop_at = next(i for i, st in enumerate(s.forward) if st.op == "loop")

  def late(data):
    body = data["forward"][loop_at]["body"]
    body.insert(len(body), body.pop(0))  # the first gather after the compute

  with pytest.raises(zjax.ScheduleError, match="must be its bucket's first gather"):
    zjax.Schedule.from_json(edited(s, late))

  def outside(data):
    data["forward"][0]["ahead"] = True

  with pytest.raises(zjax.ScheduleError, match="only a gather in a loop body"):
    zjax.Schedule.from_json(edited(s, outside))
  layer = s.report()["peak_live_param_bytes"] // 4  # two layers live: the cap fits one
  capped = dataclasses.replace(s.config, max_live_parameters=layer * 3 // 4)
  with pytest.raises(zjax.ScheduleError, match="gathering the next layer ahead"):
    zjax.Schedule.from_json(edited(s, lambda d: d["config"].update(capped.to_dict())))
