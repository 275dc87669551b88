"""zjax.autoconfig: the layout and knobs to run a model with, for a memory budget per device
and a cluster, chosen before anything runs.

The search (docs/autoconfig.md):
1. Layouts: flat ZeRO-3 over all N devices, and HSDP / hpZ with shard groups of every
   power-of-two size from one node's GPUs (from 1 inside a single node) up to N; only flat
   when the loss itself uses collectives over the data axis (sync BatchNorm), whose meaning
   a replicate axis would change. Micro-batches: every accumulation K (a power of two) that
   splits the batch evenly.
2. Each (layout, K) is planned (the schedule and its exact report), with the base config's
   `param_persistence_threshold` and with every parameter sharded (where the base keeps
   1% of the elements or more replicated), the trainer's whole step traced on an abstract
   mesh, and priced (step_cost.py) with the optimizer on the device, offloaded, and with
   the parameters offloaded too.
3. The knobs that trade time for memory (no prefetch, release after every use, both) are
   tried on the two fastest and the two smallest points of step 2.
4. A candidate fits when its predicted peak, grown by `margin`, is within the budget. The
   choice is the fastest that fits; near-ties (1%) go to fewer bytes moved, then to less
   memory, then to the simpler layout. Which candidates are searched does not depend on
   the budget and the order is total, so a tighter budget never chooses more memory.
"""

import dataclasses
import math
import re
import time as time_lib
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh, AxisType

from zjax._src.autoconfig import cluster as cluster_lib
from zjax._src.autoconfig import step_cost
from zjax._src.config import ZeroConfig
from zjax._src.errors import TraceError, ZjaxError
from zjax._src.layout import tensor_specs
from zjax._src.plan import comm_model
from zjax._src.plan.comm_model import Link
from zjax._src.plan.entry import compile_schedule, frozen_indices
from zjax._src.plan.plan import plan_schedule
from zjax._src.program.trace import trace_for_schedule
from zjax._src.schedule import render

# Predicted peak x (1 + MARGIN) must fit the budget. Measured (docs/autoconfig.md): the
# prediction is within MARGIN of the compiled footprint on every measured configuration.
MARGIN = 0.45
OFFLOADS = ("none", "optimizer", "optimizer+params")
# Knob settings tried beside the base config's: each trades time for memory.
SHARD_ALL = (("param_persistence_threshold", 0),)
KNOB_VARIANTS = (
  {"prefetch_bucket_size": 0},
  {"max_reuse_distance": 0},
  {"prefetch_bucket_size": 0, "max_reuse_distance": 0},
)
PERSISTENT_SHARE = 0.01  # sharding every parameter is searched where more stay replicated
TIE = 0.01  # step times within 1% are a tie


