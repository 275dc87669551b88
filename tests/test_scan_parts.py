"""Scanned layers keep every knob: a scan over stacked weights (`nn.scan`, a hand-written
`lax.scan`) whose layer does not fit `max_live_parameters` at once, or whose knobs release
and re-gather sub-module by sub-module (`max_reuse_distance`, `prefetch_bucket_size`), is
gathered part by part inside each iteration, as a rolled layer is (loops.scan_run: the
scan's body as a rolled layer's; loop_parts.py walks it). Before, such a scan was gathered
whole in every iteration, and a cap below one layer did not plan.

Each case: gradients == plain single-device JAX (fp32 rtol 1e-5), the compiled collectives
== the report in count and bytes, and the peak of live gathered bytes no higher than the
same model unrolled."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import real_models
import zjax
from helpers import assert_parity, reference, run_zjax
from test_rolled_parts import assert_exact, assert_hpz_step_exact, largest_bucket, parted_loops
from test_rolling import gpt
from zjax._src.errors import ScheduleError, ScheduleMismatchError
from zjax._src.schedule import ir

LEAN = dict(param_persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=0)


def scanned_and_unrolled_peaks(config, n):
  """The scanned GPT's schedule (parity and report == HLO checked) and the unrolled GPT's
  peak of live gathered bytes under the same knobs."""
  case = real_models.Case(*gpt(2, scan_layers=True))
  schedule, compiled = assert_parity(case.loss_fn, case.params, case.batch, n=n, config=config)
  assert_exact(schedule, compiled)
  unrolled = zjax.compile_schedule(
    *gpt(2), num_devices=n, config=dataclasses.replace(config, roll_layers=False)
  )
  return schedule, unrolled.report()["peak_live_param_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("n, leaves", [(8, 1), (4, 1), (8, 2)])
def test_scanned_gpt_at_one_and_two_largest_leaves(n, leaves):
  """At one largest leaf the layer does not fit: the scan's layer is gathered by parts (this
  did not plan before: 'needs ... above max_live_parameters'); at two it may be whole."""
  cap = leaves * largest_bucket(real_models.Case(*gpt(2, scan_layers=True)))
  config = zjax.ZeroConfig(param_persistence_threshold=0, max_live_parameters=cap)
  schedule, unrolled_peak = scanned_and_unrolled_peaks(config, n)
  report = schedule.report()
  assert report["peak_live_param_bytes"] <= unrolled_peak
  assert [st.length for st in schedule.forward if st.op == ir.LOOP_OP] == [2]
  if leaves == 1:
    (loop,) = parted_loops(schedule)
    assert len(loop.parts) > 1


@pytest.mark.slow
def test_scanned_gpt_released_after_every_use_gathers_by_parts():
  """ZeRO-3's leanest regime on an nn.scan stack. With nn.remat inside it the body is one op
  (one part, its weights kept from its recompute to its vjp): the whole-layer loop."""
  schedule, unrolled_peak = scanned_and_unrolled_peaks(zjax.ZeroConfig(**LEAN), 8)
  (loop,) = parted_loops(schedule)
  assert len(loop.parts) > 1
  assert schedule.report()["peak_live_param_bytes"] <= unrolled_peak
  backward = next(st for st in schedule.backward if st.op == ir.LOOP_OP)
  assert [st.part for st in backward.body if st.op == ir.RECOMPUTE_OP] == list(
    range(len(loop.parts))
  )
  remat = gpt(2, scan_layers=True, remat=True)
  schedule, compiled = assert_parity(*remat, n=8, config=zjax.ZeroConfig(**LEAN))
  assert_exact(schedule, compiled)
  assert not parted_loops(schedule)


def scan_with_outputs(num_layers=3, d=16, reverse=False, cast=False, inputs_out=False):
  """A hand-written lax.scan with what nn.scan stacks rarely have: stacked outputs (ys),
  per-layer activations as xs (computed from a weight, so they need a gradient), a float xs
  without one, an integer carry, and a weight every iteration reads (a scan const); run
  in reverse, or with the attention weights stored in bfloat16 and cast to float32 before
  the scan (mixed precision: a cast of the stack, applied per layer), or stacking each
  layer's input as a second ys (the carry passed straight to an output)."""
  k = jax.random.split(jax.random.key(3), 6)
  params = {
    "attn": {
      "w": jax.random.normal(k[0], (num_layers, d, d)) / np.sqrt(d),
      "b": 0.1 * jax.random.normal(k[1], (num_layers, d)),
    },
    "mlp": {"w": jax.random.normal(k[2], (num_layers, d, d)) / np.sqrt(d)},
    "shared": jax.random.normal(k[3], (d, d)) / np.sqrt(d),
  }
  if cast:
    params["attn"]["w"] = params["attn"]["w"].astype(jnp.bfloat16)
  batch = {
    "x": jax.random.normal(k[4], (8, d)),
    "z": jax.random.normal(k[5], (8, num_layers, d)),
  }

  def loss(p, b):
    scales = 1.0 + jnp.arange(num_layers, dtype=jnp.float32) / num_layers
    inputs = jnp.tanh(jnp.swapaxes(b["z"], 0, 1) @ p["shared"])  # xs that depend on a weight

    def body(carry, xs):
      x, count = carry
      w, bias, w2, scale, inp = xs
      h = jnp.tanh(x @ w + bias) * scale + inp
      x = x + h @ w2 + 0.1 * jnp.tanh(x @ p["shared"])
      y = jnp.mean(h * x, axis=-1)
      return (x, count + 1), (y, carry[0]) if inputs_out else y

    attn_w = p["attn"]["w"].astype(jnp.float32)
    xs = (attn_w, p["attn"]["b"], p["mlp"]["w"], scales, inputs)
    (x, count), ys = jax.lax.scan(body, (b["x"], 0), xs, reverse=reverse)
    if inputs_out:  # every layer's input
      ys, layer_inputs = ys
      x = x + jnp.mean(jnp.tanh(layer_inputs), axis=0)
    return jnp.mean(x**2) + jnp.mean(ys**2) + 0.0 * count

  return loss, params, batch


