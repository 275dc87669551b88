"""Compile time and per-device temp memory of one step vs depth: rolled, unrolled and
scanned zjax against GSPMD FSDP, with zjax's compile time split into its stages.

  python examples/depth_compile_time.py                       # L = 4 .. 64 (8 devices)
  python examples/depth_compile_time.py --layers 4 8 --d-model 64 --json out.json

Stages: "plan" is `compile_schedule` (trace + plan); "lower" is `jit(...).lower(...)`
(Python tracing of the step, for zjax every segment's and loop body's vjp); "xla" is
the compile, as a GPU orders the program (`zjax.hlo.compile_for_analysis`: on CPU with the
barriers kept; GSPMD's has none, so it is its ordinary compile). The step is the gradient
(value_and_grad) of the GPT example's loss; GSPMD is `jax.jit(jax.value_and_grad(loss))`
with parameters sharded along their largest dimension divisible by N. Wall times on this
machine: compare within one run.
"""

import argparse
import json
import time

from zjax.cli import devices

devices.setup(8)  # before JAX starts: 8 simulated devices

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zjax  # noqa: E402
from gpt import GPTConfig, abstract_setup  # noqa: E402
from zjax._src.layout import layout  # noqa: E402

VARIANTS = ("rolled", "unrolled", "scanned", "gspmd")


def _timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def measure(variant, num_layers, d_model, mesh):
  """{plan, lower, xla, total seconds; temp bytes} of one compiled gradient step."""
  cfg = GPTConfig(
    d_model=d_model,
    n_layer=num_layers,
    n_head=4,
    d_ff=4 * d_model,
    seq_len=32,
    scan_layers=variant == "scanned",
  )
  loss, params, batch = abstract_setup(cfg, batch_size=8)
  n = mesh.devices.size
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("fsdp"))), batch
  )
  if variant == "gspmd":
    plan = 0.0
    step = jax.jit(jax.value_and_grad(loss))
    args = (
      jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
          x.shape,
          x.dtype,
          sharding=NamedSharding(mesh, layout.largest_dim_spec(x.shape, n, "fsdp")),
        ),
        params,
      ),
      batch,
    )
  else:
    config = zjax.ZeroConfig(param_persistence_threshold=1024, roll_layers=variant == "rolled")
    schedule, plan = _timed(
      lambda: zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
    )
    step = zjax.value_and_grad(loss, schedule, mesh=mesh)
    args = (layout.abstract_storage(schedule, mesh), batch)
  lowered, lower = _timed(lambda: step.lower(*args))
  compiled, xla = _timed(lambda: zjax.hlo.compile_for_analysis(lowered))
  return {
    "variant": variant,
    "layers": num_layers,
    "plan_seconds": plan,
    "lower_seconds": lower,
    "xla_seconds": xla,
    "total_seconds": plan + lower + xla,
    "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32, 64])
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
  parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
  args = parser.parse_args()
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  print(f"GPT example, d_model={args.d_model}, 8 simulated devices; seconds, temp MiB")
  print(f"{'L':>3} {'variant':>9} {'plan':>6} {'lower':>6} {'xla':>6} {'total':>6} {'temp':>7}")
  rows = []
  for num_layers in args.layers:
    for variant in args.variants:
      r = measure(variant, num_layers, args.d_model, mesh)
      rows.append(r)
      print(
        f"{num_layers:>3} {variant:>9} {r['plan_seconds']:>6.2f} {r['lower_seconds']:>6.2f} "
        f"{r['xla_seconds']:>6.2f} {r['total_seconds']:>6.2f} "
        f"{r['temp_bytes'] / 2**20:>7.2f}",
        flush=True,
      )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
