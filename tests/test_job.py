"""`zjax train` end to end (subprocesses, tiny settings), its bad-input handling, and the
example scripts that show the library API (run so that they never rot)."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = [
  "--d-model",
  "32",
  "--n-layer",
  "1",
  "--n-head",
  "2",
  "--d-ff",
  "64",
  "--seq-len",
  "32",
  "--batch",
  "8",
  "--corpus-bytes",
  "300000",
  "--sample-bytes",
  "20",
  "--eval-batches",
  "1",
  "--eval-every",
  "4",
  "--checkpoint-every",
  "4",
  "--warmup-steps",
  "2",
]


def zjax_cli(*args, cwd=None):
  return subprocess.run(
    [sys.executable, "-m", "zjax.cli.main", *args],
    capture_output=True,
    text=True,
    timeout=900,
    cwd=cwd,
  )


def zjax_cli_here(argv, cwd, monkeypatch, capsys):
  """`zjax ARGV` run in this process from `cwd`, for input refused before any device is set
  up: (exit code, stdout, stderr)."""
  from zjax.cli.main import main

  monkeypatch.chdir(cwd)
  try:
    code = main(argv)
  except SystemExit as e:  # argparse's usage errors
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def example(name, *args, cwd=ROOT / "examples"):
  done = subprocess.run(
    [sys.executable, name, *args], capture_output=True, text=True, timeout=900, cwd=cwd
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


@pytest.mark.slow
def test_train_end_to_end_then_resume_on_other_devices_scanned(tmp_path):
  out = tmp_path / "run"
  first = zjax_cli(
    "train",
    *TINY,
    "--steps",
    "8",
    "--devices",
    "4",
    "--lr",
    "1e-2",
    "--scan",
    "--out-dir",
    str(out),
  )
  assert first.returncode == 0, first.stderr[-3000:]
  metrics = json.loads((out / "metrics.json").read_text())
  losses = [row["loss"] for row in metrics["train"]]
  assert len(losses) == 8 and losses[-1] < losses[0] - 0.5  # it learns
  assert [row["step"] for row in metrics["validation"]] == [4, 8]
  assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (out / "sample.txt").read_bytes().startswith(b"def ")
  summary = metrics["summary"]
  assert summary["steps"] == 8 and summary["tokens_per_second"] > 0
  assert summary["optimizer_steps"] == 8 and summary["skipped_steps"] == 0
  assert metrics["skipped"] == []
  assert summary["all_gather_bytes"] > 0 and summary["per_device_state_bytes"] > 0
  # what a GPU runs (the analysis) and what the CPU ran: at most the analysed gathers
  assert 0 < summary["cpu_executed_all_gather_count"] <= summary["all_gather_count"]
  assert "as a GPU orders the step" in first.stdout and "the CPU executed" in first.stdout
  assert "Plan" in first.stdout and "Summary" in first.stdout
  assert "state per device (params + adam moments)" in first.stdout
  assert max(len(line) for line in first.stdout.splitlines()) > 80  # piped: no 80-column wrap

  # a second run on 2 devices resumes from step 8's checkpoint
  second = zjax_cli(
    "train",
    *TINY,
    "--steps",
    "10",
    "--devices",
    "2",
    "--lr",
    "1e-2",
    "--scan",
    "--out-dir",
    str(out),
  )
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resumed from step 8" in second.stdout and "saved on 4 device(s), now 2" in second.stdout
  metrics = json.loads((out / "metrics.json").read_text())
  assert [row["step"] for row in metrics["train"]] == list(range(1, 11))
  assert metrics["train"][-1]["loss"] < losses[0] - 0.5

  # a finished run started again: nothing to train, the metrics are kept as they were
  finished = (out / "metrics.json").read_text()
  third = zjax_cli(
    "train",
    *TINY,
    "--steps",
    "10",
    "--devices",
    "2",
    "--lr",
    "1e-2",
    "--scan",
    "--out-dir",
    str(out),
  )
  assert third.returncode == 0, third.stderr[-3000:]
  assert "already complete: step 10 of 10" in third.stdout
  assert (out / "metrics.json").read_text() == finished
  assert json.loads(finished)["summary"]["tokens_per_second"] > 0

  # resume off on a directory with checkpoints: refused, nothing touched
  before = sorted(p.name for p in (out / "checkpoints").iterdir())
  refused = zjax_cli("train", *TINY, "--no-resume", "--out-dir", str(out))
  assert refused.returncode == 2 and "--no-resume" in refused.stderr
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before

  # the export example turns the run's checkpoint into plain Flax params for model.apply
  printed = example("export_checkpoint.py", str(out))
  assert "exported" in printed and "next byte" in printed


@pytest.mark.slow
def test_train_unrolled_in_bf16_with_quantized_communication_and_offload(tmp_path):
  done = zjax_cli(
    "train",
    *TINY,
    "--steps",
    "3",
    "--devices",
    "8",
    "--precision",
    "bf16",
    "--gather-quantization",
    "int8",
    "--reduce-quantization",
    "int4",
    "--offload-optimizer",
    "--out-dir",
    str(tmp_path / "run"),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
  assert metrics["settings"]["precision"] == "bf16" and len(metrics["train"]) == 3
  assert metrics["settings"]["reduce_quantization"] == "int4"
  summary = metrics["summary"]
  assert summary["all_to_all_bytes"] > 0 and summary["reduce_scatter_bytes"] == 0
  assert "all-gather (qwZ int8)" in done.stdout and "all-to-all (qgZ)" in done.stdout
  # offloaded: bf16 copies on the device, fp32 masters and adam moments (3x) on the host
  host, device = summary["per_device_state_host_bytes"], summary["per_device_state_device_bytes"]
  assert 0 <= host - 6 * device <= 64  # + the optimizer's step counts
  assert "masters + adam state (host)" in done.stdout


@pytest.mark.slow
def test_train_tensor_parallel_then_resume_without_it(tmp_path):
  """--tensor-parallel 2: a (4, 2) mesh of (fsdp, tensor); the data-axis collectives are the
  schedule's, the tensor axis's are GSPMD's; the checkpoint resumes on 2 devices without
  tensor parallelism (the vocab is padded the same way for any T)."""
  out = tmp_path / "run"
  first = zjax_cli(
    "train", *TINY, "--steps", "4", "--tensor-parallel", "2", "--lr", "1e-2", "--out-dir", str(out)
  )
  assert first.returncode == 0, first.stderr[-3000:]
  assert "8 devices (4-way ZeRO-3 x 2-way tensor parallel)" in first.stdout
  summary = json.loads((out / "metrics.json").read_text())["summary"]
  assert summary["data_axis_collective_bytes"] == summary["schedule_collective_bytes"] > 0
  measured, estimated = (summary[f"tensor_axis_{k}_bytes"] for k in ("collective", "estimated"))
  assert measured > 0 and abs(estimated - measured) <= 0.1 * measured, (estimated, measured)
  second = zjax_cli(
    "train", *TINY, "--steps", "6", "--devices", "2", "--lr", "1e-2", "--out-dir", str(out)
  )
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resumed from step 4" in second.stdout and "saved on 8 device(s), now 2" in second.stdout
  losses = [row["loss"] for row in json.loads((out / "metrics.json").read_text())["train"]]
  assert len(losses) == 6 and losses[-1] < losses[0] - 0.5
  # scanned and unrolled layers are different parameter trees: resuming this (unrolled) run
  # with nn.scan blocks is refused, no silent mix-up
  other = zjax_cli(
    "train", *TINY, "--steps", "8", "--devices", "2", "--scan", "--out-dir", str(out)
  )
  assert other.returncode == 2 and "saved from a different model" in other.stderr
  scanned = zjax_cli(
    "train",
    *TINY,
    "--steps",
    "2",
    "--tensor-parallel",
    "2",
    "--scan",
    "--out-dir",
    str(tmp_path / "scanned"),
  )  # nn.scan blocks, split too
  assert scanned.returncode == 0, scanned.stderr[-3000:]
  summary = json.loads((tmp_path / "scanned" / "metrics.json").read_text())["summary"]
  assert summary["data_axis_collective_bytes"] == summary["schedule_collective_bytes"] > 0
  assert summary["tensor_axis_collective_bytes"] > 0


@pytest.mark.slow
def test_skipped_steps_are_printed_counted_and_too_many_stop_the_run(tmp_path):
  """A learning rate that makes the loss overflow: every skipped step is a line; after 3
  in a row the run saves the last good state and exits 1 saying what to check."""
  out = tmp_path / "run"
  done = zjax_cli(
    "train",
    *TINY,
    "--steps",
    "12",
    "--lr",
    "1e9",
    "--max-consecutive-skips",
    "3",
    "--out-dir",
    str(out),
  )
  assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
  skipped = re.findall(r"step (\d+): skipped \(loss (\S+), gradient norm", done.stdout)
  assert len(skipped) == 3, done.stdout[-3000:]
  last = int(skipped[-1][0])
  assert f"3 steps in a row (up to step {last})" in done.stderr and "--lr" in done.stderr
  metrics = json.loads((out / "metrics.json").read_text())
  assert [row["step"] for row in metrics["skipped"]] == [int(s) for s, _ in skipped]
  assert metrics["summary"] == {"stopped_at": last}
  assert last in zjax_cli_checkpoints(out)


def zjax_cli_checkpoints(out):
  return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.parametrize(
  "args, message",
  [
    (["--config", "/no/such/file.toml"], "does not exist"),
    (["--bogus-option", "3"], "unrecognized arguments: --bogus-option"),
    (["--batch", "12", "--devices", "8"], "not divisible by the 8 data-parallel devices"),
    (["--batch", "6", "--tensor-parallel", "2"], "not divisible by the 4 data-parallel devices"),
    (["--tensor-parallel", "3"], "tensor_parallel 3 does not divide devices 8"),
    (["--tensor-parallel", "2", "--d-ff", "511"], "d_ff 511 is not divisible by tensor_parallel 2"),
    (["--out-dir", "/proc/zjax-cannot-write-here"], "cannot be created or written"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--reduce-quantization", "int2"], "invalid choice: 'int2'"),
    (["--quantization-block", "0"], "quantization_block must be a positive integer"),
    (["--offload-params"], "offload_params needs offload_optimizer"),
  ],
)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, monkeypatch, capsys, args, message):
  """In this process (`zjax_cli_here`); the shell's path once, below."""
  code, _, err = zjax_cli_here(["train", *args], tmp_path, monkeypatch, capsys)
  assert code == 2
  lines = err.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], err
  assert list(tmp_path.iterdir()) == []  # nothing written


