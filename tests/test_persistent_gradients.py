"""Persistent (replicated) parameters' gradients are averaged module by module, right after
the backward that completes them (plan._gradient_groups cuts segments per owning module
whose gradient outweighs the activations the cut keeps; ir.persistent_reductions says
where), not in one all-reduce at the end of the step where every full gradient would be
live at once.

Under the default `param_persistence_threshold` every parameter of these small models is
persistent: zjax runs them data parallel. Checked against plain single-device JAX on the
full batch (fp32 rtol 1e-5) on 8 and 4 devices; the compiled program's all-reduces over the
data axis equal the report's, in count and bytes; its temp is at most GSPMD FSDP's on the
same model and batch (issue 26: before, Llama-style 1.21x and BERT-style 1.09x).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zjax
from helpers import ATOL, RTOL, assert_report_matches, assert_trees_close, mesh_of, run_zjax
from real_models import bert, eqx_mlp, gspmd_fsdp_temp, llama

MODELS = {"llama": llama, "bert": bert}
RELEASE_EVERY_USE = zjax.ZeroConfig(max_reuse_distance=0)


def compile_zjax(case, n, config):
  mesh = mesh_of(n)
  schedule = zjax.compile_schedule(case.loss_fn, case.params, case.batch, mesh=mesh, config=config)
  step = zjax.value_and_grad(case.loss_fn, schedule, mesh=mesh)
  return schedule, step, zjax.shard(case.params, schedule, mesh)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
  case = MODELS[request.param]()
  return request.param, case, jax.jit(jax.value_and_grad(case.loss_fn))(case.params, case.batch)


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_gradients_match_with_every_parameter_persistent(model, n):
  name, case, (ref_loss, ref_grads) = model
  schedule, step, sharded = compile_zjax(case, n, RELEASE_EVERY_USE)
  assert all(p.persistent for p in schedule.params), name
  loss, grads = step(sharded, case.batch)
  assert_trees_close(loss, ref_loss, rtol=RTOL, atol=0)
  assert_trees_close(zjax.unshard(grads, schedule), ref_grads, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize(
  "config", [zjax.ZeroConfig(), RELEASE_EVERY_USE], ids=["defaults", "release-every-use"]
)
def test_one_all_reduce_per_module_and_temp_at_most_gspmd(model, config):
  name, case, _ = model
  schedule, step, sharded = compile_zjax(case, 8, config)
  program = zjax.hlo.compile_for_analysis(step.lower(sharded, case.batch))
  report = schedule.report()
  gradients = [
    c
    for c in zjax.hlo.collectives(program.as_text())
    if c.kind == "all_reduce" and c.shape != "f32[]"
  ]  # (not the loss)
  assert report["persistent_grad_all_reduce_count"] > 10, name  # module by module
  assert len(gradients) == report["persistent_grad_all_reduce_count"], name
  expected = report["persistent_grad_all_reduce_bytes"]  # (+ the loss's scalar, which XLA
  assert expected <= sum(c.bytes for c in gradients) <= expected + 4, name  # may combine)
  temp = zjax.hlo.summarize(program)["temp_bytes"]
  # the full gradients are never all live at once (they were, before: temp > their sum)
  assert temp < report["persistent_grad_all_reduce_bytes"] / 2, (name, temp)
  gspmd = gspmd_fsdp_temp(case, mesh_of(8, explicit=False))
  assert temp <= gspmd, (name, temp, gspmd)


def test_a_module_cuts_a_segment_only_when_its_gradient_outweighs_the_cut(model):
  """A projection's gradient is larger than the activations a cut before it makes backward
  keep, a norm's scale is not: segments start at projections, never at norms."""
  name, case, _ = model
  schedule = zjax.compile_schedule(case.loss_fn, case.params, case.batch, num_devices=8)
  starts = [seg.label.split("/")[-1] for seg in schedule.segments]
  assert len(starts) > 10 and not any("norm" in s for s in starts), (name, starts)
  assert sum("proj" in s or s in ("query", "intermediate", "output") for s in starts) > 8


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_equinox_style_mlp_exact_and_temp_at_most_gspmd(n):
  """eqx.nn.MLP's computation (weights [out, in], one example's matvecs under jax.vmap):
  gradients equal single-device JAX's, the program's collectives equal the report, at the
  defaults (every parameter persistent) and with every parameter sharded and released
  after each use; at the defaults its temp is at most GSPMD FSDP's (issue 42 measured an
  equinox MLP at 2.5x GSPMD's; at four commits since 12-01 and four shapes it did not
  reproduce here: 18.6 KiB against GSPMD's 35.3 at this shape)."""
  case = eqx_mlp()
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(case.loss_fn))(case.params, case.batch)
  sharded_everywhere = zjax.ZeroConfig(param_persistence_threshold=0, max_reuse_distance=0)
  for config in (zjax.ZeroConfig(), sharded_everywhere):
    schedule, step, sharded = compile_zjax(case, n, config)
    loss, grads = step(sharded, case.batch)
    assert_trees_close(loss, ref_loss, rtol=RTOL, atol=0)
    assert_trees_close(zjax.unshard(grads, schedule), ref_grads, rtol=RTOL, atol=ATOL)
    program = zjax.hlo.compile_for_analysis(step.lower(sharded, case.batch))
    assert_report_matches(schedule, program)
    if n == 8 and config == zjax.ZeroConfig():
      temp = zjax.hlo.summarize(program)["temp_bytes"]
      assert temp <= gspmd_fsdp_temp(case, mesh_of(8, explicit=False)), temp


