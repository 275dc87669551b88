"""`zjax bench` at tiny size: structure only (never speed), in a subprocess."""

import json
import subprocess
import sys

import pytest

import zjax


@pytest.mark.slow
def test_bench_runs_and_writes_json_and_plots(tmp_path):
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "zjax.cli.main",
      "bench",
      "--layers",
      "1",
      "--d-model",
      "32",
      "--batch",
      "8",
      "--devices",
      "4",
      "--rounds",
      "1",
      "--steps-per-round",
      "1",
      "--scale-devices",
      "1",
      "4",
      "--scale-layers",
      "1",
      "2",
      "--json",
      str(tmp_path / "bench.json"),
      "--plots",
      str(tmp_path),
    ],
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((tmp_path / "bench.json").read_text())
  methods = [r["method"] for r in results["compare"]]
  assert methods == [
    "zjax_rolled",
    "zjax_unrolled",
    "zjax_qwz",
    "zjax_qgz",
    "zjax_qwz_qgz",
    "zjax_scanned",
    "gspmd_fsdp",
    "data_parallel",
    "zjax_hsdp",
    "zjax_hpz",
    "gspmd_hsdp",
    "zjax_tp",
    "gspmd_2d",
  ]
  rows = {r["method"]: r for r in results["compare"]}
  for name in (
    "zjax_rolled",
    "zjax_unrolled",
    "zjax_qwz",
    "zjax_qgz",
    "zjax_qwz_qgz",
    "zjax_scanned",
    "zjax_hsdp",
    "zjax_hpz",
  ):
    r = rows[name]
    assert (r["all_gather_bytes"], r["reduce_scatter_bytes"], r["all_to_all_bytes"]) == (
      r["predicted_all_gather_bytes"],
      r["predicted_reduce_scatter_bytes"],
      r["predicted_all_to_all_bytes"],
    )
  # ZeRO-3 x TP on 2 x 2: the fsdp-axis gathers and reduce-scatters are the schedule's;
  # GSPMD's tensor-axis collectives appear in both TP rows
  tp = rows["zjax_tp"]
  assert tp["bytes_by_axis"]["all_gather"]["fsdp"] == tp["predicted_all_gather_bytes"]
  assert tp["bytes_by_axis"]["reduce_scatter"]["fsdp"] == tp["predicted_reduce_scatter_bytes"]
  for name in ("zjax_tp", "gspmd_2d"):
    assert zjax.hlo.bytes_over(rows[name]["bytes_by_axis"], "tensor") > 0
  assert "ZeRO-3 x tensor parallelism: 2 x 2" in done.stdout
  # tiny model: most leaves replicated, chunks below a block; still well under the fp32 wire
  assert rows["zjax_qwz_qgz"]["comm_vs_3psi"] < 0.75 * rows["zjax_rolled"]["comm_vs_3psi"]
  assert rows["data_parallel"]["all_gather_count"] == 0
  for r in results["compare"]:
    assert r["step_seconds_min"] <= r["step_seconds_median"] <= r["step_seconds_max"]
    assert r["state_bytes"] > 0 and r["flops"] > 0
    assert r["compile_seconds"] > 0 and r["setup_seconds"] > 0  # measured apart
  assert {(r["devices"], r["method"]) for r in results["devices"]} == {
    (n, m) for n in (1, 4) for m in ("zjax_rolled", "gspmd_fsdp", "data_parallel")
  }
  # the sweeps' points at the compared model and mesh (4 devices, 1 layer) are its rows
  for sweep, at in (("devices", {"devices": 4}), ("depth", {"layers": 1})):
    for r in results[sweep]:
      if all(r[k] == v for k, v in at.items()):
        assert all(r[k] == rows[r["method"]][k] for k in r if k not in at), (sweep, r)
  assert {(r["layers"], r["method"]) for r in results["depth"]} == {
    (n, m) for n in (1, 2) for m in ("zjax_rolled", "zjax_unrolled", "zjax_scanned", "gspmd_fsdp")
  }
  assert all(r["compile_seconds"] > 0 for r in results["depth"])
  assert sorted(p.name for p in tmp_path.glob("*.png")) == [
    "memory_vs_depth.png",
    "memory_vs_devices.png",
    "step_time.png",
  ]
  assert "time / gspmd" in done.stdout
  # XLA's partitioner warnings (GSPMD baselines) are counted, not shown; tables fit 80 columns
  assert "Involuntary full rematerialization" not in done.stdout + done.stderr
  assert max(len(line) for line in done.stdout.splitlines()) <= 80


def test_partitioner_warnings_are_counted_and_the_rest_passes(capfd):
  """What XLA's C++ logging writes to file descriptor 2 while a baseline compiles."""
  import os

  from zjax._src.xla.xla_warnings import Held, partitioner_warnings_held

  held = Held()
  with partitioner_warnings_held(held):
    os.write(
      2,
      b"W1202 spmd_partitioner.cc:652] Involuntary full rematerialization. The "
      b"compiler was not able to go from sharding {devices=[8]} to {replicated}\n",
    )
    os.write(2, b"something else\n")
    os.write(2, b"W1202 spmd_partitioner.cc:652] Involuntary full rematerialization. again\n")
  err = capfd.readouterr().err
  assert held.count == 2 and "Involuntary" not in err and "something else" in err
  assert "warned 2 times" in held.summary()


def test_bench_bad_input_exits_2(tmp_path):
  done = subprocess.run(
    [sys.executable, "-m", "zjax.cli.main", "bench", "--batch", "10", "--devices", "4"],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=tmp_path,
  )
  assert done.returncode == 2 and "not divisible" in done.stderr
  assert list(tmp_path.iterdir()) == []


def test_bench_sweeps_are_short_by_default_and_long_with_full():
  from zjax.cli import bench_cmd
  from zjax.cli.main import build_parser

  quick = build_parser().parse_args(["bench"])
  full = build_parser().parse_args(["bench", "--full", "--scale-devices", "8"])
  for args in (quick, full):
    bench_cmd.fill_sweep_defaults(args)
  assert (quick.scale_devices, quick.scale_layers) == ([2, 8], [4, 16])
  assert (full.scale_devices, full.scale_layers) == ([8], [4, 8, 16, 32, 64])
