"""Small models written the way Flax users write them (our own versions of common public
architectures), as test fixtures: each is a `Case` with a loss, params, a batch, optional
non-parameter state (`extra`) and the plain single-device loss to compare with.

  resnet_syncbn  ResNet blocks with BatchNorm(axis_name="fsdp") (synchronised statistics)
  resnet18       the same blocks in ResNet-18's layout (not in CASES: slow to compile)
  encdec         encoder-decoder, one embedding shared by encoder, decoder and output
  nnx_gqa        NNX decoder: grouped-query attention, qk-norm, sliding-window and global
                 layers, logit soft-caps, tied embedding
  rnn_lstm       two LSTMs through nn.RNN, classifier head
  bilstm_scan    bidirectional LSTM through nn.scan(variable_broadcast="params")
  griffin        Griffin-style recurrent LM: every layer an nn.remat block holding a
                 causal depthwise conv, an RG-LRU whose sqrt has a custom_vjp (bounded
                 derivative) and its own lax.scan over time; identical layers (rolled)
  t5             T5-style encoder-decoder: RMSNorm, no biases, relative position bias
                 held by the first layer of each stack and reused by the others, dropout
  llama          Llama-style decoder: RMSNorm, GQA, SwiGLU, rotary tables either computed
                 once before the layers or built by each layer as its own numpy constant
                 (as Hugging Face's Flax Llama does), a causal mask built once
  bert           BERT-style post-LN encoder: q/k/v with biases, heads split by reshape, a
                 padding mask built once and added in every layer, tied MLM head
  mlp5           a 5-layer MLP written as a pure function over a list of dicts (the way
                 plain-JAX users write one)
  eqx_mlp        the same as equinox's eqx.nn.MLP computes it: weights [out, in], one
                 example's matrix-vector products, jax.vmap over the batch
"""

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zjax
from helpers import init
from zjax._src.layout import layout


@dataclasses.dataclass(frozen=True)
class Case:
  loss_fn: Callable  # (params, batch) -> loss, or (params, batch, extra) -> (loss, extra)
  params: Any
  batch: Any
  extra: Any = None
  reference_loss_fn: Callable = None  # the same on one device and the full batch


def gspmd_fsdp_temp(case: Case, mesh) -> int:
  """Compiled temp per device of GSPMD FSDP's gradient step on `case`, the baseline of
  activation memory: every parameter sharded along its largest dimension divisible by the
  mesh's (Auto) axis, the batch over it, `jax.value_and_grad` jitted (zjax bench's
  baseline). A sync-BatchNorm model runs its reference loss: GSPMD's statistics are the
  full batch's."""
  (axis,) = mesh.axis_names
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  params = jax.tree.map(
    lambda x: put(x, layout.largest_dim_spec(x.shape, mesh.size, axis)), case.params
  )
  batch = jax.tree.map(lambda x: put(x, P(axis) if x.ndim else P()), case.batch)
  grad = jax.value_and_grad(case.reference_loss_fn or case.loss_fn, has_aux=case.extra is not None)
  args = (params, batch) if case.extra is None else (params, batch, case.extra)
  program = zjax.hlo.compile_for_analysis(jax.jit(grad).lower(*args))
  return zjax.hlo.summarize(program)["temp_bytes"]


