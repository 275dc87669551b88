"""A user's first minute: seconds to plan, `trainer.init` (twice: the second hits the
optimizer-check cache), lower and compile the training step of `zjax bench`'s GPT. Beside
`init`, init again with the optimizer check's cache emptied, its probe on one device (as
small probes run) and sharded over the mesh (as every probe ran before 2026-12-07;
`optcheck.ONE_DEVICE_PROBE_BYTES`).

  python examples/startup_time.py                      # 8 and 32 layers, 8 devices
  python examples/startup_time.py --layers 8 --devices 1 --json out.json

Each phase is timed alone (wall time, this machine): `plan` is compile_schedule, `init` is
trainer.init on natural params (sharding + the optimizer's shard-compatibility check +
optax init), `lower` traces the step, `compile` is XLA compilation only.
"""

import argparse
import json
import time

from devices import setup_devices

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--d-model", type=int, default=128)
parser.add_argument("--json", metavar="FILE")
args = parser.parse_args()
setup_devices(args.devices)

import jax  # noqa: E402
import optax  # noqa: E402

import zjax  # noqa: E402
from zjax._src.train import optcheck  # noqa: E402
from zjax.bench.run import gpt_model, mesh_of  # noqa: E402


def timed(fn):
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def cpu_timed(fn):
  """(wall seconds, CPU seconds of every thread of this process)."""
  start, cpu = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn())
  return time.perf_counter() - start, time.process_time() - cpu


def measure(layers):
  model = gpt_model(layers, args.d_model, batch_size=2 * args.devices)
  mesh = mesh_of(args.devices)
  schedule, plan = timed(
    lambda: zjax.compile_schedule(
      model.loss_fn, model.params, model.batch, mesh=mesh, config=model.config
    )
  )
  trainer = zjax.zero3(model.loss_fn, optax.adamw(1e-3), schedule, mesh=mesh)
  state, init = timed(lambda: trainer.init(model.params))
  _, init_again = timed(lambda: trainer.init(model.params))
  probe = {}  # init again with the optimizer check's cache emptied: its probe's cost
  for placement, limit in (("one_device", optcheck.ONE_DEVICE_PROBE_BYTES), ("sharded", 0)):
    default, optcheck.ONE_DEVICE_PROBE_BYTES = optcheck.ONE_DEVICE_PROBE_BYTES, limit
    optcheck._cache.clear()
    probe[placement] = cpu_timed(lambda: trainer.init(model.params))
    optcheck.ONE_DEVICE_PROBE_BYTES = default
  lowered, lower = timed(lambda: trainer.lower(state, model.batch))
  _, compile_ = timed(lowered.compile)
  return {
    "layers": layers,
    "devices": args.devices,
    "params": len(schedule.params),
    "platform": jax.devices()[0].platform,
    "plan_s": plan,
    "init_s": init,
    "init_again_s": init_again,
    "init_probe_one_device_s": probe["one_device"],
    "init_probe_sharded_s": probe["sharded"],
    "lower_s": lower,
    "compile_s": compile_,
  }


rows = [measure(n) for n in args.layers]
print(
  "| layers | leaves | plan | init | init again | init, probe on one device | init, probe "
  "sharded | lower | compile |"
)
print("|---|---|---|---|---|---|---|---|---|")
wall_and_cpu = lambda pair: f"{pair[0]:.2f} s (CPU {pair[1]:.2f} s)"  # noqa: E731
for r in rows:
  print(
    f"| {r['layers']} | {r['params']} | {r['plan_s']:.2f} s | {r['init_s']:.2f} s | "
    f"{r['init_again_s']:.2f} s | {wall_and_cpu(r['init_probe_one_device_s'])} | "
    f"{wall_and_cpu(r['init_probe_sharded_s'])} | {r['lower_s']:.2f} s | {r['compile_s']:.2f} s |"
  )
if args.json:
  with open(args.json, "w") as f:
    json.dump(rows, f, indent=1)
