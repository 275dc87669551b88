"""Types of the schedule IR, shared by the planner, validator, report, renderer and executor.

Vocabulary:
  * op: a top-level equation of the traced program, numbered by `trace.walk_ops`.
  * segment: a contiguous op range [start, end), the unit of compute. Its buckets are exactly
    those holding a parameter used by one of its ops; its backward_buckets, those whose
    values its backward (vjp) reads. The gradient of x @ W needs x, not W, so a first layer
    or an embedding lookup needs no re-gather.
  * bucket: sharded parameters of one owning module and one dtype, gathered together by one
    coalesced all-gather; its gradient is reduce-scattered by one psum_scatter.
  * steps: the forward list computes segments 0..K-1, the backward list their vjps K-1..0.
    Step ops: "gather" (a prefetch when issued ahead of need), "compute", "release", and in
    backward "reduce_scatter" (the bucket's gradient, summed over devices, into its shard):
    once per forward gather, after the last backward compute that uses the bucket.
  * layout: a sharded parameter is stored flat, zero-padded to a multiple of N elements, and
    split into N contiguous chunks, chunk d on device d; persistent parameters are replicated.
  * mesh axes: storage is sharded over `config.storage_axes` (N devices: the shard axes,
    or with hpZ every data axis), device d = row-major index over those axes. Every gather
    and reduce-scatter step names the axes it runs over (`collective_axes`). HSDP averages
    each reduce-scattered shard over the replicate axes. hpZ (`secondary_partition`): a
    forward gather followed by "keep_secondary" leaves the device the bucket's 1/S slice
    over the shard axes; backward gathers read it (over the shard axes only) until
    "drop_secondary".
  * rolled layers: L consecutive identical layers of an unrolled model run as a loop step
    too; a rolled bucket lists layer 0's parameters and every layer's (`layers`), each
    iteration gathering that layer's slice. Each per-layer parameter names the stack it is
    stored in (`stack`: layer 0's path) and its row there (`layer`): the L leaves are one
    leaf of the sharded layout, [L, padded layer] as for a scan (or [L, *shape] replicated
    if persistent), at layer 0's path (see StorageLeaf).
  * loops: a parameter stacked along a layer axis and consumed whole by one scan (as its xs)
    is *stacked*: stored [L, padded layer], each device holding 1/N of every layer. Its
    bucket (all stacked members of one module) is gathered one layer at a time inside a
    "loop" step, which runs its segment (that scan alone) with a body of steps executed
    once per iteration.
  * loop bodies (one form for rolled runs and scans): the layer is cut into `parts`
    (Segments over a rolled run's first layer's ops, or the scan body's ops numbered from
    0); a loop step without `parts` has one, part 0, the whole layer. Forward computes the
    parts in order; backward recomputes them in order, then computes their vjps in reverse.
    Its gathers, releases and reduce-scatters sit between those steps. A gather with
    ahead=True is issued one iteration early (the first layer's before the loop), so the
    next layer arrives while this one computes.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from zjax._src.execute.quantize import Quantization

FORMAT_NAME = "zjax-schedule"
FORMAT_VERSION = 3
# version 1: no loops, no stacked parameters; version 2: a whole-layer loop's body computes
# its segment (no recompute), its gathers all prefetching one iteration ahead or none
READABLE_VERSIONS = (1, 2, 3)
FORWARD_OPS = ("gather", "compute", "release", "keep_secondary")
BACKWARD_OPS = ("gather", "compute", "release", "reduce_scatter", "drop_secondary")
# in a rolled loop's backward body cut into parts (loop_parts.py): a part's forward rerun
# under vjp, before the parts' vjps run in reverse
RECOMPUTE_OP = "recompute"
LOOP_OP = "loop"


@dataclasses.dataclass(frozen=True)
class ParamEntry:
  """One parameter leaf: identity, storage layout and uses (op numbers, program order)."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  persistent: bool  # replicated on every device, never gathered
  bucket: int | None  # None for persistent and unused parameters
  uses: tuple[int, ...]
  frozen: bool = False  # gathered for compute, but no gradient, reduction or optimizer state
  stacked: bool = False  # stored per layer slice [L, padded layer], gathered per iteration
  # A rolled layer's parameter: the path of the stack it is stored in (layer 0's path; ""
  # for a leaf stored on its own) and its row there.
  stack: str = ""
  layer: int = 0
  # Tensor parallelism: the dimension split over the tensor axis (None: replicated over
  # it), counted in `layer_shape` (a stacked leaf's: of one layer), and that axis's size T.
  # Each device works on the TP slice (that dimension / T); sharded storage holds every
  # slice flat and padded over the data axes, [T, padded] ([L, T, padded] if stacked).
  tensor_dim: int | None = None
  tensor_size: int = 1
  # Trained, but the loss reads it only where no gradient flows (trace.gradient_free): its
  # gradient is zero and never reduced; the optimizer still updates it (weight decay).
  zero_gradient: bool = False

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    if not self.stack:  # most parameters: the file stays as it was before rolled storage
      del out["stack"], out["layer"]
    if self.tensor_dim is None:  # and before tensor parallelism
      del out["tensor_dim"], out["tensor_size"]
    if not self.zero_gradient:  # and before gradient-free parameters
      del out["zero_gradient"]
    return out

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def layer_shape(self) -> tuple[int, ...]:
    """The shape of what one gather makes whole: one layer slice if stacked, else all."""
    return tuple(self.shape[1:]) if self.stacked else tuple(self.shape)

  @property
  def layer_size(self) -> int:
    return int(np.prod(self.layer_shape, dtype=np.int64))

  @property
  def slice_shape(self) -> tuple[int, ...]:
    """The shape of the TP slice one device computes with (its layer's, if stacked): the
    tensor dimension divided by T; the whole layer shape without tensor parallelism."""
    shape = list(self.layer_shape)
    if self.tensor_dim is not None:
      shape[self.tensor_dim] //= self.tensor_size
    return tuple(shape)

  @property
  def slice_size(self) -> int:
    """Elements one gather makes whole on one device (one TP slice of one layer)."""
    return int(np.prod(self.slice_shape, dtype=np.int64))

  @property
  def tensor_slices(self) -> int:
    """TP slices stored (T for a tensor-parallel parameter, else 1)."""
    return 1 if self.tensor_dim is None else self.tensor_size


