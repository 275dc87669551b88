"""Issue 46's activation model against the compiler: the per-device footprint of zjax's
gradient step predicted from its trace alone (`zjax._src.plan.activation_memory`), beside
the analysis compile's (zjax.hlo.compile_for_analysis: arguments + outputs + temp -
aliased), on the models of tests/real_models.py and two GPT sizes.

  python examples/activation_liveness.py [--devices 8] [--models llama gpt128 ...]

Each model at the default knobs and at `param_persistence_threshold=0` (every parameter
sharded); the GPTs also unrolled and at `max_reuse_distance=0`.
"""

import argparse
import dataclasses
import pathlib
import sys

from zjax.cli import devices

REAL = "mlp5 eqx_mlp resnet18 resnet_syncbn encdec nnx_gqa rnn_lstm griffin t5 llama bert".split()
GPTS = {"gpt128": (128, 8), "gpt256": (256, 4)}  # d_model, layers

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--models", nargs="*", default=[*REAL, *GPTS])
ARGS = parser.parse_args()
devices.setup(ARGS.devices)  # before JAX starts
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import real_models  # noqa: E402
import zjax  # noqa: E402
from helpers import case_step  # noqa: E402
from zjax._src.plan.activation_memory import step_footprint  # noqa: E402
from zjax.models.gpt import GPT, GPTConfig, make_loss_fn  # noqa: E402


def gpt(d_model, layers, n):
  cfg = GPTConfig(d_model=d_model, n_layer=layers, n_head=4, d_ff=4 * d_model, seq_len=64)
  model = GPT(cfg)
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))
  )
  batch = {"tokens": jax.ShapeDtypeStruct((8 * n, cfg.seq_len + 1), jnp.int32)}
  return real_models.Case(make_loss_fn(model), params, batch, reference_loss_fn=None)


def configs(name):
  if name in GPTS:
    base = zjax.ZeroConfig(param_persistence_threshold=1000)
    return {
      "rolled": base,
      "unrolled": dataclasses.replace(base, roll_layers=False),
      "rolled, reuse 0": dataclasses.replace(base, max_reuse_distance=0),
    }
  return {
    "default": zjax.ZeroConfig(),
    "all sharded": zjax.ZeroConfig(param_persistence_threshold=0),
  }


def compared(case, config, mesh):
  """(predicted Footprint, compiled footprint, compiled temp)."""
  step, args = case_step(case, config, mesh)
  m = zjax.hlo.compile_for_analysis(step.lower(*args)).memory_analysis()
  compiled = (
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )
  return step_footprint(step, *args), compiled, m.temp_size_in_bytes


def main():
  n = ARGS.devices
  mesh = jax.make_mesh((n,), ("fsdp",))
  print(
    "| model | config | predicted temp | compiled temp | predicted footprint | "
    "compiled footprint | ratio |\n|---|---|---|---|---|---|---|"
  )
  ratios = []
  for name in ARGS.models:
    if name in GPTS:
      case = gpt(*GPTS[name], n)
    else:
      case = getattr(real_models, name)(batch_size=n if name in ("llama", "bert") else 2 * n)
    for label, config in configs(name).items():
      predicted, compiled, temp = compared(case, config, mesh)
      ratios.append(predicted.total / compiled)
      print(
        f"| {name} | {label} | {predicted.temp:,} | {temp:,} | {predicted.total:,} | "
        f"{compiled:,} | {ratios[-1]:.2f} |",
        flush=True,
      )
  print(f"\nfootprint ratio: {min(ratios):.2f} to {max(ratios):.2f}")


if __name__ == "__main__":
  main()
