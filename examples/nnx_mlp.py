"""A residual MLP classifier written with Flax NNX, as a pure function for zjax.

NNX models are objects; zjax needs `loss_fn(params, batch)`. `nnx.split` separates the
parameters (an `nnx.State` pytree whose leaf paths end in `.value`) from the graph, and the
loss merges them back:

    zjax inspect examples/nnx_mlp.py:inspect_nnx_mlp --devices 8
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import zjax


class ResidualMLP(nnx.Module):
  def __init__(self, d_in: int, d_hidden: int, n_classes: int, n_layers: int, *, rngs):
    self.stem = nnx.Linear(d_in, d_hidden, rngs=rngs)
    self.blocks = nnx.List([nnx.Linear(d_hidden, d_hidden, rngs=rngs) for _ in range(n_layers)])
    self.norm = nnx.LayerNorm(d_hidden, rngs=rngs)
    self.head = nnx.Linear(d_hidden, n_classes, rngs=rngs)

  def __call__(self, x):
    x = self.stem(x)
    for block in self.blocks:
      x = x + nnx.relu(block(x))
    return self.head(self.norm(x))


def split_model(model: nnx.Module):
  """(loss_fn, params) for a model: params is the nnx.Param state, the rest is closed over."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params, rest)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss_fn, params


def make_model(d_in=64, d_hidden=256, n_classes=10, n_layers=3, seed=0):
  return ResidualMLP(d_in, d_hidden, n_classes, n_layers, rngs=nnx.Rngs(seed))


def inspect_nnx_mlp():
  """Shapes only: the model is built abstractly with nnx.eval_shape."""
  model = nnx.eval_shape(make_model)
  loss_fn, params = split_model(model)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  batch = {
    "x": jax.ShapeDtypeStruct((16, 64), jnp.float32),
    "y": jax.ShapeDtypeStruct((16,), jnp.int32),
  }
  config = zjax.ZeroConfig(
    prefetch_bucket_size=70_000, max_reuse_distance=100_000, param_persistence_threshold=1024
  )
  return loss_fn, params, batch, config