@dataclasses.dataclass(frozen=True)
class StorageLeaf:
  """One leaf of the sharded layout: a parameter's own, or a rolled stack holding L
  per-layer parameters (`members`, in layer order) at layer 0's path."""

  entry: ParamEntry  # as stored; a stack's has shape (L, *layer shape), stacked if sharded
  members: tuple[int, ...]  # indices of the parameters it holds (one, or the L layers)

  @property
  def path(self) -> str:
    return self.entry.path

  @property
  def rolled(self) -> bool:
    return bool(self.entry.stack)


def storage_leaves(params) -> tuple[StorageLeaf, ...]:
  """The sharded layout's leaves, in tree order: every parameter stored on its own, and
  each rolled stack at the position of its layer 0 (its other layers hold no leaf)."""
  rows: dict[str, list[int]] = {}
  for i, p in enumerate(params):
    if p.stack:
      rows.setdefault(p.stack, []).append(i)
  out = []
  for i, p in enumerate(params):
    if not p.stack:
      out.append(StorageLeaf(p, (i,)))
    elif p.stack == p.path:
      members = tuple(sorted(rows[p.path], key=lambda j: params[j].layer))
      out.append(StorageLeaf(stacked_entry(p, len(members)), members))
  return tuple(out)


def stacked_entry(first: ParamEntry, length: int) -> ParamEntry:
  """How a rolled stack of `length` layers like `first` is stored: as a scanned parameter
  [L, *shape] would be (sharded per layer row), or replicated whole if persistent."""
  # a tensor dim counts from the dimensions one gather makes whole (`layer_shape`): the
  # layer's when sharded, the whole stack's when persistent (stored natural)
  tensor_dim = first.tensor_dim
  if first.persistent and tensor_dim is not None:
    tensor_dim += 1
  return dataclasses.replace(
    first,
    shape=(length,) + tuple(first.shape),
    uses=(),
    stacked=not first.persistent,
    tensor_dim=tensor_dim,
  )


@dataclasses.dataclass(frozen=True)
class Bucket:
  id: int
  module: str  # owning module of its parameters
  dtype: str
  params: tuple[str, ...]  # paths, in first-use order
  frozen: bool = False  # all its parameters are frozen (a bucket never mixes)
  stacked: bool = False  # gathered one layer at a time in a loop
  # A rolled run of identical layers (roll.py): each layer's parameter paths, layer 0's
  # being `params` (each parameter's layers are one stack of the layout). () otherwise.
  layers: tuple[tuple[str, ...], ...] = ()
  zero_gradient: bool = False  # all its parameters have a zero gradient (never mixes)

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    if not self.zero_gradient:  # the file stays as it was before gradient-free parameters
      del out["zero_gradient"]
    return out

  @property
  def loop_paths(self) -> tuple[str, ...]:
    """Every parameter the bucket stands for: all layers' if rolled."""
    return tuple(p for layer in self.layers for p in layer) if self.layers else self.params