class BudgetError(ZjaxError, ValueError):
  """No configuration fits the memory budget; `smallest` is the least memory found."""

  def __init__(self, message, smallest=None):
    super().__init__(message)
    self.smallest = smallest


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One point of the search: R replicas x S shards (R=1: flat), hpZ or not, K micro-batches
  per step, where the optimizer lives, and knob overrides of the base config."""

  replicas: int
  shard: int
  secondary: bool = False
  accumulation: int = 1
  offload: str = "none"
  knobs: tuple = ()

  @property
  def layout(self) -> str:
    if self.replicas == 1:
      return f"flat ZeRO-3 over {self.shard}"
    return f"{'hpZ' if self.secondary else 'HSDP'} {self.replicas}x{self.shard}"

  def describe(self) -> str:
    parts = [self.layout]
    if self.accumulation > 1:
      parts.append(f"{self.accumulation} micro-batches")
    if self.offload != "none":
      parts.append(f"offload {self.offload}")
    parts += [f"{k}={v:g}" for k, v in self.knobs]
    return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Evaluated:
  """A candidate with its predicted memory and time; `fits`: within the budget."""

  candidate: Candidate
  memory: step_cost.Memory
  time: step_cost.Time
  fits: bool
  schedule: Any = dataclasses.field(repr=False, compare=False, default=None)
  axis_sizes: dict = dataclasses.field(default_factory=dict)

  def row(self) -> dict:
    return {
      "candidate": self.candidate.describe(),
      "peak_bytes": self.memory.total,
      "step_seconds": self.time.step,
      "fits": self.fits,
    }


@dataclasses.dataclass(frozen=True)
class AutoConfig:
  """What `autoconfig` chose, what it predicts, and why.

  Attributes:
    config: the ZeroConfig to compile the schedule with.
    axis_sizes: the mesh's axes and sizes, in mesh order (`mesh()` builds it).
    accumulation_steps, offload_optimizer, offload_params: `zjax.zero3`'s options.
    schedule: the chosen schedule, planned for one micro-batch (what the trainer runs).
    memory: predicted peak bytes per device, by what holds them (`step_cost.Memory`).
    time: predicted seconds per step: compute, communication per axis, exposed, step.
    decisions: one line per choice: what it saves and what it costs.
    rejected: the other candidates (dicts: candidate, peak_bytes, step_seconds, fits).
    budget, margin, cluster: what the choice was made against.
  """

  config: ZeroConfig
  axis_sizes: dict
  accumulation_steps: int
  offload_optimizer: bool
  offload_params: bool
  schedule: Any
  memory: step_cost.Memory
  time: step_cost.Time
  decisions: tuple
  rejected: tuple
  budget: int
  margin: float
  cluster: cluster_lib.Cluster
  search_seconds: float

  def mesh(self, devices=None) -> jax.sharding.Mesh:
    """The mesh to run on (`devices`: default the first N of `jax.devices()`)."""
    n = math.prod(self.axis_sizes.values())
    devices = jax.devices()[:n] if devices is None else devices
    return jax.make_mesh(tuple(self.axis_sizes.values()), tuple(self.axis_sizes), devices=devices)

  def trainer_options(self) -> dict:
    """Keyword arguments for `zjax.zero3`."""
    return {
      "accumulation_steps": self.accumulation_steps,
      "offload_optimizer": self.offload_optimizer,
      "offload_params": self.offload_params,
    }

  def to_dict(self) -> dict:
    """JSON-serialisable: the choice, the prediction, the decisions and the rejected."""
    return {
      "config": self.config.to_dict(),
      "axis_sizes": dict(self.axis_sizes),
      **self.trainer_options(),
      "memory": self.memory.to_dict(),
      "time": self.time.to_dict(),
      "decisions": list(self.decisions),
      "rejected": list(self.rejected),
      "budget": self.budget,
      "margin": self.margin,
      "cluster": dataclasses.asdict(self.cluster),
      "search_seconds": self.search_seconds,
    }

  def summary(self, rejected: int = 8) -> str:
    """A short table a person reads in a terminal."""
    gib = render.format_bytes
    m, t = self.memory, self.time
    mesh = " x ".join(f"{a}={n}" for a, n in self.axis_sizes.items())
    lines = [
      f"chosen: {describe_choice(self)} on mesh {mesh}",
      f"memory per device: {gib(m.total)} predicted (budget {gib(self.budget)}, margin "
      f"{self.margin:.0%}): parameters {gib(m.parameters)}, optimizer {gib(m.optimizer)}, "
      f"gradients {gib(m.gradients)}, gathered {gib(m.gathered)}, activations "
      f"{gib(m.activations)}, batch {gib(m.batch)}",
      f"step time: {_ms(t.step)} predicted: compute {_ms(t.compute)}, communication "
      f"{_ms(t.communication)} ({_ms(t.exposed_communication)} not hidden), host transfers "
      f"{_ms(t.host_transfer)}",
    ]
    for axis, row in t.by_axis.items():
      lines.append(
        f"  {axis}: {gib(row['bytes'])} in {row['count']} collectives, {_ms(row['seconds'])}"
      )
    lines.append("why:")
    lines += [f"  - {d}" for d in self.decisions]
    table = [["rejected", "peak", "step", "fits"]] + [
      [r["candidate"], gib(r["peak_bytes"]), _ms(r["step_seconds"]), "yes" if r["fits"] else "no"]
      for r in self.rejected[:rejected]
    ]
    lines.append(render.table(table))
    if len(self.rejected) > rejected:
      lines.append(f"(and {len(self.rejected) - rejected} more; --json lists all)")
    lines.append(f"cluster: {self.cluster.describe()}; searched in {self.search_seconds:.1f} s")
    return "\n".join(lines)


def describe_choice(plan: AutoConfig) -> str:
  c = plan.config
  base = ZeroConfig()
  knobs = [
    f"{k}={getattr(c, k):g}"
    for k in ("prefetch_bucket_size", "max_reuse_distance", "param_persistence_threshold")
    if getattr(c, k) != getattr(base, k)
  ]
  parts = [_layout_words(plan.axis_sizes, c)]
  if plan.accumulation_steps > 1:
    parts.append(f"accumulation_steps={plan.accumulation_steps}")
  if plan.offload_optimizer:
    parts.append("offload_optimizer" + (" + offload_params" if plan.offload_params else ""))
  return ", ".join(parts + knobs)


def _layout_words(sizes, config) -> str:
  if not config.replicate_axes:
    return f"flat ZeRO-3 over {math.prod(sizes.values())}"
  r = math.prod(sizes[a] for a in config.replicate_axes)
  s = math.prod(sizes[a] for a in config.shard_axes)
  return f"{'hpZ' if config.secondary_partition else 'HSDP'} {r} replicas x {s} shards"


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def autoconfig(
  loss_fn: Callable,
  params: Any,
  batch: Any,
  *,
  device_memory,
  num_devices: int | None = None,
  mesh=None,
  cluster=None,
  config: ZeroConfig | None = None,
  optimizer=None,
  extra: Any = None,
  frozen: Any = None,
  margin: float = MARGIN,
  compute_efficiency: float = 0.4,
  offload: bool = True,
  platform: str | None = None,
) -> AutoConfig:
  """Choose the layout and knobs that fit `device_memory` per device and run fastest.

  Nothing is compiled or allocated: each candidate is planned (its exact report), its
  gradient step traced on an abstract mesh for the activation model, and priced with the
  cluster's links and compute peak (docs/autoconfig.md: the models and their measured
  error).

  Args:
    loss_fn, params, batch: as for `compile_schedule` (params and batch may be
      ShapeDtypeStructs); `batch` is the global batch of one optimizer step.
    device_memory: bytes per device (an int, or a string such as "80GiB", "80GB").
    num_devices: N: every layout of N devices is considered (flat ZeRO-3; HSDP and hpZ
      with shard groups from one node up). Or `mesh`: plan for its devices, keeping its
      axis names (a 1-D mesh: flat; a 2-D mesh: flat over both, HSDP or hpZ).
    cluster: a preset name (`zjax._src.autoconfig.cluster.PRESETS`: "h100x8", "h200x8",
      "h100x4", ...), a dict of `Cluster` fields, a JSON file of them, or a Cluster; None:
      "h100x8".
    config: the base ZeroConfig: its compute and reduce dtypes, quantization and the
      knobs the search does not change are kept (default `ZeroConfig()`).
    optimizer: the optax transformation the trainer will run (its state and its update's
      temporaries are part of the step's memory; None: `optax.adam`).
    extra, frozen: as for `compile_schedule`.
    margin: the predicted peak grown by this fraction must fit (default: the measured
      prediction error, docs/autoconfig.md).
    compute_efficiency: the fraction of the cluster's peak FLOP/s compute reaches.
    offload: consider optimizer and parameter offload (host memory).
    platform: whose compiled program the report predicts (as `compile_schedule`).

  Returns:
    An `AutoConfig`: `config`, `axis_sizes` (`mesh()`), `trainer_options()` for
    `zjax.zero3`, the `schedule`, the predicted `memory` and `time`, `decisions` and
    `rejected`. Raises `BudgetError` (naming the smallest budget found) when nothing fits.
  """
  started = time_lib.perf_counter()
  budget = parse_bytes(device_memory, "device_memory")
  the_cluster = cluster_lib.resolve(cluster)
  base = ZeroConfig() if config is None else config
  if not isinstance(base, ZeroConfig):
    raise TypeError(f"config must be a zjax.ZeroConfig, got {type(base).__name__}.")
  if base.tensor_axes:
    raise ValueError(
      "autoconfig plans data-parallel layouts; ZeroConfig.tensor_axes is "
      f"{base.tensor_axes}: this version does not search tensor-parallel degrees. Plan a "
      "tensor-parallel layout with compile_schedule and zjax inspect."
    )
  _check_fraction("margin", margin, upper=10.0)
  _check_fraction("compute_efficiency", compute_efficiency, upper=1.0, positive=True)
  if platform is None:
    concrete = isinstance(mesh, jax.sharding.Mesh)
    platform = mesh.devices.flat[0].platform if concrete else jax.default_backend()
  params = tensor_specs.unbox(params)
  layouts = _layouts(base, num_devices, mesh, the_cluster, loss_fn, params, batch, extra)
  n = math.prod(next(iter(layouts))[1].values())
  steps = accumulation_choices(batch, n)
  search = _Search(
    (loss_fn, params, batch, extra, frozen, platform),
    the_cluster,
    compute_efficiency,
    optimizer,
    budget=budget,
    margin=margin,
    offload=offload,
  )
  search.collectives = mesh is not None or len(layouts) == 1
  persistence = [(), SHARD_ALL]
  for layout_config, sizes in layouts:
    for k in steps:
      for knobs in persistence:
        evaluated = search.evaluate(layout_config, sizes, k, knobs)
        if not knobs and _persistent_share(evaluated[0].schedule) < PERSISTENT_SHARE:
          persistence = [()]  # sharding the few replicated parameters changes nothing
  points = search.promising()  # fixed before the budget is consulted: monotone choices
  for knobs in KNOB_VARIANTS:
    for p in points:
      variant = (*p.candidate.knobs, *knobs.items())
      search.evaluate(p.config, p.axis_sizes, p.candidate.accumulation, variant)
  return search.choose(time_lib.perf_counter() - started)


def predict(
  loss_fn,
  params,
  batch,
  *,
  config: ZeroConfig,
  axis_sizes: dict,
  accumulation_steps: int = 1,
  offload: str = "none",
  cluster=None,
  optimizer=None,
  extra=None,
  frozen=None,
  compute_efficiency: float = 0.4,
  platform: str | None = None,
) -> Evaluated:
  """The predicted memory and time of one configuration given by hand (the models
  autoconfig ranks candidates with): `config` on a mesh of `axis_sizes`, K micro-batches,
  `offload` one of "none", "optimizer", "optimizer+params"."""
  if offload not in OFFLOADS:
    raise ValueError(f"offload must be one of {list(OFFLOADS)}, got {offload!r}.")
  model = (loss_fn, params, batch, extra, frozen, platform or jax.default_backend())
  search = _Search(model, cluster_lib.resolve(cluster), compute_efficiency, optimizer)
  search.collectives = True  # one layout: trace it with its own axes
  evaluated = search.evaluate(config, axis_sizes, accumulation_steps, ())
  return next(ev for ev in evaluated if ev.candidate.offload == offload)


class _Search:
  """The evaluated candidates, keyed by (layout, K, knobs); the choice among them."""

  def __init__(
    self, model, cluster, efficiency, optimizer, budget=float("inf"), margin=0.0, offload=True
  ):
    """`model`: (loss_fn, params, batch, extra, frozen, platform); `optimizer` None:
    `optax.adam`."""
    self.loss_fn, self.params, self.batch, self.extra, self.frozen, self.platform = model
    self.cluster, self.efficiency, self.budget, self.margin = cluster, efficiency, budget, margin
    self.optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    self.offloads = OFFLOADS if offload else ("none",)
    self.results: dict = {}  # (layout, K, knobs) -> _Priced
    self.traces: dict = {}  # (devices or axis sizes, micro-batch shape) -> ProgramTrace
    self.collectives = False  # the loss uses collectives over the data axes

  def evaluate(self, config, sizes, k, knobs):
    config = dataclasses.replace(config, **dict(knobs))
    key = (_layout_key(config, sizes), k, knobs)
    if key in self.results:
      return self.results[key].evaluated
    micro = micro_batch(self.batch, k)
    schedule = self.plan(config, sizes, micro)
    abstract = AbstractMesh(
      tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Explicit,) * len(sizes)
    )
    program = step_cost.trainer_program(
      schedule,
      self.loss_fn,
      abstract,
      optimizer=self.optimizer,
      accumulation=k,
      batch=self.batch,
      extra=self.extra,
    )
    n = math.prod(sizes.values())
    batch_bytes = step_cost.batch_share_bytes(self.batch, n)
    report = schedule.report()
    comm = comm_model.predict(schedule, _links(sizes, config, self.cluster))
    itemsize = _compute_itemsize(schedule)
    replicas = math.prod(sizes[a] for a in config.replicate_axes)
    evaluated = []
    for where in self.offloads:
      plan = step_cost.offload_plan(schedule, where)
      memory = step_cost.memory(report, program, accumulation=k, plan=plan, batch_bytes=batch_bytes)
      time = step_cost.step_time(
        schedule,
        program.flops,
        comm,
        self.cluster,
        accumulation=k,
        plan=plan,
        efficiency=self.efficiency,
        compute_itemsize=itemsize,
      )
      candidate = Candidate(replicas, n // replicas, config.secondary_partition, k, where, knobs)
      fits = memory.total * (1 + self.margin) <= self.budget
      evaluated.append(Evaluated(candidate, memory, time, fits, schedule, dict(sizes)))
    self.results[key] = _Priced(config, dict(sizes), evaluated)
    return evaluated

  def plan(self, config, sizes, micro):
    """The schedule of `config` on `sizes` for one micro-batch: the loss traced once per
    micro-batch shape (a trace depends on the per-device batch, not on the layout, unless
    the loss names the data axes itself), then planned for the layout."""
    n = math.prod(sizes.values())
    key = (tuple(sizes.items()) if self.collectives else n, jax.tree.leaves(micro)[0].shape)
    if key not in self.traces:
      self.traces[key] = trace_for_schedule(
        self.loss_fn, self.params, micro, config, sizes, self.extra
      )
    trace = self.traces[key]
    frozen = frozen_indices(self.params, self.frozen, trace)
    schedule = plan_schedule(trace, config, sizes, frozen=frozen, platform=self.platform)
    object.__setattr__(schedule, "params_treedef", jax.tree_util.tree_structure(self.params))
    return schedule

  def all(self) -> list[Evaluated]:
    return [ev for priced in self.results.values() for ev in priced.evaluated]

  def promising(self, count: int = 2) -> list:
    """The points to try the knob variants on: the `count` fastest and the `count`
    smallest so far, whatever the budget (so that the candidates searched, and with them
    the choice's order, do not depend on it)."""
    points = list(self.results.values())
    fastest = sorted(points, key=lambda p: min(_order(ev) for ev in p.evaluated))
    smallest = sorted(points, key=lambda p: min(ev.memory.total for ev in p.evaluated))
    chosen = []
    for p in fastest[:count] + smallest[:count]:
      if p not in chosen:
        chosen.append(p)
    return [_PricedPoint(p.config, p.axis_sizes, p.evaluated[0].candidate) for p in chosen]

  def choose(self, seconds) -> AutoConfig:
    every = self.all()
    fitting = [ev for ev in every if ev.fits]
    if not fitting:
      raise _no_fit(every, self.budget, self.margin)
    best = min(fitting, key=_order)
    decisions = _decisions(best, every, self.budget, self.margin)
    rejected = tuple(ev.row() for ev in sorted(every, key=_order) if ev is not best)
    config = best.schedule.config
    return AutoConfig(
      config=config,
      axis_sizes=best.axis_sizes,
      accumulation_steps=best.candidate.accumulation,
      offload_optimizer=best.candidate.offload != "none",
      offload_params=best.candidate.offload == "optimizer+params",
      schedule=best.schedule,
      memory=best.memory,
      time=best.time,
      decisions=tuple(decisions),
      rejected=rejected,
      budget=self.budget,
      margin=self.margin,
      cluster=self.cluster,
      search_seconds=seconds,
    )


@dataclasses.dataclass(frozen=True)
class _Priced:
  config: ZeroConfig
  axis_sizes: dict
  evaluated: list


@dataclasses.dataclass(frozen=True)
class _PricedPoint:
  config: ZeroConfig
  axis_sizes: dict
  candidate: Candidate


def _order(ev: Evaluated):
  """Fastest first (step times rounded to TIE steps), then fewer bytes moved (collectives
  and host transfers), then less memory, then the simpler layout (flat before HSDP before
  hpZ, no offload, the base knobs), then the description: a total order."""
  bucket = round(math.log(max(ev.time.step, 1e-12)) / math.log1p(TIE))
  c = ev.candidate
  moved = ev.time.communication_bytes + ev.time.host_transfer_bytes
  simpler = (c.replicas > 1, c.secondary, OFFLOADS.index(c.offload), len(c.knobs))
  return (bucket, moved, ev.memory.total, simpler, c.describe())


def _decisions(best, every, budget, margin) -> list[str]:
  """One line per dimension of the choice: against the candidate that differs only there,
  what the choice saves and what it costs."""
  c = best.candidate
  lines = []
  alternatives = {
    "layout": lambda o: (
      (o.replicas, o.shard, o.secondary) != (c.replicas, c.shard, c.secondary)
      and (o.accumulation, o.offload, o.knobs) == (c.accumulation, c.offload, c.knobs)
    ),
    "micro-batches": lambda o: (
      o.accumulation != c.accumulation
      and (o.replicas, o.shard, o.secondary, o.offload, o.knobs)
      == (c.replicas, c.shard, c.secondary, c.offload, c.knobs)
    ),
    "offload": lambda o: (
      o.offload != c.offload
      and (o.replicas, o.shard, o.secondary, o.accumulation, o.knobs)
      == (c.replicas, c.shard, c.secondary, c.accumulation, c.knobs)
    ),
    "knobs": lambda o: (
      o.knobs != c.knobs
      and (o.replicas, o.shard, o.secondary, o.accumulation, o.offload)
      == (c.replicas, c.shard, c.secondary, c.accumulation, c.offload)
    ),
  }
  what = {
    "layout": c.layout,
    "micro-batches": f"{c.accumulation} micro-batch{'es' if c.accumulation > 1 else ''} per step",
    "offload": "optimizer on the device" if c.offload == "none" else f"offload {c.offload}",
    "knobs": ", ".join(f"{k}={v:g}" for k, v in c.knobs) or "the base config's knobs",
  }
  for dim, differs in alternatives.items():
    others = sorted((o for o in every if differs(o.candidate)), key=_order)
    if not others:
      lines.append(f"{what[dim]}: the only option searched")
      continue
    ahead = [o for o in others if _order(o) < _order(best)]  # ranked first, did not fit
    if ahead:
      o = ahead[0]
      lines.append(
        f"{what[dim]}: {_alt(o, dim)} would rank first ({_ms(o.time.step)} a step) but needs "
        f"{_gib(o.memory.total)}, over the budget of {_gib(budget)} with the {margin:.0%} "
        f"margin; this choice saves {_gib(o.memory.total - best.memory.total)} and costs "
        f"{_ms(max(best.time.step - o.time.step, 0.0))} a step"
      )
    else:
      o = others[0]
      lines.append(
        f"{what[dim]}: the fastest that fits; the next, {_alt(o, dim)}, takes "
        f"{_ms(o.time.step)} at {_gib(o.memory.total)}"
      )
  return lines


def _alt(ev, dim) -> str:
  c = ev.candidate
  return {
    "layout": c.layout,
    "micro-batches": f"{c.accumulation} micro-batch{'es' if c.accumulation > 1 else ''}",
    "offload": "the optimizer on the device" if c.offload == "none" else f"offload {c.offload}",
    "knobs": ", ".join(f"{k}={v:g}" for k, v in c.knobs) or "the base knobs",
  }[dim]


def _gib(n) -> str:
  return render.format_bytes(n)


def _no_fit(every, budget, margin) -> BudgetError:
  smallest = min(every, key=lambda ev: ev.memory.total)
  need = int(smallest.memory.total * (1 + margin))
  return BudgetError(
    f"No configuration fits device_memory={_gib(budget)}: the smallest found is "
    f"{smallest.candidate.describe()} at {_gib(smallest.memory.total)} predicted, "
    f"{_gib(need)} with the {margin:.0%} margin. What would change it: more devices (the "
    f"parameter and optimizer state shrink as 1/N), offload (offload=True), a smaller "
    f"batch per step (the activations: {_gib(smallest.memory.activations)}), or a device "
    f"with at least {_gib(need)}.",
    smallest=smallest,
  )


def _layouts(base, num_devices, mesh, cluster, loss_fn, params, batch, extra):
  """[(ZeroConfig with the layout's axes, axis sizes in mesh order)] to search."""
  if (num_devices is None) == (mesh is None):
    raise ValueError("Pass exactly one of num_devices= (N devices) or mesh= (a jax Mesh).")
  if mesh is not None:
    if not hasattr(mesh, "axis_names") or not hasattr(mesh, "shape"):
      raise TypeError(f"mesh must be a jax Mesh or AbstractMesh, got {type(mesh).__name__}.")
    layouts = _mesh_layouts(base, mesh)
    n = math.prod(layouts[0][1].values())
    return layouts[:1] if _uses_collectives(loss_fn, params, batch, extra, base, n) else layouts
  if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)):
    raise ValueError(f"num_devices must be a positive int, got {num_devices!r}.")
  n = int(num_devices)
  if n < 1:
    raise ValueError(f"num_devices must be a positive int, got {n}.")
  if len(base.shard_axes) > 1 or base.replicate_axes:
    raise ValueError(
      f"With num_devices=, autoconfig chooses the mesh axes; the base config names "
      f"shard_axes={base.shard_axes} and replicate_axes={base.replicate_axes}. Pass "
      f"mesh= to keep them, or leave them at one shard axis."
    )
  axis = base.shard_axes[0]
  flat = dataclasses.replace(base, secondary_partition=False)
  out = [(flat, {axis: n})]
  if _uses_collectives(loss_fn, params, batch, extra, base, n):
    return out
  replica = "replica" if axis != "replica" else "replicas"
  shard = 1 if n <= cluster.gpus_per_node else cluster.gpus_per_node
  while shard < n:
    if n % shard == 0:
      r = n // shard
      hsdp = dataclasses.replace(flat, shard_axes=(axis,), replicate_axes=(replica,))
      out.append((hsdp, {replica: r, axis: shard}))
      if n > cluster.gpus_per_node:  # hpZ's backward gathers stay in the shard group
        out.append((dataclasses.replace(hsdp, secondary_partition=True), {replica: r, axis: shard}))
    shard *= 2
  return out


