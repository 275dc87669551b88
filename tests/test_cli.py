"""`zjax inspect`: output, files, and clear errors for bad targets."""

import argparse
import json
import pathlib
import re
import shutil
import subprocess

import pytest

import zjax
from zjax.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples/gpt.py") + ":inspect_gpt"


def run(capsys, *argv):
  code = main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


def test_inspect_prints_tables_and_report(capsys):
  code, out, _ = run(capsys, "inspect", GPT, "--devices", "8")
  assert code == 0
  assert "['params']['embed']['embedding']" in out and "reused x2" in out  # use table
  assert "zjax schedule v3: 8 device(s)" in out and "reduce_scatter" in out  # schedule
  assert "all_gather_count" in out and "trace + plan:" in out  # report


def test_inspect_plans_for_more_devices_than_present(capsys, tmp_path):
  report_file = tmp_path / "r.json"
  code, out, _ = run(
    capsys, "inspect", GPT, "--devices", "1024", "--summary", "--json", str(report_file)
  )
  assert code == 0 and "zjax schedule" not in out
  data = json.loads(report_file.read_text())
  assert data["report"]["num_devices"] == 1024 and data["schedule"]["num_devices"] == 1024
  assert zjax.Schedule.from_json(json.dumps(data["schedule"])).report() == data["report"]


def test_inspect_save_and_knob_overrides(capsys, tmp_path):
  path = tmp_path / "s.json"
  code, _, _ = run(
    capsys,
    "inspect",
    GPT,
    "--devices",
    "8",
    "--summary",
    "--save",
    str(path),
    "--prefetch-bucket-size",
    "0",
    "--param-persistence-threshold",
    "1e9",
  )
  assert code == 0
  s = zjax.Schedule.load(path)
  assert s.config.prefetch_bucket_size == 0 and s.report()["all_gather_count"] == 0


def test_inspect_predicts_offload(capsys, tmp_path):
  """--offload-optimizer / --offload-params: the device and host bytes per device and the
  update stream, as the trainer's offload_plan predicts them."""
  from zjax._src.execute import offload_stream
  from zjax._src.schedule.render import format_bytes
  from zjax._src.train.train import plan_sub_groups

  args = ("inspect", GPT, "--devices", "8", "--summary", "--sub-group-size", "20000", "--save")
  for flag, on_host in (("--offload-optimizer", False), ("--offload-params", True)):
    path = str(tmp_path / f"offload-{on_host}.json")
    code, out, _ = run(capsys, *args, path, flag)
    assert code == 0
    schedule = zjax.Schedule.load(path)
    plan = offload_stream.predicted(schedule, plan_sub_groups(schedule), params_on_host=on_host)
    assert plan["sub_groups"] > 1 and f"update: {plan['sub_groups']} sub-groups" in out
    assert format_bytes(plan["host_bytes"]) in out
    if on_host:
      assert "parameter and optimizer offload" in out and "nothing between steps" in out
      assert f"({format_bytes(plan['param_transfer_bytes'])} from the host per step)" in out
    else:
      assert f"parameter copies (compute dtype)  {format_bytes(plan['device_bytes'])}" in out


@pytest.mark.parametrize(
  "target,message",
  [
    ("examples/missing.py:f", "does not exist"),
    ("examples/gpt.py:no_such_function", "has no function 'no_such_function'"),
    ("examples/gpt.py:GPTConfig", "must return (loss_fn, params, batch)"),
    ("examples/gpt.py", "must look like PATH.py:FUNCTION"),
    ("no_such_module_zz:f", "Cannot import module 'no_such_module_zz'"),
  ],
)
def test_bad_targets_fail_clearly(capsys, monkeypatch, target, message):
  monkeypatch.chdir(ROOT)
  code, _, err = run(capsys, "inspect", target)
  assert code == 2 and message in err


def test_wrong_return_items(capsys, tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text(
    "def notfn():\n  return (1, {}, {})\n"
    "def badcfg():\n  return (lambda p, b: 0.0, {}, {}, {'x': 1})\n"
  )
  code, _, err = run(capsys, "inspect", f"{bad}:notfn")
  assert code == 2 and "first item must be the loss function" in err
  code, _, err = run(capsys, "inspect", f"{bad}:badcfg")
  assert code == 2 and "fourth item must be a zjax.ZeroConfig" in err


def test_dtype_overrides(capsys, tmp_path):
  path = tmp_path / "s.json"
  code, _, _ = run(
    capsys,
    "inspect",
    GPT,
    "--devices",
    "8",
    "--summary",
    "--save",
    str(path),
    "--compute-dtype",
    "bfloat16",
    "--reduce-dtype",
    "bfloat16",
  )
  s = zjax.Schedule.load(path)
  assert code == 0 and s.config.compute_dtype.name == s.config.reduce_dtype.name == "bfloat16"


def test_bad_knob_value(capsys):
  code, _, err = run(capsys, "inspect", GPT, "--max-live-parameters", "0")
  assert code == 2 and "max_live_parameters must be > 0" in err


@pytest.mark.slow
def test_console_script_is_installed():
  exe = shutil.which("zjax")
  assert exe, "the zjax console script is not on PATH: install the package (pip install -e .)"
  done = subprocess.run(
    [exe, "inspect", GPT, "--devices", "16", "--summary"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr
  assert re.search(r"num_devices\s+16\n", done.stdout)


def test_every_option_of_every_command_has_help():
  from zjax.cli.main import build_parser

  parser = build_parser()
  (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
  for name, sub in subparsers.choices.items():
    for action in sub._actions:
      if not isinstance(action, argparse._HelpAction):
        assert action.help, (name, action.option_strings or action.dest)
