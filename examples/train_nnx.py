"""Train a Flax NNX model with ZeRO-3: split the module into a pure loss over its params,
train with the zero3 trainer, merge the trained params back into the module.

  python examples/train_nnx.py --steps 100 --devices 8
"""

import argparse

import jax

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--devices", type=int, default=8)
args = parser.parse_args()
jax.config.update("jax_num_cpu_devices", args.devices)  # simulated devices (CPU)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zjax  # noqa: E402
from nnx_mlp import make_model  # noqa: E402  (examples/nnx_mlp.py)

model = make_model(d_in=32, d_hidden=128, n_classes=4, n_layers=3)
graphdef, params, rest = nnx.split(model, nnx.Param, ...)


def loss_fn(params, batch):  # pure: params in, scalar loss out
  logits = nnx.merge(graphdef, params, rest)(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def batch_at(step, size=64):  # a learnable toy task: the label is
  x = jax.random.normal(jax.random.key(step), (size, 32))  # which quarter is largest
  return {"x": x, "y": jnp.argmax(x.reshape(size, 4, 8).sum(-1), axis=-1)}


mesh = jax.make_mesh((args.devices,), ("fsdp",))
schedule = zjax.compile_schedule(
  loss_fn, params, batch_at(0), mesh=mesh, config=zjax.ZeroConfig(param_persistence_threshold=1024)
)
trainer = zjax.zero3(loss_fn, optax.adam(3e-3), schedule, mesh=mesh)
state = trainer.init(params)
for step in range(args.steps):
  state, metrics = trainer.step(state, batch_at(step))
  if step % 10 == 0 or step == args.steps - 1:
    print(f"step {step}: loss {float(metrics['loss']):.3f}")

nnx.update(model, trainer.gather_params(state))  # the trained weights, back in the module
test = batch_at(10_000)
accuracy = jnp.mean(jnp.argmax(model(test["x"]), -1) == test["y"])
print(f"accuracy {float(accuracy):.2f}")
