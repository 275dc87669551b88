"""`zjax train`: the GPT example on standard-library source, with ZeRO-3 on N devices.

The loop: plan the schedule, build (or resume) the sharded state, train with a progress bar,
validate and checkpoint periodically (asynchronously), and finish with the outputs of
outputs.py. Resuming is automatic: a checkpoint directory that holds a step is restored,
whatever device count saved it, and the batches continue where they left off (each batch
is a function of the seed and the step).
"""

import dataclasses
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

import zjax
from zjax._src.layout import layout
from zjax._src.xla import hlo
from zjax.job import corpus as corpus_lib
from zjax.job import outputs
from zjax.job import settings as settings_lib
from zjax.models.gpt import GPT, LOGICAL_AXIS_RULES, GPTConfig, make_loss_fn

PROMPT = b"def "


def train(settings, console: Console) -> dict:
  """Run the job; returns the summary (also written to OUT_DIR/metrics.json). On SIGTERM it
  finishes the step in flight, saves it, and returns {"preempted_at": step}; after
  `max_consecutive_skips` non-finite steps in a row it saves the last good state and raises
  TrainingStopped."""
  start = time.perf_counter()
  mesh = _mesh(settings.devices, settings.tensor_parallel)
  data = corpus_lib.stdlib_corpus(settings.corpus_bytes)
  console.print(
    f"corpus: {data.num_files} files of {data.source}, "
    f"{len(data.train):,} train / {len(data.validation):,} validation bytes"
  )
  model, loss_fn, trainer, param_count, param_bytes = _setup(settings, mesh)
  console.print(
    outputs.plan_table(
      trainer.schedule,
      param_count,
      param_bytes,
      settings.offload_optimizer,
      settings.offload_params,
    )
  )

  settings.checkpoint_dir.mkdir(parents=True, exist_ok=True)
  ckpt = zjax.CheckpointManager(settings.checkpoint_dir, trainer, max_to_keep=2)
  metrics_path = settings.checkpoint_dir.parent / "metrics.json"
  latest = ckpt.latest_step()
  if latest is not None and latest >= settings.steps:  # nothing to train: nothing restored
    ckpt.close()
    console.print(
      f"already complete: step {latest} of {settings.steps}; nothing to train "
      f"and {metrics_path} is kept. Raise --steps to train further."
    )
    return outputs.read_summary(metrics_path)
  first_step, state, history = _start(settings, ckpt, trainer, model, metrics_path, console)

  batch_at = lambda step: {
    "tokens": corpus_lib.batch_at(data.train, step, settings.batch, settings.seq_len, settings.seed)
  }
  loop = _Loop(
    settings,
    trainer,
    ckpt,
    history,
    metrics_path,
    _evaluator(loss_fn, trainer, data.validation, settings),
  )
  try:
    with _progress(console, settings) as progress:
      state, stopped = loop.run(state, first_step, batch_at, progress)
  finally:  # also when too many skipped steps stop the run: every save written
    ckpt.wait_until_finished()
    ckpt.close()
  if stopped is not None:  # preempted: the step is saved, the curves so far written
    outputs.write_metrics(
      metrics_path, history, {"preempted_at": stopped}, dataclasses.asdict(settings)
    )
    console.print(
      f"preempted (SIGTERM): saved step {stopped} to {settings.checkpoint_dir}; "
      f"run the same command to resume"
    )
    return {"preempted_at": stopped}

  summary = _summary(
    settings,
    trainer,
    state,
    history,
    loop.speed,
    time.perf_counter() - start,
    batch_at(settings.steps - 1),
  )
  sample = outputs.generate(
    model,
    trainer.gather_params(state),
    PROMPT,
    settings.sample_bytes,
    settings.seq_len,
    seed=settings.seed,
  )
  out = settings.checkpoint_dir.parent
  (out / "sample.txt").write_bytes(PROMPT + sample)
  outputs.plot_losses(
    out / "loss.png", history, f"zjax train: GPT {param_count:,} params, {settings.devices} devices"
  )
  outputs.write_metrics(metrics_path, history, summary, dataclasses.asdict(settings))
  console.print("sample:\n" + (PROMPT + sample).decode("utf-8", errors="replace"))
  console.print(outputs.summary_table(summary))
  console.print(
    f"wrote {out / 'metrics.json'}, {out / 'loss.png'}, {out / 'sample.txt'}; "
    f"checkpoints in {settings.checkpoint_dir}"
  )
  return summary


