"""`zjax bench`: zjax vs GSPMD FSDP vs data parallel on one mesh and one batch, measured side
by side (DESIGN.md §3), plus scaling with the device count and with depth.

Per method: per-device state (params + optimizer state actually held), `memory_analysis()`
temp/argument bytes, the collectives as executed (a while body's once per iteration) from
the HLO, both of the step compiled as a GPU orders it (`hlo.compile_for_analysis`; the CPU
runs XLA's own compile of the same lowering), flops from `cost_analysis()`, compile time,
and step time as the median (min, max) of interleaved rounds A B C D A B C D ... Floors:
state 12 bytes per fp32 parameter / N (parameter + adam's two moments; ZeRO's 16Ψ/N counts
fp16 copies and gradients too), communication 3Ψ (forward all-gather, backward all-gather,
reduce-scatter; every collective counted by its full buffer, the convention of
`Schedule.report()`).
"""

import dataclasses
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich import box
from rich.table import Table

import zjax
from zjax._src.layout import layout
from zjax._src.schedule.render import format_bytes
from zjax._src.xla import hlo
from zjax.bench.methods import gspmd_method, zjax_method

ADAM_BYTES_PER_PARAM_BYTE = 3  # the parameter and adam's mu and nu


@dataclasses.dataclass(frozen=True)
class Model:
  loss_fn: object
  params: object
  batch: object
  config: object  # ZeroConfig
  scanned: "Model | None" = None  # the same model with its layers stacked (GPT only)
  tensor: "Model | None" = None  # annotated with logical axis names (GPT only): params are
  #                                Flax boxes, `rules` map the names to mesh axes
  rules: tuple = ()


def gpt_model(layers: int, d_model: int, batch_size: int, seq_len: int = 64) -> Model:
  from zjax.models.gpt import GPT, GPTConfig, make_loss_fn

  def build(scan, annotated=False):
    cfg = GPTConfig(
      n_layer=layers,
      d_model=d_model,
      d_ff=4 * d_model,
      seq_len=seq_len,
      scan_layers=scan,
      logical_axes=annotated,
      vocab_multiple=TENSOR_PARALLEL if annotated else 1,
    )
    model = GPT(cfg)
    tokens = jax.random.randint(jax.random.key(0), (batch_size, seq_len + 1), 0, cfg.vocab_size)
    params = jax.jit(model.init)(jax.random.key(1), tokens[:1, :-1])  # (eager: one compile per op)
    block = 4 * d_model**2 + 2 * d_model * 4 * d_model
    # ZeRO-3's memory regime: one block ahead, release after every use
    config = zjax.ZeroConfig(
      prefetch_bucket_size=block, max_reuse_distance=0, param_persistence_threshold=4096
    )
    return Model(make_loss_fn(model), params, {"tokens": tokens}, config)

  from zjax.models.gpt import LOGICAL_AXIS_RULES

  tensor = dataclasses.replace(build(False, annotated=True), rules=LOGICAL_AXIS_RULES)
  return dataclasses.replace(build(False), scanned=build(True), tensor=tensor)


def target_model(spec: str) -> Model:
  """A user's `module:function` / `path.py:function` (as for `zjax inspect`), with shapes
  made concrete: floats normal * 0.02, integers zero."""
  from zjax.cli.target import load_target

  target = load_target(spec)
  if target.tensor_specs is not None or (target.config and target.config.tensor_axes):
    raise ValueError(
      f"{spec}: zjax bench runs a target data parallel only (its tensor-"
      f"parallel rows use the built-in GPT); return a config without "
      f"tensor_axes and no tensor_specs."
    )
  keys = iter(
    jax.random.split(jax.random.key(0), len(jax.tree.leaves((target.params, target.batch))))
  )

  def concrete(x):
    key = next(keys)
    if isinstance(x, jax.Array):
      return x
    if jnp.issubdtype(x.dtype, jnp.floating):
      return (jax.random.normal(key, x.shape) * 0.02).astype(x.dtype)
    return jnp.zeros(x.shape, x.dtype)

  return Model(
    target.loss_fn,
    jax.tree.map(concrete, target.params),
    jax.tree.map(concrete, target.batch),
    target.config or zjax.ZeroConfig(),
  )


