"""The communication model: ring formulas and whole-step predictions against hand-computed
cases, analytic planning for meshes that do not exist, and `zjax inspect --mesh`."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import zjax
from zjax._src.plan import comm_model
from zjax._src.plan.comm_model import Link
from zjax.cli.main import main

# The data axis (across nodes) slow and far, the shard axis (inside a node) fast and near.
LINKS = {"data": Link(bandwidth=1e4, latency=0.5), "fsdp": Link(bandwidth=4e4, latency=0.1)}
CONFIG = zjax.ZeroConfig(
  param_persistence_threshold=0, max_reuse_distance=0, roll_layers=False
)  # steps of the unrolled planner


def test_ring_formulas_by_hand():
  link = Link(bandwidth=100.0, latency=1.0)
  # 800 bytes over 8 devices: 7 ring steps, each 1 s + 100 bytes at 100 B/s
  assert comm_model.collective_seconds("all_gather", 800, 8, link) == pytest.approx(14.0)
  assert comm_model.collective_seconds("reduce_scatter", 800, 8, link) == pytest.approx(14.0)
  assert comm_model.collective_seconds("all_reduce", 800, 8, link) == pytest.approx(28.0)
  assert comm_model.collective_seconds("all_gather", 800, 1, link) == 0.0


def three_kernels():
  """Three 64x64 fp32 kernels (16 KiB each): forward gathers all three; backward re-gathers
  only the second (the last one stays gathered across the turn, the first one's vjp needs
  the input, not the kernel)."""
  params = {f"w{i}": jax.ShapeDtypeStruct((64, 64), jnp.float32) for i in (1, 2, 3)}
  batch = jax.ShapeDtypeStruct((16, 64), jnp.float32)
  return lambda p, x: jnp.mean(x @ p["w1"] @ p["w2"] @ p["w3"]), params, batch


@pytest.mark.parametrize(
  "layout,expected",
  [
    # 4 all-gathers + 3 reduce-scatters of 16384 B over all 8 (paced by the data link):
    # 7 * 7 * (0.5 + 16384 / (8 * 1e4))
    ("flat ZeRO-3", 7 * 7 * (0.5 + 0.2048)),
    # the same 7 over fsdp (4 devices), then 3 all-reduces of 4096 B over data (2 devices)
    ("HSDP", 7 * 3 * (0.1 + 16384 / 16e4) + 3 * 2 * 1 * (0.5 + 4096 / 2e4)),
    # forward gathers and reduce-scatters over all 8, the one backward re-gather over fsdp
    ("hpZ", 6 * 7 * (0.5 + 0.2048) + 3 * (0.1 + 16384 / 16e4)),
  ],
)
def test_a_step_by_hand(layout, expected):
  loss, params, batch = three_kernels()
  config = comm_model.layouts(CONFIG, ("data", "fsdp"))[layout]
  schedule = zjax.compile_schedule(
    loss, params, batch, axis_sizes={"data": 2, "fsdp": 4}, config=config
  )
  report = schedule.report()
  assert (
    report["all_gather_count"],
    report["backward_all_gather_count"],
    report["reduce_scatter_count"],
  ) == (4, 1, 3)
  prediction = comm_model.predict(schedule, LINKS)
  assert prediction["seconds"] == pytest.approx(expected, rel=1e-12)
  assert sum(a["bytes"] for a in prediction["by_axis"].values()) == (
    report["all_gather_bytes"] + report["reduce_scatter_bytes"] + report["replica_all_reduce_bytes"]
  )


def test_layouts_side_by_side_for_a_cluster_that_is_not_here():
  """The 70B-class shapes on 128x8 (1024 devices), planned analytically: flat and hpZ store
  1/1024 per device, HSDP 1/8; hpZ moves the backward gathers inside the node; with a slow
  inter-node link HSDP is fastest; on a uniform network without latency hpZ is, and flat
  beats HSDP (per device HSDP moves B(1 + 1/S - 2/N), flat B(1 - 1/N))."""
  sys.path.insert(0, "examples")
  try:
    import llama70b_shapes as llama
  finally:
    sys.path.pop(0)
  loss, params, batch, config = llama.llama70b()
  sizes = {"replica": 128, "fsdp": 8}
  trace = zjax._src.program.trace.trace_for_schedule(loss, params, batch, config, sizes)
  rows = {r["layout"]: r for r in comm_model.compare(trace, config, sizes, platform="gpu")}
  flat, hsdp, hpz = rows["flat ZeRO-3"], rows["HSDP"], rows["hpZ"]
  assert flat["state_bytes_per_device"] == hpz["state_bytes_per_device"]
  assert hsdp["state_bytes_per_device"] == pytest.approx(
    128 * flat["state_bytes_per_device"], rel=1e-3
  )
  assert set(flat["by_axis"]) == {"replica+fsdp"}
  # the secondary holds what backward re-gathers: every layer (not the embedding, whose vjp
  # needs no table, nor the head, kept across the turn), in bf16, 1/S of it
  layer_elements = sum(x.size for x in jax.tree.leaves(params["layers"]))
  assert hpz["secondary_bytes"] == layer_elements * 2 // 8
  assert hpz["by_axis"]["fsdp"]["count"] == 80 + 0  # one re-gather per layer, inside the node
  assert min(rows.values(), key=lambda r: r["seconds"]) is hsdp
  fast = {"replica": Link(900e9, 0.0), "fsdp": Link(900e9, 0.0)}
  fast_rows = comm_model.compare(trace, config, sizes, links=fast, platform="gpu")
  uniform = {r["layout"]: r["seconds"] for r in fast_rows}
  assert uniform["hpZ"] < uniform["flat ZeRO-3"] < uniform["HSDP"]


def test_every_axis_needs_a_link_and_links_are_checked():
  loss, params, batch = three_kernels()
  schedule = zjax.compile_schedule(
    loss,
    params,
    batch,
    axis_sizes={"data": 2, "fsdp": 4},
    config=dataclasses.replace(CONFIG, replicate_axes=("data",)),
  )
  with pytest.raises(ValueError, match="No Link for mesh axis 'data'"):
    comm_model.predict(schedule, {"fsdp": LINKS["fsdp"]})
  with pytest.raises(ValueError, match="Link.bandwidth must be a positive number"):
    Link(bandwidth=0, latency=1e-6)
  with pytest.raises(ValueError, match="axis_sizes must give the size of exactly"):
    zjax.compile_schedule(loss, params, batch, axis_sizes={"data": 2, "fsdp": 4}, config=CONFIG)
  with pytest.raises(ValueError, match="pass axis_sizes= with every axis's size"):
    zjax.compile_schedule(
      loss,
      params,
      batch,
      num_devices=8,
      config=dataclasses.replace(CONFIG, shard_axes=("data", "fsdp")),
    )


def zjax_cli(capsys, *args):
  code = main(list(args))
  out = capsys.readouterr()
  return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_inspect_mesh_prints_the_three_layouts(capsys):
  out = zjax_cli(
    capsys,
    "inspect",
    "examples/llama70b_shapes.py:llama70b",
    "--mesh",
    "16x8",
    "--axes",
    "replica,fsdp",
    "--summary",
    "--layout",
    "hpz",
    "--link",
    "replica=25,20",
  )
  assert out.returncode == 0, out.stderr
  text = out.stdout
  assert "links: replica 25 GB/s 20 us, fsdp 900 GB/s 3 us" in text
  for name in ("flat ZeRO-3", "HSDP", "hpZ", "fastest: "):
    assert name in text
  assert "secondary_bytes" in text and "all_gather_bytes_by_axis" in text
  assert "replica+fsdp:" in text and "fsdp:" in text  # hpZ's report, both gather axes


@pytest.mark.parametrize(
  "args,message",
  [
    (["--mesh", "0x8"], "--mesh must be positive axis sizes"),
    (["--mesh", "16x8", "--axes", "replica"], "--axes must name each of the 2 mesh axes"),
    (["--mesh", "16x8", "--link", "node=1,2"], "--link 'node=1,2' must be AXIS=GBPS,US"),
    (["--mesh", "16x8", "--devices", "8"], "Pass --devices or --mesh, not both"),
    (["--axes", "a,b"], "--axes and --link go with --mesh"),
  ],
)
def test_inspect_mesh_bad_input(capsys, args, message):
  out = zjax_cli(capsys, "inspect", "examples/llama70b_shapes.py:llama70b", "--summary", *args)
  assert out.returncode != 0 and message in out.stderr, out.stderr


# ---- tensor parallelism: the Megatron-style estimate of the tensor axis -----------------
TP_FILE = """
import jax, jax.numpy as jnp, zjax
from jax.sharding import PartitionSpec as P

