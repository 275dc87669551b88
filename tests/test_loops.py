"""Loops: scan over stacked layers gathers one layer per iteration (with prefetch), fori_loop
gathers its shared weight once, cond/switch gather outside the branches. Parity against
plain JAX, the compiled program's while bodies against the schedule, and memory vs depth."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from helpers import assert_parity, assert_trees_close, init, mesh_of, run_zjax
from zjax._src.layout import layout
from zjax._src.schedule import ir
from zjax._src.xla import hlo

D = 64
PREFETCH = zjax.ZeroConfig(param_persistence_threshold=100)
NO_PREFETCH = zjax.ZeroConfig(param_persistence_threshold=100, prefetch_bucket_size=0)


def scan_stack(num_layers=4, d=D, reverse=False, seed=0):
  """A hand-written lax.scan over stacked (w, b), a shared weight as a scan const, an
  integer counter in the carry and a per-layer scale as a non-parameter xs."""
  k = jax.random.split(jax.random.key(seed), 4)
  params = {
    "w": jax.random.normal(k[0], (num_layers, d, d)) / np.sqrt(d),
    "b": jax.random.normal(k[1], (num_layers, d)) * 0.1,
    "shared": jax.random.normal(k[2], (d, d)) / np.sqrt(d),
  }
  batch = {"x": jax.random.normal(k[3], (16, d))}

  def loss(p, b):
    scales = jnp.linspace(0.5, 1.5, num_layers)

    def body(carry, layer):
      x, count = carry
      w, bias, scale = layer
      x = jnp.tanh(x @ w + bias) * scale + 0.1 * jnp.tanh(x @ p["shared"])
      return (x, count + 1), jnp.mean(x)

    (x, count), means = jax.lax.scan(body, (b["x"], 0), (p["w"], p["b"], scales), reverse=reverse)
    return jnp.mean(x**2) + jnp.mean(means) + 0.0 * count

  return loss, params, batch


def loop_steps(schedule):
  return [st for st in schedule.forward + schedule.backward if st.op == ir.LOOP_OP]


@pytest.mark.slow
@pytest.mark.parametrize("config", [PREFETCH, NO_PREFETCH], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("n", [8, 4])
def test_lax_scan_stack_parity(n, config):
  schedule, _ = assert_parity(*scan_stack(), n=n, config=config)
  assert schedule.param("['w']").stacked and schedule.param("['b']").stacked
  assert not schedule.param("['shared']").stacked  # a const: gathered once, before the loop
  loops = loop_steps(schedule)
  assert [st.length for st in loops] == [4, 4]
  assert all(
    g.prefetch == (config is PREFETCH) for st in loops for g in st.body if g.op == "gather"
  )


def test_a_scan_reading_a_float_no_parameter_reaches_through_a_while_loop():
  """The backward differentiates a scan's consts and xs only where they depend on trained
  parameters: a const from the batch that the body runs through a while_loop (which JAX
  cannot reverse-differentiate) trains as with jax.value_and_grad, which never asks."""
  num_layers, d = 3, 16
  k = jax.random.split(jax.random.key(3), 3)
  params = {"w": jax.random.normal(k[0], (num_layers, d, d)) / np.sqrt(d)}
  batch = {"x": jax.random.normal(k[1], (16, d)), "t": jnp.float32(0.9)}

  def loss(p, b):
    def body(x, w):
      halved = jax.lax.while_loop(
        lambda c: c[1] > 0.3, lambda c: (c[0] + 1, c[1] / 2), (0, b["t"])
      )[1]
      return jnp.tanh(x @ w) * halved + x, None

    x, _ = jax.lax.scan(body, b["x"], p["w"])
    return jnp.mean(x**2)

  schedule, _ = assert_parity(loss, params, batch, config=PREFETCH)
  assert [st.length for st in loop_steps(schedule)] == [num_layers, num_layers]


@pytest.mark.slow
def test_reverse_scan_parity():
  assert_parity(*scan_stack(num_layers=3, reverse=True), config=PREFETCH)


def test_one_layer_scan_parity():
  assert_parity(*scan_stack(num_layers=1), config=PREFETCH)


def indexed_stack(kind):
  """Stacked weights passed as a scan const and read as W[i], i the layer: a fori_loop
  counter, or the xs of jnp.arange in a reverse scan; "shifted" reads W[(i + 1) % L]
  (not its own layer: must be gathered whole)."""
  k = jax.random.split(jax.random.key(5), 3)
  params = {"w": jax.random.normal(k[0], (4, D, D)) / 8, "b": jax.random.normal(k[1], (4, D))}
  x = jax.random.normal(k[2], (16, D))

  def layer(p, i, x):
    return jnp.tanh(x @ p["w"][i] + 0.1 * p["b"][i])

  def loss(p, x):
    if kind == "fori":
      x = jax.lax.fori_loop(0, 4, lambda i, x: layer(p, i, x), x)
    elif kind == "arange":
      x = jax.lax.scan(lambda x, i: (layer(p, i, x), None), x, jnp.arange(4), reverse=True)[0]
    else:
      x = jax.lax.fori_loop(0, 4, lambda i, x: layer(p, (i + 1) % 4, x), x)
    return jnp.mean(x**2)

  return loss, params, x


@pytest.mark.parametrize("config", [PREFETCH, NO_PREFETCH], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("kind", ["fori", "arange", "shifted"])
def test_consts_indexed_by_the_iteration(kind, config):
  schedule, compiled = assert_parity(*indexed_stack(kind), config=config)
  stacked = [schedule.param(path).stacked for path in ("['w']", "['b']")]
  assert stacked == ([False, False] if kind == "shifted" else [True, True])
  executed, report = hlo.executed(compiled.as_text()), schedule.report()
  assert len(report["loops"]) == (0 if kind == "shifted" else 2)
  for key in ("all_gather_count", "all_gather_bytes", "reduce_scatter_count"):
    assert executed[key] == report[key], key


def gpt_scan_setup(n_layer=3, remat=False):
  from gpt import GPT, GPTConfig, make_loss_fn

  cfg = GPTConfig(
    d_model=64, n_layer=n_layer, n_head=4, d_ff=128, seq_len=16, scan_layers=True, remat=remat
  )
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
  params = init(model, jax.random.key(1), tokens[:, :-1])
  return make_loss_fn(model), params, {"tokens": tokens}


GPT_CONFIG = zjax.ZeroConfig(param_persistence_threshold=256)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_linen_nn_scan_gpt_parity(remat):
  schedule, _ = assert_parity(*gpt_scan_setup(remat=remat), config=GPT_CONFIG)
  stacked = {p.path for p in schedule.params if p.stacked}
  kernels = {p.path for p in schedule.params if "layers" in p.path and "kernel" in p.path}
  assert len(kernels) == 4 and kernels <= stacked
  assert all("['layers']" in path for path in stacked)


@pytest.mark.slow
def test_scanned_gpt_trains_like_optax():
  from test_train import assert_training_parity, same_batch

  loss, params, batch = gpt_scan_setup()
  # eps=1e-5 as in test_hsdp.py: gradients agree to 6e-8 (max 0.08), but at eps=1e-6 Adam
  # turned that into 6.7e-5 on one embedding element after 5 steps on some CPUs (measured
  # 2026-12-02; 1.4e-5 at eps=1e-5)
  _, state, _ = assert_training_parity(
    loss,
    optax.adamw(1e-2, eps=1e-5),
    params,
    same_batch(batch, 5),
    param_atol=5e-5,
    config=GPT_CONFIG,
  )
  assert int(state.step) == 5


def test_fori_loop_gathers_the_shared_layer_once():
  k = jax.random.split(jax.random.key(3), 2)
  params = {"w": jax.random.normal(k[0], (D, D)) / np.sqrt(D), "head": jnp.ones((D,)) / D}
  batch = jax.random.normal(k[1], (16, D))

  def loss(p, x):
    x = jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ p["w"]) + 0.01 * i, x)
    return jnp.mean((x @ p["head"]) ** 2)

  config = zjax.ZeroConfig(param_persistence_threshold=100)
  schedule, compiled = assert_parity(loss, params, batch, config=config)
  assert not loop_steps(schedule)
  text = compiled.as_text()
  bodies = hlo.while_loops(text)
  assert bodies, "the fori_loop stays a loop"
  assert not [c for c in hlo.collectives(text) if c.computation in bodies]
  report, executed = schedule.report(), hlo.executed(text)
  assert report["all_gather_count"] == executed["all_gather_count"] == 1  # kept for backward
  assert report["reduce_scatter_count"] == executed["reduce_scatter_count"] == 1


def cond_model():
  k = jax.random.split(jax.random.key(4), 4)
  params = {
    "a": jax.random.normal(k[0], (D, D)) / 8,
    "b": jax.random.normal(k[1], (D, D)) / 8,
    "c": jax.random.normal(k[2], (D, D)) / 8,
  }

  def loss(p, batch):
    x = batch["x"]
    pick = (jnp.sum(x) > 0).astype(jnp.int32)  # data-dependent: differs between devices
    y = jax.lax.cond(pick, lambda x: jnp.tanh(x @ p["a"]), lambda x: jnp.tanh(x @ p["b"]), x)
    z = jax.lax.switch(
      jnp.clip(pick + batch["mode"], 0, 2), [lambda y: y, lambda y: y @ p["c"], lambda y: -y], y
    )
    return jnp.mean(z**2)

  # rows of opposite sign per device pair: half of the 8 devices take each branch
  rows = jax.random.normal(k[3], (16, D))
  signs = jnp.repeat(jnp.array([1.0, -1.0] * 4), 2)[:, None]
  batch = {"x": jnp.abs(rows) * signs, "mode": jnp.int32(1)}
  return loss, params, batch


def per_device_reference(loss_fn, params, batch, n):
  """What data parallelism means when devices branch differently: the mean over devices of
  each device's loss and gradient on its own rows."""
  rows = batch["x"].shape[0] // n
  device_grad = jax.jit(jax.value_and_grad(loss_fn))
  parts = [
    device_grad(params, dict(batch, x=batch["x"][d * rows : (d + 1) * rows])) for d in range(n)
  ]
  return (
    np.mean([float(loss) for loss, _ in parts]),
    jax.tree.map(lambda *g: sum(g) / n, *[g for _, g in parts]),
  )


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 2])
def test_cond_and_switch_gather_outside_the_branches(n):
  """Devices take different branches (n=8: half each way) and nothing deadlocks: every
  gather happens before the conditional, none inside a branch; results equal the
  per-device reference."""
  loss, params, batch = cond_model()
  schedule, loss_value, grads, compiled = run_zjax(
    loss, params, batch, n=n, config=zjax.ZeroConfig(param_persistence_threshold=0)
  )
  ref_loss, ref_grads = per_device_reference(loss, params, batch, n)
  np.testing.assert_allclose(loss_value, ref_loss, rtol=1e-5)
  assert_trees_close(grads, ref_grads)
  text = compiled.as_text()
  branches = hlo.conditional_branches(text)
  assert branches, "the conds stay conditionals"
  assert not [c for c in hlo.collectives(text) if c.computation in branches]