def test_bad_input_from_the_shell_is_one_clear_line_and_exit_2(tmp_path):
  done = zjax_cli("train", "--batch", "12", "--devices", "8", cwd=tmp_path)
  assert done.returncode == 2
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and "not divisible by the 8 data-parallel devices" in lines[0]
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
  "text, message",
  [
    ("steps = 5\nlearning_rate = 0.1\n", "unknown setting(s) ['learning_rate']"),
    ('gather_quantization = "int4"\n', "gather_quantization must be one of ['none', 'int8']"),
  ],
)
def test_config_file_with_an_unknown_key_or_value(tmp_path, monkeypatch, capsys, text, message):
  config = tmp_path / "run.toml"
  config.write_text(text)
  code, _, err = zjax_cli_here(["train", "--config", str(config)], tmp_path, monkeypatch, capsys)
  assert code == 2 and message in err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


@pytest.mark.slow
def test_linen_training_example():
  printed = example("train_linen.py", "--steps", "2", "--devices", "2", "--d-model", "32")
  assert "step 1: loss" in printed and "logits (1, 64, 257)" in printed


@pytest.mark.slow
def test_nnx_training_example():
  printed = example("train_nnx.py", "--steps", "3", "--devices", "2")
  assert "step 2: loss" in printed and "accuracy" in printed


