"""Schedule: the validated, serialisable plan of one model on N devices.

The JSON form is stable and diff-friendly (fixed key order, one list item per line) and is
only ever parsed as data: nothing in a schedule file is executed.
"""

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any, Callable

import numpy as np

from zjax._src.config import ZeroConfig
from zjax._src.errors import ScheduleError, ScheduleMismatchError
from zjax._src.layout.mesh_roles import MeshRoles
from zjax._src.program.trace import trace_for_schedule
from zjax._src.schedule import ir, render, report, validate


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """A validated ZeRO-3 schedule for one model on `num_devices` devices.

  Build one with `zjax.compile_schedule` or `Schedule.load`; construction validates it, so an
  illegal schedule cannot exist. `str(schedule)` is a table to review; `report()` gives the
  predicted memory and communication per device per step.

  Example:
    >>> import jax.numpy as jnp, zjax
    >>> s = zjax.compile_schedule(lambda p, x: (x @ p["w"]).mean(), {"w": jnp.ones((512, 512))},
    ...                           jnp.ones((8, 512)), num_devices=8)
    >>> zjax.Schedule.from_json(s.to_json()) == s
    True
  """

  num_devices: int
  config: ZeroConfig
  num_ops: int
  program_hash: str
  params: tuple[ir.ParamEntry, ...]
  buckets: tuple[ir.Bucket, ...]
  segments: tuple[ir.Segment, ...]
  forward: tuple[ir.Step, ...]
  backward: tuple[ir.Step, ...]
  fingerprint: str = ""
  # The backend the report predicts for ("cpu", "gpu", "tpu"; "" = unspecified): it decides
  # the dtype 16-bit gradients are reduced in (ir.reduce_wire_dtype).
  platform: str = ""
  # Sizes of config.replicate_axes (HSDP, hpZ): R = their product copies of the parameters
  # (HSDP) or groups holding a secondary partition each (hpZ).
  replica_sizes: tuple[int, ...] = ()
  # Sizes of config.shard_axes (S = their product); num_devices is the product of the
  # storage axes' sizes: S, or R*S with hpZ. Default: (num_devices,) for one shard axis.
  shard_sizes: tuple[int, ...] = ()
  # What layer rolling did: each rolled run, and why other repeated layers were not rolled
  # (for people; the executor reads the loop steps and the buckets' `layers`).
  rolling: tuple[str, ...] = ()
  # Sizes of config.tensor_axes (tensor parallelism; () without).
  tensor_sizes: tuple[int, ...] = ()
  # A Megatron-style estimate of the tensor axis's collectives, which are GSPMD's, not the
  # schedule's: (kind, phase, bytes) each (tensor_comm.py; () without tensor parallelism).
  tensor_estimate: tuple[tuple[str, str, int], ...] = ()
  # What tracing changed in the loss, for people (data axes dropped from its sharding
  # constraints under tensor parallelism); () when nothing.
  notes: tuple[str, ...] = ()
  # The params' pytree structure, known when compiled in this process (not saved in JSON);
  # with Flax partitioning boxes, also the structure as given, boxes and their metadata
  # included (what `unshard` returns).
  params_treedef = None
  boxed_treedef = None

  def __post_init__(self):
    if not self.shard_sizes and len(self.config.shard_axes) == 1:
      shards = self.num_devices
      replicas = int(np.prod(self.replica_sizes, dtype=np.int64))
      if self.config.secondary_partition and isinstance(shards, int) and replicas:
        shards //= replicas
      object.__setattr__(self, "shard_sizes", (shards,))
    expected = model_fingerprint(self.params, self.num_ops, self.program_hash)
    if not self.fingerprint:
      object.__setattr__(self, "fingerprint", expected)
    elif self.fingerprint != expected:
      raise ScheduleError(
        f"Schedule fingerprint {self.fingerprint[:12]}... does not match its own parameter "
        f"table and program ({expected[:12]}...): the table was edited. Regenerate the "
        f"schedule with `zjax inspect ... --save FILE` instead of editing parameters."
      )
    object.__setattr__(self, "roles", self._roles())
    object.__setattr__(self, "_simulation", validate.validate_schedule(self))
    # the leaves of the sharded layout (rolled stacks as one leaf each), in tree order
    object.__setattr__(self, "storage", ir.storage_leaves(self.params))

  def __eq__(self, other):
    return isinstance(other, Schedule) and self.to_json() == other.to_json()

  def __hash__(self):
    return hash(self.fingerprint)

  def __str__(self) -> str:
    return render.render_schedule(self, self._simulation)

  def _roles(self) -> MeshRoles:
    """The mesh's roles with this schedule's axis sizes (`roles`)."""
    config = self.config
    for field, axes, sizes in (
      ("replica_sizes", config.replicate_axes, self.replica_sizes),
      ("shard_sizes", config.shard_axes, self.shard_sizes),
      ("tensor_sizes", config.tensor_axes, self.tensor_sizes),
    ):
      if len(sizes) != len(axes) or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes
      ):
        raise ScheduleError(
          f"{field} {list(sizes)} must give one positive size per axis of {list(axes)}."
        )
    names = (*config.replicate_axes, *config.shard_axes, *config.tensor_axes)
    sizes = (*self.replica_sizes, *self.shard_sizes, *self.tensor_sizes)
    return MeshRoles.of(config, dict(zip(names, sizes)))

  @property
  def replicas(self) -> int:
    """R: how many sharded copies (1 without replicate axes)."""
    return self.roles.replicas

  @property
  def shards(self) -> int:
    """S: devices along the shard axes (one sharded copy, or one secondary partition)."""
    return self.roles.shards

  @property
  def data_parallel_size(self) -> int:
    """Devices the batch is split over: R x S."""
    return self.roles.data_parallel_size

  @property
  def axis_sizes(self) -> dict[str, int]:
    """Size of every data axis, replicate axes first (the row-major device order)."""
    return self.roles.axis_sizes

  @property
  def tensor_axis_sizes(self) -> dict[str, int]:
    """Size of every tensor axis (tensor parallelism; empty without)."""
    return self.roles.tensor_axis_sizes

  def report(self) -> dict:
    """Predicted per-device numbers for one training step, JSON-serialisable."""
    return report.make_report(self, self._simulation)

  def param(self, path: str) -> ir.ParamEntry:
    """The entry of the parameter with keystr `path`, e.g. "['params']['Dense_0']['kernel']"."""
    for p in self.params:
      if p.path == path:
        return p
    raise KeyError(f"No parameter {path} in this schedule.")

  def bucket_elements(self) -> list[int]:
    """Gathered (padded) elements of each bucket."""
    return validate.bucket_elements(self)

  # ---- serialisation -------------------------------------------------------------------
  def to_dict(self) -> dict:
    return {
      "format": ir.FORMAT_NAME,
      "version": ir.FORMAT_VERSION,
      "fingerprint": self.fingerprint,
      "num_devices": self.num_devices,
      "platform": self.platform,
      "replica_sizes": list(self.replica_sizes),
      "shard_sizes": list(self.shard_sizes),
      **({"tensor_sizes": list(self.tensor_sizes)} if self.tensor_sizes else {}),
      "config": self.config.to_dict(),
      "program": {"num_ops": self.num_ops, "hash": self.program_hash},
      "params": [p.to_dict() for p in self.params],
      "buckets": [b.to_dict() for b in self.buckets],
      "segments": [dataclasses.asdict(s) for s in self.segments],
      "rolling": list(self.rolling),
      **({"tensor_estimate": list(self.tensor_estimate)} if self.tensor_estimate else {}),
      **({"notes": list(self.notes)} if self.notes else {}),
      "forward": [s.to_dict_with_axes("forward", self.config, self.buckets) for s in self.forward],
      "backward": [
        s.to_dict_with_axes("backward", self.config, self.buckets) for s in self.backward
      ],
    }

  def to_json(self) -> str:
    """Stable JSON: fixed key order, one list item per line, so that diffs read well."""
    return _format_json(_lists(self.to_dict()))

  @classmethod
  def from_json(cls, text: str, *, source: str = "<string>") -> "Schedule":
    """Parse and validate a schedule; errors name `source`, the field and the step."""
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise ScheduleError(
        f"{source} is not valid JSON (line {e.lineno}, column {e.colno}: "
        f"{e.msg}); the file may be truncated. Regenerate it with `zjax "
        f"inspect ... --save {source}`."
      ) from None
    try:
      return cls(**_parse(data))
    except ScheduleError as e:
      raise ScheduleError(f"{source}: {e}") from None

  def save(self, path) -> None:
    """Write the JSON atomically: a failed write leaves any existing file intact."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".zjax-schedule-", suffix=".tmp")
    try:
      with os.fdopen(fd, "w") as f:
        f.write(self.to_json())
      os.chmod(tmp, _default_file_mode())  # mkstemp creates 0600; a schedule is shareable
      os.replace(tmp, path)
    except BaseException:
      os.unlink(tmp)
      raise

  @classmethod
  def load(cls, path) -> "Schedule":
    path = os.fspath(path)
    try:
      with open(path) as f:
        text = f.read()
    except FileNotFoundError:
      raise ScheduleError(f"Schedule file {path} does not exist.") from None
    except UnicodeDecodeError:
      raise ScheduleError(f"Schedule file {path} is not UTF-8 text.") from None
    return cls.from_json(text, source=path)

  def verify(self, loss_fn: Callable, params: Any, batch: Any, extra: Any = None) -> None:
    """Raise ScheduleMismatchError unless this schedule was made for this model.

    Compares parameter paths, shapes, dtypes and the use order of a fresh trace.
    """
    trace = trace_for_schedule(
      loss_fn,
      params,
      batch,
      self.config,
      self.axis_sizes,
      extra,
      mesh={**self.axis_sizes, **self.tensor_axis_sizes},
    )
    theirs = {p.path: p for p in self.params}
    for p in trace.params:
      mine = theirs.get(p.path)
      found = (list(p.shape), p.dtype.name, [u.op for u in p.uses])
      if mine is None:
        raise ScheduleMismatchError(
          f"Parameter {p.path} is not in the schedule: it was made "
          f"for another model. Recompile the schedule."
        )
      if found != (list(mine.shape), mine.dtype, list(mine.uses)):
        raise ScheduleMismatchError(
          f"Parameter {p.path} differs from the schedule: model has shape {list(p.shape)} "
          f"{p.dtype.name} used at ops {found[2]}, schedule has shape {list(mine.shape)} "
          f"{mine.dtype} used at ops {list(mine.uses)}. Recompile the schedule."
        )
    missing = sorted(set(theirs) - {p.path for p in trace.params})
    if missing:
      raise ScheduleMismatchError(
        f"The schedule has parameter(s) the model lacks: {missing[:3]}. Recompile the schedule."
      )
    got = program_hash(o.primitive for o in trace.ops)
    if got != self.program_hash or len(trace.ops) != self.num_ops:
      raise ScheduleMismatchError(
        f"The model's program differs from the schedule's ({len(trace.ops)} ops vs "
        f"{self.num_ops}, hash {got[:12]} vs {self.program_hash[:12]}): same parameters, "
        f"different computation. Recompile the schedule."
      )


def _default_file_mode() -> int:
  umask = os.umask(0)
  os.umask(umask)
  return 0o666 & ~umask


def model_fingerprint(params, num_ops: int, prog_hash: str) -> str:
  """Hash of the parameter structure (paths, shapes, dtypes) and the use order."""
  table = [[p.path, list(p.shape), p.dtype, list(p.uses)] for p in params]
  blob = json.dumps(
    {"params": table, "num_ops": num_ops, "program": prog_hash}, separators=(",", ":")
  )
  return hashlib.sha256(blob.encode()).hexdigest()


def program_hash(op_primitives) -> str:
  return hashlib.sha256("\n".join(op_primitives).encode()).hexdigest()


def _lists(data):
  """Tuples to lists, recursively, so the JSON text does not depend on container type."""
  if isinstance(data, dict):
    return {k: _lists(v) for k, v in data.items()}
  if isinstance(data, (list, tuple)):
    return [_lists(v) for v in data]
  return data


def _format_json(data: dict) -> str:
  lines = []
  for key, value in data.items():
    if isinstance(value, list) and value:
      rows = ",\n".join(f"    {json.dumps(v, separators=(', ', ': '))}" for v in value)
      lines.append(f'  "{key}": [\n{rows}\n  ]')
    else:
      lines.append(f'  "{key}": {json.dumps(value, separators=(", ", ": "))}')
  return "{\n" + ",\n".join(lines) + "\n}\n"


# ---- parsing (data only; every field is type-checked) -----------------------------------


def _parse(data) -> dict:
  _expect(isinstance(data, dict), "the top level must be a JSON object")
  _expect(
    data.get("format") == ir.FORMAT_NAME,
    f"'format' must be {ir.FORMAT_NAME!r}, got {data.get('format')!r}",
  )
  version = data.get("version")
  _expect(
    version in ir.READABLE_VERSIONS,
    f"'version' is {version!r}, but this zjax reads versions "
    f"{list(ir.READABLE_VERSIONS)}; regenerate the schedule with this zjax",
  )
  program = _field(data, "program", dict, "top level")
  config = dict(_field(data, "config", dict, "top level"))
  # files written before the knob existed reduce-scatter once per forward gather
  config.setdefault("gradient_reduction", "per_gather")
  config.setdefault("roll_layers", False)  # nor rolled layers
  try:
    config = ZeroConfig.from_dict(config)
  except ValueError as e:
    raise ScheduleError(f"'config': {e}") from None
  buckets = tuple(_parse_bucket(b, i) for i, b in enumerate(_items(data, "buckets")))
  return dict(
    fingerprint=_field(data, "fingerprint", str, "top level"),
    num_devices=_field(data, "num_devices", int, "top level"),
    platform=_optional(data, "platform", str, "top level", ""),
    replica_sizes=tuple(
      _int_list(data, "replica_sizes", "top level") if "replica_sizes" in data else ()
    ),
    shard_sizes=tuple(_int_list(data, "shard_sizes", "top level") if "shard_sizes" in data else ()),
    tensor_sizes=tuple(
      _int_list(data, "tensor_sizes", "top level") if "tensor_sizes" in data else ()
    ),
    config=config,
    num_ops=_field(program, "num_ops", int, "'program'"),
    program_hash=_field(program, "hash", str, "'program'"),
    params=tuple(_parse_param(p, i) for i, p in enumerate(_items(data, "params"))),
    buckets=buckets,
    segments=tuple(_parse_segment(s, i) for i, s in enumerate(_items(data, "segments"))),
    rolling=tuple(_string_list(data, "rolling", "top level") if "rolling" in data else ()),
    tensor_estimate=_tensor_estimate(data),
    notes=tuple(_string_list(data, "notes", "top level") if "notes" in data else ()),
    forward=tuple(
      _upgraded(_parse_step(s, i, "forward", config, buckets), "forward", version)
      for i, s in enumerate(_items(data, "forward"))
    ),
    backward=tuple(
      _upgraded(_parse_step(s, i, "backward", config, buckets), "backward", version)
      for i, s in enumerate(_items(data, "backward"))
    ),
  )


def _upgraded(step, phase: str, version: int) -> ir.Step:
  """A step of a version-2 file as this version writes it: a loop body without parts
  (the whole layer) becomes the one-part body it meant. Its compute names part 0 and
  backward recomputes that part first; its gathers prefetched one iteration ahead; hpZ's
  keep/drop of a secondary follows its bucket's gather."""
  if version >= 3 or step.op != ir.LOOP_OP or step.parts:
    return step
  hpz = ("keep_secondary", "drop_secondary")
  secondary = [st for st in step.body if st.op in hpz]
  body = []
  for st in step.body:
    if st.op == "compute":
      if phase == "backward":
        body.append(dataclasses.replace(st, op=ir.RECOMPUTE_OP, part=0))
      body.append(dataclasses.replace(st, part=0))
    elif st.op == "gather":
      body.append(dataclasses.replace(st, ahead=st.prefetch))
      body += [kept for kept in secondary if kept.bucket == st.bucket]
    elif st.op not in hpz:
      body.append(st)
  return dataclasses.replace(step, body=tuple(body))