def cross_entropy(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.take_along_axis(logp, labels[..., None], -1).mean()


# ---- ResNet with synchronised BatchNorm -------------------------------------------------
class ResNet(nn.Module):
  """Basic-block ResNet: per stage (features, stride of its first block), `blocks` each."""

  axis_name: str | None = "fsdp"
  stages: tuple = ((8, 1), (16, 2))
  blocks: int = 1

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=0.9,
      axis_name=self.axis_name if train else None,
    )
    x = nn.relu(norm()(nn.Conv(self.stages[0][0], (3, 3), use_bias=False)(x)))
    for features, first_stride in self.stages:
      for block in range(self.blocks):
        strides = first_stride if block == 0 else 1
        y = nn.relu(norm()(nn.Conv(features, (3, 3), strides, use_bias=False)(x)))
        y = norm(scale_init=nn.initializers.zeros)(nn.Conv(features, (3, 3), use_bias=False)(y))
        if strides != 1 or x.shape[-1] != features:
          x = norm()(nn.Conv(features, (1, 1), strides, use_bias=False)(x))
        x = nn.relu(x + y)
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def resnet_syncbn(batch_size=16, axis_name="fsdp", image=8, **arch) -> Case:
  """`axis_name`: the data axes BatchNorm synchronises over (all of them, under HSDP);
  `arch`: ResNet's stages and blocks."""
  model, plain = ResNet(axis_name=axis_name, **arch), ResNet(axis_name=None, **arch)
  x = jax.random.normal(jax.random.key(0), (batch_size, image, image, 3))
  batch = {"x": x, "y": jnp.arange(batch_size) % 10}
  variables = init(plain, jax.random.key(1), x, train=False)
  # non-trivial statistics: one full-batch update from the initial ones
  _, stats = jax.jit(functools.partial(plain.apply, mutable=["batch_stats"]))(variables, x)

  def make_loss(m):
    def loss_fn(params, batch, extra):
      logits, updates = m.apply({"params": params, **extra}, batch["x"], mutable=["batch_stats"])
      return cross_entropy(logits, batch["y"]), {"batch_stats": updates["batch_stats"]}

    return loss_fn

  return Case(make_loss(model), variables["params"], batch, dict(stats), make_loss(plain))


def resnet18(batch_size=16, width=16, image=32) -> Case:
  """ResNet-18's layout (4 stages of 2 basic blocks, widths w, 2w, 4w, 8w) with sync
  BatchNorm, on `image` x `image` inputs."""
  stages = ((width, 1), (2 * width, 2), (4 * width, 2), (8 * width, 2))
  return resnet_syncbn(batch_size, image=image, stages=stages, blocks=2)


# ---- encoder-decoder with one shared embedding ------------------------------------------
class EncoderDecoder(nn.Module):
  vocab: int = 37  # odd on purpose: the embedding does not divide by the device count
  d: int = 32

  def setup(self):
    self.shared = nn.Embed(self.vocab, self.d)
    attention = functools.partial(nn.MultiHeadDotProductAttention, num_heads=4, qkv_features=self.d)
    self.enc_attn, self.dec_attn, self.cross_attn = attention(), attention(), attention()
    self.enc_mlp = nn.Sequential([nn.Dense(2 * self.d), nn.gelu, nn.Dense(self.d)])
    self.dec_mlp = nn.Sequential([nn.Dense(2 * self.d), nn.gelu, nn.Dense(self.d)])
    self.norms = [nn.LayerNorm() for _ in range(5)]

  def __call__(self, src, tgt):
    enc = self.shared(src)
    enc = enc + self.enc_attn(self.norms[0](enc))
    enc = enc + self.enc_mlp(self.norms[1](enc))
    dec = self.shared(tgt)
    causal = nn.make_causal_mask(tgt)
    dec = dec + self.dec_attn(self.norms[2](dec), mask=causal)
    dec = dec + self.cross_attn(self.norms[3](dec), enc)
    dec = dec + self.dec_mlp(self.norms[4](dec))
    return self.shared.attend(dec)


def encdec(batch_size=16) -> Case:
  model = EncoderDecoder()
  src = jax.random.randint(jax.random.key(0), (batch_size, 10), 0, model.vocab)
  tgt = jax.random.randint(jax.random.key(1), (batch_size, 9), 0, model.vocab)
  params = init(model, jax.random.key(2), src, tgt[:, :-1])["params"]

  def loss_fn(p, b):
    logits = model.apply({"params": p}, b["src"], b["tgt"][:, :-1])
    return cross_entropy(logits, b["tgt"][:, 1:])

  return Case(loss_fn, params, {"src": src, "tgt": tgt}, reference_loss_fn=loss_fn)