def test_cond_parity_with_plain_jax_when_all_devices_agree():
  loss, params, batch = cond_model()
  batch = dict(batch, x=jnp.abs(batch["x"]))
  assert_parity(loss, params, batch, config=zjax.ZeroConfig(param_persistence_threshold=0))


def test_untaken_branch_gets_zero_gradient():
  loss, params, batch = cond_model()
  batch = dict(batch, x=jnp.abs(batch["x"]))  # every device takes branch "a", then "c"
  _, _, grads, _ = run_zjax(
    loss, params, batch, config=zjax.ZeroConfig(param_persistence_threshold=0)
  )
  assert float(jnp.max(jnp.abs(grads["b"]))) == 0.0
  assert float(jnp.max(jnp.abs(grads["a"]))) > 0.0


# ---- the compiled program against the schedule ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("config", [PREFETCH, NO_PREFETCH], ids=["prefetch", "no-prefetch"])
def test_while_bodies_hold_the_per_iteration_collectives(config):
  schedule, _, _, compiled = run_zjax(*scan_stack(num_layers=5), config=config)
  text, report = compiled.as_text(), schedule.report()
  loops = hlo.while_loops(text)
  in_bodies = {}
  for c in hlo.collectives(text):
    if c.computation in loops:
      in_bodies.setdefault(c.computation, []).append(c)
  prefetch = config is PREFETCH
  expected = sorted(
    (
      loop["length"] - prefetch,
      loop["all_gather_count_per_iteration"],
      loop["reduce_scatter_count_per_iteration"],
    )
    for loop in report["loops"]
  )
  found = sorted(
    (
      loops[body],
      sum(c.kind == "all_gather" for c in cs),
      sum(c.kind == "reduce_scatter" for c in cs),
    )
    for body, cs in in_bodies.items()
  )
  assert found == expected
  executed = hlo.executed(text)
  for kind in ("all_gather", "reduce_scatter"):
    assert executed[f"{kind}_count"] == report[f"{kind}_count"], kind
    assert executed[f"{kind}_bytes"] == report[f"{kind}_bytes"], kind