def _tensor_estimate(data) -> tuple:
  rows = data.get("tensor_estimate", [])
  _expect(
    isinstance(rows, list)
    and all(
      isinstance(r, list)
      and len(r) == 3
      and r[0] in ("all_reduce", "all_gather", "reduce_scatter")
      and r[1] in ("forward", "backward")
      and isinstance(r[2], int)
      and r[2] >= 0
      for r in rows
    ),
    "'tensor_estimate' must be a list of [kind, phase, bytes] (e.g. [\"all_reduce\", "
    '"forward", 4096])',
  )
  return tuple(tuple(r) for r in rows)


def _parse_param(p, i) -> ir.ParamEntry:
  where = f"params[{i}]"
  _expect(isinstance(p, dict), f"{where} must be an object")
  entry = _param_entry(p, where)
  if entry.tensor_dim is not None:  # tensor parallelism: a dim (of a layer, if stacked)
    layer = entry.layer_shape  # that splits evenly
    _expect(
      0 <= entry.tensor_dim < len(layer)
      and entry.tensor_size >= 1
      and layer[entry.tensor_dim] % entry.tensor_size == 0,
      f"{where} ({entry.path}): tensor_dim {entry.tensor_dim} of "
      f"{'one layer of shape' if entry.stacked else 'shape'} {list(layer)} does not "
      f"split into {entry.tensor_size} slices",
    )
  return entry


