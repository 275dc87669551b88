"""`zjax train`: the GPT example on standard-library source, with ZeRO-3 on N devices.

The loop: plan the schedule, build (or resume) the sharded state, train with a progress bar,
validate and checkpoint periodically (asynchronously), and finish with the outputs of
outputs.py. Resuming is automatic: a checkpoint directory that holds a step is restored,
whatever device count saved it, and the batches continue where they left off (each batch
is a function of the seed and the step).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

import zjax
from zjax._src import hlo, layout
from zjax.job import corpus as corpus_lib
from zjax.job import outputs
from zjax.models.gpt import GPT, GPTConfig, make_loss_fn

PROMPT = b"def "


def train(settings, console: Console) -> dict:
  """Run the job; returns the summary (also written to OUT_DIR/metrics.json)."""
  start = time.perf_counter()
  mesh = _mesh(settings.devices)
  data = corpus_lib.stdlib_corpus(settings.corpus_bytes)
  console.print(f"corpus: {data.num_files} files of {data.source}, "
                f"{len(data.train):,} train / {len(data.validation):,} validation bytes")
  model, loss_fn, trainer, param_count, param_bytes = _setup(settings, mesh)
  console.print(outputs.plan_table(trainer.schedule, param_count, param_bytes,
                                   settings.offload_optimizer, settings.offload_params))

  settings.checkpoint_dir.mkdir(parents=True, exist_ok=True)
  ckpt = zjax.CheckpointManager(settings.checkpoint_dir, trainer, max_to_keep=2)
  metrics_path = settings.checkpoint_dir.parent / "metrics.json"
  latest = ckpt.latest_step()
  if latest is not None and latest >= settings.steps:  # nothing to train: nothing restored
    ckpt.close()
    console.print(f"already complete: step {latest} of {settings.steps}; nothing to train "
                  f"and {metrics_path} is kept. Raise --steps to train further.")
    return outputs.read_summary(metrics_path)
  state, history = _start(settings, ckpt, trainer, model, metrics_path, console)
  first_step = int(state.step)

  batch_at = lambda step: {"tokens": corpus_lib.batch_at(
      data.train, step, settings.batch, settings.seq_len, settings.seed)}
  evaluate = _evaluator(loss_fn, trainer, data.validation, settings)
  tokens_per_step = settings.batch * settings.seq_len
  timed_steps, timed_seconds, speed = 0, 0.0, 0.0
  with _progress(console, settings) as progress:
    task = progress.add_task("train", total=settings.steps, completed=first_step,
                             status="compiling the step...", speed=0.0)
    for step in range(first_step, settings.steps):
      tick = time.perf_counter()
      state, metrics = trainer.step(state, batch_at(step))
      loss = float(metrics["loss"])  # waits for the step: honest timing
      if step > first_step:  # the first step compiles
        timed_steps, timed_seconds = timed_steps + 1, timed_seconds + time.perf_counter() - tick
      speed = tokens_per_step * timed_steps / timed_seconds if timed_seconds else 0.0
      history["train"].append({"step": step + 1, "loss": loss})
      progress.update(task, advance=1, status=f"loss {loss:.4f}", speed=speed)
      _log_plain(console, settings, step + 1, loss, speed)
      done = step + 1
      if done % settings.eval_every == 0 or done == settings.steps:
        val = evaluate(state)
        history["validation"].append({"step": done, "loss": val})
        progress.console.print(f"step {done}: validation loss {val:.4f}")
      if done % settings.checkpoint_every == 0 or done == settings.steps:
        if done not in ckpt.all_steps():
          ckpt.save(done, state)
  ckpt.wait_until_finished()
  ckpt.close()

  summary = _summary(settings, trainer, state, history, speed, time.perf_counter() - start,
                     batch_at(settings.steps - 1))
  sample = outputs.generate(model, trainer.gather_params(state), PROMPT, settings.sample_bytes,
                            settings.seq_len, seed=settings.seed)
  out = settings.checkpoint_dir.parent
  (out / "sample.txt").write_bytes(PROMPT + sample)
  outputs.plot_losses(out / "loss.png", history,
                      f"zjax train: GPT {param_count:,} params, {settings.devices} devices")
  outputs.write_metrics(metrics_path, history, summary, dataclasses.asdict(settings))
  console.print("sample:\n" + (PROMPT + sample).decode("utf-8", errors="replace"))
  console.print(outputs.summary_table(summary))
  console.print(f"wrote {out / 'metrics.json'}, {out / 'loss.png'}, {out / 'sample.txt'}; "
                f"checkpoints in {settings.checkpoint_dir}")
  return summary


def _mesh(num_devices: int):
  devices = jax.devices()
  if len(devices) < num_devices:
    raise ValueError(f"devices {num_devices}: only {len(devices)} {devices[0].platform} "
                     f"device(s) are present; use --devices {len(devices)} or fewer.")
  return jax.make_mesh((num_devices,), ("fsdp",), devices=devices[:num_devices])


def _setup(settings, mesh):
  cfg = GPTConfig(vocab_size=corpus_lib.VOCAB_SIZE, seq_len=settings.seq_len,
                  d_model=settings.d_model, n_layer=settings.n_layer, n_head=settings.n_head,
                  d_ff=settings.d_ff, scan_layers=settings.scan)
  model = GPT(cfg)
  loss_fn = make_loss_fn(model)
  tokens = jax.ShapeDtypeStruct((settings.batch, settings.seq_len + 1), jnp.int32)
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          jax.ShapeDtypeStruct((1, settings.seq_len), jnp.int32))
  # ZeRO-3 as it is meant for models that do not fit: one block ahead prefetched, a block
  # not kept gathered from forward into backward (re-gathered), small leaves replicated.
  block = 4 * settings.d_model ** 2 + 2 * settings.d_model * settings.d_ff
  config = zjax.ZeroConfig(
      prefetch_bucket_size=block, max_reuse_distance=block, param_persistence_threshold=4096,
      compute_dtype="bfloat16" if settings.precision == "bf16" else None,
      roll_layers=settings.roll_layers,
      gather_quantization=_or_none(settings.gather_quantization),
      reduce_quantization=_or_none(settings.reduce_quantization),
      quantization_block=settings.quantization_block)
  schedule = zjax.compile_schedule(loss_fn, shapes, {"tokens": tokens}, mesh=mesh,
                                   config=config)
  lr = optax.warmup_cosine_decay_schedule(
      0.0, settings.lr, settings.warmup_steps, max(settings.steps, settings.warmup_steps + 1),
      settings.lr * settings.min_lr_ratio)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(lr, weight_decay=settings.weight_decay))
  trainer = zjax.zero3(loss_fn, optimizer, schedule, mesh=mesh,
                       offload_optimizer=settings.offload_optimizer,
                       offload_params=settings.offload_params)
  leaves = jax.tree.leaves(shapes)
  count = sum(int(np.prod(x.shape)) for x in leaves)
  return model, loss_fn, trainer, count, sum(int(np.prod(x.shape)) * x.dtype.itemsize
                                             for x in leaves)


def _start(settings, ckpt, trainer, model, metrics_path, console):
  latest = ckpt.latest_step()
  if latest is None:
    tokens = jnp.zeros((1, settings.seq_len), jnp.int32)
    state = trainer.init_from(model.init, jax.random.key(settings.seed), tokens)
    return state, {"train": [], "validation": []}
  state = ckpt.restore()
  console.print(f"resumed from step {int(state.step)} in {settings.checkpoint_dir} "
                f"(saved on {_saved_devices(ckpt, latest)} device(s), now "
                f"{settings.devices})")
  return state, outputs.read_history(metrics_path, int(state.step))


def _saved_devices(ckpt, step):
  return ckpt._manifest(step)["num_devices"]


def _evaluator(loss_fn, trainer, validation, settings):
  grad_step = zjax.value_and_grad(loss_fn, trainer.schedule, mesh=trainer.mesh)
  batches = [{"tokens": corpus_lib.batch_at(validation, i, settings.batch, settings.seq_len,
                                            seed=settings.seed + 1)}
             for i in range(settings.eval_batches)]

  def evaluate(state):  # loss only (the gradients are dropped; one compiled program)
    return float(np.mean([float(grad_step(state.params, b)[0]) for b in batches]))

  return evaluate


def _summary(settings, trainer, state, history, speed, seconds, batch) -> dict:
  compiled = trainer.step.lower(state, batch).compile()
  memory = compiled.memory_analysis()
  executed = hlo.executed(compiled.as_text())
  report = trainer.schedule.report()
  return {
      "steps": int(state.step),
      "final_train_loss": history["train"][-1]["loss"] if history["train"] else float("nan"),
      "final_validation_loss": (history["validation"][-1]["loss"] if history["validation"]
                                else float("nan")),
      "tokens_per_second": speed,
      "wall_seconds": seconds,
      "devices": settings.devices,
      "per_device_state_bytes": layout.per_device_bytes(_state_arrays(state)),
      "per_device_state_device_bytes": layout.per_device_bytes(_state_arrays(state), "device"),
      "per_device_state_host_bytes": layout.per_device_bytes(_state_arrays(state),
                                                             "pinned_host"),
      "step_temp_bytes": int(memory.temp_size_in_bytes),
      "step_argument_bytes": int(memory.argument_size_in_bytes),
      "all_gather_bytes": int(executed.get("all_gather_bytes", 0)),
      "reduce_scatter_bytes": int(executed.get("reduce_scatter_bytes", 0)),
      "all_to_all_bytes": int(executed.get("all_to_all_bytes", 0)),
      "all_reduce_bytes": int(executed.get("all_reduce_bytes", 0)),
      "schedule_collective_bytes": report["all_gather_bytes"] +
      report["reduce_scatter_bytes"] + report["all_to_all_bytes"],
  }


def _state_arrays(state):
  return (state.params, state.opt_state, state.masters)


def _or_none(name: str):
  return None if name == "none" else name


def _progress(console, settings):
  return Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[status]}"),
                  TextColumn("{task.fields[speed]:,.0f} tok/s"), TimeRemainingColumn(),
                  console=console, disable=not console.is_terminal)


def _log_plain(console, settings, step, loss, speed):
  """Without a terminal (CI, logs) the bar is off: a line every log_every steps."""
  if not console.is_terminal and (step % settings.log_every == 0 or step == settings.steps):
    console.print(f"step {step}/{settings.steps}  loss {loss:.4f}  {speed:,.0f} tok/s")