# ---- NNX decoder: GQA, qk-norm, sliding window, soft-caps ------------------------------
COLUMN, ROW = (None, "tensor"), ("tensor", None)  # tensor_parallel=True: Megatron's splits


def _linear(d_in, d_out, sharding, rngs):
  """A bias-free nnx.Linear, its kernel annotated with `sharding` names when given."""
  init = nnx.initializers.lecun_normal()
  if sharding is not None:
    init = nnx.with_partitioning(init, sharding)
  return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=init, rngs=rngs)


class GQAttention(nnx.Module):
  def __init__(self, d, heads, kv_heads, window, rngs, tp=False):
    self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, d // heads, window
    self.q = _linear(d, heads * self.head_dim, COLUMN if tp else None, rngs)
    self.kv = _linear(d, 2 * kv_heads * self.head_dim, COLUMN if tp else None, rngs)
    self.o = _linear(heads * self.head_dim, d, ROW if tp else None, rngs)
    self.q_norm = nnx.RMSNorm(self.head_dim, rngs=rngs)
    self.k_norm = nnx.RMSNorm(self.head_dim, rngs=rngs)

  def __call__(self, x):
    b, t, _ = x.shape
    q = self.q_norm(self.q(x).reshape(b, t, self.heads, self.head_dim))
    k, v = jnp.split(self.kv(x).reshape(b, t, 2 * self.kv_heads, self.head_dim), 2, axis=2)
    k = jnp.repeat(self.k_norm(k), self.heads // self.kv_heads, axis=2)
    v = jnp.repeat(v, self.heads // self.kv_heads, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(self.head_dim)
    logits = 50.0 * jnp.tanh(logits / 50.0)  # attention soft-cap
    pos = jnp.arange(t)
    allowed = pos[:, None] >= pos[None, :]
    if self.window:
      allowed &= pos[:, None] - pos[None, :] < self.window
    logits = jnp.where(allowed, logits, -1e9)
    out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, -1), v)
    return self.o(out.reshape(b, t, -1))


class GQABlock(nnx.Module):
  def __init__(self, d, window, rngs, tp=False):
    self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
    self.attn = GQAttention(d, heads=4, kv_heads=2, window=window, rngs=rngs, tp=tp)
    self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
    self.gate = _linear(d, 2 * d, COLUMN if tp else None, rngs)
    self.up = _linear(d, 2 * d, COLUMN if tp else None, rngs)
    self.down = _linear(2 * d, d, ROW if tp else None, rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x))
    h = self.mlp_norm(x)
    return x + self.down(nnx.gelu(self.gate(h)) * self.up(h))


class GQADecoder(nnx.Module):
  def __init__(self, vocab=61, d=32, layers=3, window=4, *, rngs, tp=False):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)  # 61 rows: replicated over a tensor axis
    # alternating local (sliding-window) and global layers
    self.blocks = nnx.List(
      [GQABlock(d, window if i % 2 == 0 else 0, rngs, tp) for i in range(layers)]
    )
    self.final_norm = nnx.RMSNorm(d, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) * jnp.sqrt(32.0)
    for block in self.blocks:
      x = block(x)
    logits = self.embed.attend(self.final_norm(x))
    return 30.0 * jnp.tanh(logits / 30.0)  # final logit soft-cap


def nnx_gqa(batch_size=16, tensor_parallel=False) -> Case:
  """tensor_parallel: q, kv, gate, up split by columns and o, down by rows over "tensor"
  (nnx.with_partitioning; the variables carry the names, no mesh needed)."""
  with nnx.use_eager_sharding(False):
    model = GQADecoder(rngs=nnx.Rngs(0), tp=tensor_parallel)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(3), (batch_size, 13), 0, 61)

  def loss_fn(p, b):
    logits = nnx.merge(graphdef, p, rest)(b["tokens"][:, :-1])
    return cross_entropy(logits, b["tokens"][:, 1:])

  return Case(loss_fn, params, {"tokens": tokens}, reference_loss_fn=loss_fn)


