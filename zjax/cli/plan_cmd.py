"""`zjax plan TARGET --memory 80GiB --devices 64`: the layout and knobs zjax chooses for a
memory budget and a cluster (zjax.autoconfig), as a short table or JSON."""

import argparse
import json

from jax.sharding import AbstractMesh

from zjax._src.autoconfig import cluster as cluster_lib
from zjax._src.autoconfig.search import MARGIN, autoconfig
from zjax.cli.inspect_cmd import parse_mesh
from zjax.cli.target import load_target


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
    "plan",
    help="choose the layout and knobs for a memory budget and a cluster",
    description="TARGET is PATH.py:FUNCTION or MODULE:FUNCTION returning (loss_fn, "
    "params, batch[, ZeroConfig]) as for zjax inspect; batch is the global batch of one "
    "optimizer step. Nothing is compiled or allocated: --devices may exceed the devices "
    "present.",
  )
  p.add_argument("target", help="PATH.py:FUNCTION or MODULE:FUNCTION")
  p.add_argument(
    "--memory", required=True, metavar="SIZE", help="memory per device, e.g. 80GiB or 80GB"
  )
  p.add_argument("--devices", type=int, default=None, help="number of devices N")
  p.add_argument(
    "--mesh",
    default=None,
    metavar="SIZES",
    help="plan for this mesh instead (e.g. 128x8, with --axes; the last axis is the node): "
    "flat over every axis, HSDP or hpZ",
  )
  p.add_argument("--axes", default=None, metavar="NAMES", help="--mesh's axis names (replica,fsdp)")
  p.add_argument(
    "--cluster",
    default=cluster_lib.DEFAULT,
    metavar="NAME|FILE",
    help=f"a preset ({', '.join(cluster_lib.PRESETS)}) or a JSON file of Cluster fields "
    f"(default {cluster_lib.DEFAULT})",
  )
  p.add_argument(
    "--platform",
    default="gpu",
    choices=("cpu", "gpu", "tpu"),
    help="backend whose compiled program the prediction is for (default gpu)",
  )
  p.add_argument("--margin", type=float, default=MARGIN, help=f"safety margin (default {MARGIN})")
  p.add_argument(
    "--efficiency",
    type=float,
    default=0.4,
    help="fraction of the peak FLOP/s compute reaches (default 0.4)",
  )
  p.add_argument(
    "--no-offload", action="store_true", help="do not consider optimizer or parameter offload"
  )
  p.add_argument("--json", action="store_true", help="print the plan as JSON")
  p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
  target = load_target(args.target)
  if args.devices is None and args.mesh is None:
    raise ValueError("Pass --devices N or --mesh SIZES (with --axes).")
  mesh = None if args.mesh is None else _abstract_mesh(args.mesh, args.axes)
  if mesh is not None and args.devices is not None and mesh.size != args.devices:
    raise ValueError(
      f"--mesh {args.mesh} has {mesh.size} devices, but --devices is {args.devices}: the "
      f"mesh's sizes must multiply to the device count."
    )
  plan = autoconfig(
    target.loss_fn,
    target.params,
    target.batch,
    device_memory=args.memory,
    num_devices=args.devices if mesh is None else None,
    mesh=mesh,
    cluster=args.cluster,
    config=target.config,
    margin=args.margin,
    compute_efficiency=args.efficiency,
    offload=not args.no_offload,
    platform=args.platform,
  )
  if args.json:
    print(json.dumps(plan.to_dict(), indent=1))
  else:
    print(plan.summary())
  return 0


def _abstract_mesh(sizes: str, names: str | None) -> AbstractMesh:
  dims, axes = parse_mesh(sizes, names)
  return AbstractMesh(tuple(dims), axes)
