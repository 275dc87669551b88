"""The convolution rule: a convolution whose kernel outweighs its image's patches (a deep
stage of a CNN on a small image) runs as matmuls over the patches, reading the kernel in
place. Used by `segments.segment_fn` for the convolutions of gathered, trained kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def kernel_dominated(op, param_views, perturbed) -> bool:
  """Whether `op` is a convolution of a parameter's kernel (differentiated) by an image so
  small that the kernel outweighs twice the image's patches (a deep stage of a CNN on a
  small image): it runs as matmuls over the patches (`conv_as_patch_matmul`). Grouped
  convolutions, mixed dtypes, and kernels whose output features are neither their first
  nor their last dim keep XLA's convolution."""
  if op.primitive != "conv_general_dilated" or len(op.inputs) != 2:
    return False
  rhs = op.inputs[1]
  if not (isinstance(rhs, int) and rhs in param_views and rhs in perturbed):
    return False
  p = op.eqn.params
  if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
    return False
  dn = p["dimension_numbers"]
  kernel = op.eqn.invars[1].aval
  dtypes = {v.aval.dtype for v in (*op.eqn.invars, *op.eqn.outvars)}
  if dtypes != {kernel.dtype} or not jnp.issubdtype(kernel.dtype, jnp.floating):
    return False  # (an output wider than the operands: XLA's own rule)
  if dn.rhs_spec[0] not in (0, kernel.ndim - 1):  # output features first or last
    return False
  out = op.eqn.outvars[0].aval
  if out.size == 0 or kernel.size == 0:
    return False
  positions = out.size // out.shape[dn.out_spec[1]]
  return positions * kernel.size // kernel.shape[dn.rhs_spec[0]] < kernel.size // 2


def conv_as_patch_matmul(op, image_differentiated: bool):
  """`op`, a convolution, as matmuls over the image's patches, forward and backward, each
  reading the kernel in place and emitting the kernel gradient in the kernel's own dim
  order. XLA's CPU convolution copied the kernel of a weight-dominated convolution (one
  whose window is wider than its image, reversed, or transposed for the input cotangent)
  and emitted the kernel gradient input-features-major ([I, H, W, O] for an HWIO kernel),
  copied again for the reduce-scatter: each copy as large as the network's largest buffer
  (ResNet-18's last stage, 9 MiB).

  Window taps that read only padding for every output (a 3x3 kernel on a 1x1 image: all
  but the centre) are left out, their kernel gradient exactly zero: the sums then run over
  the products that are not zero by construction, and need no patches of zeros. A forward
  that would sum in fewer than `MIN_FORWARD_LANES` interleaved lanes is XLA's convolution
  (as accurate as what the rule replaces, by construction)."""
  image_shape, kernel_shape = (v.aval.shape for v in op.eqn.invars)
  taps, params = _live_taps(image_shape, kernel_shape, op.eqn.params) or (None, op.eqn.params)
  conv = _patch_conv(op, params, image_differentiated)
  return conv if taps is None else lambda lhs, rhs: conv(lhs, rhs[taps])


def _live_taps(lhs_shape, rhs_shape, p):
  """(an index of the kernel's taps that read the image for some output, the convolution's
  params with the padding for those taps), or None where every tap does."""
  if any(d != 1 for d in p["lhs_dilation"]):
    return None
  dn = p["dimension_numbers"]
  taps, padding = [slice(None)] * len(rhs_shape), list(p["padding"])
  for i, (image_dim, kernel_dim) in enumerate(zip(dn.lhs_spec[2:], dn.rhs_spec[2:])):
    size, k = lhs_shape[image_dim], rhs_shape[kernel_dim]
    stride, dilation, (lo, hi) = p["window_strides"][i], p["rhs_dilation"][i], padding[i]
    outputs = (size + lo + hi - dilation * (k - 1) - 1) // stride + 1
    live = [
      t for t in range(k) if any(0 <= o * stride + t * dilation - lo < size for o in range(outputs))
    ]
    if not live or (live[0], live[-1]) == (0, k - 1):
      continue
    lo, hi = lo - live[0] * dilation, hi - (k - 1 - live[-1]) * dilation
    if lo >= 0 and hi >= 0:  # (the outputs stay where they were)
      taps[kernel_dim], padding[i] = slice(live[0], live[-1] + 1), (lo, hi)
  if all(t == slice(None) for t in taps):
    return None
  return tuple(taps), {**p, "padding": tuple(padding)}


