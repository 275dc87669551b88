"""Shared test helpers: meshes of N simulated devices and the parity check against plain JAX."""

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zjax

RTOL = 1e-5  # fp32
ATOL = 1e-6


def mesh_of(n: int, explicit: bool = True):
  kw = {} if explicit else {"axis_types": (jax.sharding.AxisType.Auto,)}
  return jax.make_mesh((n,), ("fsdp",), devices=jax.devices()[:n], **kw)


@contextlib.contextmanager
def compiles_logged():
  """Yields the list of jax's "Compiling ..." messages logged inside the block."""
  records, handler = [], logging.Handler()
  handler.emit = records.append
  logging.getLogger("jax").addHandler(handler)
  compiled = []
  try:
    with jax.log_compiles():
      yield compiled
  finally:
    logging.getLogger("jax").removeHandler(handler)
    compiled += [r.getMessage() for r in records if "Compiling" in r.getMessage()]


@contextlib.contextmanager
def fully_optimized_compiles():
  """Inside the block, XLA compiles with LLVM's optimizations on (the suite turns them off:
  conftest.py). jax's caches are cleared on entry and exit (the flag is not part of their
  keys), so nothing compiled in the other mode is reused inside or after the block."""
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)
    jax.clear_caches()


class LazyAnalysis:
  """A step compiled for analysis (zjax.hlo.compile_for_analysis) when first asked: its own
  compile, which most parity tests never need."""

  def __init__(self, lowered):
    self._lowered, self._program = lowered, None

  def __getattr__(self, name):
    if self._program is None:
      self._program = zjax.hlo.compile_for_analysis(self._lowered)
    return getattr(self._program, name)


def run_zjax(loss_fn, params, batch, *, n=8, config=None, mesh=None):
  """(schedule, loss, natural-shape grads, the step compiled for analysis) of zjax on n
  devices."""
  mesh = mesh or mesh_of(n)
  schedule = zjax.compile_schedule(loss_fn, params, batch, mesh=mesh, config=config)
  step = zjax.value_and_grad(loss_fn, schedule, mesh=mesh)
  sharded = zjax.shard(params, schedule, mesh)
  loss, grads = step(sharded, batch)
  return schedule, loss, zjax.unshard(grads, schedule), LazyAnalysis(step.lower(sharded, batch))


def analyse_zjax(loss_fn, params, batch, *, n=8, config=None):
  """(schedule, the step compiled for analysis), nothing executed."""
  mesh = mesh_of(n)
  schedule = zjax.compile_schedule(loss_fn, params, batch, mesh=mesh, config=config)
  step = zjax.value_and_grad(loss_fn, schedule, mesh=mesh)
  lowered = step.lower(zjax.shard(params, schedule, mesh), batch)
  return schedule, zjax.hlo.compile_for_analysis(lowered)


def init(model, *args, **kwargs):
  """`model.init(*args, **kwargs)` of a Flax linen model, jitted once per model and keywords
  in this process (linen modules compare and hash by their fields): run eagerly, XLA
  compiled each of its ops as a program of its own."""
  return _jitted_init(model, tuple(sorted(kwargs.items())))(*args)


@functools.lru_cache(maxsize=None)
def _jitted_init(model, kwargs):
  return jax.jit(functools.partial(model.init, **dict(kwargs)))


def case_step(case, config, mesh):
  """(zjax's gradient step for a `real_models.Case`, its abstract arguments: the sharded
  layout as ShapeDtypeStructs, the batch and the batch statistics `extra` if any)."""
  from zjax._src.layout import layout

  schedule = zjax.compile_schedule(
    case.loss_fn, case.params, case.batch, mesh=mesh, config=config, extra=case.extra
  )
  step = zjax.value_and_grad(case.loss_fn, schedule, mesh=mesh)
  args = (layout.abstract_storage(schedule, mesh), case.batch)
  return step, args + ((case.extra,) if case.extra is not None else ())


def case_temp(case, config, n=8):
  """Compiled temp per device of zjax's gradient step for a `real_models.Case` (with its
  batch statistics, `extra`), compiled for analysis."""
  step, args = case_step(case, config, mesh_of(n))
  return zjax.hlo.compile_for_analysis(step.lower(*args)).memory_analysis().temp_size_in_bytes


