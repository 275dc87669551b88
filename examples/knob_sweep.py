"""Every model of tests/real_models.py at many knob settings, rolled and unrolled: the
gradient step's report against its analysis compile (all-gathers, reduce-scatters and
all-reduces: count and bytes) and its gradients against plain single-device JAX (fp32
rtol 1e-5, atol 1e-6). One line per case; "refused" is a documented ScheduleError (a
bucket above max_live_parameters).

  python examples/knob_sweep.py [--devices 8] [--models llama,bert] [--knobs reuse0,hpz]

HSDP and hpZ run on a 2 x N/2 ("data", "fsdp") mesh; the sync-BatchNorm ResNet's
statistics then span "fsdp" only, by the model's choice, so its parity is not checked
there. t5 draws dropout per device, so only its report is checked.
"""

import argparse
import dataclasses
import pathlib
import sys

from zjax.cli import devices

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--models", default="", help="comma-separated names (default: all)")
parser.add_argument("--knobs", default="", help="comma-separated names (default: all)")
ARGS = parser.parse_args()
devices.setup(ARGS.devices)  # before JAX starts

import jax  # noqa: E402

import zjax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import helpers  # noqa: E402
import real_models  # noqa: E402
from test_real_models import assert_same_outputs, reference  # noqa: E402

MODELS = {
  **real_models.CASES,
  **real_models.STRESS_CASES,
  "llama": real_models.llama,
  "bert": real_models.bert,
  "mlp5": real_models.mlp5,
  "eqx_mlp": real_models.eqx_mlp,
}


def knobs(case) -> dict:
  """Name -> config, scaled to the model's largest leaf."""
  big = max(x.size for x in jax.tree.leaves(case.params))
  shard_all = zjax.ZeroConfig(param_persistence_threshold=0)
  reuse0 = dataclasses.replace(shard_all, max_reuse_distance=0)
  two_axes = dataclasses.replace(reuse0, replicate_axes=("data",))
  hpz = dataclasses.replace(two_axes, secondary_partition=True)
  with_ = dataclasses.replace
  return {
    "reuse0": reuse0,
    "no-prefetch": with_(reuse0, prefetch_bucket_size=0),
    "live-2-leaves": with_(reuse0, max_live_parameters=2 * big, prefetch_bucket_size=big),
    "live-1-leaf": with_(
      shard_all, max_live_parameters=big, prefetch_bucket_size=0, max_reuse_distance=big
    ),
    "reuse-3-leaves": with_(shard_all, max_reuse_distance=3 * big, prefetch_bucket_size=big // 2),
    "per-gather": with_(reuse0, gradient_reduction="per_gather"),
    "persistence-200": zjax.ZeroConfig(param_persistence_threshold=200, max_reuse_distance=0),
    "hsdp": two_axes,
    "hpz": hpz,
    "hpz-live-2-leaves": with_(hpz, max_live_parameters=2 * big),
  }


def check(case, config, reference) -> list[str]:
  """What differs: the report from the compiled program, the gradients from `reference`."""
  n = ARGS.devices
  two_axes = bool(config.replicate_axes)
  mesh = jax.make_mesh((2, n // 2), ("data", "fsdp")) if two_axes else helpers.mesh_of(n)
  schedule = zjax.compile_schedule(
    case.loss_fn, case.params, case.batch, mesh=mesh, config=config, extra=case.extra
  )
  step = zjax.value_and_grad(case.loss_fn, schedule, mesh=mesh)
  args = (zjax.shard(case.params, schedule, mesh), case.batch)
  args += () if case.extra is None else (case.extra,)
  out, grads = step(*args)
  text = zjax.hlo.compile_for_analysis(step.lower(*args)).as_text()
  problems = []
  report, executed = schedule.report(), zjax.hlo.executed(text)
  for kind in ("all_gather", "reduce_scatter"):
    got = (executed.get(f"{kind}_count", 0), executed.get(f"{kind}_bytes", 0))
    if got != (report[f"{kind}_count"], report[f"{kind}_bytes"]):
      problems.append(f"{kind} {got} vs report {report[f'{kind}_count'], report[f'{kind}_bytes']}")
  reduced = report["replica_all_reduce_bytes"] + report["persistent_grad_all_reduce_bytes"]
  in_model = case.extra is not None  # sync BatchNorm: the statistics' all-reduces too
  if not in_model and not reduced <= executed.get("all_reduce_bytes", 0) <= reduced + 16:
    problems.append(f"all-reduce {executed.get('all_reduce_bytes', 0)} B vs report {reduced}")
  if reference is not None and not (two_axes and in_model):
    ref_out, ref_grads = reference
    try:
      assert_same_outputs(case, out, ref_out)  # the loss (and updated statistics)
      helpers.assert_trees_close(zjax.unshard(grads, schedule), ref_grads)
    except AssertionError as e:
      problems.append("gradients: " + " ".join(str(e).split())[:200])
  return problems


def main():
  names = ARGS.models.split(",") if ARGS.models else list(MODELS)
  for name in names:
    case = MODELS[name]()
    ref = None if name == "t5" else reference(case)
    for knob, config in knobs(case).items():
      if ARGS.knobs and knob not in ARGS.knobs.split(","):
        continue
      for roll in (True, False):
        try:
          problems = check(case, dataclasses.replace(config, roll_layers=roll), ref)
          verdict = "; ".join(problems) or "ok"
        except zjax.ScheduleError as e:
          verdict = "refused: " + str(e).split(". ")[0][:120]
        print(f"{name:14} {knob:18} {'rolled' if roll else 'unrolled':9} {verdict}", flush=True)


if __name__ == "__main__":
  main()