def _param_entry(p, where) -> ir.ParamEntry:
  return ir.ParamEntry(
    path=_field(p, "path", str, where),
    shape=tuple(_int_list(p, "shape", where)),
    dtype=_field(p, "dtype", str, where),
    persistent=_field(p, "persistent", bool, where),
    bucket=_field(p, "bucket", (int, type(None)), where),
    uses=tuple(_int_list(p, "uses", where)),
    frozen=_field(p, "frozen", bool, where),
    stacked=_optional(p, "stacked", bool, where, False),
    stack=_optional(p, "stack", str, where, ""),
    layer=_optional(p, "layer", int, where, 0),
    tensor_dim=_optional(p, "tensor_dim", (int, type(None)), where, None),
    tensor_size=_optional(p, "tensor_size", int, where, 1),
    zero_gradient=_optional(p, "zero_gradient", bool, where, False),
  )


def _parse_bucket(b, i) -> ir.Bucket:
  where = f"buckets[{i}]"
  _expect(isinstance(b, dict), f"{where} must be an object")
  paths = _field(b, "params", list, where)
  _expect(all(isinstance(x, str) for x in paths), f"{where}.params must be a list of paths")
  return ir.Bucket(
    id=_field(b, "id", int, where),
    module=_field(b, "module", str, where),
    dtype=_field(b, "dtype", str, where),
    params=tuple(paths),
    frozen=_field(b, "frozen", bool, where),
    stacked=_optional(b, "stacked", bool, where, False),
    zero_gradient=_optional(b, "zero_gradient", bool, where, False),
    layers=tuple(
      tuple(_string_list({"layer": layer}, "layer", f"{where}.layers[{k}]"))
      for k, layer in enumerate(_optional(b, "layers", list, where, []))
    ),
  )