def _mesh_layouts(base, mesh):
  sizes = {a: int(mesh.shape[a]) for a in mesh.axis_names}
  axes = tuple(sizes)
  flat = dataclasses.replace(base, shard_axes=axes, replicate_axes=(), secondary_partition=False)
  out = [(flat, sizes)]
  if len(axes) > 1:
    hsdp = dataclasses.replace(flat, shard_axes=axes[-1:], replicate_axes=axes[:-1])
    out += [(hsdp, sizes), (dataclasses.replace(hsdp, secondary_partition=True), sizes)]
  return out


def _uses_collectives(loss_fn, params, batch, extra, base, n) -> bool:
  """Whether the loss itself uses a collective over its data axis (traced with the axis
  under another name: the trace then fails to find it)."""
  probe = dataclasses.replace(
    base, shard_axes=("__zjax_probe__",), replicate_axes=(), secondary_partition=False
  )
  try:
    compile_schedule(
      loss_fn,
      params,
      micro_batch(batch, 1),
      axis_sizes={"__zjax_probe__": n},
      config=probe,
      extra=extra,
    )
  except TraceError as e:
    if getattr(e, "axis", None) is not None or "collective over the axis" in str(e):
      return True
    raise
  return False


def _persistent_share(schedule) -> float:
  """The share of parameter elements kept whole on every device (persistent)."""
  total = sum(p.size for p in schedule.params)
  return sum(p.size for p in schedule.params if p.persistent) / max(total, 1)