def _patch_conv(op, p, image_differentiated):
  """The rule for `op` with convolution params `p` (its own, or trimmed to its live taps)."""
  budget_of = int(np.prod(op.eqn.invars[1].aval.shape))  # the whole kernel's elements
  dn = p["dimension_numbers"]
  feature = dn.out_spec[1]
  out_dtype = op.eqn.outvars[0].aval.dtype
  accumulate = jnp.promote_types(op.eqn.invars[1].aval.dtype, jnp.float32)
  matmul = functools.partial(
    jax.lax.dot_general, precision=p["precision"], preferred_element_type=accumulate
  )

  def run(lhs, rhs):
    patches = _patch_matrix(lhs, rhs.shape, p)
    k = rhs.ndim - 1  # the window's dims: the kernel's, less its output features
    window = [d for d in range(rhs.ndim) if d != dn.rhs_spec[0]]
    split = window.index(dn.rhs_spec[1])  # the sum runs in lanes over input features
    chunked, lanes = _lane_count(rhs, patches, window, split, budget_of)
    if not chunked and lanes < MIN_FORWARD_LANES:
      return _xla_convolution(lhs, rhs, p).astype(out_dtype)
    out = _lane_dot(
      rhs, patches, window, range(patches.ndim - k, patches.ndim), split, matmul, budget_of
    )
    return jnp.moveaxis(out, -1, feature).astype(out_dtype)

  def forward(lhs, rhs):
    return run(lhs, rhs), (lhs, rhs)

  def backward(operands, ct):
    lhs, rhs = operands
    patches, unpatch = jax.vjp(lambda x: _patch_matrix(x, rhs.shape, p), lhs)
    k = rhs.ndim - 1
    n = patches.ndim - k  # the output's batch and spatial dims
    patches_ct = _lane_dot(rhs, ct, [dn.rhs_spec[0]], [feature], 0, matmul, budget_of)
    if image_differentiated:
      # The kernel's last read before its gradient is made, so that the two are never live
      # together (ResNet-18's layout at width 32 on 16x16 images: 5.3 -> 3.0 MiB of temp).
      patches_ct, patches = jax.lax.optimization_barrier((patches_ct, patches))
    ct_dims = tuple(d for d in range(ct.ndim) if d != feature)
    if dn.rhs_spec[0] == rhs.ndim - 1:  # output features last: patches^T @ ct
      kernel_ct = matmul(patches, ct, ((tuple(range(n)), ct_dims), ((), ())))
    else:
      kernel_ct = matmul(ct, patches, ((ct_dims, tuple(range(n))), ((), ())))
    (lhs_ct,) = unpatch(patches_ct.astype(patches.dtype))
    return lhs_ct, kernel_ct.astype(rhs.dtype)

  conv = jax.custom_vjp(run)
  conv.defvjp(forward, backward)
  return conv


# A forward whose lanes interleave (a kernel with its output features first) and of which
# fewer than this many fit their budget is XLA's convolution instead: with 4 lanes such a
# forward had 1.14x XLA's error, with 2 1.21x, with 8 0.88x (docs/results.md, issue 42).
MIN_FORWARD_LANES = 8


def _xla_convolution(lhs, rhs, p):
  return jax.lax.conv_general_dilated(
    lhs,
    rhs,
    window_strides=p["window_strides"],
    padding=p["padding"],
    lhs_dilation=p["lhs_dilation"],
    rhs_dilation=p["rhs_dilation"],
    dimension_numbers=p["dimension_numbers"],
    precision=p["precision"],
    preferred_element_type=p.get("preferred_element_type"),
  )


