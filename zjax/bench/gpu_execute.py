"""Parts 2 and 3 of `zjax bench --suite gpu`: one device, executed. The Llama-style model of
zjax/models/llama.py (1B-class; --tiny: a few thousand parameters on one CPU device) in
bf16 compute over fp32 masters, trained with adamw:

  --method zjax               zjax on a one-device mesh (part 2)
  --method plain              jax.jit(jax.value_and_grad) + optax, the same math (part 2)
  --method offload_optimizer  zjax with the masters and adam state in host memory (part 3)
  --method offload_params     the same with the bf16 parameter copies on the host too
  --method budget             (GPU) under a device-memory budget (XLA_PYTHON_CLIENT_MEM_FRACTION
                              set by the suite): optimizer offload, then no offload

Each method runs in a process of its own: `device.memory_stats()` keeps one peak per
process. Step time: the median of timed steps after two warm-up steps, each step waited for.
MFU: model FLOPs per step (zjax/models/llama.py `train_flops_per_token` x tokens) over the
step time and the device's dense bf16 peak (989 TFLOP/s on an H100/H200 SXM).

  python -m zjax.bench.gpu_execute --out DIR --method zjax [--tiny]
"""

import argparse
import statistics
import time

from zjax.bench import gpu_record

PEAK_BF16_FLOPS = 989e12  # dense bf16, H100 / H200 SXM (NVIDIA's datasheet, no sparsity)
BATCH, TINY_BATCH = 8, 2  # sequences per step (x seq_len 1024 tokens; tiny: 16)
STEPS, TINY_STEPS = 5, 2  # timed steps after 2 warm-up steps
# Elements per offload sub-group on the 1B model: 11 groups, two (2.4 GB) on the device at once.
SUB_GROUP = int(1e8)


def _setup(tiny: bool):
  import jax

  if tiny:
    jax.config.update("jax_platforms", "cpu")
  from zjax.models import llama as lm

  cfg = lm.LLAMA_TINY if tiny else lm.LLAMA_1B
  return jax, lm, cfg, (TINY_BATCH if tiny else BATCH)


def _timed(step, state, batch, steps: int):
  """(state, per-step seconds, losses): two warm-up steps, then `steps` each waited for."""
  import jax

  losses, times = [], []
  for i in range(2 + steps):
    start = time.perf_counter()
    state, loss = step(state, batch)
    loss = float(jax.block_until_ready(loss))
    if i >= 2:
      times.append(time.perf_counter() - start)
    losses.append(loss)
    gpu_record.progress(f"step {i}", seconds=time.perf_counter() - start, loss=loss)
  return state, times, losses


def _summary(lm, cfg, batch_size, times, losses, device) -> dict:
  tokens = batch_size * cfg.seq_len
  median = statistics.median(times)
  flops = lm.train_flops_per_token(cfg) * tokens
  out = {
    "params": lm.param_count(cfg),
    "tokens_per_step": tokens,
    "step_seconds": median,
    "step_seconds_min": min(times),
    "step_seconds_max": max(times),
    "tokens_per_second": tokens / median,
    "model_flops_per_step": flops,
    "losses": losses,
  }
  if device.platform == "gpu":
    out["mfu"] = flops / median / PEAK_BF16_FLOPS
  stats = device.memory_stats()
  if stats:
    out["peak_device_bytes"] = int(stats.get("peak_bytes_in_use", 0))
    out["device_bytes_limit"] = int(stats.get("bytes_limit", 0))
  else:
    out["peak_device_bytes_skipped"] = f"{device.platform} devices report no memory_stats()"
  return out


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  out = {}
  for key in (
    "temp_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "host_temp_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
  ):
    if hasattr(m, key):
      out["compiled_" + key.replace("_size_in", "")] = int(getattr(m, key))
  return out


