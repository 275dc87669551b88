"""`zjax bench --suite gpu`: its --tiny mode end to end (what CI runs; the GPU run is
documented in docs/results.md), its time limits, and the HLO analysis it relies on, on text
shaped as a GPU's compiled program (async start/done pairs, wrapped reduce-scatters, nested
loops) and as jaxlib 0.11's (mesh-axes replica groups)."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from zjax import hlo
from zjax.bench import gpu_suite

# A scheduled GPU-style module: a while loop (3 trips) whose body prefetches with an async
# all-gather around a fusion, reduces with an async reduce-scatter wrapped in a computation,
# and runs a nested loop (2 trips) with an async all-reduce and a collective-permute.
GPU_TEXT = textwrap.dedent("""\
    HloModule jit_step, is_scheduled=true

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %sum = f32[] add(f32[] %a, f32[] %b)
    }

    %fused_computation (p: f32[64]) -> f32[64] {
      %p = f32[64]{0} parameter(0)
      ROOT %neg = f32[64]{0} negate(f32[64]{0} %p)
    }

    %rs_wrapped (w: f32[1024]) -> f32[128] {
      %w = f32[1024]{0} parameter(0)
      ROOT %rs = f32[128]{0} reduce-scatter(f32[1024]{0} %w), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
    }

    %inner_body (q: (s32[], f32[256])) -> (s32[], f32[256]) {
      %q = (s32[], f32[256]{0}) parameter(0)
      %v = f32[256]{0} get-tuple-element((s32[], f32[256]{0}) %q), index=1
      %ars = f32[256]{0} all-reduce-start(f32[256]{0} %v), replica_groups=mesh['fsdp'=4,'tensor'=2] {'tensor'}, to_apply=%add
      %ard = f32[256]{0} all-reduce-done(f32[256]{0} %ars)
      %cps = (f32[32]{0}, f32[32]{0}, u32[], u32[]) collective-permute-start(f32[32]{0} %c), source_target_pairs={{0,1},{1,0}}
      %cpd = f32[32]{0} collective-permute-done((f32[32]{0}, f32[32]{0}, u32[], u32[]) %cps)
      ROOT %t = (s32[], f32[256]{0}) tuple(s32[] %i, f32[256]{0} %ard)
    }

    %inner_cond (q: (s32[], f32[256])) -> pred[] {
      ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
    }

    %body (param: (s32[], f32[128])) -> (s32[], f32[128]) {
      %param = (s32[], f32[128]{0}) parameter(0)
      %gte = f32[128]{0} get-tuple-element((s32[], f32[128]{0}) %param), index=1
      %ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(f32[128]{0} %gte), replica_groups=[1,8]<=[8], dimensions={0}
      %fusion = f32[64]{0} fusion(f32[64]{0} %x), kind=kLoop, calls=%fused_computation
      %agd = f32[1024]{0} all-gather-done((f32[128]{0}, f32[1024]{0}) %ags)
      %barrier = (f32[1024]{0}) opt-barrier((f32[1024]{0}) %tup), metadata={op_name="jit(step)/optimization_barrier"}
      %rss = ((f32[1024]{0}), f32[128]{0}) reduce-scatter-start(f32[1024]{0} %agd), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add, calls=%rs_wrapped
      %rsd = f32[128]{0} reduce-scatter-done(((f32[1024]{0}), f32[128]{0}) %rss)
      %inner = (s32[], f32[256]{0}) while((s32[], f32[256]{0}) %init2), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"2"}}
      ROOT %out = (s32[], f32[128]{0}) tuple(s32[] %j, f32[128]{0} %rsd)
    }

    %cond (param: (s32[], f32[128])) -> pred[] {
      ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
    }

    ENTRY %main (p0: f32[128]) -> f32[1024] {
      %p0 = f32[128]{0} parameter(0)
      %while = (s32[], f32[128]{0}) while((s32[], f32[128]{0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
      ROOT %ag = f32[1024]{0} all-gather(f32[128]{0} %p0), replica_groups=mesh['fsdp'=8] {'fsdp'}, dimensions={0}
    }
    """)


def test_gpu_text_collectives_counted_once_per_run_of_their_computation():
  found = {(c.kind, c.computation): c for c in hlo.collectives(GPU_TEXT)}
  # the reduce-scatter inside the async wrapper counts at its start, not twice
  assert sorted(found) == [
    ("all_gather", "body"),
    ("all_gather", "main"),
    ("all_reduce", "inner_body"),
    ("collective_permute", "inner_body"),
    ("reduce_scatter", "body"),
  ]
  assert found[("all_gather", "body")].bytes == 4096  # the start's output, not its operand
  assert found[("reduce_scatter", "body")].bytes == 128 * 4 * 8
  assert found[("collective_permute", "inner_body")].bytes == 128  # not the u32 contexts
  assert found[("all_reduce", "inner_body")].bytes == 1024
  times = hlo.multiplicities(GPU_TEXT)
  assert (times["main"], times["body"], times["inner_body"]) == (1, 3, 6)
  assert times["fused_computation"] == 3
  executed = hlo.executed(GPU_TEXT)
  assert executed["all_gather_count"] == 4 and executed["all_gather_bytes"] == 4 * 4096
  assert executed["reduce_scatter_count"] == 3
  assert executed["all_reduce_count"] == 6  # nested: 2 per outer iteration


def test_gpu_text_overlap_and_barriers():
  pairs = {a.kind: a for a in hlo.async_collectives(GPU_TEXT)}
  assert set(pairs) == {"all_gather", "reduce_scatter", "all_reduce", "collective_permute"}
  assert pairs["all_gather"].compute_between == 1  # the fusion between start and done
  assert pairs["reduce_scatter"].compute_between == 0
  assert pairs["all_reduce"].computation == "inner_body"
  assert hlo.barrier_count(GPU_TEXT) == 1  # the op, not its name or metadata
  assert hlo.barrier_count("%0 = stablehlo.optimization_barrier %a, %b : tensor<4xf32>") == 1


@pytest.mark.parametrize(
  "groups, expected",
  [
    ("mesh['fsdp'=4,'tensor'=2] {'fsdp'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("mesh['fsdp'=4,'tensor'=2] {'tensor'}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['replica'=2,'fsdp'=4] {'replica','fsdp'}", (tuple(range(8)),)),
    ("mesh['fsdp'=8] {'fsdp':(1)4}", ((0, 2, 4, 6), (1, 3, 5, 7))),  # sub-axis: major 4
    ("mesh['fsdp'=8] {'fsdp':(2)4}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=2,'b'=4] {'a'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=2,'b'=4]<=[4,2]T(1,0) {'a'}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("{{0,2},{1,3}}", ((0, 2), (1, 3))),
  ],
)
def test_replica_group_forms(groups, expected):
  assert (
    hlo.replica_groups(f"x = f32[8] all-gather(y), replica_groups={groups}, dimensions={{0}}")
    == expected
  )


def test_mesh_axes_groups_name_their_axes():
  line = "x = f32[4,8] all-gather(y), replica_groups=mesh['fsdp'=4,'tensor'=2] {'fsdp'}"
  assert hlo.axes_of_groups(hlo.replica_groups(line), {"fsdp": 4, "tensor": 2}) == "fsdp"
  rs = "  x = f32[2,8] reduce-scatter(y), replica_groups=mesh['fsdp'=8] {'fsdp'}, dimensions={0}"
  assert hlo.collectives(rs)[0].bytes == 2 * 8 * 4 * 8  # output x group size


def test_gpu_programs_leave_combining_to_the_schedule():
  """On GPUs zjax's programs (run and analysed) compile with XLA's collective combiners off;
  CPU programs are unchanged; this jaxlib knows the option names."""
  import jax
  import jax.numpy as jnp

  from zjax._src.xla import xla_options

  assert xla_options.execution_options("gpu") == xla_options.GPU_OPTIONS
  assert xla_options.analysis_options("cuda") == xla_options.GPU_OPTIONS
  assert set(xla_options.GPU_OPTIONS) == {
    f"xla_gpu_{kind}_combine_threshold_bytes"
    for kind in ("all_gather", "reduce_scatter", "all_reduce")
  }
  assert xla_options.execution_options("cpu") == {}
  assert "xla_gpu_all_gather_combine_threshold_bytes" not in xla_options.analysis_options("cpu")
  program = jax.jit(lambda x: x + 1, compiler_options=xla_options.GPU_OPTIONS)
  assert float(program.lower(jnp.ones(())).compile()(jnp.ones(()))) == 2.0


def test_schedule_check_is_skipped_under_a_mock_topology():
  """One process stands for all under a mock topology and its collectives move no data: the
  processes' schedules cannot be compared there (on an H200 the comparison read garbage)."""
  import jax

  from zjax import distributed

  assert not distributed._mocked_processes()
  jax.config.update("jax_mock_gpu_topology", "1x8x1")  # (read only when a GPU client starts)
  try:
    assert distributed._mocked_processes()
  finally:
    jax.config.update("jax_mock_gpu_topology", "")
  assert not distributed._mocked_processes()


def test_collective_permute_groups_come_from_its_pairs():
  """A collective-permute has source-target pairs, not replica groups: its axes are those the
  pairs connect (it was labelled as spanning every axis)."""
  ring = (
    "  %cp = f32[4]{0} collective-permute(f32[4]{0} %x), source_target_pairs={{0,2},{2,4},"
    "{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}"
  )
  groups = hlo.replica_groups(ring)
  assert groups == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert hlo.axes_of_groups(groups, {"fsdp": 4, "tensor": 2}) == "fsdp"
  swap = "  %cp = f32[4]{0} collective-permute(f32[4]{0} %x), source_target_pairs={{0,1},{1,0}}"
  assert hlo.axes_of_groups(hlo.replica_groups(swap), {"fsdp": 4, "tensor": 2}) == "tensor (part)"


def _run(args, **kwargs):
  return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, **kwargs)


@pytest.mark.slow
def test_tiny_suite_end_to_end(tmp_path):
  """The command a GPU machine runs, in tiny mode: every part that can run on CPU devices
  runs and writes its figures; the GPU-only ones say why they were skipped."""
  out = tmp_path / "gpu"
  done = _run(
    ["zjax.cli.main", "bench", "--suite", "gpu", "--tiny", "--out", str(out)], timeout=900
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  results = json.loads((out / "gpu.json").read_text())
  assert results["tiny"] and results["machine"]["platform"] == "cpu"
  assert results["machine"]["jax"]  # every figure labelled with the versions
  parts = results["parts"]
  for name in ("mock_run", "offload_budget"):
    assert parts[name]["status"] == "skipped" and "GPU" in parts[name]["reason"]
  for name in ("compile", "single_zjax", "single_plain", "offload_optimizer", "offload_params"):
    assert parts[name]["status"] == "ok", (name, parts[name])
    assert all(v["status"] == "ok" for v in parts[name]["items"].values()), parts[name]
  compiled = parts["compile"]["items"]
  zjax_rows = {k: v for k, v in compiled.items() if "gspmd" not in k}
  assert len(zjax_rows) == 11 and len(compiled) == 13
  for name, row in zjax_rows.items():  # the report equals the analysed program
    assert row["report_equal"], (name, row["all_gather"], row["reduce_scatter"])
    assert row["all_gather"]["program_count"] > 0 and row["barriers_compiled"] > 0
    assert (out / "hlo" / f"{name}_program.txt.gz").exists()
  tp = compiled["llama_rolled_default_tp"]["bytes_by_axis"]
  assert "fsdp" in tp["all_gather"] and "fsdp" in tp["reduce_scatter"]
  single = {
    name: next(iter(parts[name]["items"].values()))
    for name in ("single_zjax", "single_plain", "offload_optimizer", "offload_params")
  }
  for row in single.values():
    assert np.isfinite(row["losses"]).all() and row["losses"][-1] < row["losses"][0]
    assert row["step_seconds"] > 0 and "mfu" not in row  # no MFU without a GPU's peak
    assert "peak_device_bytes_skipped" in row
  # the same model and data: zjax's first loss is the plain program's (bf16 compute both),
  # and offloaded training is bitwise training on the device
  np.testing.assert_allclose(
    single["single_zjax"]["losses"][0], single["single_plain"]["losses"][0], rtol=5e-3
  )
  for name in ("offload_optimizer", "offload_params"):
    assert single[name]["losses"] == single["single_zjax"]["losses"]
    assert single[name]["predicted_peak_device_bytes"] > 0
  text = (out / "gpu.md").read_text()
  for heading in ("## Part 1", "## Part 2", "## Part 3"):
    assert heading in text
  assert "**no**" not in text and "## Errors" not in text


@pytest.mark.slow
def test_a_part_stopped_at_its_limit_keeps_what_it_recorded(tmp_path):
  """A part that outlives its limit is stopped; the items it finished stay in the results."""
  module = tmp_path / "slow_part.py"
  module.write_text(
    textwrap.dedent("""\
      import sys, time
      from zjax.bench import gpu_record
      record = gpu_record.PartRecord(sys.argv[sys.argv.index("--out") + 1], "slow")
      record.run_item("first", lambda: {"value": 1})
      record.run_item("broken", lambda: 1 / 0)
      time.sleep(120)
      record.run_item("never", lambda: {})
      """)
  )
  out = str(tmp_path / "out")
  os.makedirs(os.path.join(out, "logs"))
  env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
  record = gpu_suite._run_part(
    out, ("slow", "slow_part", [], 0, False), tiny=False, limit=8, log=lambda _: None, env=env
  )
  assert record["status"] == "incomplete" and "time limit" in record["ended"]
  assert record["items"]["first"] == {
    "status": "ok",
    "value": 1,
    "seconds": record["items"]["first"]["seconds"],
  }
  assert record["items"]["broken"]["status"] == "error"
  assert "ZeroDivisionError" in record["items"]["broken"]["error"]
  assert "never" not in record["items"]


@pytest.mark.slow
def test_compile_part_skips_items_past_its_deadline(tmp_path):
  done = _run(
    ["zjax.bench.gpu_compile", "--out", str(tmp_path), "--tiny", "--deadline", "0"], timeout=300
  )
  assert done.returncode == 0, done.stderr[-2000:]
  record = json.loads((tmp_path / "parts" / "compile.json").read_text())
  assert record["done"] and record["items"]
  assert all(
    v == {"status": "skipped", "reason": "the part's time limit"} for v in record["items"].values()
  )


@pytest.mark.slow
def test_bad_arguments_name_the_flag(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("")
  done = _run(["zjax.cli.main", "bench", "--suite", "gpu", "--out", str(a_file)], timeout=120)
  assert done.returncode == 2 and "--out" in done.stderr and "not a directory" in done.stderr
  done = _run(
    ["zjax.cli.main", "bench", "--suite", "gpu", "--time-scale", "0", "--out", str(tmp_path / "d")],
    timeout=120,
  )
  assert done.returncode == 2 and "--time-scale" in done.stderr
