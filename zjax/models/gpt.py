"""A GPT-style byte-level decoder in Flax linen, with tied input/output embeddings: the
model `zjax train` trains (and the examples and tests use).

`GPTConfig(scan_layers=True)` stacks the blocks with `nn.scan` (one set of stacked params,
MaxText's `scan_layers`); `remat=True` wraps each block in `nn.remat`.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp



@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 257  # 256 byte values + end-of-text; deliberately not a multiple of 8
  seq_len: int = 64
  d_model: int = 128
  n_layer: int = 4
  n_head: int = 4
  d_ff: int = 512
  scan_layers: bool = False
  remat: bool = False
  dtype: Any = jnp.float32  # activation dtype


class Attention(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    b, t, d = x.shape
    head = d // cfg.n_head
    # No qkv bias: the key bias has an exactly zero gradient (softmax ignores a shift that
    # is the same for every key), which Adam would turn into noise-driven updates.
    qkv = nn.Dense(3 * d, use_bias=False, dtype=cfg.dtype, name="qkv")(x)
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * cfg.n_head, head), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(cfg.dtype)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    return nn.Dense(d, dtype=cfg.dtype, name="out")(out)


class MLP(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(self.cfg.d_ff, dtype=self.cfg.dtype, name="fc")(x))
    return nn.Dense(self.cfg.d_model, dtype=self.cfg.dtype, name="proj")(h)


class Block(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x):
    x = x + Attention(self.cfg, name="attn")(nn.LayerNorm(dtype=self.cfg.dtype, name="ln1")(x))
    return x + MLP(self.cfg, name="mlp")(nn.LayerNorm(dtype=self.cfg.dtype, name="ln2")(x))


class ScanBlock(nn.Module):
  """`Block` with nn.scan's (carry, x) -> (carry, y) signature."""
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x, _):
    block = nn.remat(Block) if self.cfg.remat else Block
    return block(self.cfg, name="block")(x), None


class GPT(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, name="embed")
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))
    x = (embed(tokens) + pos[:tokens.shape[1]]).astype(cfg.dtype)
    if cfg.scan_layers:
      stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=cfg.n_layer)
      x, _ = stack(cfg, name="layers")(x, None)
    else:
      block = nn.remat(Block) if cfg.remat else Block
      for i in range(cfg.n_layer):
        x = block(cfg, name=f"block_{i}")(x)
    x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
    return embed.attend(x.astype(jnp.float32))  # tied output projection


def make_loss_fn(model: GPT):
  """Mean next-byte cross-entropy; batch = {"tokens": int32[B, seq_len + 1]}."""

  def loss_fn(params, batch):
    tokens = batch["tokens"]
    logits = model.apply(params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return -target.mean()

  return loss_fn


def abstract_setup(cfg: GPTConfig, batch_size: int = 8):
  """(loss_fn, params shapes, batch shapes) without allocating anything."""
  model = GPT(cfg)
  batch = {"tokens": jax.ShapeDtypeStruct((batch_size, cfg.seq_len + 1), jnp.int32)}
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(
      (batch_size, cfg.seq_len), jnp.int32)))
  return make_loss_fn(model), params, batch