# ---- LSTMs ---------------------------------------------------------------------------------
class RNNClassifier(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.RNN(nn.LSTMCell(24))(x)
    h = nn.RNN(nn.OptimizedLSTMCell(24))(h)
    return nn.Dense(5)(h[:, -1])


class ScanLSTM(nn.Module):
  features: int
  reverse: bool = False

  @nn.compact
  def __call__(self, x):
    cell = nn.scan(
      nn.OptimizedLSTMCell,
      variable_broadcast="params",
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
      reverse=self.reverse,
    )(self.features)
    zeros = jnp.zeros((x.shape[0], self.features), x.dtype)
    _, ys = cell((zeros, zeros), x)
    return ys


class BiLSTM(nn.Module):
  @nn.compact
  def __call__(self, x):
    both = jnp.concatenate([ScanLSTM(16)(x), ScanLSTM(16, reverse=True)(x)], -1)
    return nn.Dense(5)(both.mean(axis=1))


def _sequence_case(model, batch_size) -> Case:
  x = jax.random.normal(jax.random.key(4), (batch_size, 7, 12))
  y = jnp.arange(batch_size) % 5
  params = init(model, jax.random.key(5), x)["params"]

  def loss_fn(p, b):
    return cross_entropy(model.apply({"params": p}, b["x"]), b["y"])

  return Case(loss_fn, params, {"x": x, "y": y}, reference_loss_fn=loss_fn)


def rnn_lstm(batch_size=16) -> Case:
  return _sequence_case(RNNClassifier(), batch_size)


def bilstm_scan(batch_size=16) -> Case:
  return _sequence_case(BiLSTM(), batch_size)


# ---- Griffin-style recurrent LM -----------------------------------------------------------
@jax.custom_vjp
def sqrt_bounded_derivative(x):
  """sqrt(x) whose derivative is capped (at x -> 0), as Griffin's RG-LRU writes it."""
  return jnp.sqrt(x)


def _sqrt_forward(x):
  return jnp.sqrt(x), x


def _sqrt_backward(x, g):
  return (g / (2 * jnp.sqrt(jnp.maximum(x, 1e-6))),)


sqrt_bounded_derivative.defvjp(_sqrt_forward, _sqrt_backward)


class RGLRU(nn.Module):
  """Real-gated linear recurrent unit: h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)."""

  width: int

  @nn.compact
  def __call__(self, x):
    input_gate = nn.sigmoid(nn.Dense(self.width, name="input_gate")(x))
    a_gate = nn.sigmoid(nn.Dense(self.width, name="a_gate")(x))
    a_param = self.param("a_param", nn.initializers.uniform(2.0), (self.width,))
    log_a = -8.0 * a_gate * nn.softplus(a_param)
    gated = x * input_gate * sqrt_bounded_derivative(1.0 - jnp.exp(2.0 * log_a))

    def step(h, inputs):
      a_t, x_t = inputs
      h = a_t * h + x_t
      return h, h

    h0 = jnp.zeros((x.shape[0], self.width), x.dtype)
    _, ys = jax.lax.scan(step, h0, (jnp.exp(log_a).swapaxes(0, 1), gated.swapaxes(0, 1)))
    return ys.swapaxes(0, 1)


class GriffinBlock(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    h = nn.RMSNorm()(x)
    y = nn.gelu(nn.Dense(self.width)(h))
    r = nn.Conv(self.width, (4,), padding=((3, 0),), feature_group_count=self.width)(
      nn.Dense(self.width)(h)
    )  # causal depthwise temporal conv
    x = x + nn.Dense(x.shape[-1])(RGLRU(self.width)(r) * y)
    h = nn.RMSNorm()(x)
    return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(h)))


