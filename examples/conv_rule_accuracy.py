"""How accurate is zjax's patch-matmul convolution rule, per op, against fp64?

The rule (zjax/_src/program/conv_rule.py) runs a convolution whose kernel outweighs its
image's patches as matmuls. This script prints, for 3x3 kernels on 1x1 to 7x7 images, the
RMS relative error against an fp64 reference of XLA's convolution and of the rule
(forward, image cotangent, kernel cotangent), and the rule's error over XLA's. The table
in docs/results.md ("the rule's sums run in lanes") is its output; `--lanes 1` gives the
"before" column (one running sum per output).

  python examples/conv_rule_accuracy.py [--seeds 4] [--lanes 32]
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from zjax._src.program import conv_rule, trace

NHWC = dict(dimension_numbers=("NHWC", "HWIO", "NHWC"), window_strides=(1, 1), padding="SAME")
NCHW = dict(dimension_numbers=("NCHW", "OIHW", "NCHW"), window_strides=(1, 1), padding="SAME")
SHAPES = [  # (label, image shape, kernel shape, conv args)
  ("2 x 1x1, HWIO 128", (2, 1, 1, 128), (3, 3, 128, 128), NHWC),
  ("2 x 2x2, HWIO 128", (2, 2, 2, 128), (3, 3, 128, 128), NHWC),
  ("2 x 1x1, HWIO 512", (2, 1, 1, 512), (3, 3, 512, 512), NHWC),
  ("16 x 1x1, HWIO 256", (16, 1, 1, 256), (3, 3, 256, 256), NHWC),
  ("2 x 1x1, OIHW 128", (2, 128, 1, 1), (128, 128, 3, 3), NCHW),
  ("2 x 2x2, OIHW 128", (2, 128, 2, 2), (128, 128, 3, 3), NCHW),
  ("16 x 1x1, OIHW 256", (16, 256, 1, 1), (256, 256, 3, 3), NCHW),
  # ResNet-18's last two stages on 224 x 224 images (7x7 and, at 128, 4x4), where the rule
  # applies with few lanes
  ("2 x 4x4, HWIO 256", (2, 4, 4, 256), (3, 3, 256, 256), NHWC),
  ("2 x 7x7, HWIO 512", (2, 7, 7, 512), (3, 3, 512, 512), NHWC),
  ("2 x 7x7, OIHW 512", (2, 512, 7, 7), (512, 512, 3, 3), NCHW),
]


def rule_for(image, kernel, conv_args):
  """The rule's function for `lax.conv_general_dilated(image, kernel, **conv_args)`."""
  traced = trace.trace_program(
    lambda w, x: jnp.sum(jax.lax.conv_general_dilated(x, w, **conv_args)), kernel, image
  )
  (op,) = [op for op in traced.program.ops if op.primitive == "conv_general_dilated"]
  return conv_rule.conv_as_patch_matmul(op, True)


def relative_errors(fn, image, kernel, ct, exact):
  out, vjp = jax.jit(lambda x, w: jax.vjp(fn, x, w))(image, kernel)
  got = [out, *jax.jit(vjp)(ct)]
  return np.array(
    [np.sqrt(np.mean((np.float64(g) - e) ** 2) / np.mean(e**2)) for g, e in zip(got, exact)]
  )


def measure(image_shape, kernel_shape, conv_args, seeds):
  """(XLA's errors, the rule's errors), each (forward, image ct, kernel ct), seed-averaged."""
  conv = functools.partial(jax.lax.conv_general_dilated, **conv_args)
  xla, rule = np.zeros(3), np.zeros(3)
  for seed in range(seeds):
    k = jax.random.split(jax.random.key(seed), 3)
    image, kernel = jax.random.normal(k[0], image_shape), jax.random.normal(k[1], kernel_shape)
    ct = jax.random.normal(k[2], jax.eval_shape(conv, image, kernel).shape)
    with jax.enable_x64(True):
      wide = [jnp.asarray(np.asarray(a), jnp.float64) for a in (image, kernel, ct)]
      out, vjp = jax.vjp(conv, *wide[:2])
      exact = [np.asarray(out), *(np.asarray(c) for c in vjp(wide[2]))]
    xla += relative_errors(conv, image, kernel, ct, exact)
    rule += relative_errors(rule_for(image, kernel, conv_args), image, kernel, ct, exact)
  return xla / seeds, rule / seeds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=4)
  parser.add_argument("--lanes", type=int, default=conv_rule.MAX_LANES, help="MAX_LANES")
  args = parser.parse_args()
  conv_rule.MAX_LANES = args.lanes
  print("| image, kernel (3x3) | XLA's error | the rule's | rule / XLA |")
  print("|---|---|---|---|")
  fmt = lambda v, f: " / ".join(f.format(x) for x in v)  # noqa: E731
  for label, image_shape, kernel_shape, conv_args in SHAPES:
    xla, rule = measure(image_shape, kernel_shape, conv_args, args.seeds)
    print(
      f"| {label} | {fmt(xla, '{:.2e}')} | {fmt(rule, '{:.2e}')} | {fmt(rule / xla, '{:.2f}')} |"
    )


if __name__ == "__main__":
  main()