@pytest.mark.slow
@pytest.mark.parametrize(
  "n, variant",
  [(8, {}), (4, {}), (8, {"reverse": True}), (4, {"cast": True}), (8, {"inputs_out": True})],
)
def test_lax_scan_with_ys_xs_and_a_shared_weight_by_parts(n, variant):
  loss, params, batch = scan_with_outputs(**variant)
  if "cast" in variant:
    schedule, compiled = assert_bfloat16_weight_parity(loss, params, batch, n)
  else:
    schedule, compiled = assert_parity(loss, params, batch, n=n, config=zjax.ZeroConfig(**LEAN))
  assert_exact(schedule, compiled)
  (loop,) = parted_loops(schedule)
  # attn, then mlp (the bfloat16 weight is a bucket of its own: a part of its own)
  assert len(loop.parts) == (3 if "cast" in variant else 2)
  assert schedule.param("['attn']['w']").stacked and not schedule.param("['shared']").stacked


def indexed_layers(num_layers=3, d=16, kind="fori"):
  """Stacked weights of two modules read as W[i] (a scan const, i the layer): a fori_loop
  counter, or the xs of jnp.arange in a reverse scan."""
  k = jax.random.split(jax.random.key(6), 3)
  params = {
    "attn": {"w": jax.random.normal(k[0], (num_layers, d, d)) / np.sqrt(d)},
    "mlp": {"w": jax.random.normal(k[1], (num_layers, d, d)) / np.sqrt(d)},
  }

  def layer(p, i, x):
    h = jnp.tanh(x @ p["attn"]["w"][i])
    return x + jnp.tanh(h @ p["mlp"]["w"][i])

  def loss(p, x):
    if kind == "fori":
      x = jax.lax.fori_loop(0, num_layers, lambda i, x: layer(p, i, x), x)
    else:
      steps = jnp.arange(num_layers)
      x = jax.lax.scan(lambda x, i: (layer(p, i, x), None), x, steps, reverse=True)[0]
    return jnp.mean(x**2)

  return loss, params, jax.random.normal(k[2], (8, d))


@pytest.mark.slow
@pytest.mark.parametrize("n, kind", [(8, "fori"), (4, "arange")])
def test_weights_read_as_w_i_by_parts(n, kind):
  loss, params, x = indexed_layers(kind=kind)
  schedule, compiled = assert_parity(loss, params, x, n=n, config=zjax.ZeroConfig(**LEAN))
  assert_exact(schedule, compiled)
  assert schedule.param("['attn']['w']").stacked and schedule.param("['mlp']['w']").stacked
  (loop,) = parted_loops(schedule)
  assert len(loop.parts) == 2