class TrainingStopped(RuntimeError):
  """Too many skipped steps in a row: the last good state is saved; the message says what
  to check."""


class _Loop:
  """The training steps: progress, skipped-step lines, validation, checkpoints, and the
  save on preemption or on too many skipped steps."""

  def __init__(self, settings, trainer, ckpt, history, metrics_path, evaluate):
    self.settings, self.trainer, self.ckpt = settings, trainer, ckpt
    self.history, self.metrics_path, self.evaluate = history, metrics_path, evaluate
    self.timed_steps, self.timed_seconds, self.speed = 0, 0.0, 0.0

  def run(self, state, first_step, batch_at, progress):
    """-> (state, the step saved on preemption or None)."""
    s = self.settings
    task = progress.add_task(
      "train", total=s.steps, completed=first_step, status="compiling the step...", speed=0.0
    )
    for step in range(first_step, s.steps):
      tick = time.perf_counter()
      try:
        state, metrics = self.trainer.step(state, batch_at(step))
      except zjax.NonFiniteError as e:
        self._skipped(progress, step + 1, e.metrics)
        self._save_and_stop(step + 1, e.state, progress)
        raise TrainingStopped(
          f"{s.max_consecutive_skips} steps in a row (up to step {step + 1}) had a "
          f"non-finite loss or gradient norm and were skipped; the last good state "
          f"(optimizer step {int(e.state.step)}) is saved as step {step + 1} in "
          f"{s.checkpoint_dir}. Check --lr (lower it, or raise --warmup-steps), the data, "
          f"and bf16 overflow (--precision); --max-consecutive-skips sets how many skips "
          f"in a row are tolerated (0: never stop)."
        ) from None
      loss = float(metrics["loss"])  # waits for the step: honest timing
      if step > first_step:  # the first step compiles
        self.timed_steps += 1
        self.timed_seconds += time.perf_counter() - tick
      tokens = s.batch * s.seq_len
      self.speed = tokens * self.timed_steps / self.timed_seconds if self.timed_seconds else 0.0
      done = step + 1
      self.history["train"].append({"step": done, "loss": loss})
      if not bool(metrics["finite"]):
        self._skipped(progress, done, metrics)
      progress.update(task, advance=1, status=f"loss {loss:.4f}", speed=self.speed)
      _log_plain(progress.console, s, done, loss, self.speed)
      if done % s.eval_every == 0 or done == s.steps:
        val = self.evaluate(state)
        self.history["validation"].append({"step": done, "loss": val})
        progress.console.print(f"step {done}: validation loss {val:.4f}")
      if (done % s.checkpoint_every == 0 or done == s.steps) and done not in self.ckpt.all_steps():
        self.ckpt.save(done, state)
      if self.ckpt.save_if_preempted(done, state):
        return state, done
    return state, None

  def _skipped(self, progress, step, metrics):
    loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
    self.history["skipped"].append({"step": step, "loss": loss, "grad_norm": norm})
    progress.console.print(
      f"step {step}: skipped (loss {loss}, gradient norm {norm}: not "
      f"finite); the state is unchanged"
    )

  def _save_and_stop(self, step, state, progress):
    """Too many skipped steps: keep the last good state as `step`, and the curves so far."""
    if step not in self.ckpt.all_steps():
      self.ckpt.save(step, state)
    self.ckpt.wait_until_finished()
    outputs.write_metrics(
      self.metrics_path, self.history, {"stopped_at": step}, dataclasses.asdict(self.settings)
    )
    progress.console.print(
      f"saved the last good state as step {step} to {self.settings.checkpoint_dir}"
    )