def trainer_footprint(case, plan) -> int:
  """Device bytes of the trainer step a `zjax.autoconfig` plan configures for a
  `real_models.Case` (adam), compiled for analysis: arguments + outputs + temp - aliased.
  CPU has one memory, so state placed in host memory (offload) counts as arguments there;
  it is subtracted."""
  import math

  import optax

  from zjax._src.autoconfig.search import micro_batch

  mesh = plan.mesh()
  micro = micro_batch(case.batch, plan.accumulation_steps)
  schedule = zjax.compile_schedule(
    case.loss_fn, case.params, micro, mesh=mesh, config=plan.config, extra=case.extra
  )
  trainer = zjax.zero3(
    case.loss_fn, optax.adam(1e-3), schedule, mesh=mesh, **plan.trainer_options()
  )
  state = trainer.abstract_state(case.extra)
  m = zjax.hlo.compile_for_analysis(trainer.lower(state, case.batch)).memory_analysis()
  host = sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(state)
    if x.sharding.memory_kind == "pinned_host"
  )
  total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  return total - m.alias_size_in_bytes - host


def reference(loss_fn, params, batch):
  """Plain single-device jax.value_and_grad (integer leaves: zero gradient)."""
  loss, grads = jax.jit(jax.value_and_grad(loss_fn, allow_int=True))(params, batch)
  grads = jax.tree.map(
    lambda g, p: jnp.zeros(p.shape, p.dtype) if g.dtype == jax.dtypes.float0 else g, grads, params
  )
  return loss, grads


def assert_parity(loss_fn, params, batch, *, n=8, config=None, rtol=RTOL, atol=ATOL):
  schedule, loss, grads, compiled = run_zjax(loss_fn, params, batch, n=n, config=config)
  ref_loss, ref_grads = reference(loss_fn, params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=rtol, atol=atol)
  assert_trees_close(grads, ref_grads, rtol=rtol, atol=atol)
  return schedule, compiled


def steps_like_optax(trainer, state, loss_fn, optimizer, params, batch, steps):
  """Run `steps` trainer steps beside plain optax on one device, losses equal at rtol 1e-5;
  -> (the trainer's state, optax's params)."""

  @jax.jit  # (op by op, XLA compiled each op of the model alone)
  def ref_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  ref_params, ref_opt = params, optimizer.init(params)
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    ref_params, ref_opt, ref_loss = ref_step(ref_params, ref_opt, batch)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
  return state, ref_params


def assert_trees_close(a, b, *, rtol=RTOL, atol=ATOL):
  paths_a = jax.tree_util.tree_flatten_with_path(a)[0]
  leaves_b = jax.tree.leaves(b)
  assert len(paths_a) == len(leaves_b)
  for (path, x), y in zip(paths_a, leaves_b):
    assert x.shape == y.shape and x.dtype == y.dtype, (jax.tree_util.keystr(path), x, y)
    np.testing.assert_allclose(
      np.asarray(x, np.float32),
      np.asarray(y, np.float32),
      rtol=rtol,
      atol=atol,
      err_msg=jax.tree_util.keystr(path),
    )


def assert_report_matches(schedule, compiled):
  """The compiled program's all-gathers and reduce-scatters equal the schedule's report in
  count and bytes, and so do its persistent-gradient all-reduces (XLA may combine the
  loss's scalar into one of them: 4 bytes more)."""
  report, text = schedule.report(), compiled.as_text()
  executed = zjax.hlo.executed(text)
  for kind in ("all_gather", "reduce_scatter"):
    assert (executed.get(f"{kind}_count", 0), executed.get(f"{kind}_bytes", 0)) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind
  gradients = [
    c for c in zjax.hlo.collectives(text) if c.kind == "all_reduce" and c.shape != "f32[]"
  ]  # (not the loss)
  assert len(gradients) == report["persistent_grad_all_reduce_count"]
  expected = report["persistent_grad_all_reduce_bytes"]
  assert expected <= sum(c.bytes for c in gradients) <= expected + 4


def mlp(num_layers=4, d=64, batch=16, seed=0):
  keys = jax.random.split(jax.random.key(seed), num_layers + 2)
  params = {
    f"layer{i}": {
      "kernel": jax.random.normal(keys[i], (d, d)) / np.sqrt(d),
      "bias": jax.random.normal(keys[i], (d,)) * 0.1,
    }
    for i in range(num_layers)
  }
  batch = {
    "x": jax.random.normal(keys[-2], (batch, d)),
    "y": jax.random.normal(keys[-1], (batch, d)),
  }

  def loss(p, b):
    x = b["x"]
    for i in range(num_layers):
      x = jnp.tanh(x @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"])
    return jnp.mean((x - b["y"]) ** 2)

  return loss, params, batch


@jax.custom_vjp
def custom_vjp_matmul(x, w):
  """x @ w with a hand-written vjp (a custom_vjp op for trace and executor tests)."""
  return x @ w


custom_vjp_matmul.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))
