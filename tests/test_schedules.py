"""The checked-in schedules under schedules/ must match what the code produces now."""

import pathlib

import pytest

from zjax._src.plan.plan import plan_schedule
from zjax._src.program.trace import trace_for_schedule
from zjax.cli.target import load_target

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKED_IN = {
  "gpt.json": "examples/gpt.py:inspect_gpt",
  "scan_gpt.json": "examples/gpt.py:inspect_scan_gpt",
  "nnx_mlp.json": "examples/nnx_mlp.py:inspect_nnx_mlp",
}


@pytest.mark.parametrize("name", sorted(CHECKED_IN))
def test_checked_in_schedule_matches_the_code(name):
  target = load_target(str(ROOT / CHECKED_IN[name]))
  trace = trace_for_schedule(
    target.loss_fn, target.params, target.batch, target.config, {"fsdp": 8}
  )
  produced = plan_schedule(trace, target.config, {"fsdp": 8}, platform="cpu").to_json()
  on_disk = (ROOT / "schedules" / name).read_text()
  assert produced == on_disk, (
    f"schedules/{name} is stale: regenerate it as schedules/README.md says, and review the diff."
  )


def test_every_schedule_file_is_checked():
  assert sorted(p.name for p in (ROOT / "schedules").glob("*.json")) == sorted(CHECKED_IN)