def _layout_key(config, sizes):
  return (tuple(sizes.items()), config.replicate_axes, config.secondary_partition)


def _links(sizes, config, cluster) -> dict[str, Link]:
  """Each axis's link: the axes from the last inwards share a node while their product
  fits in one."""
  links, span = {}, 1
  for axis in reversed(list(sizes)):
    span *= sizes[axis]
    links[axis] = cluster.link(span)
  return links


def _compute_itemsize(schedule) -> int:
  dtype = schedule.config.compute_dtype
  if dtype is not None:
    return np.dtype(dtype).itemsize
  sizes = [
    np.dtype(p.dtype).itemsize for p in schedule.params if np.issubdtype(p.dtype, np.floating)
  ]
  return max(sizes, default=4)


def accumulation_choices(batch, n) -> list[int]:
  """Powers of two K that split every batch leaf's leading dimension into K micro-batches
  each divisible by N."""
  rows = [np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x) > 0]
  if not rows:
    return [1]
  bad = [r for r in rows if r % n]
  if bad:
    raise ValueError(
      f"The batch's leading dimension {bad[0]} does not divide by the {n} devices; give a "
      f"global batch whose leading dimension is a multiple of {n}."
    )
  out, k = [], 1
  while all(r % (n * k) == 0 for r in rows):
    out.append(k)
    k *= 2
  return out