@pytest.mark.slow
def test_gpt_scan_collectives_equal_the_report():
  schedule, _, _, compiled = run_zjax(*gpt_scan_setup(), config=GPT_CONFIG)
  executed, report = hlo.executed(compiled.as_text()), schedule.report()
  assert len(report["loops"]) == 2
  for kind in ("all_gather", "reduce_scatter"):
    assert (executed[f"{kind}_count"], executed[f"{kind}_bytes"]) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind


def scans_with_integer_leaves(num_layers=4, d=16):
  """Two scans over stacked layers, each with an integer leaf per layer: the first scan's
  (an offset added to the output) is not read by the backward iteration, the second's (a
  permutation of the features) is (its vjp scatters through it)."""
  k = jax.random.split(jax.random.key(3), 3)
  perms = jnp.stack([jax.random.permutation(jax.random.key(i), d) for i in range(num_layers)])
  params = {
    "a": {
      "w": jax.random.normal(k[0], (num_layers, d, d)) / np.sqrt(d),
      "offset": jnp.arange(num_layers * d, dtype=jnp.int32).reshape(num_layers, d),
    },
    "b": {
      "w": jax.random.normal(k[1], (num_layers, d, d)) / np.sqrt(d),
      "perm": perms.astype(jnp.int32),
    },
  }

  def loss(p, b):
    def first(x, layer):
      w, offset = layer
      return jnp.tanh(x @ w) + 0.01 * offset.astype(jnp.float32), None

    def second(x, layer):
      w, perm = layer
      return jnp.tanh(x[:, perm] @ w), None

    x = jax.lax.scan(first, b["x"], (p["a"]["w"], p["a"]["offset"]))[0]
    x = jax.lax.scan(second, x, (p["b"]["w"], p["b"]["perm"]))[0]
    return jnp.mean(x**2)

  return loss, params, {"x": jax.random.normal(k[2], (16, d))}