def _mesh(num_devices: int, tensor_parallel: int):
  devices = jax.devices()
  if len(devices) < num_devices:
    raise ValueError(
      f"devices {num_devices}: only {len(devices)} {devices[0].platform} "
      f"device(s) are present; use --devices {len(devices)} or fewer."
    )
  if tensor_parallel == 1:
    return jax.make_mesh((num_devices,), ("fsdp",), devices=devices[:num_devices])
  # the tensor axis is GSPMD's inside zjax's shard_map: it must be Auto
  return jax.make_mesh(
    (num_devices // tensor_parallel, tensor_parallel),
    ("fsdp", "tensor"),
    axis_types=(AxisType.Auto, AxisType.Auto),
    devices=devices[:num_devices],
  )


def model_config(settings) -> GPTConfig:
  """The GPT `settings` train (a TrainSettings, or the dict metrics.json keeps of one)."""
  if isinstance(settings, dict):
    settings = settings_lib.TrainSettings(
      **{k: v for k, v in settings.items() if k in settings_lib.FIELDS}
    )
  return GPTConfig(
    vocab_size=corpus_lib.VOCAB_SIZE,
    seq_len=settings.seq_len,
    d_model=settings.d_model,
    n_layer=settings.n_layer,
    n_head=settings.n_head,
    d_ff=settings.d_ff,
    scan_layers=settings.scan,
    logical_axes=settings.tensor_parallel > 1,
    vocab_multiple=settings_lib.VOCAB_MULTIPLE,
  )


def _setup(settings, mesh):
  tp = settings.tensor_parallel > 1
  model = GPT(model_config(settings))
  loss_fn = make_loss_fn(model)
  tokens = jax.ShapeDtypeStruct((settings.batch, settings.seq_len + 1), jnp.int32)
  shapes = jax.eval_shape(
    model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, settings.seq_len), jnp.int32)
  )
  # ZeRO-3 as it is meant for models that do not fit: one block ahead prefetched, a block
  # not kept gathered from forward into backward (re-gathered), small leaves replicated.
  block = 4 * settings.d_model**2 + 2 * settings.d_model * settings.d_ff
  config = zjax.ZeroConfig(
    prefetch_bucket_size=block,
    max_reuse_distance=block,
    param_persistence_threshold=4096,
    compute_dtype="bfloat16" if settings.precision == "bf16" else None,
    roll_layers=settings.roll_layers,
    gather_quantization=_or_none(settings.gather_quantization),
    reduce_quantization=_or_none(settings.reduce_quantization),
    quantization_block=settings.quantization_block,
    tensor_axes=("tensor",) if tp else (),
  )
  schedule = zjax.compile_schedule(
    loss_fn,
    shapes,
    {"tokens": tokens},
    mesh=mesh,
    config=config,
    logical_axis_rules=LOGICAL_AXIS_RULES if tp else None,
  )
  lr = optax.warmup_cosine_decay_schedule(
    0.0,
    settings.lr,
    settings.warmup_steps,
    max(settings.steps, settings.warmup_steps + 1),
    settings.lr * settings.min_lr_ratio,
  )
  optimizer = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=settings.weight_decay)
  )
  trainer = zjax.zero3(
    loss_fn,
    optimizer,
    schedule,
    mesh=mesh,
    max_consecutive_skips=settings.max_consecutive_skips or None,
    offload_optimizer=settings.offload_optimizer,
    offload_params=settings.offload_params,
  )
  leaves = jax.tree.leaves(nn.unbox(shapes))
  count = sum(int(np.prod(x.shape)) for x in leaves)
  return (
    model,
    loss_fn,
    trainer,
    count,
    sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves),
  )


def _start(settings, ckpt, trainer, model, metrics_path, console):
  """-> (the step to continue from, the state, the curves so far): a fresh start, or the
  latest checkpoint (its step counts the batches trained, skipped ones included)."""
  latest = ckpt.latest_step()
  if latest is None:
    tokens = jnp.zeros((1, settings.seq_len), jnp.int32)
    state = trainer.init_from(model.init, jax.random.key(settings.seed), tokens)
    return 0, state, {"train": [], "validation": [], "skipped": []}
  state = ckpt.restore()
  console.print(
    f"resumed from step {latest} in {settings.checkpoint_dir} "
    f"(saved on {_saved_devices(ckpt, latest)} device(s), now "
    f"{settings.devices})"
  )
  return latest, state, outputs.read_history(metrics_path, latest)


def _saved_devices(ckpt, step):
  """Every device of the mesh that saved `step`: the data axes' and the tensor axis's."""
  manifest = ckpt._manifest(step)
  saved = zjax.Schedule.from_json(manifest["schedule"])
  return manifest["num_devices"] * int(np.prod(saved.tensor_sizes, dtype=int))