def odd_model(d=32, vocab=48):
  """Tied embedding (read first and last), an unused leaf, an empty leaf, a bf16 scale and
  a frozen-by-dtype integer leaf, all persistent under the defaults."""
  k = jax.random.split(jax.random.key(31), 4)
  params = {
    "embed": jax.random.normal(k[0], (vocab, d)) * 0.1,
    "w1": jax.random.normal(k[1], (d, d)) / np.sqrt(d),
    "w2": jax.random.normal(k[2], (d, d)) / np.sqrt(d),
    "unused": jnp.ones((d, d)),
    "empty": jnp.zeros((0, d)),
    "scale": jnp.ones((d,), jnp.bfloat16),
    "step": jnp.int32(3),
  }
  tokens = jax.random.randint(k[3], (16, 9), 0, vocab)

  def loss(p, b):
    x = p["embed"][b["tokens"][:, :-1]] + jnp.sum(p["empty"], axis=0)
    x = jnp.tanh(x @ p["w1"]) * p["scale"].astype(jnp.float32)
    x = jnp.tanh(x @ p["w2"]) * p["step"].astype(jnp.float32) / 3
    logp = jax.nn.log_softmax(x @ p["embed"].T)
    return -jnp.take_along_axis(logp, b["tokens"][:, 1:, None], -1).mean()

  return loss, params, {"tokens": tokens}


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 4])
def test_tied_unused_empty_and_mixed_dtype_leaves(n):
  loss_fn, params, batch = odd_model()
  schedule, loss, grads, program = run_zjax(loss_fn, params, batch, n=n)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn, allow_int=True))(params, batch)
  assert_trees_close(loss, ref_loss, rtol=RTOL, atol=0)
  for key in ("embed", "w1", "w2", "unused", "empty"):
    assert_trees_close(grads[key], ref_grads[key], rtol=RTOL, atol=ATOL)
  assert_trees_close(
    grads["scale"].astype(jnp.float32), ref_grads["scale"].astype(jnp.float32), rtol=1e-2, atol=1e-2
  )  # bf16
  report = schedule.report()
  gradients = [
    c
    for c in zjax.hlo.collectives(program.as_text())
    if c.kind == "all_reduce" and c.shape != "f32[]"
  ]
  assert len(gradients) == report["persistent_grad_all_reduce_count"] >= 1
  expected = report["persistent_grad_all_reduce_bytes"]
  assert expected <= sum(c.bytes for c in gradients) <= expected + 4
