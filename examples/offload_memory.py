"""Optimizer and parameter offload: per-device state in device and host memory, and step
time, with and without `zero3(..., offload_optimizer=True)` and `offload_params=True`, fp32
and bf16 compute (the bench GPT, adamw, 8 simulated devices; step times interleaved, median
of rounds; CPU: indicative only).

  python examples/offload_memory.py [--layers 8] [--d-model 128] [--rounds 5]
                                    [--sub-group-size 25000] [--devices 8]
  (on one GPU: --devices 1)
"""

import argparse
import statistics
import time

from zjax.cli import devices


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument(
    "--sub-group-size",
    type=int,
    default=25_000,
    help="elements per device per sub-group of the streamed runs",
  )
  parser.add_argument(
    "--devices", type=int, default=8, help="simulated CPU devices, or the first N accelerators"
  )
  return parser.parse_args()


ARGS = parse_args()
devices.setup(ARGS.devices)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zjax  # noqa: E402
from zjax.bench.run import gpt_model  # noqa: E402


def main(args):
  model = gpt_model(args.layers, args.d_model, 16)
  n = args.devices
  mesh = jax.make_mesh(
    (n,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
  )
  runs = {}
  modes = {
    "": (False, None, False),
    " offloaded": (True, None, False),
    " offl. streamed": (True, args.sub_group_size, False),
    " + params": (True, args.sub_group_size, True),
  }
  for precision, dtype in (("fp32", None), ("bf16", jnp.bfloat16)):
    for mode, (offloaded, group, params_too) in modes.items():
      config = zjax.ZeroConfig(
        **{
          **model.config.__dict__,
          "compute_dtype": dtype,
          "sub_group_size": group or model.config.sub_group_size,
        }
      )
      schedule = zjax.compile_schedule(
        model.loss_fn, model.params, model.batch, mesh=mesh, config=config
      )
      trainer = zjax.zero3(
        model.loss_fn,
        optax.adamw(1e-3),
        schedule,
        mesh=mesh,
        offload_optimizer=offloaded,
        offload_params=params_too,
      )
      box = [trainer.init(model.params)]
      box[0], _ = trainer.step(box[0], model.batch)  # compile
      runs[precision, mode] = (trainer, box, [])
  params = sum(x.size for x in jax.tree.leaves(model.params))
  for _ in range(args.rounds):  # interleaved: A B C D A B C D ...
    for trainer, box, times in runs.values():
      start = time.perf_counter()
      for _ in range(2):
        box[0], metrics = trainer.step(box[0], model.batch)
      jax.block_until_ready(metrics["loss"])
      times.append((time.perf_counter() - start) / 2)
  print(
    f"GPT {args.layers} layers, {params:,} parameters, {n} {jax.default_backend()} "
    f"device(s); per device: bytes per "
    f"parameter / N (device, host) and step time; the step's memory_analysis() as a GPU "
    f"orders it (zjax.hlo.compile_for_analysis) in MiB (device temp, device / host "
    f"arguments; CPU reports no host bytes)"
  )
  print(
    f"{'run':<20} {'device B/param/N':>17} {'host B/param/N':>15} {'sub-groups':>10} "
    f"{'step ms':>8} {'vs on-device':>12} {'temp':>6} {'args':>6} {'host args':>9}"
  )
  for (precision, mode), (trainer, box, times) in runs.items():
    memory = zjax.hlo.compile_for_analysis(trainer.lower(box[0], model.batch)).memory_analysis()
    mib = lambda name: getattr(memory, name) / 2**20  # noqa: E731
    state = (box[0].params, box[0].opt_state, box[0].masters)
    per = lambda kind: zjax.per_device_bytes(state, kind) * n / params  # noqa: E731
    base = statistics.median(runs[precision, ""][2])
    groups = trainer.offload_plan["sub_groups"] if trainer.offload_plan else "-"
    print(
      f"{precision + mode:<20} {per('device'):>17.2f} {per('pinned_host'):>15.2f} "
      f"{groups:>10} {statistics.median(times) * 1e3:>8.1f} "
      f"{statistics.median(times) / base:>12.2f} {mib('temp_size_in_bytes'):>6.2f} "
      f"{mib('argument_size_in_bytes'):>6.2f} {mib('host_argument_size_in_bytes'):>9.2f}"
    )


if __name__ == "__main__":
  main(ARGS)
