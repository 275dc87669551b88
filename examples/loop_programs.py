"""Loop steps side by side: for outside-style models with rolled or scanned layers, at five
settings (default knobs, max_reuse_distance=0, 4 devices, hpZ on 2 x 4, qwZ), the compiled
step's all-gathers and reduce-scatters against the report, its temp per device, and a
checksum of the gradients (sum of |g| in fp64), from one run of each.

  python examples/loop_programs.py --out after.json
  PYTHONPATH=<older checkout> python examples/loop_programs.py --out before.json
  python examples/loop_programs.py --compare before.json after.json

The compare mode prints what differs between two runs (docs/results.md, "One walker for
every loop"). Analysis compiles (zjax.hlo.compile_for_analysis); about 5 minutes.
"""

import argparse
import json
import pathlib
import sys

from zjax.cli import devices

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", help="write the measurements to this JSON file")
parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
ARGS = parser.parse_args()


def compare(before_path, after_path):
  before = {r["name"]: r for r in json.loads(pathlib.Path(before_path).read_text())}
  after = {r["name"]: r for r in json.loads(pathlib.Path(after_path).read_text())}
  print("| case | loops | collectives == report | temp before -> after | gradients |")
  print("|---|---|---|---|---|")
  for name, b in before.items():
    a = after[name]
    exact = all(r["compiled"] == r["reported"] for r in (a, b))
    same = "equal" if a["compiled"] == b["compiled"] else f"{b['compiled']} -> {a['compiled']}"
    temp = f"{b['temp']:,} -> {a['temp']:,} ({a['temp'] / b['temp'] - 1:+.1%})"
    grads = "equal" if a["checksum"] == b["checksum"] else f"{a['checksum'] / b['checksum']:.9f}"
    print(f"| {name} | {a['loops']} | {exact}, {same} | {temp} | {grads} |")


if ARGS.compare:
  compare(*ARGS.compare)
  sys.exit(0)

devices.setup(8)  # before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zjax  # noqa: E402
from zjax.bench import run as bench  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import real_models as rm  # noqa: E402
from helpers import mesh_of  # noqa: E402

SETTINGS = {
  "default": ({}, 8),
  "reuse0": ({"max_reuse_distance": 0, "prefetch_bucket_size": 0}, 8),
  "4 devices": ({}, 4),
  "hpZ 2x4": ({"replicate_axes": ("data",), "secondary_partition": True}, None),
  "qwZ": ({"gather_quantization": "int8"}, 8),
}


def loops_of(schedule) -> str:
  """'whole' or 'N parts' per loop step, with '+prefetch' where it gathers ahead."""
  out = []
  for st in schedule.forward:
    if st.op == "loop":
      kind = f"{len(st.parts)} parts" if st.parts else "whole"
      ahead = any(b.prefetch for b in st.body if b.op == "gather") and not st.parts
      out.append(kind + (" +prefetch" if ahead else ""))
  return ", ".join(out) or "none"


def measure(name, case, knobs, n) -> dict:
  mesh = jax.make_mesh((2, 4), ("data", "fsdp")) if n is None else mesh_of(n)
  config = zjax.ZeroConfig(param_persistence_threshold=16, **knobs)
  schedule = zjax.compile_schedule(
    case.loss_fn, case.params, case.batch, mesh=mesh, config=config, extra=case.extra
  )
  step = zjax.value_and_grad(case.loss_fn, schedule, mesh=mesh)
  args = (zjax.shard(case.params, schedule, mesh), case.batch)
  args += () if case.extra is None else (case.extra,)
  summary = zjax.hlo.summarize(zjax.hlo.compile_for_analysis(step.lower(*args)))
  grads = zjax.unshard(step(*args)[1], schedule)
  report = schedule.report()
  kinds = ("all_gather_count", "all_gather_bytes", "reduce_scatter_count", "reduce_scatter_bytes")
  return {
    "name": name,
    "loops": loops_of(schedule),
    "compiled": [summary[k] for k in kinds],
    "reported": [report[k] for k in kinds],
    "temp": summary["temp_bytes"],
    "checksum": float(sum(np.abs(np.asarray(g, np.float64)).sum() for g in jax.tree.leaves(grads))),
  }


gpt = bench.gpt_model(4, 64, 8).scanned
CASES = {
  "llama": rm.llama(),
  "t5": rm.t5(),
  "bert": rm.bert(),
  "griffin": rm.griffin(),
  "scanned GPT": rm.Case(gpt.loss_fn, gpt.params, gpt.batch),
}
results = []
for case_name, case in CASES.items():
  for setting, (knobs, n) in SETTINGS.items():
    results.append(measure(f"{case_name}, {setting}", case, knobs, n))
    print(json.dumps(results[-1]), flush=True)
if ARGS.out:
  pathlib.Path(ARGS.out).write_text(json.dumps(results, indent=1))
