"""`zjax inspect TARGET`: print the parameter-use table, the schedule and its report."""

import argparse
import dataclasses
import json
import time

import jax

from zjax._src.config import ZeroConfig
from zjax._src.execute import offload_stream
from zjax._src.layout import tensor_parallel, tensor_specs
from zjax._src.plan import comm_model
from zjax._src.plan.entry import resolve_axis_sizes
from zjax._src.plan.plan import plan_schedule
from zjax._src.program.trace import trace_for_schedule
from zjax._src.schedule import render
from zjax._src.train.train import plan_sub_groups
from zjax.cli.target import load_target

_KNOBS = (
  "prefetch_bucket_size",
  "max_live_parameters",
  "max_reuse_distance",
  "param_persistence_threshold",
  "sub_group_size",
)


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
    "inspect",
    help="plan and print the ZeRO-3 schedule of a loss function",
    description="TARGET is PATH.py:FUNCTION or MODULE:FUNCTION; the function returns "
    "(loss_fn, params, batch), (loss_fn, params, batch, ZeroConfig) or, for "
    "tensor parallelism (ZeroConfig.tensor_axes, planned with --mesh), "
    "(loss_fn, params, batch, ZeroConfig, tensor_specs) as for "
    "zjax.compile_schedule, where params and batch may be "
    "jax.ShapeDtypeStructs. Planning is analytic: --devices and --mesh may "
    "exceed the devices present.",
  )
  p.add_argument("target", help="PATH.py:FUNCTION or MODULE:FUNCTION (see above)")
  p.add_argument(
    "--devices",
    type=int,
    default=None,
    help="number of devices N to plan for (default: devices present)",
  )
  p.add_argument(
    "--mesh",
    default=None,
    metavar="SIZES",
    help="plan for a mesh of these axis sizes instead, e.g. 128x8 (with --axes; "
    "the last axis is the node): prints the chosen --layout's schedule, "
    "then flat ZeRO-3, HSDP and hpZ side by side with their predicted "
    "communication time per step",
  )
  p.add_argument(
    "--axes",
    default=None,
    metavar="NAMES",
    help="the mesh axes' names, e.g. replica,fsdp (default: replica,fsdp for two axes)",
  )
  p.add_argument(
    "--layout",
    default="hsdp",
    choices=tuple(_LAYOUTS),
    help="with --mesh: which layout's schedule and report to print (default hsdp)",
  )
  p.add_argument(
    "--link",
    action="append",
    default=[],
    metavar="AXIS=GBPS,US",
    help="with --mesh: an axis's per-device bandwidth in GB/s and latency per "
    "ring step in microseconds, e.g. replica=50,10 (repeatable; default: "
    "last axis 900 GB/s 3 us (NVLink), others 50 GB/s 10 us (one 400 Gb/s "
    "NIC per GPU))",
  )
  p.add_argument(
    "--platform",
    default=None,
    choices=("cpu", "gpu", "tpu"),
    help="backend whose compiled program the report predicts (default: this "
    "machine's); on cpu, 16-bit gradients are reduced in float32",
  )
  p.add_argument("--json", metavar="FILE", help="write {report, schedule} as JSON to FILE")
  p.add_argument("--save", metavar="FILE", help="write the schedule (loadable JSON) to FILE")
  p.add_argument("--summary", action="store_true", help="print only the report")
  p.add_argument(
    "--offload-optimizer",
    action="store_true",
    help="also predict optimizer offload's device and host bytes (adam)",
  )
  p.add_argument(
    "--offload-params",
    action="store_true",
    help="as --offload-optimizer, with the parameter copies in host memory too "
    "(zero3(offload_optimizer=True, offload_params=True))",
  )
  for knob in _KNOBS:
    p.add_argument(
      "--" + knob.replace("_", "-"),
      type=float,
      default=None,
      help=f"override ZeroConfig.{knob} (elements)",
    )
  p.add_argument("--compute-dtype", default=None, help="override ZeroConfig.compute_dtype")
  p.add_argument("--reduce-dtype", default=None, help="override ZeroConfig.reduce_dtype")
  p.add_argument(
    "--roll-layers",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="override ZeroConfig.roll_layers (--no-roll-layers: one segment per layer)",
  )
  p.add_argument(
    "--gather-quantization",
    choices=("none", "int8"),
    default=None,
    help="override ZeroConfig.gather_quantization (ZeRO++ qwZ)",
  )
  p.add_argument(
    "--reduce-quantization",
    choices=("none", "int8", "int4"),
    default=None,
    help="override ZeroConfig.reduce_quantization (ZeRO++ qgZ)",
  )
  p.add_argument(
    "--quantization-block",
    type=int,
    default=None,
    help="override ZeroConfig.quantization_block (values per scale)",
  )
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  target = load_target(args.target)
  config = _config(target.config, args)
  platform = args.platform or jax.default_backend()
  sizes, layouts, mesh_sizes = _mesh(args, config)
  if layouts:
    config = layouts[_LAYOUTS[args.layout]] if len(layouts) > 1 else layouts["flat ZeRO-3"]
  start = time.perf_counter()
  tensor = tensor_parallel.resolve(
    target.params, config, None, mesh_sizes, target.tensor_specs, None
  )
  params = tensor_specs.unbox(target.params)
  trace = trace_for_schedule(
    target.loss_fn,
    params,
    target.batch,
    config,
    sizes,
    mesh=mesh_sizes if config.tensor_axes else None,
  )
  schedule = plan_schedule(trace, config, sizes, platform=platform, tensor=tensor)
  seconds = time.perf_counter() - start
  report = schedule.report()
  if not args.summary:
    print(render.render_param_table(trace, schedule), end="\n\n")
    print(schedule, end="\n\n")
  print(_format_report(report))
  print(f"trace + plan: {seconds:.2f} s")
  if args.offload_optimizer or args.offload_params:
    print(_format_offload(schedule, args.offload_params))
  if layouts:
    links = _links(args.link, mesh_sizes)
    print()
    print(
      format_comparison(comm_model.compare(trace, config, sizes, links, platform, tensor), links)
    )
  if args.save:
    schedule.save(args.save)
    print(f"schedule written to {args.save}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"report": report, "schedule": schedule.to_dict()}, f, indent=1)
    print(f"report + schedule written to {args.json}")
  return 0


_LAYOUTS = {"flat": "flat ZeRO-3", "hsdp": "HSDP", "hpz": "hpZ"}


def _mesh(args, config) -> tuple[dict[str, int], dict, dict[str, int]]:
  """(data axis sizes to plan for, the comparison's layouts or {} without --mesh, every mesh
  axis's size: the tensor axes' too)."""
  if args.mesh is None and config.tensor_axes:
    raise ValueError(
      f"The target's config has tensor axes {config.tensor_axes}: give every "
      f"axis's size with --mesh and --axes (e.g. --mesh 4x2 --axes "
      f"fsdp,{config.tensor_axes[0]})."
    )
  if args.mesh is None:
    if args.axes or args.link:
      raise ValueError("--axes and --link go with --mesh (e.g. --mesh 128x8 --axes replica,fsdp).")
    devices = jax.device_count() if args.devices is None else args.devices
    if devices < 1:
      raise ValueError(f"--devices must be >= 1, got {devices}.")
    if len(config.data_axes) > 1:
      raise ValueError(
        f"The target's config spans the axes {config.data_axes}; give their "
        f"sizes with --mesh (e.g. --mesh 2x4 --axes "
        f"{','.join(config.data_axes)})."
      )
    sizes = resolve_axis_sizes(config, num_devices=devices)
    return sizes, {}, sizes
  if args.devices is not None:
    raise ValueError("Pass --devices or --mesh, not both.")
  dims, axes = parse_mesh(args.mesh, args.axes)
  missing = [a for a in config.tensor_axes if a not in axes]
  if missing:
    raise ValueError(
      f"--axes {','.join(axes)} lacks the tensor axis {missing[0]!r} of the "
      f"target's config (ZeroConfig.tensor_axes); name it, e.g. --axes "
      f"{','.join((*axes[:-1], missing[0]))}."
    )
  mesh_sizes = dict(zip(axes, dims))
  data_axes = tuple(a for a in axes if a not in config.tensor_axes)
  if not data_axes:
    raise ValueError(
      f"--axes {args.axes!r} names only tensor axes; add a data axis (e.g. "
      f"--mesh 8x{dims[-1]} --axes fsdp,{axes[-1]})."
    )
  return ({a: mesh_sizes[a] for a in data_axes}, comm_model.layouts(config, data_axes), mesh_sizes)


def parse_mesh(sizes: str, names: str | None) -> tuple[list[int], tuple[str, ...]]:
  """`--mesh 128x8 --axes replica,fsdp` -> ([128, 8], ("replica", "fsdp")); two axes are
  (replica, fsdp) by default, more are axis0, axis1, ..."""
  try:
    dims = [int(d) for d in sizes.lower().split("x")]
  except ValueError:
    dims = []
  if not dims or any(d < 1 for d in dims):
    raise ValueError(
      f"--mesh must be positive axis sizes joined by 'x' (e.g. 128x8), got {sizes!r}."
    )
  default_axes = (
    ("replica", "fsdp") if len(dims) == 2 else tuple(f"axis{i}" for i in range(len(dims)))
  )
  axes = tuple(names.split(",")) if names else default_axes
  if len(axes) != len(dims) or len(set(axes)) != len(axes) or not all(axes):
    raise ValueError(
      f"--axes must name each of the {len(dims)} mesh axes once (e.g. "
      f"{','.join(default_axes)}), got {names!r}."
    )
  return dims, axes


def _links(specs, sizes) -> dict:
  links = comm_model.default_links(sizes)
  for spec in specs:
    axis, _, values = spec.partition("=")
    parts = values.split(",")
    if axis not in sizes or len(parts) != 2:
      raise ValueError(
        f"--link {spec!r} must be AXIS=GBPS,US with AXIS one of {list(sizes)}, "
        f"e.g. {list(sizes)[0]}=50,10."
      )
    try:
      bandwidth, latency = float(parts[0]) * comm_model.GB, float(parts[1]) * 1e-6
    except ValueError:
      raise ValueError(
        f"--link {spec!r}: bandwidth (GB/s) and latency (us) must be numbers."
      ) from None
    links[axis] = comm_model.Link(bandwidth, latency)
  return links


def format_comparison(rows, links) -> str:
  """The layouts side by side: state per device, bytes and time per axis group, total."""
  keys = sorted({k for r in rows for k in r["by_axis"]}, key=lambda k: (-k.count("+"), k))
  head = (
    ["layout", "params/device", "secondary"]
    + [f"{k} bytes (time)" for k in keys]
    + ["comm time/step"]
  )
  table = [head]
  for r in rows:
    cells = [
      r["layout"],
      render.format_bytes(r["state_bytes_per_device"]),
      render.format_bytes(r["secondary_bytes"]),
    ]
    for k in keys:
      a = r["by_axis"].get(k)
      cells.append(f"{render.format_bytes(a['bytes'])} ({a['seconds'] * 1e3:.1f} ms)" if a else "-")
    cells.append(f"{r['seconds'] * 1e3:.1f} ms")
    table.append(cells)
  fastest = min(rows, key=lambda r: r["seconds"])
  link_words = ", ".join(
    f"{a} {link.bandwidth / comm_model.GB:g} GB/s {link.latency * 1e6:g} us"
    for a, link in links.items()
  )
  return (
    f"communication model (ring collectives, per device per step; links: "
    f"{link_words}):\n" + render.table(table) + f"\nfastest: {fastest['layout']}"
  )


def _config(base: ZeroConfig | None, args) -> ZeroConfig:
  overrides = {k: getattr(args, k) for k in _KNOBS if getattr(args, k) is not None}
  for name in ("compute_dtype", "reduce_dtype", "roll_layers", "quantization_block"):
    if getattr(args, name) is not None:
      overrides[name] = getattr(args, name)
  for name in ("gather_quantization", "reduce_quantization"):
    if getattr(args, name) is not None:
      overrides[name] = None if getattr(args, name) == "none" else getattr(args, name)
  return dataclasses.replace(base or ZeroConfig(), **overrides)


def _format_offload(schedule, params_on_host=False) -> str:
  """zero3(offload_optimizer=True) with adam, per device: what stays on the device, what
  moves to the host, and the update stream's sub-groups (`params_on_host`: offload_params
  too, the parameter copies on the host, each brought to the device by its gather)."""
  plan = offload_stream.predicted(
    schedule, plan_sub_groups(schedule), params_on_host=params_on_host
  )
  size, groups = render.format_bytes, plan["sub_groups"]
  hint = "" if groups > 1 else "; a smaller ZeroConfig.sub_group_size streams it in groups"
  if params_on_host:
    where = (
      f"  device: nothing between steps; each gather brings its bucket's shards "
      f"({size(plan['param_transfer_bytes'])} from the host per step)\n"
      f"  host:   parameter copies + fp32 masters + adam moments  "
      f"{size(plan['host_bytes'])}\n"
    )
  else:
    where = (
      f"  device: parameter copies (compute dtype)  {size(plan['device_bytes'])}\n"
      f"  host:   fp32 masters + adam moments       {size(plan['host_bytes'])}\n"
    )
  title = "parameter and optimizer offload" if params_on_host else "optimizer offload"
  return (
    f"{title} (adam; per device):\n"
    + where
    + f"  update: {groups} sub-group{'s' * (groups != 1)} (sub_group_size "
    f"{schedule.config.sub_group_size:,} elements per device); the device holds at "
    f"most {size(plan['stream_device_bytes'])} of their masters and state at once (of "
    f"{size(plan['whole_state_bytes'])}){hint}"
  )


_REPORT_NOTES = {
  "state_bytes_per_device": "parameters only; the optimizer adds its state, e.g. adam 2x this",
  "peak_live_param_bytes": "gathered (full) parameters alive at once",
  "peak_live_grad_bytes": "full gradients awaiting their reduce-scatter",
}


def _format_report(report: dict) -> str:
  width = max(len(k) for k in report)
  lines = ["report (per device, per training step):"]
  for key, value in report.items():
    if key == "quantization":
      shown = _quantization_words(value)
    elif isinstance(value, dict) and "bytes" in key:
      shown = ", ".join(f"{k}: {v} ({render.format_bytes(v)})" for k, v in value.items()) or "-"
    elif "bytes" in key:
      shown = f"{value}  ({render.format_bytes(value)})"
    else:
      shown = value
    note = _REPORT_NOTES.get(key)
    lines.append(f"  {key.ljust(width)}  {shown}" + (f"  [{note}]" if note else ""))
  return "\n".join(lines)


def _quantization_words(q: dict) -> str:
  """What qwZ / qgZ save, in words: each one's format and bytes against unquantized."""
  if not q:
    return "off"
  parts = []
  for name, what in (("gather", "all-gathers"), ("reduce", "gradient all-to-alls")):
    if name in q:
      e = q[name]
      phases = f" ({'+'.join(e['phases'])})" if "phases" in e else ""
      parts.append(
        f"{what}{phases} {e['dtype']}/{e['block']} {e['rounding']}: "
        f"{render.format_bytes(e['value_bytes'])} values + "
        f"{render.format_bytes(e['scale_bytes'])} scales vs "
        f"{render.format_bytes(e['unquantized_bytes'])} unquantized"
      )
  parts.append(f"gathers + reductions {q['bytes_vs_unquantized']:.3f}x of unquantized")
  return "; ".join(parts)