def run_zjax(tiny: bool, offload: str | None = None) -> dict:
  """zjax on one device; `offload`: None, "optimizer" or "params" (both on the host)."""
  jax, lm, cfg, batch_size = _setup(tiny)
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import zjax

  device = jax.devices()[0]
  mesh = jax.make_mesh((1,), ("fsdp",), devices=[device], axis_types=(jax.sharding.AxisType.Auto,))
  config = zjax.ZeroConfig(
    compute_dtype=jnp.bfloat16, sub_group_size=SUB_GROUP if not tiny else 2000
  )
  loss_fn = lm.make_loss_fn(cfg)
  start = time.perf_counter()
  schedule = zjax.compile_schedule(
    loss_fn, lm.param_shapes(cfg), lm.batch_shapes(cfg, batch_size), mesh=mesh, config=config
  )
  trainer = zjax.zero3(
    loss_fn,
    optax.adamw(1e-4),
    schedule,
    mesh=mesh,
    offload_optimizer=offload is not None,
    offload_params=offload == "params",
  )
  planned = time.perf_counter()
  gpu_record.progress("planned", seconds=planned - start)
  state = trainer.init(lm.host_params(cfg))  # numpy: straight to the shards, nothing compiled
  batch = jax.device_put(
    lm.random_batch(cfg, batch_size, jax.random.key(1)), NamedSharding(mesh, P("fsdp"))
  )
  jax.block_until_ready(state)
  initialised = time.perf_counter()
  gpu_record.progress("initialised", seconds=initialised - planned)
  compiled = trainer.lower(state, batch).compile()
  compiled_at = time.perf_counter()
  gpu_record.progress("compiled", seconds=compiled_at - initialised)

  def step(state, batch):
    state, metrics = compiled(state, batch)
    return state, metrics["loss"]

  state, times, losses = _timed(step, state, batch, TINY_STEPS if tiny else STEPS)
  out = {
    "method": "zjax" if offload is None else f"zjax, offload {offload}",
    "plan_seconds": planned - start,
    "init_seconds": initialised - planned,
    "compile_seconds": compiled_at - initialised,
    **_memory(compiled),
    **_summary(lm, cfg, batch_size, times, losses, device),
  }
  if trainer.offload_plan is not None:
    plan = trainer.offload_plan
    out["offload_plan"] = dict(plan)
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch))
    # the device between steps (copies, batch) plus the step's own temp, as compiled
    out["predicted_peak_device_bytes"] = (
      plan["device_bytes"] + batch_bytes + out.get("compiled_temp_bytes", 0)
    )
  return out


def run_plain(tiny: bool) -> dict:
  """jax.jit(value_and_grad) + optax adamw on fp32 params, bf16 compute (the params cast
  inside the loss), everything on the device."""
  jax, lm, cfg, batch_size = _setup(tiny)
  import jax.numpy as jnp
  import optax

  device = jax.devices()[0]
  loss_fn = lm.make_loss_fn(cfg)
  optimizer = optax.adamw(1e-4)
  start = time.perf_counter()
  params = jax.device_put(lm.host_params(cfg))
  opt_state = jax.jit(optimizer.init)(params)
  batch = lm.random_batch(cfg, batch_size, jax.random.key(1))
  jax.block_until_ready((params, opt_state))
  initialised = time.perf_counter()
  gpu_record.progress("initialised", seconds=initialised - start)

  def train_step(carry, batch):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(lambda p, b: loss_fn(lm.cast_params(p, jnp.bfloat16), b))(
      params, batch
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  compiled = jax.jit(train_step, donate_argnums=0).lower((params, opt_state), batch).compile()
  compiled_at = time.perf_counter()
  gpu_record.progress("compiled", seconds=compiled_at - initialised)
  _, times, losses = _timed(compiled, (params, opt_state), batch, TINY_STEPS if tiny else STEPS)
  return {
    "method": "jax.jit(value_and_grad) + optax",
    "init_seconds": initialised - start,
    "compile_seconds": compiled_at - initialised,
    **_memory(compiled),
    **_summary(lm, cfg, batch_size, times, losses, device),
  }


def run_budget(tiny: bool) -> dict:
  """Under the budget the suite set: optimizer offload first (its peak is this process's
  until then), then the step without offload, which should not fit."""
  out = {
    "offload_optimizer": _attempt(lambda: run_zjax(tiny, "optimizer")),
    "no_offload": _attempt(lambda: run_zjax(tiny, None)),
  }
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  out["device_bytes_limit"] = int(stats.get("bytes_limit", 0))
  return out


def _attempt(run) -> dict:
  try:
    return {"fits": True, **run()}
  except Exception as e:  # noqa: BLE001 (an out-of-memory error is the expected answer)
    import gc

    gc.collect()
    text = str(e)
    return {
      "fits": False,
      "out_of_memory": "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower(),
      "error": f"{type(e).__name__}: {text[:1500]}",
    }


METHODS = {
  "zjax": ("single_zjax", lambda tiny: run_zjax(tiny)),
  "plain": ("single_plain", run_plain),
  "offload_optimizer": ("offload_optimizer", lambda tiny: run_zjax(tiny, "optimizer")),
  "offload_params": ("offload_params", lambda tiny: run_zjax(tiny, "params")),
  "budget": ("offload_budget", run_budget),
}


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--method", choices=sorted(METHODS), required=True)
  args = p.parse_args(argv)
  part, run = METHODS[args.method]
  record = gpu_record.PartRecord(args.out, part)
  record.run_item(args.method, lambda: run(args.tiny))
  record.finish()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
