"""zjax.autoconfig (plan from a budget): the cluster presets and files, the search's
choices and their order, bad input, `zjax plan`, and the chosen configuration compiled.
The fast tier checks the pieces and the errors; every test that runs a search is slow."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import real_models
import zjax
from helpers import mesh_of, trainer_footprint
from zjax._src.autoconfig import cluster as cluster_lib
from zjax._src.autoconfig import search, step_cost
from zjax.cli.main import main as cli_main

MLP = None


def mlp_case():
  """mlp5 (a pure-JAX MLP over a list of dicts), every parameter sharded by default."""
  global MLP
  if MLP is None:
    MLP = real_models.mlp5()
  return MLP


def plan(budget, case=None, **kw):
  case = case or mlp_case()
  kw.setdefault("num_devices", 8)
  return zjax.autoconfig(
    case.loss_fn, case.params, case.batch, device_memory=budget, extra=case.extra, **kw
  )


# -- the cluster ------------------------------------------------------------------------


def test_presets_state_their_figures():
  h100 = cluster_lib.PRESETS["h100x8"]
  assert h100.gpus_per_node == 8 and h100.intra_node_bandwidth == 450e9
  assert h100.inter_node_bandwidth == 50e9 and h100.peak_flops_16bit == 989e12
  assert cluster_lib.PRESETS["h200x4"].gpus_per_node == 4
  assert cluster_lib.resolve(None) is h100
  assert h100.link(8) == h100.intra_node and h100.link(16) == h100.inter_node


def test_a_cluster_file_fills_from_a_preset(tmp_path):
  path = tmp_path / "c.json"
  path.write_text(json.dumps({"base": "h100x8", "name": "mine", "inter_node_bandwidth": 25e9}))
  c = cluster_lib.resolve(str(path))
  assert (c.name, c.inter_node_bandwidth, c.gpus_per_node) == ("mine", 25e9, 8)


@pytest.mark.parametrize(
  "data,field",
  [
    ({"base": "h100x8", "inter_node_bandwidth": -1}, "inter_node_bandwidth"),
    ({"base": "h100x8", "intra_node_bandwidth": 0}, "intra_node_bandwidth"),
    ({"base": "h100x8", "gpus_per_node": 2.5}, "gpus_per_node"),
    ({"name": "x", "gpus_per_node": 8}, "missing field"),
    ({"base": "h100x8", "bandwith": 1}, "unknown field"),
    ({"base": "tpu"}, "'base'"),
  ],
)
def test_a_bad_cluster_names_the_field(tmp_path, data, field):
  path = tmp_path / "c.json"
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match=field) as e:
    cluster_lib.resolve(str(path))
  assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_cluster_lists_the_presets():
  with pytest.raises(ValueError, match="h100x8"):
    cluster_lib.resolve("dgx-a100")


# -- the models -------------------------------------------------------------------------


def test_flops_count_matmuls_and_scan_iterations():
  a, b = jnp.ones((8, 16)), jnp.ones((16, 32))
  assert step_cost.device_flops(jax.make_jaxpr(lambda a, b: a @ b)(a, b).jaxpr) == 2 * 8 * 16 * 32

  def looped(a, b):
    return jax.lax.scan(lambda c, _: (c, a @ b), 0.0, None, length=5)[1]

  assert step_cost.device_flops(jax.make_jaxpr(looped)(a, b).jaxpr) == 5 * 2 * 8 * 16 * 32
  x, k = jnp.ones((2, 3, 9, 9)), jnp.ones((4, 3, 3, 3))  # NCHW, OIHW: 7x7 outputs
  conv = lambda x, k: jax.lax.conv(x, k, (1, 1), "VALID")  # noqa: E731
  assert step_cost.device_flops(jax.make_jaxpr(conv)(x, k).jaxpr) == 2 * (2 * 4 * 7 * 7) * 27


@pytest.mark.parametrize(
  "given,expected", [("80GiB", 80 * 2**30), ("80 GB", 80e9), ("1e6", 10**6), (4096, 4096)]
)
def test_budgets_read_as_bytes(given, expected):
  assert search.parse_bytes(given, "device_memory") == expected


@pytest.mark.parametrize("given", ["80 GiBs", "-1GB", 0, "lots", float("nan"), True])
def test_a_bad_budget_names_the_argument(given):
  with pytest.raises(ValueError, match="device_memory"):
    search.parse_bytes(given, "device_memory")


def test_micro_batches_split_the_batch_evenly():
  batch = {"x": jax.ShapeDtypeStruct((64, 3), jnp.float32), "key": jnp.zeros((), jnp.uint32)}
  assert search.accumulation_choices(batch, 8) == [1, 2, 4, 8]
  assert search.micro_batch(batch, 4)["x"].shape == (16, 3)
  with pytest.raises(ValueError, match="does not divide by the 12 devices"):
    search.accumulation_choices(batch, 12)


# -- the search -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep():
  """The mlp's choices over budgets from the smallest it can reach to a loose one."""
  with pytest.raises(zjax.BudgetError) as e:
    plan(1)
  smallest = e.value.smallest.memory.total
  loose = plan(2**40)
  margin = 1 + search.MARGIN
  budgets = np.geomspace(smallest * margin * 1.01, loose.memory.total * margin * 1.2, 6)
  return smallest, loose, [plan(int(b)) for b in budgets]