def _parse_segment(s, i) -> ir.Segment:
  where = f"segments[{i}]"
  _expect(isinstance(s, dict), f"{where} must be an object")
  return ir.Segment(
    id=_field(s, "id", int, where),
    start=_field(s, "start", int, where),
    end=_field(s, "end", int, where),
    buckets=tuple(_int_list(s, "buckets", where)),
    backward_buckets=tuple(_int_list(s, "backward_buckets", where)),
    label=_field(s, "label", str, where),
  )


def _parse_step(s, i, phase, config, buckets, in_loop=False) -> ir.Step:
  where = f"{phase} step {i}"
  _expect(isinstance(s, dict), f"{where} must be an object")
  op = _field(s, "op", str, where)
  if op == ir.LOOP_OP and not in_loop:
    body = _field(s, "body", list, where)
    parts = s.get("parts", [])
    _expect(isinstance(parts, list), f"{where}: parts must be a list of segments")
    return ir.Step(
      ir.LOOP_OP,
      segment=_field(s, "segment", int, where),
      length=_field(s, "length", int, where),
      body=tuple(
        _parse_step(b, j, f"{phase} step {i} body", config, buckets, True)
        for j, b in enumerate(body)
      ),
      parts=tuple(_parse_segment(p, j) for j, p in enumerate(parts)),
    )
  # the axes a collective spans follow from the config; a file that says otherwise was
  # edited (or made for another mesh layout)
  for key, expected in config.roles.collective_axes(op, phase.split()[0]).items():
    if key in s:
      _expect(
        s[key] == expected,
        f"{where}: {op} runs over {key} {expected} under this "
        f"config (shard_axes, replicate_axes, secondary_partition), not {s[key]}; "
        f"change the config, not the step",
      )
  _expect(op != ir.LOOP_OP, f"{where}: loops do not nest (a loop step inside a loop body)")
  if op in ("compute", ir.RECOMPUTE_OP):
    part = _field(s, "part", int, where) if "part" in s or op == ir.RECOMPUTE_OP else None
    _expect(in_loop or part is None, f"{where}: only a rolled loop's body steps name a part")
    return ir.Step(op, segment=_field(s, "segment", int, where), part=part)
  prefetch = _field(s, "prefetch", bool, where) if op == "gather" else False
  ahead = _optional(s, "ahead", bool, where, False)
  _expect(
    not ahead or (in_loop and op == "gather"),
    f"{where}: only a gather in a loop body can be issued an iteration ahead",
  )
  step = ir.Step(op, bucket=_field(s, "bucket", int, where), prefetch=prefetch, ahead=ahead)
  _check_quantized(s, step, phase.split()[0], config, buckets, where)
  return step


