"""A GPT-style byte-level decoder in Flax linen, with tied input/output embeddings: the
model `zjax train` trains (and the examples and tests use).

`GPTConfig(scan_layers=True)` stacks the blocks with `nn.scan` (one set of stacked params,
MaxText's `scan_layers`); `remat=True` wraps each block in `nn.remat`.
`logical_axes=True` annotates every parameter with MaxText-style logical axis names
(`nn.with_logical_partitioning`: vocab, embed, heads, mlp), so that `LOGICAL_AXIS_RULES`
make it tensor parallel (vocab-parallel tied embedding, Megatron-style attention and MLP);
`vocab_multiple` pads the embedding table's rows to a multiple (the extra ids are masked
out of the logits, so they are never predicted) for a vocab split over T devices.
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
  logical_axes: bool = False  # annotate the params with logical names (boxed; unrolled only)
  vocab_multiple: int = 1  # embedding rows padded to a multiple of this

  @property
  def padded_vocab(self) -> int:
    return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


# MaxText-style rules: the vocab, the attention heads and the MLP width split over "tensor";
# "embed" over "fsdp" (a data axis: zjax ignores it, it shards every leaf over them anyway).
LOGICAL_AXIS_RULES = (
  ("vocab", "tensor"),
  ("heads", "tensor"),
  ("mlp", "tensor"),
  ("embed", "fsdp"),
)


def _init(cfg: GPTConfig, init, names):
  """`init`, boxed with logical axis `names` when the config asks for annotations."""
  return nn.with_logical_partitioning(init, names) if cfg.logical_axes else init


def _dense(cfg: GPTConfig, features: int, names, name: str, use_bias: bool = True):
  return nn.Dense(
    features,
    use_bias=use_bias,
    dtype=cfg.dtype,
    name=name,
    kernel_init=_init(cfg, nn.initializers.lecun_normal(), names),
    bias_init=_init(cfg, nn.initializers.zeros_init(), names[1:]),
  )


def _layer_norm(cfg: GPTConfig, name: str):
  return nn.LayerNorm(
    dtype=cfg.dtype,
    name=name,
    scale_init=_init(cfg, nn.initializers.ones_init(), ("embed",)),
    bias_init=_init(cfg, nn.initializers.zeros_init(), ("embed",)),
  )


class Attention(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    b, t, d = x.shape
    head = d // cfg.n_head
    # No qkv bias: the key bias has an exactly zero gradient (softmax ignores a shift that
    # is the same for every key), which Adam would turn into noise-driven updates.
    # The columns are head-major ([q k v] of head 0, then of head 1, ...): a split of the
    # width over T devices keeps whole heads on each (Megatron's layout).
    qkv = _dense(cfg, 3 * d, ("embed", "heads"), "qkv", use_bias=False)(x)
    q, k, v = jnp.split(qkv.reshape(b, t, cfg.n_head, 3 * head), 3, axis=-1)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(cfg.dtype)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    return _dense(cfg, d, ("heads", "embed"), "out")(out)


class MLP(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(_dense(self.cfg, self.cfg.d_ff, ("embed", "mlp"), "fc")(x))
    return _dense(self.cfg, self.cfg.d_model, ("mlp", "embed"), "proj")(h)


class Block(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x):
    x = x + Attention(self.cfg, name="attn")(_layer_norm(self.cfg, "ln1")(x))
    return x + MLP(self.cfg, name="mlp")(_layer_norm(self.cfg, "ln2")(x))


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
    embed = nn.Embed(
      cfg.padded_vocab,
      cfg.d_model,
      name="embed",
      embedding_init=_init(
        cfg,
        nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
        ("vocab", "embed"),
      ),
    )
    pos = self.param(
      "pos_embed",
      _init(cfg, nn.initializers.normal(0.02), (None, "embed")),
      (cfg.seq_len, cfg.d_model),
    )
    x = (embed(tokens) + pos[: tokens.shape[1]]).astype(cfg.dtype)
    if cfg.scan_layers:
      stack = nn.scan(
        ScanBlock,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=cfg.n_layer,  # the stacked axis's logical name (MaxText's):
        metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = stack(cfg, name="layers")(x, None)
    else:
      block = nn.remat(Block) if cfg.remat else Block
      for i in range(cfg.n_layer):
        x = block(cfg, name=f"block_{i}")(x)
    x = _layer_norm(cfg, "ln_f")(x)
    logits = embed.attend(x.astype(jnp.float32))  # tied output projection
    if cfg.padded_vocab == cfg.vocab_size:
      return logits
    real = jnp.arange(cfg.padded_vocab) < cfg.vocab_size  # padding ids: never predicted
    return jnp.where(real, logits, jnp.finfo(logits.dtype).min)


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
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((batch_size, cfg.seq_len), jnp.int32))
  )
  return make_loss_fn(model), params, batch