@pytest.mark.slow
def test_every_choice_fits_its_budget_with_the_margin(sweep):
  _, loose, plans = sweep
  for p in plans + [loose]:
    assert p.memory.total * (1 + p.margin) <= p.budget
    assert p.decisions and p.rejected
    json.dumps(p.to_dict())  # JSON-serialisable
    assert p.config == p.schedule.config


@pytest.mark.slow
def test_tighter_budgets_never_choose_more_memory(sweep):
  _, _, plans = sweep
  peaks = [p.memory.total for p in plans]
  assert peaks == sorted(peaks)
  times = [p.time.step for p in plans]  # and a looser one is never slower (1% ties aside)
  assert all(b <= a * (1 + search.TIE) for a, b in zip(times, times[1:]))
  assert len(set(peaks)) > 1  # the sweep does move the choice


@pytest.mark.slow
def test_a_loose_budget_chooses_the_fastest_candidate(sweep):
  _, loose, _ = sweep
  assert all(r["step_seconds"] >= loose.time.step * (1 - search.TIE) for r in loose.rejected)
  assert not loose.offload_optimizer and loose.accumulation_steps == 1


@pytest.mark.slow
def test_too_small_a_budget_names_the_smallest_found(sweep):
  smallest, _, _ = sweep
  with pytest.raises(zjax.BudgetError, match="smallest found is") as e:
    plan(int(smallest * 0.9))
  message = str(e.value)
  assert "more devices" in message and "offload" in message and "smaller" in message


@pytest.mark.slow
def test_a_loss_with_collectives_over_the_data_axis_keeps_the_flat_layout():
  case = real_models.resnet_syncbn()  # BatchNorm(axis_name="fsdp")
  p = plan(2**40, case)
  assert p.axis_sizes == {"fsdp": 8} and not p.config.replicate_axes
  assert all(r["candidate"].startswith("flat") for r in p.rejected)


@pytest.mark.slow
def test_a_mesh_keeps_its_axes():
  mesh = jax.sharding.AbstractMesh((2, 4), ("replica", "fsdp"))
  p = plan(2**40, mesh=mesh, num_devices=None)
  assert p.axis_sizes == {"replica": 2, "fsdp": 4}
  layouts = {r["candidate"].split(",")[0] for r in p.rejected} | {p.config.replicate_axes}
  assert len(layouts) >= 3  # flat, HSDP, hpZ


