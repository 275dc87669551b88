"""The GPT example (zjax/models/gpt.py) and its `zjax inspect` targets.

The `inspect_*` functions follow `zjax inspect`'s protocol: they return
`(loss_fn, params, batch, config)` with shapes only (`jax.ShapeDtypeStruct`), so planning
needs no device memory:

    zjax inspect examples/gpt.py:inspect_gpt --devices 8
"""

import dataclasses

import zjax
from zjax.models.gpt import (  # noqa: F401
  GPT,
  MLP,
  Attention,
  Block,
  GPTConfig,
  ScanBlock,
  abstract_setup,
  make_loss_fn,
)

# Knobs for the example schedules: small enough that a small model shows every step kind
# (prefetch, release, re-gather, kept buckets at the forward/backward turn).
EXAMPLE_CONFIG = zjax.ZeroConfig(
  prefetch_bucket_size=70_000,
  max_live_parameters=400_000,
  max_reuse_distance=200_000,
  param_persistence_threshold=4096,
)


def inspect_gpt():
  """The 4-layer linen GPT (unrolled layers, tied embeddings)."""
  return (*abstract_setup(GPTConfig()), EXAMPLE_CONFIG)


def inspect_scan_gpt():
  """The same GPT with its blocks stacked by nn.scan: the stacked kernels are gathered one
  layer per iteration inside the loop, part by part (sub-module by sub-module), as
  max_reuse_distance releases the attention kernels between their recompute and their vjp
  in backward."""
  config = dataclasses.replace(
    EXAMPLE_CONFIG, prefetch_bucket_size=200_000, max_live_parameters=600_000
  )
  return (*abstract_setup(GPTConfig(scan_layers=True)), config)


def inspect_gpt48():
  """A 48-layer version, to time tracing + planning of a deep model."""
  return (*abstract_setup(GPTConfig(n_layer=48)), EXAMPLE_CONFIG)
