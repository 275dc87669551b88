"""Per-device training state of the GPT example under zero3, for several device counts.

Prints, for each N: parameter bytes per device (measured on the arrays, and the schedule's
prediction), adamw state bytes per device, and the compiled sharded initialisation's
per-device temp and output bytes (`memory_analysis()`), next to the full model's size.
The init program is compiled as a GPU orders it (`zjax.hlo.compile_for_analysis`).

    python examples/state_memory.py --devices 1 2 4 8
"""

import argparse
import os
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d-model", type=int, default=128)
  args = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from devices import setup_devices  # simulated CPU devices

  setup_devices(max(args.devices))
  for row in measure(args):
    print(row)
  return 0


def measure(args):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import zjax
  from gpt import EXAMPLE_CONFIG, GPT, GPTConfig, abstract_setup

  cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, d_ff=4 * args.d_model)
  model = GPT(cfg)
  loss, shapes, batch_shapes = abstract_setup(cfg, batch_size=8)
  full = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(shapes))
  tokens = jnp.zeros((8, cfg.seq_len), jnp.int32)
  kib = lambda b: f"{b / 1024:.1f} KiB"
  yield f"GPT: {full // 4} parameters, {kib(full)} in fp32"
  for n in args.devices:
    mesh = jax.make_mesh((n,), ("fsdp",), devices=jax.devices()[:n])
    schedule = zjax.compile_schedule(loss, shapes, batch_shapes, mesh=mesh, config=EXAMPLE_CONFIG)
    trainer = zjax.zero3(loss, optax.adamw(1e-3), schedule, mesh=mesh)
    state = trainer.init_from(model.init, jax.random.key(0), tokens)
    init = zjax.hlo.compile_for_analysis(
      zjax.sharded_init(model.init, schedule, mesh).lower(jax.random.key(0), tokens)
    ).memory_analysis()
    largest_bucket = max(schedule.bucket_elements(), default=0) * 4
    yield (
      f"N={n}: params/device {kib(zjax.per_device_bytes(state.params))} (schedule "
      f"{kib(schedule.report()['state_bytes_per_device'])}), adamw state/device "
      f"{kib(zjax.per_device_bytes(state.opt_state))}; sharded init temp "
      f"{kib(init.temp_size_in_bytes)} + outputs {kib(init.output_size_in_bytes)}; "
      f"largest bucket {kib(largest_bucket)}"
    )


if __name__ == "__main__":
  sys.exit(main())
