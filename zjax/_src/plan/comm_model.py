"""A communication model: predicted time per training step of a schedule on a cluster that
need not exist, from the bytes each collective moves over each mesh axis.

Each mesh axis is a `Link`: the bandwidth each device has over it (bytes/s, one direction)
and a latency per ring step. A collective over a group of G devices spanning some axes runs
as a ring whose every step is paced by the slowest of those axes (bandwidth beta, latency
alpha). With B the collective's full-buffer bytes (the all-gather's output, the
reduce-scatter's input, the all-reduce's operand; as in `Schedule.report()`):

    all-gather, reduce-scatter:  (G - 1) * (alpha + B / (G * beta))
    all-to-all (qgZ):            (G - 1) * (alpha + B / (G * beta))  (pairwise exchange)
    all-reduce:              2 * (G - 1) * (alpha + B / (G * beta))

and a step's communication time is the sum over its collectives (no overlap with compute
or between collectives: an upper bound on exposed communication, and the right quantity
for comparing layouts). The loss's scalar all-reduce is ignored.

With tensor parallelism the tensor axis's collectives are GSPMD's, not the schedule's: they
enter as the schedule's Megatron-style estimate (`tensor_comm.py`), under the key
"AXIS (estimate)".
"""

import dataclasses

from zjax._src.config import ZeroConfig
from zjax._src.plan.plan import plan_schedule
from zjax._src.schedule import ir
from zjax._src.schedule.report import executed_collectives

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Link:
  """One mesh axis's network: per-device bandwidth (bytes/s) and latency per ring step (s)."""

  bandwidth: float
  latency: float

  def __post_init__(self):
    for name in ("bandwidth", "latency"):
      value = getattr(self, name)
      if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < 0
        or (name == "bandwidth" and value == 0)
      ):
        rule = "positive" if name == "bandwidth" else "non-negative"
        raise ValueError(f"Link.{name} must be a {rule} number, got {value!r}.")


# A GPU node (e.g. 8 x H100/H200 with NVLink/NVSwitch) and the network between nodes (one
# 400 Gb/s NIC per GPU).
INTRA_NODE = Link(bandwidth=900 * GB, latency=3e-6)
INTER_NODE = Link(bandwidth=50 * GB, latency=10e-6)


def default_links(axes) -> dict[str, Link]:
  """The last (innermost) axis inside a node, every other axis across nodes."""
  axes = list(axes)
  return {a: INTRA_NODE if i == len(axes) - 1 else INTER_NODE for i, a in enumerate(axes)}


def collective_seconds(kind: str, nbytes: int, group: int, link: Link) -> float:
  """Ring time of one collective (see the module docstring)."""
  if group <= 1 or nbytes == 0:
    return 0.0
  one_way = (group - 1) * (link.latency + nbytes / (group * link.bandwidth))
  return 2 * one_way if kind == "all_reduce" else one_way


def predict(schedule, links: dict[str, Link] | None = None) -> dict:
  """Predicted communication of one training step: bytes and seconds per axis group (e.g.
  "replica+fsdp"; a tensor axis's estimate as "tensor (estimate)") and in total. `links`:
  mesh axis -> Link (default `default_links`, the tensor axes last)."""
  sizes = {**schedule.axis_sizes, **schedule.tensor_axis_sizes}
  links = default_links(sizes) if links is None else links
  missing = [a for a in sizes if a not in links]
  if missing:
    raise ValueError(f"No Link for mesh axis {missing[0]!r}; give one per axis of {list(sizes)}.")
  by_axis: dict[str, dict] = {}
  total = 0.0
  for kind, axes, nbytes in executed_collectives(schedule, schedule._simulation):
    group = 1
    for a in axes:
      group *= sizes[a]
    slowest = min((links[a] for a in axes), key=lambda link: (link.bandwidth, -link.latency))
    seconds = collective_seconds(kind, nbytes, group, slowest)
    row = by_axis.setdefault(ir.axes_key(axes), {"bytes": 0, "seconds": 0.0, "count": 0})
    row["bytes"] += nbytes
    row["seconds"] += seconds
    row["count"] += 1
    total += seconds
  for axis, size in schedule.tensor_axis_sizes.items():  # one tensor axis in this version
    row = {"bytes": 0, "seconds": 0.0, "count": 0}
    for kind, _, nbytes in schedule.tensor_estimate:
      row["bytes"] += nbytes
      row["seconds"] += collective_seconds(kind, nbytes, size, links[axis])
      row["count"] += 1
    if row["count"]:
      by_axis[f"{axis} (estimate)"] = row
      total += row["seconds"]
  return {"seconds": total, "by_axis": by_axis}


def layouts(config: ZeroConfig, axes) -> dict[str, ZeroConfig]:
  """The three layouts of a mesh whose last axis is the node: flat ZeRO-3 over every axis,
  HSDP (shard over the last axis, replicate over the others) and hpZ (HSDP's replica
  groups, storage over every axis, backward re-gathers inside the node)."""
  axes = tuple(axes)
  base = dataclasses.replace(config, shard_axes=axes, replicate_axes=(), secondary_partition=False)
  out = {"flat ZeRO-3": base}
  if len(axes) > 1:
    hsdp = dataclasses.replace(base, shard_axes=axes[-1:], replicate_axes=axes[:-1])
    out["HSDP"] = hsdp
    out["hpZ"] = dataclasses.replace(hsdp, secondary_partition=True)
  return out


def compare(
  trace,
  config: ZeroConfig,
  axis_sizes: dict[str, int],
  links: dict[str, Link] | None = None,
  platform: str = "",
  tensor=None,
) -> list[dict]:
  """Plan the traced program under each of `layouts` for a mesh of `axis_sizes` (data axis ->
  size, the node axis last) and predict each one's step: [{"layout", "schedule",
  "state_bytes_per_device", "seconds", "by_axis"}], in layout order. `tensor`: tensor
  parallelism (`tensor_parallel.resolve`; its axis is not in `axis_sizes` and not laid out
  here)."""
  links = default_links((*axis_sizes, *config.tensor_axes)) if links is None else links
  rows = []
  for name, layout_config in layouts(config, axis_sizes).items():
    schedule = plan_schedule(trace, layout_config, axis_sizes, platform=platform, tensor=tensor)
    report = schedule.report()
    rows.append(
      {
        "layout": name,
        "schedule": schedule,
        "state_bytes_per_device": report["state_bytes_per_device"],
        "secondary_bytes": report["secondary_bytes"],
        **predict(schedule, links),
      }
    )
  return rows
