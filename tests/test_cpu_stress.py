"""A short, bounded run of the CPU stress harness (examples/cpu_stress.py): the rolled
default `zjax train` model and the Griffin-style recurrent model (remat + custom_vjp +
inner scan per layer, rolled), 2 runs each, beside one busy process. Every run finishes,
no step is non-finite, and the two runs' losses are bitwise equal. The full table (K >= 10
per case, 4 busy processes, with and without the old flags) is in docs/results.md "CPU
execution"."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.whole_machine
def test_stress_harness_short_run(tmp_path):
  out = tmp_path / "stress.json"
  done = subprocess.run(
    [
      sys.executable,
      str(ROOT / "examples" / "cpu_stress.py"),
      "--cases",
      "gpt",
      "griffin",
      "--runs",
      "2",
      "--gpt-runs",
      "2",
      "--steps",
      "4",
      "--load",
      "1",
      "--timeout",
      "600",
      "--json",
      str(out),
    ],
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  rows = {row["case"]: row for row in json.loads(out.read_text())}
  assert set(rows) == {"gpt", "griffin"}
  for row in rows.values():
    assert (row["runs"], row["aborts"], row["nonfinite_steps"]) == (2, 0, 0), row
    assert row["deterministic"] and row["final_loss"] == row["final_loss"], row
  assert "bitwise same" in done.stdout
