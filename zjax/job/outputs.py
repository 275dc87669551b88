"""What `zjax train` shows and writes: the plan vs plain data parallelism at start; the loss
curve (PNG), the metrics (JSON), a generated sample and the summary table at the end."""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from rich.table import Table

from zjax._src.execute import offload_stream
from zjax._src.schedule.render import format_bytes
from zjax._src.train.train import plan_sub_groups
from zjax.job.corpus import END_OF_TEXT

ADAM_STATE_FACTOR = 2  # adam's mu and nu, each shaped like the parameters


def plan_table(
  schedule, num_params: int, param_bytes: int, offloaded: bool = False, params_on_host: bool = False
) -> Table:
  """Predicted per-device state and communication per step: zjax vs plain data parallel
  (replicated params, grads and adam state). Communication as ring traffic: an all-gather
  or reduce-scatter moves about its buffer, an all-reduce twice its buffer."""
  report = schedule.report()
  n = schedule.num_devices
  state = report["state_bytes_per_device"]
  tensor = report.get("tensor_axis_sizes") or {}
  t = math.prod(tensor.values())  # num_devices counts the data axes only
  devices = (
    f"{n} devices" if not tensor else f"{n * t} devices ({n}-way ZeRO-3 x {t}-way tensor parallel)"
  )
  table = Table(
    title=f"Plan: GPT, {num_params:,} parameters ({format_bytes(param_bytes)}), "
    f"{devices}, per device and step"
  )
  table.add_column("")
  table.add_column("zjax (ZeRO-3)", justify="right")
  table.add_column("data parallel", justify="right")
  if offloaded:  # device: parameter copies in the compute dtype; host: masters + adam
    plan = offload_stream.predicted(
      schedule, plan_sub_groups(schedule), ADAM_STATE_FACTOR, params_on_host
    )
    if params_on_host:
      table.add_row("params + masters + adam state (host)", format_bytes(plan["host_bytes"]), "-")
    else:
      table.add_row("params (device copies)", format_bytes(plan["device_bytes"]), "-")
      table.add_row("masters + adam state (host)", format_bytes(plan["host_bytes"]), "-")
    table.add_row(
      f"update: {plan['sub_groups']} sub-group(s), on the device at once",
      format_bytes(plan["stream_device_bytes"]),
      "-",
    )
  table.add_row(
    "params + adam state",
    format_bytes(state * (1 + ADAM_STATE_FACTOR)),
    format_bytes(param_bytes * (1 + ADAM_STATE_FACTOR)),
  )
  table.add_row("gathered params (peak)", format_bytes(report["peak_live_param_bytes"]), "-")
  comm = (
    report["all_gather_bytes"]
    + report["reduce_scatter_bytes"]
    + report["all_to_all_bytes"]
    + report["persistent_grad_all_reduce_bytes"] * 2
  )
  table.add_row("communication (ring traffic)", format_bytes(comm), format_bytes(2 * param_bytes))
  exchanges = (
    f", {report['all_to_all_count']} all-to-all (qgZ)" if report["all_to_all_count"] else ""
  )
  gathers = " (qwZ int8)" if "gather" in report["quantization"] else ""
  table.add_row(
    "collectives",
    f"{report['all_gather_count']} all-gather{gathers}, "
    f"{report['reduce_scatter_count']} reduce-scatter{exchanges}",
    "1 all-reduce",
  )
  return table


