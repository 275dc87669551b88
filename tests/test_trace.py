"""The trace pass: every parameter leaf's uses, in program order, through nested jaxprs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import zjax
from helpers import custom_vjp_matmul, init


def uses(trace, name):
  (p,) = [p for p in trace.params if p.path == f"['{name}']"]
  return p.uses


def shapes(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


X = jnp.ones((2, 4))


def test_program_order_and_primitives():
  params = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4))}
  t = zjax.trace_program(lambda p, x: (jnp.tanh(x @ p["b"]) @ p["a"]).sum(), params, X)
  assert [u.primitive for u in uses(t, "a")] == ["dot_general"]
  assert uses(t, "b")[0].op < uses(t, "a")[0].op


def test_jit_is_inlined_so_layers_stay_visible():
  params = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4))}

  @jax.jit
  def loss(p, x):
    inner = jax.jit(lambda x, w: jnp.tanh(x @ w))
    return inner(inner(x, p["a"]), p["b"]).sum()

  t = zjax.trace_program(loss, params, X)
  assert uses(t, "a")[0].op < uses(t, "b")[0].op
  assert all(o.primitive != "jit" for o in t.ops)


def test_layout_ops_are_not_uses():
  """A cast or transpose of a param is applied lazily: the use is the consumer."""
  params = {"w": jnp.ones((4, 4))}

  def loss(p, x):
    w = p["w"].astype(jnp.bfloat16).T.reshape(4, 4)
    return jnp.tanh(x.astype(jnp.bfloat16) @ w).astype(jnp.float32).sum()

  t = zjax.trace_program(loss, params, X)
  assert [u.primitive for u in uses(t, "w")] == ["dot_general"]


def test_unused_zero_sized_scalar_and_int_leaves():
  params = {
    "unused": jnp.ones(3),
    "empty": jnp.ones((0, 4)),
    "scalar": jnp.float32(2.0),
    "table": jnp.arange(4, dtype=jnp.int32),
    "w": jnp.ones((4, 4)),
  }

  def loss(p, x):
    h = x @ p["w"] * p["scalar"] + p["empty"].sum()
    return (h[:, p["table"]]).sum()

  t = zjax.trace_program(loss, params, X)
  assert uses(t, "unused") == ()
  assert len(uses(t, "empty")) == 1 and len(uses(t, "scalar")) == 1
  (table,) = [p for p in t.params if p.path == "['table']"]
  assert table.dtype == np.int32 and not table.is_float and table.uses  # index math: >1 op
  (empty,) = [p for p in t.params if p.path == "['empty']"]
  assert empty.size == 0


def test_layer_applied_three_times_and_tied_weights():
  params = {"w": jnp.ones((4, 4)), "emb": jnp.ones((4, 4))}

  def loss(p, x):
    h = x @ p["emb"]
    for _ in range(3):
      h = jnp.tanh(h @ p["w"])
    return (h @ p["emb"].T).sum()

  t = zjax.trace_program(loss, params, X)
  assert len(uses(t, "w")) == 3
  ops = [u.op for u in uses(t, "emb")]
  assert len(ops) == 2 and ops[0] < uses(t, "w")[0].op < uses(t, "w")[-1].op < ops[1]


def test_scan_consts_and_xs():
  params = {"stacked": jnp.ones((3, 4, 4)), "shared": jnp.ones((4, 4))}

  def loss(p, x):
    def body(h, w):
      return jnp.tanh(h @ w) @ p["shared"], None

    h, _ = lax.scan(body, x, p["stacked"])
    return h.sum()

  t = zjax.trace_program(loss, params, X)
  for name in ("stacked", "shared"):
    (u,) = uses(t, name)
    assert t.ops[u.op].primitive == "scan"
    assert u.context.startswith("scan(length=3)") and u.primitive == "dot_general"


def test_cond_switch_branches():
  params = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4)), "c": jnp.ones((4, 4))}

  def loss(p, x):
    h = lax.cond(x.sum() > 0, lambda h: h @ p["a"], lambda h: h @ p["b"], x)
    i = jnp.int32(x.sum()) % 3
    h = lax.switch(i, [lambda h: h, lambda h: h @ p["c"], lambda h: -h], h)
    return h.sum()

  t = zjax.trace_program(loss, params, X)
  assert uses(t, "a")[0].context == "cond[branch 1]"
  assert uses(t, "b")[0].context == "cond[branch 0]"
  assert uses(t, "c")[0].context == "cond[branch 1]"
  assert t.ops[uses(t, "c")[0].op].primitive == "cond"


def test_param_returned_by_a_branch_is_a_use():
  """A branch that returns the parameter itself needs its value: gathered before the cond."""
  params = {"a": jnp.ones((4, 4))}
  loss = lambda p, x: lax.cond(x.sum() > 0, lambda h, w: h, lambda h, w: w, x[:4], p["a"]).sum()
  (u,) = uses(zjax.trace_program(loss, params, jnp.ones((4, 4))), "a")
  assert u.primitive == "(passed through)"


def test_param_passed_into_branch_but_never_read_is_unused():
  """Dead code is removed before planning (as XLA removes it): nothing to gather."""
  params = {"a": jnp.ones((4, 4)), "head": jnp.ones((4, 3))}
  loss = lambda p, x: lax.cond(True, lambda h, w: h, lambda h, w: h, x, p["a"]).sum()
  assert not uses(zjax.trace_program(loss, params, X), "a")
  aux = lambda p, x: (jnp.tanh(x @ p["a"]), x @ p["head"])[0].sum()  # an unused head
  t = zjax.trace_program(aux, params, X)
  assert not uses(t, "head") and len(uses(t, "a")) == 1


def test_while_and_fori_loop():
  params = {"w": jnp.ones((4, 4)), "limit": jnp.float32(3.0)}

  def loss(p, x):
    h = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ p["w"]), x)
    n = lax.while_loop(lambda c: c[0] < p["limit"], lambda c: (c[0] + 1.0, c[1] @ p["w"]), (0.0, h))
    return n[1].sum()

  t = zjax.trace_program(loss, params, X)
  contexts = [u.context for u in uses(t, "w")]
  assert contexts[0].startswith("scan(length=3)")  # fori_loop with static bounds
  assert contexts[1] == "while[body]"
  assert uses(t, "limit")[0].context == "while[cond]"


def test_remat_and_custom_derivatives():
  params = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4)), "c": jnp.ones((4, 4))}

  matmul = custom_vjp_matmul

  @jax.custom_jvp
  def scale(x, w):
    return x * w.sum()

  scale.defjvp(lambda primals, tangents: (scale(*primals), tangents[0] * primals[1].sum()))

  def loss(p, x):
    h = jax.checkpoint(lambda h: jnp.sin(h @ p["a"]))(x)
    return scale(matmul(h, p["b"]), p["c"]).sum()

  t = zjax.trace_program(loss, params, X)
  assert t.ops[uses(t, "a")[0].op].primitive in ("checkpoint", "remat2", "remat")
  assert t.ops[uses(t, "b")[0].op].primitive == "custom_vjp_call"
  assert t.ops[uses(t, "c")[0].op].primitive == "custom_jvp_call"
  assert all(u.primitive in ("dot_general", "reduce_sum") for n in "abc" for u in uses(t, n))


class _Shared(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = nn.Dense(4, name="dense")
    for _ in range(3):  # the same module applied three times
      x = jnp.tanh(dense(x))
    return nn.remat(nn.Dense)(4, name="remat_dense")(x)


def test_linen_module_reuse_and_remat():
  model = _Shared()
  params = init(model, jax.random.key(0), X)
  t = zjax.trace_program(lambda p, x: model.apply(p, x).sum(), params, X)
  by_path = {p.path: p for p in t.params}
  kernel = by_path["['params']['dense']['kernel']"]
  assert len(kernel.uses) == 3 and kernel.owner == "params/dense"
  assert all(u.module.endswith("dense") for u in kernel.uses)
  remat_kernel = by_path["['params']['remat_dense']['kernel']"]
  assert (
    "remat" in t.ops[remat_kernel.uses[0].op].primitive
    or t.ops[remat_kernel.uses[0].op].primitive == "checkpoint"
  )


def test_linen_nn_scan_stack_is_one_use_inside_scan():
  from gpt import GPTConfig, abstract_setup

  loss_fn, params, batch = abstract_setup(GPTConfig(scan_layers=True, n_layer=3))
  t = zjax.trace_program(loss_fn, params, batch)
  stacked = [p for p in t.params if "'layers'" in p.path]
  assert stacked and all(p.shape[0] == 3 for p in stacked)
  for p in stacked:
    assert len(p.uses) == 1 and t.ops[p.uses[0].op].primitive == "scan"
    assert p.uses[0].context.startswith("scan(length=3)")


def test_tied_embedding_in_gpt_and_foreign_module_use():
  from gpt import GPTConfig, abstract_setup

  loss_fn, params, batch = abstract_setup(GPTConfig(n_layer=2))
  t = zjax.trace_program(loss_fn, params, batch)
  (emb,) = [p for p in t.params if p.path.endswith("['embedding']")]
  assert len(emb.uses) == 2
  assert emb.uses[0].op < emb.uses[1].op
  assert "attend" in emb.uses[1].module


def test_nnx_paths_and_owner():
  from nnx_mlp import inspect_nnx_mlp

  loss_fn, params, batch, _ = inspect_nnx_mlp()
  t = zjax.trace_program(loss_fn, params, batch)
  kernels = [p for p in t.params if p.path.endswith("['kernel'].value")]
  assert kernels and all(len(p.uses) == 1 for p in kernels)
  assert {p.owner for p in kernels} >= {"stem", "blocks/0", "head"}


@pytest.mark.slow
def test_shape_dtype_structs_give_the_same_table_as_arrays():
  from gpt import GPT, GPTConfig, make_loss_fn

  cfg = GPTConfig(n_layer=2, d_model=32, d_ff=64, seq_len=8)
  model = GPT(cfg)
  tokens = jnp.zeros((2, cfg.seq_len + 1), jnp.int32)
  params = init(model, jax.random.key(0), tokens[:, :-1])
  concrete = zjax.trace_program(make_loss_fn(model), params, {"tokens": tokens})
  abstract = zjax.trace_program(make_loss_fn(model), shapes(params), shapes({"tokens": tokens}))
  assert concrete.params == abstract.params and concrete.ops == abstract.ops


@pytest.mark.parametrize(
  "bad_loss,found",
  [
    (lambda p, x: x @ p["w"], "float32[2, 4]"),
    (lambda p, x: (x.sum(), x.mean()), "float32[], float32[]"),
    (lambda p, x: jnp.int32(1) + p["w"].sum().astype(jnp.int32), "int32[]"),
  ],
)
def test_loss_must_be_one_float_scalar(bad_loss, found):
  with pytest.raises(zjax.TraceError, match="one scalar floating-point loss") as e:
    zjax.trace_program(bad_loss, {"w": jnp.ones((4, 4))}, X)
  assert found in str(e.value)


def test_non_array_leaf_is_named():
  with pytest.raises(zjax.TraceError, match=r"\['cfg'\].*str"):
    zjax.trace_program(lambda p, x: x.sum(), {"cfg": "relu", "w": jnp.ones(2)}, X)