def test_schedule_inspection_example(tmp_path):
  printed = example("inspect_schedule.py", "--out", str(tmp_path), "--layers", "1")
  assert "peak_live_param_bytes" in printed and "step lines differ" in printed
  assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt_keep.json", "gpt_lean.json"]


def test_the_corpus_walk_takes_files_in_sorted_path_order_and_stops_at_the_budget(tmp_path):
  """`zjax train`'s corpus reads the standard library in `sorted(rglob("*.py"))` order,
  skipped folders left out, walking lazily: a folder "b" sorts before "b.py" (part by
  part), and the walk never lists what lies past the budget."""
  from zjax.job import corpus

  for name in ("b.py", "b/c.py", "b/tests/t.py", "a.py", "ab/x.py", "a/z.py", "site-packages/s.py"):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("x = 1\n" * 5)
  (tmp_path / "notes.txt").write_text("not python")
  (tmp_path / "link").symlink_to(tmp_path / "b", target_is_directory=True)  # not followed
  expected = [
    p
    for p in sorted(tmp_path.rglob("*.py"))
    if not corpus._SKIPPED_DIRS & set(p.relative_to(tmp_path).parts[:-1])
  ]
  walked = list(corpus._sources(tmp_path))
  assert walked == expected
  assert [p.relative_to(tmp_path).as_posix() for p in walked] == [
    "a/z.py",
    "a.py",
    "ab/x.py",
    "b/c.py",
    "b.py",
  ]
  walk = corpus._sources(tmp_path)
  assert next(walk).name == "z.py"
  (tmp_path / "b").rename(tmp_path / "moved")  # a folder is listed only when reached
  assert [p.relative_to(tmp_path).as_posix() for p in walk] == ["a.py", "ab/x.py", "b.py"]
