"""A 70B-class dense transformer (Llama-2/3-70B shapes: 80 layers, d_model 8192, GQA with 8
KV heads, SwiGLU 28672, vocabulary 128256) as `jax.ShapeDtypeStruct`s: nothing is allocated,
so zjax can plan it, and predict its communication, on any machine.

  zjax inspect examples/llama70b_shapes.py:llama70b --mesh 128x8 --axes replica,fsdp --summary

With tensor parallelism (Megatron's split: q/k/v, gate and up by columns, the attention
output and down projections by rows, the embedding and the head over the vocabulary), on a
(replica, fsdp, tensor) mesh:

  zjax inspect examples/llama70b_shapes.py:llama70b_tp --mesh 16x8x8 \
      --axes replica,fsdp,tensor --summary
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

LAYERS, D_MODEL, HEADS, KV_HEADS, D_FF, VOCAB = 80, 8192, 64, 8, 28672, 128256
SEQ, BATCH = 4096, 8192  # one global batch of 8192 sequences (32M tokens)


def _rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale


def _block(x, p):
  b, t, d = x.shape
  head = d // HEADS
  h = _rms_norm(x, p["attn_norm"])
  q = (h @ p["wq"]).reshape(b, t, HEADS, head)
  k = jnp.repeat((h @ p["wk"]).reshape(b, t, KV_HEADS, head), HEADS // KV_HEADS, axis=2)
  v = jnp.repeat((h @ p["wv"]).reshape(b, t, KV_HEADS, head), HEADS // KV_HEADS, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(x.dtype)
  causal = jnp.tril(jnp.ones((t, t), bool))
  attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d) @ p["wo"]
  h = _rms_norm(x, p["mlp_norm"])
  return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def loss_fn(params, batch):
  tokens = batch["tokens"]
  x = params["embed"][tokens[:, :-1]]
  x, _ = jax.lax.scan(lambda x, p: (_block(x, p), None), x, params["layers"])
  logits = _rms_norm(x, params["final_norm"]) @ params["head"]
  labels = jax.nn.one_hot(tokens[:, 1:], VOCAB, dtype=logits.dtype)
  return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


def shapes(dtype=jnp.float32) -> dict:
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  kv = D_MODEL // HEADS * KV_HEADS
  layer = {
    "attn_norm": s(LAYERS, D_MODEL),
    "wq": s(LAYERS, D_MODEL, D_MODEL),
    "wk": s(LAYERS, D_MODEL, kv),
    "wv": s(LAYERS, D_MODEL, kv),
    "wo": s(LAYERS, D_MODEL, D_MODEL),
    "mlp_norm": s(LAYERS, D_MODEL),
    "w_gate": s(LAYERS, D_MODEL, D_FF),
    "w_up": s(LAYERS, D_MODEL, D_FF),
    "w_down": s(LAYERS, D_FF, D_MODEL),
  }
  return {
    "embed": s(VOCAB, D_MODEL),
    "layers": layer,
    "final_norm": s(D_MODEL),
    "head": s(D_MODEL, VOCAB),
  }


def llama70b():
  """zjax inspect target: (loss_fn, params, batch, config); bf16 compute, fp32 masters."""
  import zjax

  batch = {"tokens": jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)}
  # the embedding (1.05e9 elements) is one module: let it be gathered whole
  config = zjax.ZeroConfig(compute_dtype=jnp.bfloat16, max_live_parameters=int(2e9))
  return loss_fn, shapes(), batch, config


# torchtitan-style rules on the "/"-joined parameter path, first match wins
TENSOR_RULES = [
  (r"/(wq|wk|wv|w_gate|w_up)$", P(None, "tensor")),
  (r"/(wo|w_down)$", P("tensor", None)),
  (r"^embed$", P("tensor", None)),
  (r"^head$", P(None, "tensor")),
]


def unrolled_loss_fn(params, batch):
  """As loss_fn, with one parameter dict per layer (this version of tensor parallelism
  runs layers unrolled)."""
  tokens = batch["tokens"]
  x = params["embed"][tokens[:, :-1]]
  for layer in params["layers"]:
    x = _block(x, layer)
  logits = _rms_norm(x, params["final_norm"]) @ params["head"]
  labels = jax.nn.one_hot(tokens[:, 1:], VOCAB, dtype=logits.dtype)
  return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * labels, axis=-1))


def llama70b_tp():
  """zjax inspect target with tensor parallelism: (loss_fn, params, batch, config,
  tensor_specs); plan it with --mesh R x S x T --axes replica,fsdp,tensor."""
  import zjax

  params = shapes()
  stacked = params.pop("layers")
  params["layers"] = [
    jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
    for _ in range(LAYERS)
  ]
  batch = {"tokens": jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)}
  config = zjax.ZeroConfig(
    compute_dtype=jnp.bfloat16, max_live_parameters=int(2e9), tensor_axes=("tensor",)
  )
  return unrolled_loss_fn, params, batch, config, TENSOR_RULES
