"""The convolution rule: a convolution whose kernel outweighs its image's patches (a deep
stage of a CNN on a small image) runs as matmuls over the patches, reading the kernel in
place. Used by `segments.segment_fn` for the convolutions of gathered, trained kernels."""

import functools

import jax
import jax.numpy as jnp


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
  (ResNet-18's last stage, 9 MiB)."""
  p = op.eqn.params
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
    window = tuple(d for d in range(rhs.ndim) if d != dn.rhs_spec[0])
    out = matmul(patches, rhs, ((tuple(range(patches.ndim - k, patches.ndim)), window), ((), ())))
    return jnp.moveaxis(out, -1, feature).astype(out_dtype)

  def forward(lhs, rhs):
    return run(lhs, rhs), (lhs, rhs)

  def backward(operands, ct):
    lhs, rhs = operands
    patches, unpatch = jax.vjp(lambda x: _patch_matrix(x, rhs.shape, p), lhs)
    k = rhs.ndim - 1
    n = patches.ndim - k  # the output's batch and spatial dims
    # The kernel as the left operand, contracted on its output features: read in place
    # (as the right one, XLA copied it transposed).
    window_ct = matmul(rhs, ct, (((dn.rhs_spec[0],), (feature,)), ((), ())))
    patches_ct = window_ct.transpose([*range(k, window_ct.ndim), *range(k)])
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