class Griffin(nn.Module):
  vocab: int = 61
  d: int = 32
  layers: int = 3

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.d)
    x = embed(tokens) * jnp.sqrt(float(self.d))
    for _ in range(self.layers):
      x = nn.remat(GriffinBlock)(2 * self.d)(x)
    return embed.attend(nn.RMSNorm()(x))


def griffin(batch_size=16, layers=3) -> Case:
  model = Griffin(layers=layers)
  tokens = jax.random.randint(jax.random.key(6), (batch_size, 12), 0, model.vocab)
  params = init(model, jax.random.key(7), tokens[:, :-1])["params"]

  def loss_fn(p, b):
    logits = model.apply({"params": p}, b["tokens"][:, :-1])
    return cross_entropy(logits, b["tokens"][:, 1:])

  return Case(loss_fn, params, {"tokens": tokens}, reference_loss_fn=loss_fn)


# ---- T5-style encoder-decoder ---------------------------------------------------------------
def relative_buckets(q_len, k_len, bidirectional, num_buckets=8, max_distance=16):
  """T5's bucketing of key-minus-query offsets: exact for small ones, log-spaced after."""
  offset = jnp.arange(k_len)[None, :] - jnp.arange(q_len)[:, None]
  buckets = 0
  if bidirectional:
    num_buckets //= 2
    buckets = (offset > 0).astype(jnp.int32) * num_buckets
    offset = jnp.abs(offset)
  else:
    offset = -jnp.minimum(offset, 0)
  exact = num_buckets // 2
  log_bucket = exact + (
    jnp.log(jnp.maximum(offset, 1) / exact) / jnp.log(max_distance / exact) * (num_buckets - exact)
  ).astype(jnp.int32)
  return buckets + jnp.where(offset < exact, offset, jnp.minimum(log_bucket, num_buckets - 1))