def _backward_loop_dtypes(schedule):
  return [
    sorted(schedule.buckets[st.bucket].dtype for st in loop.body if st.op == "gather")
    for loop in schedule.backward
    if loop.op == ir.LOOP_OP
  ]


@pytest.mark.slow
@pytest.mark.parametrize("n", [8, 2])
def test_scan_leaves_out_re_gathers_the_backward_does_not_read(n):
  """A scan's backward loop re-gathers an integer leaf only where its vjp reads it, so the
  report equals the collectives XLA keeps (it deletes a re-gather nothing reads)."""
  loss, params, batch = scans_with_integer_leaves()
  config = zjax.ZeroConfig(param_persistence_threshold=0)
  schedule, compiled = assert_parity(loss, params, batch, n=n, config=config)
  assert all(schedule.param(f"['{s}']['w']").stacked for s in "ab")
  # backward runs the second scan first: its permutation is re-gathered, the offset is not
  assert _backward_loop_dtypes(schedule) == [["float32", "int32"], ["float32"]]
  report, executed = schedule.report(), hlo.executed(compiled.as_text())
  for kind in ("all_gather", "reduce_scatter"):
    assert (executed[f"{kind}_count"], executed[f"{kind}_bytes"]) == (
      report[f"{kind}_count"],
      report[f"{kind}_bytes"],
    ), kind


