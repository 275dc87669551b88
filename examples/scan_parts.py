"""Scanned layers by parts: the schedule's report (parts, peak of live gathered bytes,
all-gathers) of the test GPT of tests/test_rolling.py (2 layers, d_model 32) scanned with
nn.scan and unrolled, every parameter sharded, planned for 8 devices (nothing runs; the
compiled programs equal these reports, tests/test_scan_parts.py).

  python examples/scan_parts.py [--devices 8]

Run it on an older checkout (PYTHONPATH=that checkout) for the "before" column of
docs/results.md ("Scanned layers by parts").
"""

import argparse
import dataclasses
import pathlib
import sys

from zjax.cli import devices

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=8)
ARGS = parser.parse_args()
devices.setup(ARGS.devices)  # before JAX starts

import zjax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import real_models  # noqa: E402
from test_rolled_parts import largest_bucket  # noqa: E402
from test_rolling import gpt  # noqa: E402


def describe(case, config) -> str:
  try:
    schedule = zjax.compile_schedule(*case, num_devices=ARGS.devices, config=config)
  except zjax.ScheduleError as e:
    return f"refused ({str(e)[:60]}...)"
  report = schedule.report()
  parts = [len(st.parts) for st in schedule.forward if st.op == "loop"]
  return (
    f"parts {parts}; peak {report['peak_live_param_bytes']:,} B; "
    f"{report['all_gather_count']} all-gathers / {report['all_gather_bytes']:,} B"
  )


def main():
  scanned, unrolled = gpt(2, scan_layers=True), gpt(2)
  leaf = largest_bucket(real_models.Case(*scanned))  # below it nothing plans
  knobs = {
    "1 largest leaf": dict(max_live_parameters=leaf),
    "2 largest leaves": dict(max_live_parameters=2 * leaf),
    "reuse 0, prefetch 0": dict(max_reuse_distance=0, prefetch_bucket_size=0),
  }
  print("| knobs | scanned | unrolled |\n|---|---|---|")
  for name, kw in knobs.items():
    config = zjax.ZeroConfig(param_persistence_threshold=0, **kw)
    flat = dataclasses.replace(config, roll_layers=False)
    print(f"| {name} | {describe(scanned, config)} | {describe(unrolled, flat)} |")


if __name__ == "__main__":
  main()