@dataclasses.dataclass(frozen=True)
class Segment:
  id: int
  start: int
  end: int  # exclusive
  buckets: tuple[int, ...]
  backward_buckets: tuple[int, ...]  # buckets whose values the backward of this segment reads
  label: str  # module of the first op that uses a bucket (for people, not machines)


@dataclasses.dataclass(frozen=True)
class Step:
  op: str
  bucket: int | None = None
  segment: int | None = None
  prefetch: bool = False
  length: int = 0  # loop: trip count
  body: tuple = ()  # loop: the steps run once per iteration
  # a loop whose layer is cut into parts (loop_parts.py): the parts (Segments over a rolled
  # run's first layer's ops, or a scan body's ops numbered from 0; ids 0..; none: one part,
  # the whole layer); compute / recompute steps of its body name a part
  parts: tuple = ()
  part: int | None = None
  ahead: bool = False  # a loop body's gather issued one iteration early

  def to_dict(self) -> dict:
    if self.op in ("compute", RECOMPUTE_OP):
      out = {"op": self.op, "segment": self.segment}
      return out if self.part is None else {**out, "part": self.part}
    if self.op == LOOP_OP:
      out = {
        "op": LOOP_OP,
        "segment": self.segment,
        "length": self.length,
        "body": [st.to_dict() for st in self.body],
      }
      return (
        out if not self.parts else {**out, "parts": [dataclasses.asdict(p) for p in self.parts]}
      )
    out = {"op": self.op, "bucket": self.bucket}
    if self.op == "gather":
      out["prefetch"] = self.prefetch
      if self.ahead:
        out["ahead"] = True
    return out

  def to_dict_with_axes(self, phase: str, config, buckets) -> dict:
    """to_dict plus the mesh axes of its collective and its quantization (what the JSON
    and the table show)."""
    if self.op == LOOP_OP:
      return {
        **self.to_dict(),
        "body": [st.to_dict_with_axes(phase, config, buckets) for st in self.body],
      }
    return {
      **self.to_dict(),
      **config.roles.collective_axes(self.op, phase),
      **step_quantization(self, phase, buckets, config),
    }


def axes_key(axes) -> str:
  """The report's name of a group of mesh axes, e.g. "replica+fsdp"."""
  return "+".join(axes)


def padded_size(size: int, num_devices: int) -> int:
  """Elements of a sharded parameter's flat storage: size rounded up to a multiple of N."""
  return -(-size // num_devices) * num_devices


def gathered_elements(entry, num_devices: int) -> int:
  """Elements one gather of the parameter makes whole (padded) on one device: one layer if
  stacked, its TP slice if tensor-parallel."""
  return padded_size(entry.slice_size, num_devices)


def local_elements(entry, num_devices: int) -> int:
  """Elements of the parameter each device stores."""
  if entry.persistent:
    return entry.size // entry.tensor_slices
  per_layer = padded_size(entry.slice_size, num_devices) // num_devices
  return per_layer * entry.shape[0] if entry.stacked else per_layer


def is_float(dtype) -> bool:
  """Floating point (PRNG key dtypes are not)."""
  return bool(jnp.issubdtype(jnp.dtype(dtype) if isinstance(dtype, str) else dtype, jnp.floating))


def has_gradient(item) -> bool:
  """Whether a ParamEntry or Bucket has a gradient to compute and reduce: trained, and read
  where a gradient flows."""
  return is_trained(item) and not item.zero_gradient


def is_trained(item) -> bool:
  """Whether a ParamEntry or Bucket is trained (the optimizer updates it): floating point
  and not frozen."""
  return is_float(item.dtype) and not item.frozen


def aval_bytes(aval) -> int:
  """Bytes of a value of abstract value `aval` (0 for one without data: a token)."""
  itemsize = getattr(getattr(aval, "dtype", None), "itemsize", 0)
  return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64)) * itemsize