def test_a_scan_body_missing_a_re_gather_its_backward_reads_is_refused():
  loss, params, batch = scans_with_integer_leaves()
  mesh = mesh_of(8)
  s = zjax.compile_schedule(
    loss, params, batch, mesh=mesh, config=zjax.ZeroConfig(param_persistence_threshold=0)
  )
  data = s.to_dict()
  loop = next(st for st in data["backward"] if st["op"] == "loop")  # the second scan's
  ints = {b["id"] for b in data["buckets"] if b["dtype"] == "int32"}
  loop["body"] = [st for st in loop["body"] if st.get("bucket") not in ints]
  edited = zjax.Schedule.from_json(_dumps(data))
  with pytest.raises(zjax.ScheduleMismatchError, match=r"\['b'\]\['perm'\].*reads it"):
    zjax.value_and_grad(loss, edited, mesh=mesh).lower(zjax.shard(params, edited, mesh), batch)


# ---- memory and depth --------------------------------------------------------------------

W_D = 256
W1 = W_D * W_D * 4  # one layer's weight, bytes
BATCH = 8  # rows per device x 8 devices


def deep_scan(num_layers):
  """DESIGN.md's reference: D=256 layers with weights that dominate the activations."""
  params = {"w": jax.ShapeDtypeStruct((num_layers, W_D, W_D), jnp.float32)}

  def loss(p, x):
    x, _ = jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, p["w"])
    return jnp.mean(x**2)

  return loss, params, jax.ShapeDtypeStruct((BATCH * 8, W_D), jnp.float32)


def compiled_step(num_layers, config):
  loss, params, batch = deep_scan(num_layers)
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
  step = zjax.value_and_grad(loss, schedule, mesh=mesh)
  return schedule, zjax.hlo.compile_for_analysis(
    step.lower(_abstract_shards(schedule, mesh), batch)
  )


def _abstract_shards(schedule, mesh):
  return layout.abstract_storage(schedule, mesh)


@pytest.mark.parametrize("config", [PREFETCH, NO_PREFETCH], ids=["prefetch", "no-prefetch"])
def test_temp_memory_grows_only_by_the_saved_activations(config):
  """temp(L) = G + L * A, where A = one saved carry per layer (the [rows, D] activation at
  the layer boundary: backward recomputes the layer from it) and G, the gathered weights
  and one layer's work, does not depend on L. Check the growth from L=8 to L=32 is A per
  layer (within 5%), and G within 3 one-layer weights W1 (with prefetch: two layers live)."""
  config = zjax.ZeroConfig(
    param_persistence_threshold=0, prefetch_bucket_size=config.prefetch_bucket_size
  )
  t8 = compiled_step(8, config)[1].memory_analysis().temp_size_in_bytes
  t32 = compiled_step(32, config)[1].memory_analysis().temp_size_in_bytes
  activation = BATCH * W_D * 4
  per_layer = (t32 - t8) / 24
  assert activation <= per_layer <= 1.05 * activation, (t8, t32, per_layer)
  assert t8 - 8 * per_layer <= 3 * W1, (t8, t32, (t8 - 8 * per_layer) / W1)


def test_deep_scan_never_holds_the_stack():
  """What the loop step avoids (DESIGN.md): gathering inside a plainly differentiated scan
  saves every gathered layer for backward (47 W1 at L=32); gathering the stack before the
  loop holds 32 W1."""
  _, large = compiled_step(32, zjax.ZeroConfig(param_persistence_threshold=0))
  assert large.memory_analysis().temp_size_in_bytes < 4 * W1