def micro_batch(batch, k):
  """One of K micro-batches of `batch` as ShapeDtypeStructs (0-d leaves whole)."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      (np.shape(x)[0] // k, *np.shape(x)[1:]) if np.ndim(x) else (), x.dtype
    ),
    batch,
  )


_UNITS = {
  "": 1,
  "b": 1,
  "kb": 1e3,
  "mb": 1e6,
  "gb": 1e9,
  "tb": 1e12,
  "kib": 2**10,
  "mib": 2**20,
  "gib": 2**30,
  "tib": 2**40,
}


def parse_bytes(value, field: str) -> int:
  """Bytes from an int or a string such as "80GiB", "80 GB", "8e10"."""
  if isinstance(value, str):
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
      raise ValueError(
        f"{field} must be a number of bytes or a size such as '80GiB' or '80GB', got {value!r}."
      )
    try:
      value = float(m.group(1)) * _UNITS[unit]
    except ValueError:
      raise ValueError(f"{field}: {m.group(1)!r} is not a number.") from None
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise ValueError(f"{field} must be a number of bytes or a size such as '80GiB', got {value!r}.")
  if not np.isfinite(value) or value <= 0:
    raise ValueError(f"{field} must be a positive number of bytes, got {value!r}.")
  return int(value)


def _check_fraction(field, value, upper, positive=False):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
    raise ValueError(f"{field} must be a number, got {value!r}.")
  if value < 0 or (positive and value == 0) or value > upper:
    low = "(0" if positive else "[0"
    raise ValueError(f"{field} must be in {low}, {upper:g}], got {value!r}.")
