"""`zjax inspect TARGET`: print the parameter-use table, the schedule and its report."""

import argparse
import dataclasses
import json
import time

import jax

from zjax._src import render
from zjax._src.config import ZeroConfig
from zjax._src.plan import plan_schedule
from zjax._src.trace import trace_for_schedule
from zjax.cli.target import load_target

_KNOBS = ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance",
          "param_persistence_threshold", "sub_group_size")


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
      "inspect", help="plan and print the ZeRO-3 schedule of a loss function",
      description="TARGET is PATH.py:FUNCTION or MODULE:FUNCTION; the function returns "
                  "(loss_fn, params, batch) or (loss_fn, params, batch, ZeroConfig), where "
                  "params and batch may be jax.ShapeDtypeStructs. Planning is analytic: "
                  "--devices may exceed the devices present.")
  p.add_argument("target", help="PATH.py:FUNCTION or MODULE:FUNCTION (see above)")
  p.add_argument("--devices", type=int, default=None,
                 help="number of devices N to plan for (default: devices present)")
  p.add_argument("--platform", default=None, choices=("cpu", "gpu", "tpu"),
                 help="backend whose compiled program the report predicts (default: this "
                      "machine's); on cpu, 16-bit gradients are reduced in float32")
  p.add_argument("--json", metavar="FILE", help="write {report, schedule} as JSON to FILE")
  p.add_argument("--save", metavar="FILE", help="write the schedule (loadable JSON) to FILE")
  p.add_argument("--summary", action="store_true", help="print only the report")
  for knob in _KNOBS:
    p.add_argument("--" + knob.replace("_", "-"), type=float, default=None,
                   help=f"override ZeroConfig.{knob} (elements)")
  p.add_argument("--compute-dtype", default=None, help="override ZeroConfig.compute_dtype")
  p.add_argument("--reduce-dtype", default=None, help="override ZeroConfig.reduce_dtype")
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  target = load_target(args.target)
  config = _config(target.config, args)
  devices = jax.device_count() if args.devices is None else args.devices
  if devices < 1:
    raise ValueError(f"--devices must be >= 1, got {devices}.")
  start = time.perf_counter()
  trace = trace_for_schedule(target.loss_fn, target.params, target.batch, config, devices)
  schedule = plan_schedule(trace, config, devices,
                           platform=args.platform or jax.default_backend())
  seconds = time.perf_counter() - start
  report = schedule.report()
  if not args.summary:
    print(render.render_param_table(trace, schedule), end="\n\n")
    print(schedule, end="\n\n")
  print(_format_report(report))
  print(f"trace + plan: {seconds:.2f} s")
  if args.save:
    schedule.save(args.save)
    print(f"schedule written to {args.save}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"report": report, "schedule": schedule.to_dict()}, f, indent=1)
    print(f"report + schedule written to {args.json}")
  return 0


def _config(base: ZeroConfig | None, args) -> ZeroConfig:
  overrides = {k: getattr(args, k) for k in _KNOBS if getattr(args, k) is not None}
  for name in ("compute_dtype", "reduce_dtype"):
    if getattr(args, name) is not None:
      overrides[name] = getattr(args, name)
  return dataclasses.replace(base or ZeroConfig(), **overrides)


_REPORT_NOTES = {
    "state_bytes_per_device": "parameters only; the optimizer adds its state, e.g. adam "
                              "2x this",
    "peak_live_param_bytes": "gathered (full) parameters alive at once",
    "peak_live_grad_bytes": "full gradients awaiting their reduce-scatter",
}


def _format_report(report: dict) -> str:
  width = max(len(k) for k in report)
  lines = ["report (per device, per training step):"]
  for key, value in report.items():
    shown = f"{value}  ({render.format_bytes(value)})" if "bytes" in key else value
    note = _REPORT_NOTES.get(key)
    lines.append(f"  {key.ljust(width)}  {shown}" + (f"  [{note}]" if note else ""))
  return "\n".join(lines)
