"""zjax.autoconfig against the compiler: for each model of tests/real_models.py and the bench
GPT, at three budgets per device (tight: just above the smallest configuration zjax finds;
loose: room for the fastest; middle: their geometric mean) on N simulated devices, the
chosen configuration, its predicted peak, and the analysis compile of the trainer's step
it configures (adam; zjax.hlo.compile_for_analysis: arguments + outputs + temp - aliased,
device memory only).

  python examples/autoconfig_budgets.py [--devices 8] [--models llama gpt ...] [--json F]
"""

import argparse
import json
import math
import pathlib
import sys
import time

from zjax.cli import devices

REAL = (
  "mlp5 eqx_mlp resnet18 resnet_syncbn encdec nnx_gqa rnn_lstm bilstm_scan griffin t5 llama bert"
)
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--models", nargs="*", default=[*REAL.split(), "gpt"])
parser.add_argument("--json", default=None, help="write the rows as JSON to this file")
parser.add_argument(
  "--offload",
  action="store_true",
  help="let the search offload (the CPU's one memory cannot show what stays on a device)",
)
ARGS = parser.parse_args()
devices.setup(ARGS.devices)  # before JAX starts
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import optax  # noqa: E402

import real_models  # noqa: E402
import zjax  # noqa: E402
from helpers import trainer_footprint  # noqa: E402
from zjax._src.autoconfig.search import MARGIN, describe_choice  # noqa: E402
from zjax.bench.run import gpt_model  # noqa: E402


def case(name):
  if name == "gpt":
    m = gpt_model(8, 128, 8 * ARGS.devices)
    return real_models.Case(m.loss_fn, m.params, m.batch)
  return getattr(real_models, name)()


def plan_at(c, budget):
  return zjax.autoconfig(
    c.loss_fn,
    c.params,
    c.batch,
    device_memory=budget,
    num_devices=ARGS.devices,
    extra=c.extra,
    optimizer=optax.adam(1e-3),
    offload=ARGS.offload,
  )


def budgets(c):
  """(tight, middle, loose) budgets for this model."""
  try:
    plan_at(c, 1)
  except zjax.BudgetError as e:
    smallest = e.smallest.memory.total
  fastest = plan_at(c, 2**40).memory.total
  tight = math.ceil(smallest * (1 + MARGIN) * 1.01)
  loose = math.ceil(max(fastest * (1 + MARGIN) * 1.25, tight * 1.5))
  return tight, math.ceil(math.sqrt(tight * loose)), loose


def main():
  rows = []
  print(
    f"{'model':14s} {'budget':>6s} {'budget B':>11s} {'predicted':>11s} {'compiled':>11s} "
    f"{'pred/comp':>9s} {'fits':>4s}  chosen"
  )
  for name in ARGS.models:
    c = case(name)
    started = time.perf_counter()
    for label, budget in zip(("tight", "middle", "loose"), budgets(c)):
      plan = plan_at(c, budget)
      compiled = trainer_footprint(c, plan)
      predicted = plan.memory.total
      row = {
        "model": name,
        "budget": label,
        "budget_bytes": budget,
        "predicted": predicted,
        "compiled": compiled,
        "ratio": predicted / compiled,
        "fits": compiled <= budget,
        "chosen": describe_choice(plan),
        "step_seconds": plan.time.step,
        "search_seconds": plan.search_seconds,
      }
      rows.append(row)
      print(
        f"{name:14s} {label:>6s} {budget:11,d} {predicted:11,d} {compiled:11,d} "
        f"{row['ratio']:9.3f} {'yes' if row['fits'] else 'NO':>4s}  {row['chosen']}",
        flush=True,
      )
    print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
  ratios = [r["ratio"] for r in rows]
  print(
    f"predicted / compiled: {min(ratios):.3f} - {max(ratios):.3f} over {len(rows)} plans; "
    f"every chosen configuration fits: {all(r['fits'] for r in rows)}"
  )
  if ARGS.json:
    with open(ARGS.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
