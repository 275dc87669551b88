"""A Llama-style decoder in plain JAX (RMSNorm, rotary positions, grouped-query attention,
SwiGLU, untied head): the model of `zjax bench --suite gpu`, sized from tiny to billions of
parameters by `LlamaConfig`.

Params are a dict with one dict per layer (`params["layers"][i]`), so zjax rolls the
identical layers into one loop. The loss computes in the dtype of the params it is given:
under `ZeroConfig(compute_dtype=jnp.bfloat16)` zjax gathers bf16 copies of fp32 masters;
for plain JAX, `cast_params(params, jnp.bfloat16)` inside the loss does the same. Norms,
softmax and the cross-entropy run in fp32.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab: int = 32000
  d_model: int = 2048
  layers: int = 20
  heads: int = 16
  kv_heads: int = 8
  d_ff: int = 5632
  seq_len: int = 1024

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads


# About 1.07e9 parameters: the "1B-class" model of the GPU suite.
LLAMA_1B = LlamaConfig()
# A few thousand parameters, for CPU runs of the same code (`--tiny`).
LLAMA_TINY = LlamaConfig(vocab=64, d_model=32, layers=3, heads=4, kv_heads=2, d_ff=64, seq_len=16)


def param_shapes(cfg: LlamaConfig, dtype: Any = jnp.float32) -> dict:
  """The params as `jax.ShapeDtypeStruct`s (nothing allocated)."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
  layer = lambda: {
    "attn_norm": s(d),
    "wq": s(d, d),
    "wk": s(d, kv),
    "wv": s(d, kv),  # noqa
    "wo": s(d, d),
    "mlp_norm": s(d),
    "w_gate": s(d, cfg.d_ff),
    "w_up": s(d, cfg.d_ff),
    "w_down": s(cfg.d_ff, d),
  }
  return {
    "embed": s(cfg.vocab, d),
    "layers": [layer() for _ in range(cfg.layers)],
    "final_norm": s(d),
    "head": s(d, cfg.vocab),
  }


def init_params(cfg: LlamaConfig, key, dtype: Any = jnp.float32) -> dict:
  """Random params: norms one, matrices normal / sqrt(fan-in). Jit it to build them on a
  device (`jax.jit(init_params, static_argnums=0)`)."""
  shapes = param_shapes(cfg, dtype)
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(key, len(leaves))

  def one(k, x):
    if x.ndim == 1:
      return jnp.ones(x.shape, x.dtype)
    return (jax.random.normal(k, x.shape, x.dtype) / np.sqrt(x.shape[0])).astype(x.dtype)

  return jax.tree.unflatten(treedef, [one(k, x) for k, x in zip(keys, leaves)])


def host_params(cfg: LlamaConfig, seed: int = 0) -> dict:
  """Params as numpy arrays, cheap to make at any size: each leaf tiles one block of 2^22
  standard normals from its own offset, over sqrt(fan-in); norms one. Leaves are not
  independent draws (a benchmark's weights need not be), and no device program is compiled
  to make them: on an H200 the compile of `init_params` for the 1B model alone took over
  45 s (180 random-normal fusions)."""
  rng = np.random.default_rng(seed)
  block = rng.standard_normal(1 << 22, dtype=np.float32)
  leaves, treedef = jax.tree.flatten(param_shapes(cfg))

  def one(i, x):
    if len(x.shape) == 1:
      return np.ones(x.shape, np.float32)
    source = np.roll(block, -((i * 7919) % block.size))  # a different phase per leaf
    out, scale = np.empty(int(np.prod(x.shape)), np.float32), np.float32(x.shape[0] ** -0.5)
    for at in range(0, out.size, source.size):  # one pass: copy and scale
      np.multiply(source[: out.size - at], scale, out=out[at : at + source.size])
    return out.reshape(x.shape)

  return jax.tree.unflatten(treedef, [one(i, x) for i, x in enumerate(leaves)])


def param_count(cfg: LlamaConfig) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes(cfg)))


def train_flops_per_token(cfg: LlamaConfig) -> float:
  """Model FLOPs of one training token: 6 x params (forward and backward matmuls; the
  embedding lookup counted as a matmul, as PaLM's appendix B does) plus attention's
  12 x layers x seq_len x d_model (scores and weighted values, forward and backward, the
  whole square although the mask is causal)."""
  return 6.0 * param_count(cfg) + 12.0 * cfg.layers * cfg.seq_len * cfg.d_model


def cast_params(params, dtype):
  """Floating-point leaves as `dtype` (mixed precision for a plain-JAX baseline)."""
  return jax.tree.map(
    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
  )


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x, sin, cos):  # x: [batch, seq, heads, head_dim]
  x1, x2 = jnp.split(x, 2, axis=-1)
  sin, cos = sin[None, :, None, :].astype(x.dtype), cos[None, :, None, :].astype(x.dtype)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _block(cfg: LlamaConfig, x, p, sin, cos, causal):
  b, t, d = x.shape
  hd, group = cfg.head_dim, cfg.heads // cfg.kv_heads
  h = _rms_norm(x, p["attn_norm"])
  q = _rope((h @ p["wq"]).reshape(b, t, cfg.heads, hd), sin, cos)
  k = _rope((h @ p["wk"]).reshape(b, t, cfg.kv_heads, hd), sin, cos)
  v = (h @ p["wv"]).reshape(b, t, cfg.kv_heads, hd)
  q = q.reshape(b, t, cfg.kv_heads, group, hd)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / np.sqrt(hd)
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(x.dtype)
  out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(b, t, d)
  x = x + out @ p["wo"]
  h = _rms_norm(x, p["mlp_norm"])
  return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def make_loss_fn(cfg: LlamaConfig):
  """Mean next-token cross-entropy; batch = {"tokens": int32[B, seq_len + 1]}."""

  def loss_fn(params, batch):
    tokens = batch["tokens"]
    t = tokens.shape[1] - 1
    inverse = 1.0 / 10000.0 ** (jnp.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    angles = jnp.arange(t)[:, None] * inverse[None, :]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    causal = jnp.tril(jnp.ones((t, t), bool))
    x = params["embed"][tokens[:, :-1]]
    for p in params["layers"]:
      x = _block(cfg, x, p, sin, cos, causal)
    logits = (_rms_norm(x, params["final_norm"]) @ params["head"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

  return loss_fn


def batch_shapes(cfg: LlamaConfig, batch_size: int) -> dict:
  return {"tokens": jax.ShapeDtypeStruct((batch_size, cfg.seq_len + 1), jnp.int32)}


def random_batch(cfg: LlamaConfig, batch_size: int, key) -> dict:
  return {"tokens": jax.random.randint(key, (batch_size, cfg.seq_len + 1), 0, cfg.vocab, jnp.int32)}
