"""Compile time and per-device temp memory of one zjax step vs depth, scanned vs unrolled.

  python examples/scan_compile_time.py                    # L = 4, 16, 64 (8 devices)
  python examples/scan_compile_time.py --layers 4 8 --d-model 64

Scanned layers are gathered one layer per iteration inside one while loop, so compile time
and gathered-weight memory should not grow with depth; unrolled layers are one segment
each. Compile time is wall time of `lower(...).compile()` on this machine (noisy: compare
within one run).
"""

import argparse
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_disable_hlo_passes=cse_barrier_expander").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import zjax  # noqa: E402
from gpt import GPTConfig, abstract_setup  # noqa: E402
from zjax._src import layout  # noqa: E402


def measure(num_layers, scan, d_model):
  cfg = GPTConfig(d_model=d_model, n_layer=num_layers, n_head=4, d_ff=4 * d_model,
                  seq_len=32, scan_layers=scan)
  loss, params, batch = abstract_setup(cfg, batch_size=8)
  mesh = jax.make_mesh((8,), ("fsdp",))
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh,
                                   config=zjax.ZeroConfig(param_persistence_threshold=1024))
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  shards = jax.tree_util.tree_unflatten(schedule.params_treedef, [
      jax.ShapeDtypeStruct(layout.storage_shape(p, 8), p.dtype,
                           sharding=jax.sharding.NamedSharding(mesh, spec))
      for p, spec in zip(schedule.params, layout.param_specs(schedule))])
  start = time.perf_counter()
  compiled = step.lower(shards, batch).compile()
  seconds = time.perf_counter() - start
  return seconds, compiled.memory_analysis().temp_size_in_bytes


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 64])
  parser.add_argument("--d-model", type=int, default=128)
  args = parser.parse_args()
  print(f"GPT example, d_model={args.d_model}, 8 simulated devices")
  print(f"{'L':>4} {'scanned compile s':>18} {'unrolled compile s':>19} "
        f"{'scanned temp KiB':>17} {'unrolled temp KiB':>18}")
  for num_layers in args.layers:
    scanned = measure(num_layers, True, args.d_model)
    unrolled = measure(num_layers, False, args.d_model)
    print(f"{num_layers:>4} {scanned[0]:>18.2f} {unrolled[0]:>19.2f} "
          f"{scanned[1] / 1024:>17.1f} {unrolled[1] / 1024:>18.1f}", flush=True)


if __name__ == "__main__":
  main()