class T5Attention(nn.Module):
  heads: int
  bidirectional: bool = True
  has_bias: bool = False  # the first layer of a stack holds the relative position bias
  rate: float = 0.1

  @nn.compact
  def __call__(self, x, context=None, bias=None, mask=None, train=True):
    d = x.shape[-1]
    context = x if context is None else context
    split = lambda y: y.reshape(y.shape[:2] + (self.heads, d // self.heads))  # noqa: E731
    q = split(nn.Dense(d, use_bias=False, name="q")(x))
    k = split(nn.Dense(d, use_bias=False, name="k")(context))
    v = split(nn.Dense(d, use_bias=False, name="v")(context))
    if self.has_bias:
      table = nn.Embed(8, self.heads, name="relative_attention_bias")
      bias = table(relative_buckets(x.shape[1], context.shape[1], self.bidirectional))
      bias = bias.transpose(2, 0, 1)[None]  # [1, heads, q, k]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # T5: no 1/sqrt(d) scaling
    if bias is not None:
      logits = logits + bias
    if mask is not None:
      logits = jnp.where(mask, logits, -1e9)
    weights = nn.Dropout(self.rate, deterministic=not train)(jax.nn.softmax(logits, -1))
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape)
    return nn.Dense(d, use_bias=False, name="o")(out), bias


class T5Layer(nn.Module):
  decoder: bool = False
  has_bias: bool = False
  rate: float = 0.1

  @nn.compact
  def __call__(self, x, bias, enc=None, train=True):
    drop = nn.Dropout(self.rate, deterministic=not train)
    mask = nn.make_causal_mask(x[..., 0]) if self.decoder else None
    y, bias = T5Attention(4, not self.decoder, self.has_bias, self.rate, name="self_attn")(
      nn.RMSNorm()(x), bias=bias, mask=mask, train=train
    )
    x = x + drop(y)
    if self.decoder:
      y, _ = T5Attention(4, rate=self.rate, name="cross_attn")(nn.RMSNorm()(x), enc, train=train)
      x = x + drop(y)
    h = nn.relu(nn.Dense(2 * x.shape[-1], use_bias=False)(nn.RMSNorm()(x)))
    return x + drop(nn.Dense(x.shape[-1], use_bias=False)(drop(h))), bias


class T5(nn.Module):
  vocab: int = 37
  d: int = 32
  layers: int = 3

  @nn.compact
  def __call__(self, src, tgt, train=True):
    shared = nn.Embed(self.vocab, self.d)
    x, bias = shared(src), None
    for i in range(self.layers):
      x, bias = T5Layer(has_bias=i == 0, name=f"encoder_{i}")(x, bias, train=train)
    enc = nn.RMSNorm()(x)
    y, bias = shared(tgt), None
    for i in range(self.layers):
      y, bias = T5Layer(decoder=True, has_bias=i == 0, name=f"decoder_{i}")(
        y, bias, enc, train=train
      )
    return shared.attend(nn.RMSNorm()(y) * self.d**-0.5)


def t5(batch_size=16, layers=3) -> Case:
  """Dropout on: the batch carries one key (zjax folds each device's position into it)."""
  model = T5(layers=layers)
  src = jax.random.randint(jax.random.key(8), (batch_size, 10), 0, model.vocab)
  tgt = jax.random.randint(jax.random.key(9), (batch_size, 9), 0, model.vocab)
  params = init(model, jax.random.key(10), src, tgt[:, :-1], train=False)["params"]

  def loss_fn(p, b):
    logits = model.apply({"params": p}, b["src"], b["tgt"][:, :-1], rngs={"dropout": b["dropout"]})
    return cross_entropy(logits, b["tgt"][:, 1:])

  batch = {"src": src, "tgt": tgt, "dropout": jax.random.key(11)}
  return Case(loss_fn, params, batch, reference_loss_fn=loss_fn)


# ---- Llama-style decoder -----------------------------------------------------------------


def rope_tables(seq_len, head_dim, xp=np, base=10000.0):
  """(sin, cos) [seq_len, head_dim / 2]: numpy constants (xp=np) or traced ops (xp=jnp)."""
  inverse = 1.0 / base ** (xp.arange(0, head_dim, 2) / head_dim)
  angles = xp.arange(seq_len)[:, None] * inverse[None, :]
  return xp.sin(angles).astype(np.float32), xp.cos(angles).astype(np.float32)


def apply_rope(x, sin, cos):  # x: [batch, seq, heads, head_dim]
  x1, x2 = jnp.split(x, 2, axis=-1)
  sin, cos = sin[None, :, None, :], cos[None, :, None, :]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class LlamaAttention(nn.Module):
  heads: int
  kv_heads: int
  own_tables: bool  # build the rotary tables here (a numpy constant per layer)

  @nn.compact
  def __call__(self, x, mask, tables):
    b, s, d = x.shape
    hd = d // self.heads
    if self.own_tables:
      tables = rope_tables(s, hd)
    sin, cos = tables
    q = nn.Dense(d, use_bias=False, name="q_proj")(x).reshape(b, s, self.heads, hd)
    k = nn.Dense(self.kv_heads * hd, use_bias=False, name="k_proj")(x)
    v = nn.Dense(self.kv_heads * hd, use_bias=False, name="v_proj")(x)
    k, v = (t.reshape(b, s, self.kv_heads, hd) for t in (k, v))
    q, k = apply_rope(q, sin, cos), apply_rope(k, sin, cos)
    k, v = (jnp.repeat(t, self.heads // self.kv_heads, axis=2) for t in (k, v))
    w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    w = jax.nn.softmax(jnp.where(mask, w, jnp.finfo(w.dtype).min), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, d)
    return nn.Dense(d, use_bias=False, name="o_proj")(out)


class LlamaLayer(nn.Module):
  heads: int
  kv_heads: int
  d_ff: int
  own_tables: bool

  @nn.compact
  def __call__(self, x, mask, tables):
    h = nn.RMSNorm(name="input_layernorm")(x)
    x = x + LlamaAttention(self.heads, self.kv_heads, self.own_tables, name="self_attn")(
      h, mask, tables
    )
    h = nn.RMSNorm(name="post_attention_layernorm")(x)
    gate = nn.Dense(self.d_ff, use_bias=False, name="gate_proj")(h)
    up = nn.Dense(self.d_ff, use_bias=False, name="up_proj")(h)
    return x + nn.Dense(x.shape[-1], use_bias=False, name="down_proj")(nn.silu(gate) * up)


class Llama(nn.Module):
  vocab: int = 61
  d: int = 64
  layers: int = 3
  heads: int = 4
  kv_heads: int = 2
  d_ff: int = 128
  own_tables: bool = False

  @nn.compact
  def __call__(self, tokens):
    s = tokens.shape[1]
    x = nn.Embed(self.vocab, self.d, name="embed_tokens")(tokens)
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None]  # causal, built once
    # else computed once, before the layers, and read by every layer
    tables = None if self.own_tables else rope_tables(s, self.d // self.heads, jnp)
    for i in range(self.layers):
      x = LlamaLayer(self.heads, self.kv_heads, self.d_ff, self.own_tables, name=f"layers_{i}")(
        x, mask, tables
      )
    return nn.Dense(self.vocab, use_bias=False, name="lm_head")(nn.RMSNorm(name="norm")(x))


def llama(batch_size=8, own_tables=False, layers=3) -> Case:
  model = Llama(layers=layers, own_tables=own_tables)
  tokens = jax.random.randint(jax.random.key(12), (batch_size, 17), 0, model.vocab)
  params = init(model, jax.random.key(13), tokens[:, :-1])["params"]

  def loss_fn(p, b):
    return cross_entropy(model.apply({"params": p}, b["tokens"][:, :-1]), b["tokens"][:, 1:])

  return Case(loss_fn, params, {"tokens": tokens}, reference_loss_fn=loss_fn)


# ---- BERT-style post-LN encoder --------------------------------------------------------------
class BertLayer(nn.Module):
  heads: int
  d_ff: int
  rate: float

  @nn.compact
  def __call__(self, x, mask_bias, train):
    b, s, d = x.shape
    drop = nn.Dropout(self.rate, deterministic=not train)
    heads = lambda name: nn.Dense(d, name=name)(x).reshape(b, s, self.heads, d // self.heads)
    q, k, v = heads("query"), heads("key"), heads("value")
    w = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads) + mask_bias
    w = drop(jax.nn.softmax(w, axis=-1))
    out = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, d)
    x = nn.LayerNorm(name="attention_norm")(x + drop(nn.Dense(d, name="attention_out")(out)))
    h = nn.gelu(nn.Dense(self.d_ff, name="intermediate")(x))
    return nn.LayerNorm(name="output_norm")(x + drop(nn.Dense(d, name="output")(h)))


class Bert(nn.Module):
  vocab: int = 53
  d: int = 64
  layers: int = 3
  heads: int = 4
  d_ff: int = 128
  rate: float = 0.1

  @nn.compact
  def __call__(self, tokens, attention_mask, train=True):
    embed = nn.Embed(self.vocab, self.d, name="word_embeddings")
    positions = self.param(
      "position_embeddings", nn.initializers.normal(0.02), (tokens.shape[1], self.d)
    )
    x = nn.LayerNorm(name="embeddings_norm")(embed(tokens) + positions)
    x = nn.Dropout(self.rate, deterministic=not train)(x)
    # built once, read by every layer: 0 where a token is real, a large negative on padding
    mask_bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, -1e9)
    for i in range(self.layers):
      x = BertLayer(self.heads, self.d_ff, self.rate, name=f"layer_{i}")(x, mask_bias, train)
    h = nn.LayerNorm(name="mlm_norm")(nn.gelu(nn.Dense(self.d, name="mlm_dense")(x)))
    return embed.attend(h) + self.param("mlm_bias", nn.initializers.zeros, (self.vocab,))


def bert(batch_size=8, layers=3, dropout=False) -> Case:
  """Padding: each row's last few tokens are masked out (different counts per row)."""
  model = Bert(layers=layers, rate=0.1 if dropout else 0.0)
  tokens = jax.random.randint(jax.random.key(14), (batch_size, 16), 0, model.vocab)
  lengths = 16 - jnp.arange(batch_size) % 5
  attention_mask = (jnp.arange(16)[None, :] < lengths[:, None]).astype(jnp.int32)
  params = init(model, jax.random.key(15), tokens, attention_mask, train=False)["params"]

  def loss_fn(p, b):
    logits = model.apply(
      {"params": p},
      b["tokens"],
      b["attention_mask"],
      train=dropout,
      rngs={"dropout": b["dropout"]} if dropout else {},
    )
    return cross_entropy(logits, b["tokens"])

  batch = {"tokens": tokens, "attention_mask": attention_mask}
  if dropout:
    batch["dropout"] = jax.random.key(16)
  return Case(loss_fn, params, batch, reference_loss_fn=loss_fn)


# ---- a plain-JAX MLP -------------------------------------------------------------------------
def mlp5(batch_size=16, width=64, layers=5) -> Case:
  keys = jax.random.split(jax.random.key(17), layers)
  params = [
    {"weight": jax.random.normal(k, (width, width)) / np.sqrt(width), "bias": jnp.zeros(width)}
    for k in keys
  ]

  def loss_fn(p, b):
    x = b["x"]
    for i, layer in enumerate(p):
      x = x @ layer["weight"] + layer["bias"]
      x = jax.nn.relu(x) if i < len(p) - 1 else x
    return jnp.mean((x - b["y"]) ** 2)

  batch = {
    "x": jax.random.normal(jax.random.key(18), (batch_size, width)),
    "y": jax.random.normal(jax.random.key(19), (batch_size, width)),
  }
  return Case(loss_fn, params, batch, reference_loss_fn=loss_fn)


def eqx_mlp(batch_size=32, in_size=16, width=64, out_size=4, depth=4) -> Case:
  """eqx.nn.MLP(in_size, out_size, width, depth) as equinox runs it: `depth + 1` Linear
  layers (weight [out, in], bias), relu between them, called on one example and vmapped
  over the batch (equinox's own uniform init)."""
  sizes = [in_size] + [width] * depth + [out_size]
  keys = jax.random.split(jax.random.key(23), 2 * depth + 2)
  params = []
  for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    bound = 1 / np.sqrt(d_in)
    uniform = functools.partial(jax.random.uniform, minval=-bound, maxval=bound)
    params.append(
      {"weight": uniform(keys[2 * i], (d_out, d_in)), "bias": uniform(keys[2 * i + 1], (d_out,))}
    )

  def one_example(p, x):
    for i, layer in enumerate(p):
      x = layer["weight"] @ x + layer["bias"]
      x = jax.nn.relu(x) if i < len(p) - 1 else x
    return x

  def loss_fn(p, b):
    return jnp.mean((jax.vmap(one_example, in_axes=(None, 0))(p, b["x"]) - b["y"]) ** 2)

  batch = {
    "x": jax.random.normal(jax.random.key(24), (batch_size, in_size)),
    "y": jax.random.normal(jax.random.key(25), (batch_size, out_size)),
  }
  return Case(loss_fn, params, batch, reference_loss_fn=loss_fn)


CASES = {
  "resnet_syncbn": resnet_syncbn,
  "encdec": encdec,
  "nnx_gqa": nnx_gqa,
  "rnn_lstm": rnn_lstm,
  "bilstm_scan": bilstm_scan,
}
# Not in CASES' parity tests: t5's reference differs (dropout draws per device); the CPU
# stress harness (examples/cpu_stress.py) runs griffin and t5, test_rolling.py griffin and
# llama.
STRESS_CASES = {"griffin": griffin, "t5": t5}