# Each output of the rule's matmuls sums its products in up to this many partial sums, added
# at the end. XLA's CPU dot sums a contraction in one running sum: 1.8-4.1x the error of
# XLA's convolution (which this rule replaces) on 1x1 and 2x2 images, 0.3-1.3x with the
# partial sums (tests/test_conv_patch_matmul.py, against fp64).
MAX_LANES = 32
# What the lanes may add to the matmul's buffers, as a fraction of the whole kernel (its
# taps left out or not): the partial outputs of contiguous chunks (on CPU, XLA fuses their
# sum into the matmul: measured, no temp added), and the block-diagonal copy of interleaved
# lanes (a buffer of its own).
CHUNKS_BUDGET = 1
INTERLEAVED_BUDGET = 1 / 4


def _lane_dot(kernel, other, kernel_dims, other_dims, split, matmul, budget_of):
  """`other` times `kernel`, contracting `kernel_dims` with `other_dims`, as a dims-ordered
  [other's free dims, kernel's free dims]; each output's sum over the `split`-th pair of
  them cut into lanes, summed apart and then added: the rounding error of a sum of n
  products falls from ~n to ~n/lanes + lanes roundings.

  The kernel is read in place: its dims are only split (a bitcast), and it is the matmul's
  left operand where its first dim is free, else its right one, so that XLA finds its free
  and summed dims in the order it wants them (otherwise it copies the kernel to get it).
  Where the kernel's dims before the split one are all summed (an HWIO kernel's window in
  the forward, an OIHW kernel's output features in the input cotangent), the lanes are
  contiguous chunks of it and they and those dims become the matmul's batch dims, leading
  in the kernel: the partial outputs are the extra buffer. Elsewhere the lanes interleave
  (lane j takes the indices = j mod lanes) through a block-diagonal copy of `other`, lanes
  times its size. Lanes are halved until that buffer fits its budget (`CHUNKS_BUDGET`,
  `INTERLEAVED_BUDGET`)."""
  kd, od = kernel_dims[split], other_dims[split]
  # the pairs in the kernel's dim order: the matmul reads the kernel's summed dims in the
  # order they lie in memory (another order, and XLA copies the kernel to match it)
  kernel_dims, other_dims = zip(*sorted(zip(kernel_dims, other_dims)))
  kernel_dims, other_dims, split = list(kernel_dims), list(other_dims), kernel_dims.index(kd)
  size = kernel.shape[kd]
  chunked, lanes = _lane_count(kernel, other, kernel_dims, split, budget_of)
  kernel_first = 0 not in kernel_dims
  kernel_free = kernel.ndim - len(kernel_dims)

  def dot(kernel, other, dims, batch=((), ())):
    """[batch dims, other's free dims, kernel's free dims] (`dims`: the summed pairs)."""
    if kernel_first:  # [batch, kernel's free dims, other's] -> ours
      out = matmul(kernel, other, (dims, batch))
      b = len(batch[0])
      theirs = list(range(b, b + kernel_free))
      return out.transpose([*range(b), *range(b + kernel_free, out.ndim), *theirs])
    return matmul(other, kernel, (dims[::-1], batch[::-1]))

  if lanes == 1:
    return dot(kernel, other, (kernel_dims, other_dims))
  shift = lambda dims, at: [d + (d > at) for d in dims]  # noqa: E731
  kernel_dims, other_dims = shift(kernel_dims, kd), shift(other_dims, od)
  if chunked:
    kernel = kernel.reshape(kernel.shape[:kd] + (lanes, size // lanes) + kernel.shape[kd + 1 :])
    other = other.reshape(other.shape[:od] + (lanes, size // lanes) + other.shape[od + 1 :])
    # the pairs up to the split one lead the kernel: batch dims; the chunk and the rest summed
    dims = [kd + 1] + kernel_dims[split + 1 :], [od + 1] + other_dims[split + 1 :]
    batch = kernel_dims[: split + 1], other_dims[: split + 1]
    return dot(kernel, other, dims, batch).sum(tuple(range(len(batch[0]))))
  kernel = kernel.reshape(kernel.shape[:kd] + (size // lanes, lanes) + kernel.shape[kd + 1 :])
  other = other.reshape(other.shape[:od] + (size // lanes, lanes) + other.shape[od + 1 :])
  # other[..., i, j, ...] -> [..., i, j, ..., lane]: nonzero only where j == lane (a select,
  # not a product: an inf stays in its own lane)
  diagonal = jnp.eye(lanes, dtype=bool).reshape((lanes,) + (1,) * (other.ndim - od - 2) + (lanes,))
  other = jnp.where(diagonal, other[..., None], jnp.zeros((), other.dtype))
  kernel_dims.insert(split + 1, kd + 1)
  other_dims.insert(split + 1, od + 1)
  out = dot(kernel, other, (kernel_dims, other_dims))  # [other's free dims, lane, kernel's]
  return out.sum(other.ndim - len(other_dims) - 1)


def _lane_count(kernel, other, kernel_dims, split, budget_of) -> tuple[bool, int]:
  """(whether the lanes are contiguous chunks, how many) of a sum over `kernel_dims` cut
  at `kernel_dims[split]`: chunks where every kernel dim before that one is summed too."""
  kd = kernel_dims[split]
  dims = sorted(kernel_dims)
  chunked = dims.index(kd) == kd
  return chunked, _lanes(kernel, other, dims, dims.index(kd), budget_of, chunked)


def _lanes(kernel, other, kernel_dims, split, budget_of, chunked) -> int:
  """The most lanes, a power of two up to `MAX_LANES` dividing the split dim, whose extra
  buffer fits its budget: the partial outputs (one per lane and per leading kernel
  index) if `chunked`, else the block-diagonal copy of `other`."""
  kd = kernel_dims[split]
  summed = int(np.prod([kernel.shape[d] for d in kernel_dims]))
  if chunked:
    per_lane = int(np.prod(kernel.shape[:kd])) * (kernel.size // summed) * (other.size // summed)
  else:
    per_lane = other.size
  budget = (CHUNKS_BUDGET if chunked else INTERLEAVED_BUDGET) * budget_of
  lanes = MAX_LANES
  while lanes > 1 and (kernel.shape[kd] % lanes or per_lane * lanes > budget):
    lanes //= 2
  return lanes


def _patch_matrix(lhs, kernel_shape, p):
  """The image's patches for the convolution of params `p`, as an array whose dims are the
  output's batch and spatial dims (in the output's order), then the kernel's dims other
  than its output features (in the kernel's order)."""
  dn = p["dimension_numbers"]
  spatial = [kernel_shape[d] for d in dn.rhs_spec[2:]]
  feature = dn.out_spec[1]
  in_features = kernel_shape[dn.rhs_spec[1]]
  patches = jax.lax.conv_general_dilated_patches(
    lhs,
    spatial,
    p["window_strides"],
    p["padding"],
    p["lhs_dilation"],
    p["rhs_dilation"],
    dimension_numbers=dn,
    precision=jax.lax.Precision.HIGHEST,
  )  # a copy: exact
  # The feature dim is (input features, *window) flattened; split it in place.
  patches = patches.reshape(
    patches.shape[:feature] + (in_features, *spatial) + patches.shape[feature + 1 :]
  )
  position = {
    dn.rhs_spec[1]: feature,
    **{d: feature + 1 + i for i, d in enumerate(dn.rhs_spec[2:])},
  }
  outer = [
    d if d < feature else d + len(spatial)
    for d in range(patches.ndim - len(spatial))
    if d != feature
  ]
  window = [position[d] for d in range(len(kernel_shape)) if d != dn.rhs_spec[0]]
  return patches.transpose(outer + window)