def persistent_reductions(params, segments) -> dict[int, tuple[int, ...]]:
  """Segment -> the persistent trained parameters whose gradient its backward completes
  (the segment of their first use; a rolled stack's layers: their loop's). The executor
  averages them right after that backward, in one all-reduce per segment (an empty one
  has nothing to reduce)."""
  segment_of = {op: seg.id for seg in segments for op in range(seg.start, seg.end)}
  out: dict[int, list[int]] = {}
  for i, p in enumerate(params):
    if p.persistent and has_gradient(p) and p.uses and p.size:
      out.setdefault(segment_of[min(p.uses)], []).append(i)
  return {k: tuple(v) for k, v in out.items()}


def gather_dtype(dtype, compute_dtype) -> np.dtype:
  """The dtype a parameter stored as `dtype` is gathered and used in."""
  dtype = jnp.dtype(dtype)
  if compute_dtype is not None and is_float(dtype):
    return jnp.dtype(compute_dtype)
  return dtype


def reduce_dtype(dtype, config) -> np.dtype:
  """The dtype a parameter stored as `dtype` has its gradient reduced in."""
  dtype = jnp.dtype(dtype)
  if config.reduce_dtype is not None and is_float(dtype):
    return jnp.dtype(config.reduce_dtype)
  return dtype


# Backends whose collectives reduce 16-bit floats in float32 (XLA's CPU backend turns a bf16
# reduce-scatter into an f32 one); GPUs (NCCL) and TPUs reduce them natively.
WIDENING_PLATFORMS = frozenset({"cpu"})


def reduce_wire_dtype(dtype, config, platform: str) -> np.dtype:
  """The dtype the gradient of a parameter stored as `dtype` travels and is summed in on
  `platform` (its reduce_dtype, or float32 where the backend widens 16-bit floats: the
  executor then widens them itself, so the report is exact)."""
  dtype = reduce_dtype(dtype, config)
  if platform in WIDENING_PLATFORMS and is_float(dtype) and dtype.itemsize < 4:
    return jnp.dtype(jnp.float32)
  return dtype


def gather_quantization(bucket, phase: str, config):
  """How a gather of `bucket` in `phase` is quantized (ZeRO++ qwZ), or None: floating-point
  buckets, in the phases the config names."""
  if (
    config.gather_quantization is None
    or not is_float(bucket.dtype)
    or phase not in config.gather_quantization_phases
  ):
    return None
  return Quantization(config.gather_quantization, config.quantization_block)


def reduce_quantization(bucket, config):
  """How `bucket`'s gradient reduction is quantized (ZeRO++ qgZ: an all-to-all of the
  quantized chunks, stochastic rounding), or None."""
  if config.reduce_quantization is None or not has_gradient(bucket):
    return None
  return Quantization(config.reduce_quantization, config.quantization_block, stochastic=True)


def gather_wire_bytes(bucket, elements: int, phase: str, s) -> int:
  """Bytes of the gathered wire buffer of one gather of `bucket` (`elements` padded
  elements in all) in `phase` under schedule `s`'s config."""
  q = gather_quantization(bucket, phase, s.config)
  if q is not None:
    return s.num_devices * q.wire_bytes(elements // s.num_devices)
  return gathered_bytes(elements, s.num_devices, gather_dtype(bucket.dtype, s.config.compute_dtype))


def reduce_wire_bytes(bucket, elements: int, s) -> int:
  """Bytes of the full buffer one gradient reduction of `bucket` moves: the reduce-scatter's
  input, or under qgZ the all-to-all's N quantized chunks."""
  q = reduce_quantization(bucket, s.config)
  if q is not None:
    return s.num_devices * q.wire_bytes(elements // s.num_devices)
  return elements * reduce_wire_dtype(bucket.dtype, s.config, s.platform).itemsize


def step_quantization(step, phase: str, buckets, config) -> dict:
  """{"quantized": {...}} for a quantized gather or reduction step (what the JSON and the
  table show), {} otherwise."""
  if step.op == "gather":
    q = gather_quantization(buckets[step.bucket], phase, config)
  elif step.op == "reduce_scatter":
    q = reduce_quantization(buckets[step.bucket], config)
  else:
    return {}
  if q is None:
    return {}
  collective = "all_gather" if step.op == "gather" else "all_to_all"
  return {"quantized": {**q.describe(), "collective": collective}}


def gathered_bytes(elements: int, num_devices: int, dtype) -> int:
  """Bytes of a bucket's all-gather output (`elements` padded elements in all): 16-bit
  values travel packed two per 32-bit word (see layout.to_wire), odd lengths padded."""
  local = elements // num_devices
  itemsize = jnp.dtype(dtype).itemsize
  if itemsize == 2:
    return num_devices * 4 * (-(-local // 2))
  return num_devices * local * itemsize
