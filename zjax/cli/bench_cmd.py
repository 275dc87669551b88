"""`zjax bench`: compare zjax with GSPMD FSDP and data parallel on one model, mesh and
batch (see zjax/bench/run.py for what is measured and how); `--suite gpu`: the GPU suite
(zjax/bench/gpu_suite.py)."""

import pathlib

from zjax.cli import devices

# Sweep defaults: quick (minutes on a 2-core CPU) and --full.
QUICK = {"scale_devices": [2, 8], "scale_layers": [4, 16]}
FULL = {"scale_devices": [1, 2, 4, 8], "scale_layers": [4, 8, 16, 32, 64]}


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
    "bench",
    help="zjax vs GSPMD FSDP vs data parallel: memory, communication, time",
    description="Compiles and runs one training step (loss, gradients, adamw) of each "
    "method on the same mesh and batch; prints a table, writes JSON and PNG "
    "plots. Step times are medians of interleaved rounds.",
  )
  p.add_argument(
    "--suite",
    choices=("compare", "gpu"),
    default="compare",
    help="compare (default): the side-by-side comparison below; gpu: what only "
    "a GPU can tell, in under 8 minutes on one H200 (compiles for a mock "
    "8-GPU topology, runs a 1B-class Llama with and without offload); "
    "without a GPU it runs --tiny",
  )
  p.add_argument(
    "--out",
    metavar="DIR",
    default="gpu_bench",
    help="--suite gpu: where gpu.json, gpu.md, hlo/ and logs/ go",
  )
  p.add_argument(
    "--tiny",
    action="store_true",
    help="--suite gpu: tiny models on CPU devices (what a machine without a GPU runs anyway)",
  )
  p.add_argument(
    "--time-scale", type=float, default=1.0, help="--suite gpu: multiply every part's time limit"
  )
  p.add_argument(
    "--model",
    default="gpt",
    help="'gpt' (zjax/models/gpt.py; also scanned) or "
    "PATH.py:FUNCTION / MODULE:FUNCTION as for zjax inspect",
  )
  p.add_argument(
    "--devices",
    type=int,
    default=8,
    help="simulated CPU devices (or the first N accelerators) of the compared mesh",
  )
  p.add_argument("--layers", type=int, default=8, help="GPT layers")
  p.add_argument("--d-model", type=int, default=128, help="GPT width")
  p.add_argument("--batch", type=int, default=16, help="GPT global batch (sequences)")
  p.add_argument(
    "--rounds",
    type=int,
    default=5,
    help="interleaved timing rounds (each method once per round); times are medians over rounds",
  )
  p.add_argument("--steps-per-round", type=int, default=2, help="steps timed per method and round")
  p.add_argument(
    "--scale-devices",
    type=int,
    nargs="*",
    default=None,
    help=f"device counts of the state-vs-N sweep (default {QUICK['scale_devices']}"
    f", with --full {FULL['scale_devices']}; empty: skip)",
  )
  p.add_argument(
    "--scale-layers",
    type=int,
    nargs="*",
    default=None,
    help=f"depths of the temp- and compile-time-vs-L sweep, GPT only (default "
    f"{QUICK['scale_layers']}, with --full {FULL['scale_layers']}; empty: "
    f"skip)",
  )
  p.add_argument(
    "--full",
    action="store_true",
    help="the long sweeps (tens of minutes on a 2-core CPU); the defaults finish in minutes",
  )
  p.add_argument("--json", metavar="FILE", default="bench.json", help="where the results go (JSON)")
  p.add_argument("--plots", metavar="DIR", default=".", help="where the PNGs go")
  p.set_defaults(run=run)


def fill_sweep_defaults(args) -> None:
  """Sweeps not given on the command line: quick ones, or with --full the long ones."""
  for name, value in (FULL if args.full else QUICK).items():
    if getattr(args, name) is None:
      setattr(args, name, list(value))


def run(args) -> int:
  if args.suite == "gpu":
    return run_gpu_suite(args)
  fill_sweep_defaults(args)
  for name in ("devices", "layers", "d_model", "batch", "rounds", "steps_per_round"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be a positive integer.")
  if args.batch % args.devices:
    raise ValueError(f"--batch {args.batch} is not divisible by --devices {args.devices}.")
  if not pathlib.Path(args.plots).is_dir():
    raise ValueError(f"--plots {args.plots} is not a directory.")
  devices.setup(max([args.devices, *args.scale_devices]))
  import jax
  from rich.console import Console

  from zjax.bench import run as bench

  console = Console()
  if not console.is_terminal:  # logs and CI: the width the tables are made for
    console = Console(width=80)
  if jax.device_count() < args.devices:
    raise ValueError(f"--devices {args.devices}: only {jax.device_count()} present.")
  gpt = args.model == "gpt"
  make = (lambda layers: bench.gpt_model(layers, args.d_model, args.batch)) if gpt else None
  model = make(args.layers) if gpt else bench.target_model(args.model)
  mesh = bench.mesh_of(args.devices)
  settings = {k: v for k, v in vars(args).items() if k != "run"}
  results = {"machine": bench.machine(), "settings": settings}
  results["compare"] = bench.compare(model, mesh, args.rounds, args.steps_per_round)
  for table in bench.main_tables(results["compare"], args.devices):
    console.print(table)
  tensor = bench.tensor_table(results["compare"], args.devices)
  if tensor is not None:
    console.print(tensor)
  counts = [n for n in args.scale_devices if n <= jax.device_count()]
  # the sweeps' points that `compare` measured already are taken from it, not compiled again
  measured = {args.devices: results["compare"]}
  results["devices"] = bench.scale_devices(model, counts, known=measured) if counts else []
  results["depth"] = (
    bench.scale_depth(make, args.scale_layers, mesh, known={args.layers: results["compare"]})
    if gpt and args.scale_layers
    else []
  )
  for key, x in (("devices", "devices"), ("depth", "layers")):
    for row in results[key]:
      console.print(
        f"{key}: {x}={row[x]:>3} {row['method']:>14}  "
        + "  ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in row.items() if k.endswith("bytes"))
        + "".join(f"  {k} {row[k]:.2f}" for k in ("setup_seconds", "compile_seconds") if k in row)
      )
  bench.write_json(results, args.json)
  written = bench.plot(results, args.plots)
  from zjax.bench.methods import PARTITIONER_WARNINGS

  if PARTITIONER_WARNINGS.count:
    console.print(PARTITIONER_WARNINGS.summary())
  console.print(f"wrote {args.json}, " + ", ".join(written))
  return 0


def run_gpu_suite(args) -> int:
  """The GPU suite; this process never starts JAX (each part is a process of its own)."""
  if args.time_scale <= 0:
    raise ValueError(f"--time-scale {args.time_scale} must be positive.")
  if pathlib.Path(args.out).exists() and not pathlib.Path(args.out).is_dir():
    raise ValueError(f"--out {args.out} exists and is not a directory.")
  from zjax.bench import gpu_suite

  pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
  results = gpu_suite.run_suite(args.out, tiny=True if args.tiny else None, scale=args.time_scale)
  print((pathlib.Path(args.out) / "gpu.md").read_text())
  print(f"wrote {args.out}/gpu.json, {args.out}/gpu.md")
  failed = [
    name for name, part in results["parts"].items() if part.get("status") not in ("ok", "skipped")
  ]
  if failed:
    print(f"parts that did not finish: {', '.join(failed)} (see {args.out}/logs/)")
  return 1 if failed else 0