def assert_bfloat16_weight_parity(loss, params, batch, n):
  """Gradients against plain JAX data parallelism on one device: a bfloat16 weight cast up
  inside the program has its gradient rounded to bfloat16 on each device, before the
  devices' parts are summed (as on any data-parallel run), so the reference rounds each
  batch slice's gradient too, then sums them in float32 as zjax's reduce-scatter does (its
  reduce_dtype float32) and rounds once. bfloat16 leaves within one bfloat16 ulp (the sum's
  order), the rest at fp32 rtol 1e-5."""
  config = zjax.ZeroConfig(**LEAN, reduce_dtype=jnp.float32)
  schedule, loss_value, grads, compiled = run_zjax(loss, params, batch, n=n, config=config)
  slices = [jax.tree.map(lambda x, d=d: x[d * 8 // n : (d + 1) * 8 // n], batch) for d in range(n)]
  parts = [jax.jit(jax.grad(loss))(params, part) for part in slices]
  expected = jax.tree.map(
    lambda *g: (sum(x.astype(jnp.float32) for x in g) / n).astype(g[0].dtype), *parts
  )
  np.testing.assert_allclose(loss_value, reference(loss, params, batch)[0], rtol=1e-5)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    assert got.dtype == want.dtype
    rtol = 2.0**-8 if want.dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=1e-6
    )
  return schedule, compiled


@pytest.mark.slow
def test_hpz_scan_by_parts():
  """hpZ (secondary_partition) in a scan cut into parts: each part's first forward gather
  keeps the layer's secondary shard; backward re-gathers move over the shard axis only."""
  case = real_models.Case(*gpt(2, scan_layers=True))
  mesh = jax.make_mesh((2, 2), ("data", "fsdp"), devices=jax.devices()[:4])
  config = zjax.ZeroConfig(**LEAN, replicate_axes=("data",), secondary_partition=True)
  schedule = zjax.compile_schedule(case.loss_fn, case.params, case.batch, mesh=mesh, config=config)
  assert parted_loops(schedule)
  assert_hpz_step_exact(case, schedule, mesh, reference(case.loss_fn, case.params, case.batch))


def test_scan_parts_round_trip_and_a_cut_the_program_lacks_is_refused():
  loss, params, batch = scan_with_outputs(num_layers=2, d=8)
  schedule = zjax.compile_schedule(
    loss, params, batch, num_devices=4, config=zjax.ZeroConfig(**LEAN)
  )
  assert zjax.Schedule.from_json(schedule.to_json()) == schedule
  assert "part 0 body ops [0," in str(schedule)  # zjax inspect: the scan body's op numbers
  data = json.loads(schedule.to_json())
  for phase in ("forward", "backward"):  # move the cut between the two parts by one op
    loop = next(st for st in data[phase] if st["op"] == ir.LOOP_OP)
    loop["parts"][0]["end"] -= 1
    loop["parts"][1]["start"] -= 1
  edited = zjax.Schedule.from_json(json.dumps(data))  # consistent on its own
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  with pytest.raises(ScheduleMismatchError, match="cuts its layer into parts at ops"):
    zjax.value_and_grad(loss, edited, mesh=mesh)(zjax.shard(params, edited, mesh), batch)


def test_a_cap_below_the_largest_part_names_the_least_that_plans():
  """A cap no part fits is refused with the least cap that plans (the largest part: one
  module's weights), not the whole layer's (512 here), and the part's parameters."""
  loss, params, x = indexed_layers()
  config = zjax.ZeroConfig(param_persistence_threshold=0, max_live_parameters=255)
  with pytest.raises(ScheduleError, match=r"needs 256 .*\['(attn|mlp)'\]\['w'\].*at least 256"):
    zjax.compile_schedule(loss, params, x, num_devices=8, config=config)
  config = dataclasses.replace(config, max_live_parameters=256)
  assert parted_loops(zjax.compile_schedule(loss, params, x, num_devices=8, config=config))


def scan_outputting_a_constant_or_its_weight(kind, num_layers=3, d=16):
  """A scan of two modules whose iteration outputs a constant or a view of its second
  weight as a ys, as it is (loops.scan_run makes it by an op of the body, which the walker
  runs; before, such a body could not be cut into parts)."""
  k = jax.random.split(jax.random.key(7), 3)
  params = {n: jax.random.normal(k[i], (num_layers, d, d)) / np.sqrt(d) for i, n in enumerate("ab")}

  def loss(p, x):
    def body(x, w):
      x = x + jnp.tanh(jnp.tanh(x @ w["a"]) @ w["b"])
      return x, (jnp.float32(1.0) if kind == "constant" else w["b"].T)

    x, ys = jax.lax.scan(body, x, p)
    return jnp.mean(x**2) + 0.1 * jnp.mean(ys**2)

  return loss, params, jax.random.normal(k[2], (8, d))


@pytest.mark.parametrize(
  "n, kind, knobs", [(8, "constant", {}), (4, "view", {}), (8, "view", LEAN), (4, "constant", LEAN)]
)
def test_a_scan_that_outputs_a_constant_or_its_weight(n, kind, knobs):
  loss, params, x = scan_outputting_a_constant_or_its_weight(kind)
  config = zjax.ZeroConfig(**{"param_persistence_threshold": 0, **knobs})
  schedule, compiled = assert_parity(loss, params, x, n=n, config=config)
  assert_exact(schedule, compiled)
  (loop,) = [st for st in schedule.forward if st.op == ir.LOOP_OP]
  assert len(loop.parts) == (2 if knobs else 0) and loop.length == 3
