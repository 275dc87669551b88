"""A cluster the planner predicts for: GPUs per node, the links inside and between nodes,
the host link (offload), and the compute peak. Presets for common GPU nodes; any other
cluster as a dict or a JSON file with the same fields.

Every figure is per GPU and per direction. The presets' sources:
- NVLink 4 (H100 / H200 SXM): 900 GB/s per GPU in both directions together, 450 GB/s each
  way (NVIDIA H100 and H200 datasheets, "NVLink: 900GB/s").
- Between nodes: one 400 Gb/s NIC per GPU (ConnectX-7 NDR InfiniBand, as in DGX H100/H200
  nodes): 50 GB/s each way.
- Host link: PCIe Gen5 x16, 64 GB/s each way (the PCIe 5.0 specification's raw rate).
- Peak dense bf16 tensor-core throughput: 989 TFLOP/s for H100 SXM and H200 SXM; 32-bit
  math is planned at TF32's 494 TFLOP/s (datasheets' dense figures, without sparsity).
- Latencies per ring step (3 us in a node, 10 us between nodes) are typical NCCL figures,
  not datasheet ones.
These are peaks: NCCL reaches 70-85% of them and training 35-55% of the compute peak, so
the planner's `compute_efficiency` (default 0.4) scales compute, and times it predicts are
a model's, for ranking layouts (docs/autoconfig.md says how far they were checked).
"""

import dataclasses
import json
import numbers
import os

from zjax._src.plan.comm_model import GB, Link

TB = 1e12
_NUMBERS = {
  "gpus_per_node": "a positive int",
  "intra_node_bandwidth": "a positive number of bytes/s",
  "intra_node_latency": "a non-negative number of seconds",
  "inter_node_bandwidth": "a positive number of bytes/s",
  "inter_node_latency": "a non-negative number of seconds",
  "host_bandwidth": "a positive number of bytes/s",
  "peak_flops_16bit": "a positive number of FLOP/s",
  "peak_flops_32bit": "a positive number of FLOP/s",
}


@dataclasses.dataclass(frozen=True)
class Cluster:
  """GPUs per node and the per-GPU, per-direction figures the planner's models use."""

  name: str
  gpus_per_node: int
  intra_node_bandwidth: float
  intra_node_latency: float
  inter_node_bandwidth: float
  inter_node_latency: float
  host_bandwidth: float
  peak_flops_16bit: float
  peak_flops_32bit: float

  def __post_init__(self):
    for field, rule in _NUMBERS.items():
      value = getattr(self, field)
      bad = isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value
      if field == "gpus_per_node":
        bad = bad or value != int(value)
      if bad or value < 0 or (value == 0 and "latency" not in field):
        raise ValueError(f"Cluster field {field!r} must be {rule}, got {value!r}.")

  @property
  def intra_node(self) -> Link:
    return Link(self.intra_node_bandwidth, self.intra_node_latency)

  @property
  def inter_node(self) -> Link:
    return Link(self.inter_node_bandwidth, self.inter_node_latency)

  def link(self, span: int) -> Link:
    """The link that paces a collective over `span` consecutive GPUs: NVLink when they
    share a node, the network otherwise."""
    return self.intra_node if span <= self.gpus_per_node else self.inter_node

  def peak_flops(self, itemsize: int) -> float:
    """Dense matmul peak for operands of `itemsize` bytes (16-bit or 32-bit math)."""
    return self.peak_flops_16bit if itemsize <= 2 else self.peak_flops_32bit

  def describe(self) -> str:
    return (
      f"{self.name}: {self.gpus_per_node} GPUs per node, "
      f"{self.intra_node_bandwidth / GB:g} GB/s in a node, "
      f"{self.inter_node_bandwidth / GB:g} GB/s between nodes, "
      f"host {self.host_bandwidth / GB:g} GB/s (per GPU, each way), "
      f"{self.peak_flops_16bit / TB:g} TFLOP/s 16-bit"
    )


def _gpu_node(name, gpus_per_node):
  return Cluster(
    name=name,
    gpus_per_node=gpus_per_node,
    intra_node_bandwidth=450 * GB,
    intra_node_latency=3e-6,
    inter_node_bandwidth=50 * GB,
    inter_node_latency=10e-6,
    host_bandwidth=64 * GB,
    peak_flops_16bit=989 * TB,
    peak_flops_32bit=494 * TB,
  )


# H100 and H200 SXM share NVLink 4, the NIC and the compute peak; they differ in memory
# (80 and 141 GB), which is the budget the caller gives.
PRESETS = {
  name: _gpu_node(name, gpus)
  for gpu in ("h100", "h200")
  for name, gpus in ((f"{gpu}x8", 8), (f"{gpu}x4", 4), (f"{gpu}x2", 2))
}
DEFAULT = "h100x8"


def resolve(cluster) -> Cluster:
  """A Cluster from None (the default preset), a preset name, a path to a JSON file, a
  dict of the fields, or a Cluster."""
  if cluster is None:
    return PRESETS[DEFAULT]
  if isinstance(cluster, Cluster):
    return cluster
  if isinstance(cluster, dict):
    return from_dict(cluster, "the cluster dict")
  if not isinstance(cluster, str):
    raise TypeError(
      f"cluster must be a preset name, a JSON file's path, a dict or a Cluster, got "
      f"{type(cluster).__name__}."
    )
  if cluster in PRESETS:
    return PRESETS[cluster]
  if not os.path.isfile(cluster):
    raise ValueError(
      f"Cluster {cluster!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file."
    )
  try:
    with open(cluster) as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"Cluster file {cluster}: not valid JSON ({e}).") from None
  if not isinstance(data, dict):
    raise ValueError(f"Cluster file {cluster}: expected a JSON object of the cluster's fields.")
  return from_dict(data, f"cluster file {cluster}")


def from_dict(data: dict, where: str) -> Cluster:
  """A Cluster from its fields; a preset's name under "base" fills the fields not given."""
  data = dict(data)
  base = data.pop("base", None)
  if base is not None and base not in PRESETS:
    raise ValueError(f"{where}: 'base' must be one of {list(PRESETS)}, got {base!r}.")
  fields = {f.name for f in dataclasses.fields(Cluster)}
  unknown = sorted(set(data) - fields)
  if unknown:
    raise ValueError(f"{where}: unknown field(s) {unknown}; fields: {sorted(fields)}.")
  values = dataclasses.asdict(PRESETS[base]) if base else {"name": "custom"}
  values.update(data)
  missing = sorted(fields - set(values))
  if missing:
    raise ValueError(
      f"{where}: missing field {missing[0]!r} (give it, or name a preset to start from "
      f'with "base": one of {list(PRESETS)}).'
    )
  try:
    return Cluster(**values)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