@pytest.mark.parametrize(
  "kw,match",
  [
    ({"num_devices": 0}, "num_devices must be a positive int"),
    ({"num_devices": 8, "mesh": mesh_of(8)}, "exactly one of num_devices"),
    ({"margin": -0.1}, "margin must be in"),
    ({"compute_efficiency": 0}, "compute_efficiency must be in"),
    ({"config": zjax.ZeroConfig(replicate_axes=("r",))}, "chooses the mesh axes"),
    ({"cluster": {"base": "h100x8", "host_bandwidth": -5}}, "host_bandwidth"),
  ],
)
def test_bad_arguments_are_named(kw, match):
  with pytest.raises((ValueError, TypeError), match=match):
    plan(2**30, **kw)


# -- the command line --------------------------------------------------------------------


@pytest.mark.slow
def test_zjax_plan_prints_the_choice_and_json(capsys):
  gpt = "examples/gpt.py:inspect_gpt"  # a global batch of 8
  assert cli_main(["plan", gpt, "--memory", "80GiB", "--devices", "8"]) == 0
  out = capsys.readouterr().out
  assert "chosen:" in out and "why:" in out and "rejected" in out
  assert cli_main(["plan", gpt, "--memory", "80GiB", "--mesh", "2x4", "--json"]) == 0
  data = json.loads(capsys.readouterr().out)
  assert data["axis_sizes"] in ({"replica": 2, "fsdp": 4}, {"fsdp": 8})
  assert data["memory"]["total"] * (1 + data["margin"]) <= data["budget"]


@pytest.mark.parametrize(
  "args,match",
  [
    (["--memory", "80GiB", "--devices", "8", "--mesh", "3x8"], "--mesh 3x8 has 24 devices"),
    (["--memory", "80GiB", "--devices", "8", "--cluster", "nope"], "neither a preset"),
    (["--memory", "lots", "--devices", "8"], "device_memory"),
    (["--memory", "80GiB", "--devices", "64"], "does not divide by the 64 devices"),
    pytest.param(
      ["--memory", "1MiB", "--devices", "8"], "No configuration fits", marks=pytest.mark.slow
    ),
  ],
)
def test_zjax_plan_bad_input_is_one_line(capsys, args, match):
  assert cli_main(["plan", "examples/gpt.py:inspect_gpt", *args]) == 2
  err = capsys.readouterr().err.strip()
  assert match in err and err.count("\n") == 0


# -- the chosen configuration, compiled ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_the_chosen_configuration_fits_when_compiled(name):
  case = getattr(real_models, name)()
  loose = plan(2**40, case, optimizer=optax.adam(1e-3))
  for budget in (loose.budget, int(loose.memory.total * 0.8)):
    p = plan(budget, case, optimizer=optax.adam(1e-3)) if budget != loose.budget else loose
    compiled = trainer_footprint(case, p)
    assert compiled <= p.budget
    assert compiled <= p.memory.total * (1 + p.margin)  # never under by more than the margin


@pytest.mark.slow
def test_the_optimizer_state_is_counted_from_the_optimizer():
  """adam's two fp32 moments per trained element (and its step count); sgd has none."""
  case = mlp_case()
  adam = plan(2**40, case, optimizer=optax.adam(1e-3))
  sgd = plan(2**40, case, optimizer=optax.sgd(1e-3))
  assert adam.config == sgd.config
  assert adam.memory.optimizer == 2 * adam.memory.parameters + 4  # all float, all trained
  assert sgd.memory.optimizer == 0 and sgd.memory.total < adam.memory.total


@pytest.mark.slow
def test_a_mesh_with_a_loss_using_its_axis_keeps_the_flat_layout():
  case = real_models.resnet_syncbn()  # BatchNorm(axis_name="fsdp")
  mesh = jax.sharding.AbstractMesh((2, 4), ("replica", "fsdp"))
  p = plan(2**40, case, mesh=mesh, num_devices=None)
  assert not p.config.replicate_axes
  assert all(r["candidate"].startswith("flat") for r in p.rejected)