D, F, HEADS = 8, 16, 2


def loss_fn(p, x):
  b = x.shape[0]
  h = (x @ p["wqkv"]).reshape(b, HEADS, 3 * F // HEADS)  # heads split by a reshape
  h = jnp.tanh(h).reshape(b, 3 * F) @ p["wo"]  # row-parallel
  u = jax.nn.relu(h @ p["up_t"].T)  # column-parallel, stored transposed (F, D)
  return jnp.mean((u @ p["down"]) ** 2)  # row-parallel


def target():
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {"wqkv": s(D, 3 * F), "wo": s(3 * F, D), "up_t": s(F, D), "down": s(F, D)}
  rules = [("wqkv", P(None, "tensor")), ("up_t", P("tensor", None)),
           ("wo|down", P("tensor", None))]
  config = zjax.ZeroConfig(tensor_axes=("tensor",), param_persistence_threshold=0)
  return loss_fn, params, s(16, D), config, rules
"""


@pytest.fixture
def tp_target(tmp_path):
  path = tmp_path / "tp_target.py"
  path.write_text(TP_FILE)
  return f"{path}:target"


def test_megatron_estimate_by_hand(tp_target):
  from zjax.cli.target import load_target

  t = load_target(tp_target)
  sizes = {"fsdp": 4, "tensor": 2}
  schedule = zjax.compile_schedule(
    t.loss_fn, t.params, t.batch, axis_sizes=sizes, config=t.config, tensor_specs=t.tensor_specs
  )
  rows = 16 // 4  # the batch is split over the data axis only
  act = lambda width: rows * width * 4  # noqa: E731
  # wqkv: nothing (its input is the batch, with no gradient); wo: its output (forward);
  # up_t (transposed, split on its rows: columns of the matmul): the input's gradient
  # (backward); down: its output
  assert schedule.tensor_estimate == (
    ("all_reduce", "forward", act(8)),
    ("all_reduce", "backward", act(8)),
    ("all_reduce", "forward", act(8)),
  )
  assert zjax.Schedule.from_json(schedule.to_json()).tensor_estimate == schedule.tensor_estimate
  report = schedule.report()
  assert report["tensor_axis_estimated_count"] == 3
  assert report["tensor_axis_estimated_bytes"] == 3 * act(8)
  links = {"fsdp": LINKS["fsdp"], "tensor": Link(bandwidth=1e5, latency=0.01)}
  prediction = comm_model.predict(schedule, links)
  row = prediction["by_axis"]["tensor (estimate)"]
  assert row["count"] == 3 and row["bytes"] == 3 * act(8)
  # all-reduce over 2 devices: 2 (G-1) (alpha + B / (G beta))
  assert row["seconds"] == pytest.approx(3 * 2 * (0.01 + act(8) / (2 * 1e5)))
  assert prediction["seconds"] == pytest.approx(
    row["seconds"]
    + prediction["by_axis"]["fsdp"]["seconds"]
    + sum(
      r["seconds"]
      for k, r in prediction["by_axis"].items()
      if k not in ("fsdp", "tensor (estimate)")
    )
  )


def test_inspect_a_three_axis_mesh_with_a_tensor_axis(capsys, tp_target):
  out = zjax_cli(
    capsys, "inspect", tp_target, "--mesh", "2x2x2", "--axes", "replica,fsdp,tensor", "--summary"
  )
  assert out.returncode == 0, out.stderr
  text = out.stdout
  assert "tensor (estimate) bytes (time)" in text and "links:" in text and "tensor 900 GB/s" in text
  table = text.split("links:")[1]
  assert "flat ZeRO-3" in table and "HSDP" in table and "hpZ" in table
  assert (
    "tensor_axis_estimated_bytes" in text
    and "axis_sizes                        {'replica': 2, 'fsdp': 2}" in text
  )
  hpz = zjax_cli(
    capsys,
    "inspect",
    tp_target,
    "--mesh",
    "2x2x2",
    "--axes",
    "replica,fsdp,tensor",
    "--summary",
    "--layout",
    "hpz",
  )
  assert hpz.returncode == 0 and "secondary_bytes" in hpz.stdout, hpz.stderr


@pytest.mark.parametrize(
  "args,message",
  [
    ([], "has tensor axes ('tensor',): give every axis's size with --mesh"),
    (["--mesh", "2x4", "--axes", "replica,fsdp"], "lacks the tensor axis 'tensor'"),
    (["--mesh", "8", "--axes", "tensor"], "names only tensor axes"),
  ],
)
def test_inspect_tensor_parallel_bad_input(capsys, tp_target, args, message):
  out = zjax_cli(capsys, "inspect", tp_target, "--summary", *args)
  assert out.returncode != 0 and message in out.stderr, out.stderr