# What each summary entry (metrics.json "summary") is, for people.
SUMMARY_LABELS = {
  "steps": "training steps (batches)",
  "optimizer_steps": "optimizer steps taken",
  "skipped_steps": "skipped steps (loss or gradients not finite)",
  "final_train_loss": "final train loss (nats/byte)",
  "final_validation_loss": "final validation loss (nats/byte)",
  "tokens_per_second": "throughput (tokens/s, compile excluded)",
  "wall_seconds": "wall time (s)",
  "devices": "devices",
  "per_device_state_bytes": "state per device (params + adam moments)",
  "per_device_state_device_bytes": "of which in device memory",
  "per_device_state_host_bytes": "of which in host memory (offload_optimizer)",
  "step_temp_bytes": "step scratch memory per device (XLA temp; as a GPU orders the step)",
  "step_argument_bytes": "step inputs per device (state + batch)",
  "all_gather_bytes": "all-gather bytes per step (compiled, as a GPU orders the step)",
  "reduce_scatter_bytes": "reduce-scatter bytes per step (compiled)",
  "all_to_all_bytes": "all-to-all bytes per step (compiled; qgZ)",
  "all_reduce_bytes": "all-reduce bytes per step (compiled)",
  "schedule_collective_bytes": "all-gather + reduce-scatter + all-to-all bytes (schedule)",
  "data_axis_collective_bytes": "... of them over the data axes (compiled; == the schedule)",
  "tensor_axis_collective_bytes": "collective bytes over the tensor axis (compiled; GSPMD's "
  "tensor parallelism)",
  "tensor_axis_estimated_bytes": "... and the schedule's Megatron-style estimate of them",
  "all_gather_count": "all-gathers per step (compiled, as a GPU orders the step)",
  "cpu_executed_all_gather_count": "all-gathers per step the CPU executed (XLA's CPU compile)",
  "cpu_executed_step_temp_bytes": "step scratch memory the CPU executed (XLA's CPU compile)",
}


def summary_table(summary: dict) -> Table:
  table = Table(title="Summary", show_header=False)
  table.add_column("what")
  table.add_column("value", justify="right")
  for key, value in summary.items():
    if isinstance(value, float):
      value = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    elif key.endswith("bytes"):
      value = format_bytes(value)
    table.add_row(SUMMARY_LABELS.get(key, key.replace("_", " ")), str(value))
  return table


def write_metrics(path: pathlib.Path, history: dict, summary: dict, settings: dict) -> None:
  """metrics.json, written whole to a temporary file and renamed (never half-written)."""
  temporary = path.with_suffix(".json.tmp")
  temporary.write_text(json.dumps({"settings": settings, "summary": summary, **history}, indent=1))
  temporary.replace(path)


def read_summary(path: pathlib.Path) -> dict:
  """The summary an earlier run wrote ({} when there is none)."""
  try:
    return json.loads(path.read_text()).get("summary", {})
  except (OSError, ValueError):
    return {}


def read_history(path: pathlib.Path, up_to_step: int) -> dict:
  """The train/validation curves of an earlier run, up to the step it resumes from."""
  empty = {"train": [], "validation": [], "skipped": []}
  if not path.is_file():
    return empty
  try:
    data = json.loads(path.read_text())
  except ValueError:
    return empty
  return {key: [row for row in data.get(key, []) if row["step"] <= up_to_step] for key in empty}


def plot_losses(path: pathlib.Path, history: dict, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  train = history["train"]
  ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
  val = history["validation"]
  if val:
    ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per byte)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def generate(
  model,
  params,
  prompt: bytes,
  num_bytes: int,
  seq_len: int,
  temperature: float = 0.8,
  seed: int = 0,
) -> bytes:
  """Sample `num_bytes` bytes after `prompt` from the trained model (on one device)."""
  params = jax.device_put(jax.device_get(params), jax.devices()[0])
  logits_at = jax.jit(lambda p, tokens, i: model.apply(p, tokens)[0, i])
  tokens = list(prompt)
  key = jax.random.key(seed)
  for _ in range(num_bytes):
    window = tokens[-seq_len:]
    padded = np.zeros((1, seq_len), np.int32)
    padded[0, : len(window)] = window
    logits = logits_at(params, jnp.asarray(padded), len(window) - 1)
    key, sub = jax.random.split(key)
    token = int(jax.random.categorical(sub, logits / temperature))
    if token == END_OF_TEXT:
      break
    tokens.append(token)
  return bytes(tokens[len(prompt) :])