TENSOR_PARALLEL = 2  # the tensor axis of the zjax_tp and gspmd_2d rows
# Rows of the depth sweep and of the device sweep (the main table has every method).
DEPTH_METHODS = ("zjax_rolled", "zjax_unrolled", "zjax_scanned", "gspmd_fsdp")
DEVICE_METHODS = ("zjax_rolled", "gspmd_fsdp", "data_parallel")


def build_methods(model: Model, mesh, optimizer, hybrid=False, only=None) -> list:
  """The methods on `mesh` (`only`: names to build, default all): zjax with its layers
  rolled into loops (the default) and not, scanned (GPT), GSPMD FSDP, data parallel, and
  with `hybrid` the 2 x N/2 mesh rows."""
  rolled = dataclasses.replace(model.config, roll_layers=True)
  unrolled = dataclasses.replace(model.config, roll_layers=False)
  qwz = dataclasses.replace(rolled, gather_quantization="int8")
  qgz = dataclasses.replace(rolled, reduce_quantization="int8")
  both = dataclasses.replace(qwz, reduce_quantization="int8")
  methods = [
    (
      name,
      lambda name=name, config=config: zjax_method(
        name, model.loss_fn, model.params, model.batch, mesh, config, optimizer
      ),
    )
    for name, config in (
      ("zjax_rolled", rolled),
      ("zjax_unrolled", unrolled),
      ("zjax_qwz", qwz),
      ("zjax_qgz", qgz),
      ("zjax_qwz_qgz", both),
    )
  ]
  if model.scanned is not None:
    s = model.scanned
    methods.append(
      (
        "zjax_scanned",
        lambda: zjax_method(
          "zjax_scanned", s.loss_fn, s.params, s.batch, mesh, s.config, optimizer
        ),
      )
    )
  methods += [
    (
      "gspmd_fsdp",
      lambda: gspmd_method(
        "gspmd_fsdp", model.loss_fn, model.params, model.batch, mesh, optimizer, True
      ),
    ),
    (
      "data_parallel",
      lambda: gspmd_method(
        "data_parallel", model.loss_fn, model.params, model.batch, mesh, optimizer, False
      ),
    ),
  ]
  n = mesh.devices.size
  if hybrid and n >= 4 and n % 2 == 0:  # a 2 x N/2 mesh of the same devices
    mesh2d = jax.make_mesh(
      (2, n // 2),
      ("replica", "fsdp"),
      devices=list(mesh.devices.flat),
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    hsdp = dataclasses.replace(model.config, shard_axes=("fsdp",), replicate_axes=("replica",))
    hpz = dataclasses.replace(hsdp, secondary_partition=True)
    methods += [
      (
        name,
        lambda name=name, config=config: zjax_method(
          name, model.loss_fn, model.params, model.batch, mesh2d, config, optimizer
        ),
      )
      for name, config in (("zjax_hsdp", hsdp), ("zjax_hpz", hpz))
    ]
    methods.append(
      (
        "gspmd_hsdp",
        lambda: gspmd_method(
          "gspmd_hsdp", model.loss_fn, model.params, model.batch, mesh2d, optimizer, True
        ),
      )
    )
  if hybrid and model.tensor is not None and n % TENSOR_PARALLEL == 0 and n // TENSOR_PARALLEL >= 2:
    methods += tensor_parallel_methods(model.tensor, mesh, optimizer)
  return [make() for name, make in methods if only is None or name in only]


def tensor_parallel_methods(model: Model, mesh, optimizer) -> list:
  """zjax_tp and gspmd_2d on an N/T x T ("fsdp", "tensor") mesh of the same devices: the
  same annotated model, its logical names mapped by the same rules."""
  import flax.linen as nn

  n, t = mesh.devices.size, TENSOR_PARALLEL
  mesh2d = jax.make_mesh(
    (n // t, t),
    ("fsdp", "tensor"),
    devices=list(mesh.devices.flat),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  params = nn.unbox(model.params)
  specs = nn.logical_to_mesh(nn.get_partition_spec(model.params), model.rules)
  config = dataclasses.replace(model.config, tensor_axes=("tensor",))
  return [
    (
      "zjax_tp",
      lambda: zjax_method(
        "zjax_tp",
        model.loss_fn,
        model.params,
        model.batch,
        mesh2d,
        config,
        optimizer,
        logical_axis_rules=model.rules,
      ),
    ),
    (
      "gspmd_2d",
      lambda: gspmd_method(
        "gspmd_2d",
        model.loss_fn,
        params,
        model.batch,
        mesh2d,
        optimizer,
        True,
        param_specs=specs,
        batch_axes="fsdp",
      ),
    ),
  ]


def compare(model: Model, mesh, rounds: int, steps_per_round: int) -> list[dict]:
  """The side-by-side table: one row per method."""
  optimizer = optax.adamw(1e-3)
  built = build_methods(model, mesh, optimizer, hybrid=True)
  times = _interleaved_times(built, rounds, steps_per_round)
  psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model.params))
  itemsize = jax.tree.leaves(model.params)[0].dtype.itemsize
  n = mesh.devices.size
  rows = []
  for method in built:
    row = {
      "method": method.name,
      "setup_seconds": method.setup_seconds,
      "compile_seconds": method.compile_seconds,
      **_measured(method),
      **_timing(times[method.name]),
    }
    row["state_vs_floor"] = row["state_bytes"] / (ADAM_BYTES_PER_PARAM_BYTE * psi * itemsize / n)
    row["comm_vs_3psi"] = (
      row["all_gather_bytes"]
      + row["reduce_scatter_bytes"]
      + row["all_to_all_bytes"]
      + row["all_reduce_bytes"]
    ) / (3 * psi * itemsize)
    if method.schedule is not None:
      row.update(_predicted(method.schedule))
      row["state_vs_floor_plus_persistent"] = (
        row["state_bytes"] / row["state_floor_plus_persistent_bytes"]
      )
    rows.append(row)
  base = next(r for r in rows if r["method"] == "gspmd_fsdp")
  for r in rows:
    r["time_vs_gspmd"] = r["step_seconds_median"] / base["step_seconds_median"]
    r["temp_vs_gspmd"] = r["temp_bytes"] / max(base["temp_bytes"], 1)
  return rows


def _measured(method) -> dict:
  summary = hlo.summarize(method.analysis)
  executed = hlo.executed(method.analysis.as_text())
  row = {
    k: summary[k] for k in ("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes", "flops")
  }
  for kind in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce"):
    row[f"{kind}_count"] = executed.get(f"{kind}_count", 0)
    row[f"{kind}_bytes"] = executed.get(f"{kind}_bytes", 0)
  row["state_bytes"] = layout.per_device_bytes(method.state())
  mesh_shape = dict(method.mesh.shape)
  if "tensor" in mesh_shape:  # the TP rows: bytes over each axis
    by_axis = hlo.executed_by_axis(method.analysis.as_text(), mesh_shape)
    row["bytes_by_axis"] = {
      kind: {k: v for k, v in axes.items() if v} for kind, axes in by_axis.items()
    }
  return row


def _predicted(schedule) -> dict:
  """The report's figures, and the state floor of the schedule's layout: 1/N of each sharded
  parameter with N its storage devices (HSDP: the shard group; hpZ, flat: all)."""
  report, n = schedule.report(), schedule.num_devices
  state_floor = sum(
    ADAM_BYTES_PER_PARAM_BYTE
    * (p.size if p.persistent else p.size / n)
    * jnp.dtype(p.dtype).itemsize
    for p in schedule.params
  )
  return {
    "predicted_all_gather_bytes": report["all_gather_bytes"],
    "predicted_reduce_scatter_bytes": report["reduce_scatter_bytes"],
    "predicted_all_to_all_bytes": report["all_to_all_bytes"],
    "predicted_all_gather_count": report["all_gather_count"],
    "predicted_reduce_scatter_count": report["reduce_scatter_count"],
    "state_floor_plus_persistent_bytes": state_floor,
  }


def _timing(samples) -> dict:
  return {
    "step_seconds_median": statistics.median(samples),
    "step_seconds_min": min(samples),
    "step_seconds_max": max(samples),
  }


def _interleaved_times(methods, rounds, steps) -> dict[str, list[float]]:
  for method in methods:  # warm up
    jax.block_until_ready(method.run())
  times = {m.name: [] for m in methods}
  for _ in range(rounds):
    for method in methods:
      start = time.perf_counter()
      for _ in range(steps):
        out = method.run()
      jax.block_until_ready(out)
      times[method.name].append((time.perf_counter() - start) / steps)
  return times


def scale_devices(model: Model, counts, known=None) -> list[dict]:
  """Per-device state and temp of each method for each device count (compile only).
  `known`: {device count: `compare` rows of this model on that many devices}, taken as they
  are instead of building those programs again."""
  rows = []
  for n in counts:
    if known and n in known:
      rows += [
        {
          "devices": n,
          "method": r["method"],
          "state_bytes": r["state_bytes"],
          "temp_bytes": r["temp_bytes"],
        }
        for r in known[n]
        if r["method"] in DEVICE_METHODS
      ]
      continue
    mesh = mesh_of(n)
    for method in build_methods(model, mesh, optax.adamw(1e-3), only=DEVICE_METHODS):
      row = _measured(method)
      rows.append(
        {
          "devices": n,
          "method": method.name,
          "state_bytes": row["state_bytes"],
          "temp_bytes": row["temp_bytes"],
        }
      )
  return rows


def scale_depth(make_model, depths, mesh, known=None) -> list[dict]:
  """Per-device temp, setup and compile time of each method for each depth (compile
  only). `known`: {depth: `compare` rows of that depth on `mesh`}, taken as they are."""
  rows = []
  for depth in depths:
    if known and depth in known:
      keys = ("method", "temp_bytes", "setup_seconds", "compile_seconds")
      rows += [
        {"layers": depth, **{k: r[k] for k in keys}}
        for r in known[depth]
        if r["method"] in DEPTH_METHODS
      ]
      continue
    for method in build_methods(make_model(depth), mesh, optax.adamw(1e-3), only=DEPTH_METHODS):
      rows.append(
        {
          "layers": depth,
          "method": method.name,
          "temp_bytes": int(method.analysis.memory_analysis().temp_size_in_bytes),
          "setup_seconds": method.setup_seconds,
          "compile_seconds": method.compile_seconds,
        }
      )
  return rows


def mesh_of(n):
  return jax.make_mesh(
    (n,), ("fsdp",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
  )


def machine() -> dict:
  device = jax.devices()[0]
  return {
    "platform": device.platform,
    "device_kind": device.device_kind,
    "devices_present": jax.device_count(),
    "cpu": platform.processor() or platform.machine(),
    "jax": jax.__version__,
    "date": time.strftime("%Y-%m-%d"),
  }


# ---- output ------------------------------------------------------------------------------


def main_tables(rows, n) -> list[Table]:
  """Three tables (memory; communication; time), one row per method, each narrow enough
  for an 80-column terminal."""
  base = next(r for r in rows if r["method"] == "gspmd_fsdp")["step_seconds_median"]
  groups = [
    (
      "memory",
      [
        ("state", "state_bytes"),
        ("state/floor", "state_vs_floor"),
        ("temp", "temp_bytes"),
        ("temp/gspmd", "temp_vs_gspmd"),
        ("args", "argument_bytes"),
      ],
    ),
    (
      "communication",
      [
        ("AG", "all_gather_count"),
        ("AG bytes", "all_gather_bytes"),
        ("RS", "reduce_scatter_count"),
        ("RS bytes", "reduce_scatter_bytes"),
        ("A2A", "all_to_all_bytes"),
        ("AR", "all_reduce_bytes"),
        ("comm/3Ψ", "comm_vs_3psi"),
      ],
    ),
    (
      "time",
      [
        ("GFLOP", "flops"),
        ("setup s", "setup_seconds"),
        ("compile s", "compile_seconds"),
        ("step time / gspmd (min-max)", "time_vs_gspmd"),
      ],
    ),
  ]
  captions = {
    "time": "the compiled step run here, interleaved rounds",
    "memory": "as a GPU orders the step (zjax.hlo.compile_for_analysis)",
    "communication": "counts and bytes (full buffers; A2A, AR: bytes) as a GPU orders the step",
  }
  tables = []
  for title, cols in groups:
    table = Table(
      title=f"zjax bench, {title}: {n} devices, per device and step",
      caption=captions[title],
      box=box.SIMPLE_HEAD,
      pad_edge=False,
    )
    table.add_column("method", no_wrap=True)
    for head, _ in cols:
      table.add_column(head, justify="right", no_wrap=True)
    for r in rows:
      table.add_row(r["method"], *[_cell(r, key, base) for _, key in cols])
    tables.append(table)
  return tables


def tensor_table(rows, n) -> Table | None:
  """zjax_tp beside gspmd_2d: state, temp, bytes over the data axis and over the tensor
  axis (every kind), step time relative to gspmd_2d. None without those rows."""
  tp = [r for r in rows if "bytes_by_axis" in r]
  base = next((r for r in tp if r["method"] == "gspmd_2d"), None)
  if base is None:
    return None
  table = Table(
    title=f"zjax bench, ZeRO-3 x tensor parallelism: {n // TENSOR_PARALLEL} x "
    f"{TENSOR_PARALLEL} (fsdp, tensor), per device and step",
    caption="bytes as a GPU orders the step; AG, RS over fsdp; every "
    "collective's bytes over tensor; time: step time / gspmd_2d's",
    box=box.SIMPLE_HEAD,
    pad_edge=False,
    padding=(0, 0),
  )
  for head in ("method", "state", "temp", "AG fsdp", "RS fsdp", "AR fsdp", "tensor", "time"):
    table.add_column(head, justify="left" if head == "method" else "right", no_wrap=True)
  for r in tp:
    axes = r["bytes_by_axis"]
    over = lambda kind, axis: axes.get(kind, {}).get(axis, 0)  # noqa: E731
    table.add_row(
      r["method"],
      format_bytes(r["state_bytes"]),
      format_bytes(r["temp_bytes"]),
      format_bytes(over("all_gather", "fsdp")),
      format_bytes(over("reduce_scatter", "fsdp")),
      format_bytes(over("all_reduce", "fsdp")),
      format_bytes(hlo.bytes_over(axes, "tensor")),
      f"{r['step_seconds_median'] / base['step_seconds_median']:.2f}",
    )
  return table


def _cell(r, key, base) -> str:
  value = r[key]
  if key == "time_vs_gspmd":
    return f"{value:.2f} ({r['step_seconds_min'] / base:.2f}-{r['step_seconds_max'] / base:.2f})"
  if key == "flops":
    return f"{value / 1e9:.2f}"
  if key.endswith("bytes"):
    return format_bytes(value)
  return f"{value:.2f}" if isinstance(value, float) else str(value)


def plot(results: dict, directory) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  written = []

  def save(fig, name):
    path = f"{directory}/{name}"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

  for key, x, y, name, xlabel, ylabel in (
    (
      "devices",
      "devices",
      "state_bytes",
      "memory_vs_devices.png",
      "devices N",
      "per-device state (MiB)",
    ),
    ("depth", "layers", "temp_bytes", "memory_vs_depth.png", "layers L", "per-device temp (MiB)"),
  ):
    rows = results.get(key) or []
    if not rows:
      continue
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
      pts = [r for r in rows if r["method"] == method]
      ax.plot([r[x] for r in pts], [r[y] / 2**20 for r in pts], "o-", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    save(fig, name)
  rows = results["compare"]
  fig, ax = plt.subplots(figsize=(6, 4))
  base = next(r for r in rows if r["method"] == "gspmd_fsdp")["step_seconds_median"]
  medians = [r["step_seconds_median"] / base for r in rows]
  errors = [
    [m - r["step_seconds_min"] / base for m, r in zip(medians, rows)],
    [r["step_seconds_max"] / base - m for m, r in zip(medians, rows)],
  ]
  ax.bar([r["method"] for r in rows], medians, yerr=errors, capsize=4)
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_ylabel("step time / GSPMD FSDP (median, min-max)")
  save(fig, "step_time.png")
  return written


def write_json(results: dict, path) -> None:
  with open(path, "w") as f:
    json.dump(results, f, indent=1, default=float)