def _check_quantized(s, step, phase, config, buckets, where):
  """A step's quantization follows from the config and its bucket, like its axes."""
  if not 0 <= step.bucket < len(buckets):
    return  # the validator names the bad bucket
  expected = ir.step_quantization(step, phase, buckets, config).get("quantized")
  found = s.get("quantized")
  _expect(
    found is None or found == expected,
    f"{where}: {step.op} of bucket {step.bucket} is quantized as {expected} under this "
    f"config (gather_quantization, gather_quantization_phases, reduce_quantization, "
    f"quantization_block), not {found}; change the config, not the step",
  )


def _items(data, key) -> list:
  return _field(data, key, list, "top level")


def _field(obj, key, types, where):
  if key not in obj:
    raise ScheduleError(f"{where}: missing field {key!r}.")
  value = obj[key]
  bool_as_int = isinstance(value, bool) and types in (int, (int, type(None)))
  ok = isinstance(value, types) and not bool_as_int
  _expect(ok, f"{where}: field {key!r} has the wrong type ({type(value).__name__}: {value!r})")
  return value


def _optional(obj, key, types, where, default):
  """A field that older format versions lack."""
  return _field(obj, key, types, where) if key in obj else default


def _string_list(obj, key, where) -> list[str]:
  value = _field(obj, key, list, where)
  _expect(
    all(isinstance(x, str) for x in value),
    f"{where}: field {key!r} must be a list of strings, got {value!r}",
  )
  return value


def _int_list(obj, key, where) -> list[int]:
  value = _field(obj, key, list, where)
  _expect(
    all(isinstance(x, int) and not isinstance(x, bool) for x in value),
    f"{where}: field {key!r} must be a list of integers, got {value!r}",
  )
  return value


def _expect(ok, message):
  if not ok:
    raise ScheduleError(message + ".")