def _evaluator(loss_fn, trainer, validation, settings):
  grad_step = zjax.value_and_grad(loss_fn, trainer.schedule, mesh=trainer.mesh)
  batches = [
    {
      "tokens": corpus_lib.batch_at(
        validation, i, settings.batch, settings.seq_len, seed=settings.seed + 1
      )
    }
    for i in range(settings.eval_batches)
  ]

  def evaluate(state):  # loss only (the gradients are dropped; one compiled program)
    return float(np.mean([float(grad_step(state.params, b)[0]) for b in batches]))

  return evaluate


def _summary(settings, trainer, state, history, speed, seconds, batch) -> dict:
  """The end-of-run figures. Memory and collectives are those of the step as a GPU orders it
  (hlo.compile_for_analysis); on CPU also those of the program the CPU executed (XLA's own
  compile, where CSE may merge a backward re-gather into a forward gather)."""
  lowered = trainer.lower(state, batch)
  analysis = hlo.compile_for_analysis(lowered)
  memory, executed = analysis.memory_analysis(), hlo.executed(analysis.as_text())
  report = trainer.schedule.report()
  summary = {
    "steps": settings.steps,
    "optimizer_steps": int(state.step),
    "skipped_steps": len(history["skipped"]),
    "final_train_loss": history["train"][-1]["loss"] if history["train"] else float("nan"),
    "final_validation_loss": (
      history["validation"][-1]["loss"] if history["validation"] else float("nan")
    ),
    "tokens_per_second": speed,
    "wall_seconds": seconds,
    "devices": settings.devices,
    "per_device_state_bytes": layout.per_device_bytes(_state_arrays(state)),
    "per_device_state_device_bytes": layout.per_device_bytes(_state_arrays(state), "device"),
    "per_device_state_host_bytes": layout.per_device_bytes(_state_arrays(state), "pinned_host"),
    "step_temp_bytes": int(memory.temp_size_in_bytes),
    "step_argument_bytes": int(memory.argument_size_in_bytes),
    "all_gather_bytes": int(executed.get("all_gather_bytes", 0)),
    "reduce_scatter_bytes": int(executed.get("reduce_scatter_bytes", 0)),
    "all_to_all_bytes": int(executed.get("all_to_all_bytes", 0)),
    "all_reduce_bytes": int(executed.get("all_reduce_bytes", 0)),
    "schedule_collective_bytes": report["all_gather_bytes"]
    + report["reduce_scatter_bytes"]
    + report["all_to_all_bytes"],
  }
  if settings.tensor_parallel > 1:  # the tensor axis's collectives are GSPMD's, apart
    by_axis = hlo.executed_by_axis(analysis.as_text(), dict(trainer.mesh.shape))
    summary.update(
      data_axis_collective_bytes=hlo.bytes_over(
        by_axis, "tensor", over=False, kinds=("all_gather", "reduce_scatter", "all_to_all")
      ),
      tensor_axis_collective_bytes=hlo.bytes_over(by_axis, "tensor"),
      tensor_axis_estimated_bytes=report["tensor_axis_estimated_bytes"],
    )
  if analysis.barriers_kept:  # CPU: what it ran differs from what a GPU runs
    cpu = lowered.compile()
    cpu_executed = hlo.executed(cpu.as_text())
    summary.update(
      cpu_executed_step_temp_bytes=int(cpu.memory_analysis().temp_size_in_bytes),
      cpu_executed_all_gather_count=int(cpu_executed.get("all_gather_count", 0)),
      all_gather_count=int(executed.get("all_gather_count", 0)),
    )
  return summary


def _state_arrays(state):
  return (state.params, state.opt_state, state.masters)


def _or_none(name: str):
  return None if name == "none" else name


def _progress(console, settings):
  return Progress(
    TextColumn("[bold]{task.description}"),
    BarColumn(),
    TextColumn("{task.completed}/{task.total}"),
    TextColumn("{task.fields[status]}"),
    TextColumn("{task.fields[speed]:,.0f} tok/s"),
    TimeRemainingColumn(),
    console=console,
    disable=not console.is_terminal,
  )


def _log_plain(console, settings, step, loss, speed):
  """Without a terminal (CI, logs) the bar is off: a line every log_every steps."""
  if not console.is_terminal and (step % settings.log_every == 0 or step == settings.steps):
    console.print(f"step {step}/{settings.steps}  loss {loss:.4f}  {speed:,.0f} tok/s")
