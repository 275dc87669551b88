"""Block-wise symmetric quantization of the wire (ZeRO++ qwZ for weight gathers, qgZ for
gradient reductions).

A device's buffer of n values is cut into blocks of `block` values (the last one shorter);
each block gets one float32 scale, s = max|x| / Q (Q = 127 for int8, 7 for int4), and its
values become integers q in [-Q, Q]: round-to-nearest, q = round(x / s), or stochastic
rounding, q = floor(x / s + u) with u uniform in [0, 1), so that E[q s] = x.
Round-to-nearest guarantees |x - q s| <= s / 2; stochastic rounding |x - q s| < s. int4
values travel two per byte. The wire is one int8 buffer per device: the n values (int4: n/2
bytes, rounded up), then the scales' bytes; so a quantized collective is one collective, as
the unquantized one, of n + 4 ceil(n / block) bytes for int8.

Edge cases: an all-zero block (and the zero padding) quantizes to exactly zero (s = 0);
a block whose largest magnitude is below float32's smallest normal (~1.2e-38) may flush to
zero on backends that flush denormals (error below 1.2e-38); a block holding inf or nan
gets a non-finite scale, so every value of the block dequantizes to inf or nan: a
non-finite weight or gradient stays non-finite (the trainer's on_nonfinite policy sees it),
never silently finite.

The uniform numbers of stochastic rounding are hashed from each value's bits and position
(no key to thread through the step): deterministic for given inputs, independent of where
a value falls between two levels.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

LEVELS = {"int8": 127, "int4": 7}  # the largest |q|
SCALE_BYTES = 4  # one float32 scale per block


@dataclasses.dataclass(frozen=True)
class Quantization:
  """How one collective's buffer is quantized."""

  dtype: str  # "int8" or "int4"
  block: int  # values per scale
  stochastic: bool = False  # stochastic rounding (gradients) instead of nearest

  @property
  def levels(self) -> int:
    return LEVELS[self.dtype]

  def blocks(self, n: int) -> int:
    return -(-n // self.block)

  def value_bytes(self, n: int) -> int:
    """Bytes of the quantized values of n elements."""
    return n if self.dtype == "int8" else -(-n // 2)

  def scale_bytes(self, n: int) -> int:
    return self.blocks(n) * SCALE_BYTES

  def wire_bytes(self, n: int) -> int:
    """Bytes one device sends for a buffer of n elements: values, then scales."""
    return self.value_bytes(n) + self.scale_bytes(n)

  def describe(self) -> dict:
    return {
      "dtype": self.dtype,
      "block": self.block,
      "scale_dtype": "float32",
      "rounding": "stochastic" if self.stochastic else "nearest",
    }


def quantize(x, q: Quantization):
  """[..., n] floats -> (values int8 [..., n], scales float32 [..., blocks])."""
  n = x.shape[-1]
  padded = q.blocks(n) * q.block
  x = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, padded - n)])
  blocks = x.reshape(x.shape[:-1] + (q.blocks(n), q.block))
  scales = jnp.max(jnp.abs(blocks), axis=-1, initial=0.0) / np.float32(q.levels)
  # a zero block divides by 1 (all its values are 0); a non-finite scale stays non-finite
  safe = jnp.where(scales == 0, np.float32(1), scales)
  y = blocks / safe[..., None]
  if q.stochastic:
    y = jnp.floor(y + _uniform(blocks))
  else:
    y = jnp.round(y)
  values = jnp.clip(y, -q.levels, q.levels).astype(jnp.int8)
  return values.reshape(x.shape)[..., :n], scales


def dequantize(values, scales, q: Quantization, n: int, dtype):
  """Inverse of `quantize` up to rounding: [..., n] values -> [..., n] in `dtype`."""
  padded = q.blocks(n) * q.block
  values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, padded - n)])
  blocks = values.reshape(values.shape[:-1] + (-1, q.block)).astype(jnp.float32)
  out = (blocks * scales[..., None]).reshape(values.shape)
  return out[..., :n].astype(dtype)


def pack(x, q: Quantization):
  """[..., n] floats -> the int8 wire [..., wire_bytes(n)]: values (int4: two per byte,
  low nibble first), then the scales' bytes."""
  values, scales = quantize(x, q)
  if q.dtype == "int4":
    values = _pack_nibbles(values)
  scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.int8)  # [..., blocks, 4]
  return jnp.concatenate([values, scale_bytes.reshape(scales.shape[:-1] + (-1,))], axis=-1)


def unpack(wire, q: Quantization, n: int, dtype):
  """Inverse of `pack`: the int8 wire [..., wire_bytes(n)] -> [..., n] values in `dtype`."""
  split = q.value_bytes(n)
  values, scale_bytes = wire[..., :split], wire[..., split:]
  if q.dtype == "int4":
    values = _unpack_nibbles(values)[..., :n]
  scales = jax.lax.bitcast_convert_type(
    scale_bytes.reshape(scale_bytes.shape[:-1] + (-1, SCALE_BYTES)), jnp.float32
  )
  return dequantize(values, scales, q, n, dtype)


def _pack_nibbles(values):
  """int8 in [-7, 7], [..., m] -> [..., ceil(m / 2)] bytes (an odd m gets a zero nibble)."""
  if values.shape[-1] % 2:
    values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, 1)])
  nibbles = (values.astype(jnp.uint8) & np.uint8(0xF)).reshape(values.shape[:-1] + (-1, 2))
  return (nibbles[..., 0] | (nibbles[..., 1] << np.uint8(4))).astype(jnp.int8)


def _unpack_nibbles(packed):
  """Inverse of `_pack_nibbles` (sign-extending each nibble)."""
  raw = packed.astype(jnp.uint8)
  pairs = jnp.stack([raw & np.uint8(0xF), raw >> np.uint8(4)], axis=-1)
  signed = pairs.astype(jnp.int8)
  signed = jnp.where(signed > 7, signed - 16, signed)
  return signed.reshape(packed.shape[:-1] + (-1,))


def _uniform(x):
  """Uniform [0, 1) numbers hashed from the bits and position of each value of x."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  position = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape)
  h = bits ^ (position * np.uint32(0x9E3779B9))
  h = (h ^ (h >> np.uint32(16))) * np.uint32(0x85EBCA6B)
  h = (h ^ (h >> np.uint32(13))) * np.uint32(0xC2B2AE35)
  h = h ^ (h >> np.uint32(16))
  return (h >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)
