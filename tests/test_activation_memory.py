"""The activation model (zjax._src.plan.activation_memory): each rule on a hand-sized
program, then the predicted footprint of zjax's step against the analysis compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import real_models
import zjax
from helpers import case_step, mesh_of
from zjax._src.plan import activation_memory as am

X = jax.ShapeDtypeStruct((1024,), jnp.float32)  # 4 KiB
KIB = 4096


def peak(fn, *args):
  """Peak bytes of fn's program, its arguments not counted."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return am.peak_bytes(jaxpr, frozenset(jaxpr.invars))


def test_an_element_wise_chain_into_a_reduction_is_never_stored():
  assert peak(lambda x: jnp.sum(jnp.exp(x * 2.0) + 1.0), X) == 4


def test_a_value_with_two_readers_is_stored():
  # exp(x) lives through both reductions: 4 KiB, plus the two scalars
  assert peak(lambda x: jnp.sum(jnp.exp(x)) + jnp.max(jnp.exp(x) * 1.0), X) < 2 * KIB
  assert peak(lambda x: (lambda y: jnp.sum(y) + jnp.max(y))(jnp.exp(x)), X) == KIB + 8


def test_an_optimization_barrier_aliases_its_inputs():
  w = jax.ShapeDtypeStruct((32, 32), jnp.float32)  # 4 KiB

  def tied(x, w):
    y = x.reshape(32, 32) @ w  # stored: a matmul's result
    (z,) = jax.lax.optimization_barrier((y,))
    return jnp.sum(z @ w) + jnp.sum(y)  # y is read after the barrier too

  # y (= z's buffer) and the second product, and its sum; never y and a copy of it besides
  assert peak(tied, X, w) == 2 * KIB + 4


def test_an_element_wise_result_takes_the_buffer_of_an_input_dying_there():
  def doubled(x):
    y = jnp.cumsum(x)  # not element-wise: stored
    z = y * 2.0  # two readers: stored, in y's buffer (y dies here)
    return jnp.sum(z) + jnp.max(z)

  assert peak(doubled, X) == KIB + 8  # z and the two sums
  # a matmul cannot write over its operand: the operand and the product, both stored
  w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  assert peak(lambda x, w: jnp.sum(jnp.cumsum(x).reshape(32, 32) @ w), X, w) == 2 * KIB


def test_a_transposed_matmul_operand_is_copied_while_it_runs():
  a = jax.ShapeDtypeStruct((64, 16), jnp.float32)  # 4 KiB
  a_t = jax.ShapeDtypeStruct((16, 64), jnp.float32)
  b = jax.ShapeDtypeStruct((16, 64), jnp.float32)
  product = 4 * KIB  # [64, 64]
  # [free, contracting] @ [contracting, free]: the product, then its sum
  assert peak(lambda a, b: jnp.sum(a @ b), a, b) == product + 4
  contract_first = lambda a, b: jnp.sum(jax.lax.dot_general(a, b, (((0,), (0,)), ((), ()))))
  # the same product from a's transpose: a copy of it in [free, contracting] order beside
  assert peak(contract_first, a_t, b) == product + KIB


def test_outputs_hold_temporaries_before_they_are_written():
  mesh = mesh_of(2)

  def body(x):  # per device: a stored temporary of 4 KiB, then an output of 4 KiB
    t = jnp.cumsum(x)
    return jnp.sort(t)  # (a nested program: its input and result are counted once)

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp")))
  x = jax.ShapeDtypeStruct((2048,), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
  footprint = am.step_footprint(step, x)
  assert (footprint.arguments, footprint.outputs) == (KIB, KIB)
  assert footprint.temp == KIB  # the peak holds t and the sort's result: t beyond the output


def test_a_step_without_one_shard_map_is_refused():
  with pytest.raises(ValueError, match="0 shard_map programs"):
    am.step_footprint(jax.jit(lambda x: x + 1), X)


SHARDED = zjax.ZeroConfig(param_persistence_threshold=0)


@pytest.mark.slow
@pytest.mark.parametrize(
  "name,config,n",
  [
    ("llama", zjax.ZeroConfig(), 8),
    ("llama", zjax.ZeroConfig(), 4),
    ("encdec", SHARDED, 8),
    ("encdec", SHARDED, 4),
    ("bert", SHARDED, 8),
  ],
  ids=["llama-8", "llama-4", "encdec-sharded-8", "encdec-sharded-4", "bert-sharded-8"],
)
def test_the_predicted_footprint_is_near_the_analysis_compile(name, config, n):
  """Today's accuracy (docs/results.md, "An activation model"): arguments and outputs
  exact, the footprint within 15% on these models; the measured range over the suite's
  models is 0.64-1.36x (the trainer step autoconfig plans with: 0.71-1.43x), so this is a
  floor to improve on, not the target (10%)."""
  case = getattr(real_models, name)(batch_size=n if name in ("llama", "bert") else 2 * n)
  step, args = case_step(case, config, mesh_of(n))
  m = zjax.hlo.compile_for_analysis(step.lower(*args)).memory_analysis()
  predicted = am.step_footprint(step, *args)
  assert predicted.arguments == m.argument_size_in_bytes
  results = len(jax.tree.leaves(jax.eval_shape(step, *args)))
  # (the compiled outputs add the result tuple's table: 8 bytes per result)
  assert predicted.outputs + 8 * results == m.output_size_in_bytes
  compiled = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  np.testing.assert_allclose(predicted.total, compiled, rtol=0.15)