def test_loop_step_json_round_trip_and_edits_are_checked():
  loss, params, batch = scan_stack()
  s = zjax.compile_schedule(loss, params, batch, num_devices=8, config=PREFETCH)
  assert zjax.Schedule.from_json(s.to_json()) == s
  data = s.to_dict()
  loop = next(st for st in data["forward"] if st["op"] == "loop")
  loop["length"] = 3
  with pytest.raises(zjax.ScheduleError, match="loop length 3"):
    zjax.Schedule.from_json(_dumps(data))
  loop["length"] = 4
  loop["body"] = [st for st in loop["body"] if st["op"] != "release"]
  with pytest.raises(zjax.ScheduleError, match="the loop body is"):
    zjax.Schedule.from_json(_dumps(data))
  data = s.to_dict()
  stacked = next(b["id"] for b in data["buckets"] if b["stacked"])
  data["forward"].insert(0, {"op": "gather", "bucket": stacked, "prefetch": False})
  with pytest.raises(zjax.ScheduleError, match="stacked"):
    zjax.Schedule.from_json(_dumps(data))


def test_version_1_files_still_load():
  s = zjax.compile_schedule(
    lambda p, x: jnp.mean(x @ p["w"]),
    {"w": jnp.ones((512, 512))},
    jnp.ones((8, 512)),
    num_devices=8,
  )
  data = s.to_dict()
  data["version"] = 1
  for p in data["params"]:
    del p["stacked"]
  for b in data["buckets"]:
    del b["stacked"]
  assert zjax.Schedule.from_json(_dumps(data)) == s


def _dumps(data):
  return json.dumps(data)


def test_adamw_state_is_per_layer_sharded():
  loss, params, batch = scan_stack()
  mesh = mesh_of(8)
  schedule = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=PREFETCH)
  trainer = zjax.zero3(loss, optax.adamw(1e-3), schedule, mesh=mesh)
  state = trainer.init(params)
  w = state.params["w"]
  assert w.shape == (4, D * D) and w.addressable_shards[0].data.shape == (4, D * D // 8)
  state, _ = trainer.step(state, batch)
  np.testing.assert_array_equal(trainer.gather_params(state)["w"].shape, (4, D, D))


@pytest.mark.slow
def test_compile_time_script_runs():
  """examples/depth_compile_time.py at tiny size (structure only, never speed)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  done = subprocess.run(
    [sys.executable, "depth_compile_time.py", "--layers", "1", "2", "--d-model", "32"],
    cwd=root / "examples",
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  rows = [r.split() for r in done.stdout.splitlines()[2:]]
  assert [(r[0], r[1]) for r in rows] == [
    (str(n), v) for n in (1, 2) for v in ("rolled", "unrolled", "scanned", "gspmd")
  ]
  assert all(len(r) == 7 for r in rows)


def test_a_whole_layer_body_that_gathers_after_its_recompute_is_refused():
  """A hand-edited one-part backward body whose re-gathers come after the recompute: the
  recompute would read weights that are not gathered (zeros), so the executor refuses it,
  naming the parameter, as it does for a body cut into parts."""
  loss, params, batch = scan_stack()
  mesh = mesh_of(8)
  s = zjax.compile_schedule(
    loss, params, batch, mesh=mesh, config=zjax.ZeroConfig(param_persistence_threshold=100)
  )
  data = s.to_dict()
  loop = next(st for st in data["backward"] if st["op"] == "loop")
  assert "parts" not in loop and loop["body"][0]["op"] == "gather"
  gathers = [dict(st, prefetch=False, ahead=False) for st in loop["body"] if st["op"] == "gather"]
  rest = [st for st in loop["body"] if st["op"] != "gather"]
  assert rest[0]["op"] == "recompute"
  loop["body"] = rest[:1] + gathers + rest[1:]
  edited = zjax.Schedule.from_json(_dumps(data))  # valid as data: the vjp finds its weights
  with pytest.raises(zjax.ScheduleMismatchError, match=r"\['[bw]'\] before the recompute"):
    zjax.value_and_grad(loss, edited, mesh=mesh).lower(zjax.shard(params, edited, mesh), batch)
