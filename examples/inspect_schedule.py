"""Inspect a schedule before running anything: plan the GPT example for 8 devices with two
knob settings, print the report side by side, save both, and show how they differ.

  python examples/inspect_schedule.py [--out DIR]

(The CLI does the same for any model: `zjax inspect examples/gpt.py:inspect_gpt`.)
"""

import argparse
import difflib
import pathlib

import zjax
from gpt import GPTConfig, abstract_setup

parser = argparse.ArgumentParser()
parser.add_argument("--out", default=".", help="where to save the two schedules")
parser.add_argument("--layers", type=int, default=4)
args = parser.parse_args()

loss_fn, params, batch = abstract_setup(GPTConfig(n_layer=args.layers))  # shapes only
configs = {
  "keep": zjax.ZeroConfig(param_persistence_threshold=4096),  # DeepSpeed-like defaults
  "lean": zjax.ZeroConfig(
    param_persistence_threshold=4096, prefetch_bucket_size=100_000, max_reuse_distance=0
  ),  # re-gather in backward, 1 block ahead
}
schedules = {
  name: zjax.compile_schedule(loss_fn, params, batch, num_devices=8, config=c)
  for name, c in configs.items()
}
keys = (
  "all_gather_count",
  "all_gather_bytes",
  "reduce_scatter_bytes",
  "peak_live_param_bytes",
  "state_bytes_per_device",
)
print(f"{'report (per device, per step)':32}" + "".join(f"{n:>14}" for n in schedules))
for key in keys:
  print(f"{key:32}" + "".join(f"{s.report()[key]:>14,}" for s in schedules.values()))

out = pathlib.Path(args.out)
for name, schedule in schedules.items():
  schedule.save(out / f"gpt_{name}.json")  # reviewable, diffable, loadable
  assert zjax.Schedule.load(out / f"gpt_{name}.json") == schedule
diff = difflib.unified_diff(
  schedules["keep"].to_json().splitlines(),
  schedules["lean"].to_json().splitlines(),
  "keep",
  "lean",
  n=0,
)
changed = [line for line in diff if line.startswith(("+ ", "- ")) and '"op"' in line]
print(f"{len(changed)} step lines differ, e.g.:")
print("\n".join(changed[:6]))
