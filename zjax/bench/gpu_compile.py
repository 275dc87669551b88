"""Part 1 of `zjax bench --suite gpu` ("compile"): zjax's programs compiled by the GPU
compiler for 8 GPUs on one GPU (a mock topology: mock NCCL, real passes, latency-hiding
scheduler and memory assignment), each measured against its schedule's report, against
GSPMD FSDP's program for the same model, and against zjax's own CPU analysis compile of the
same step (`zjax.hlo.compile_for_analysis`, the stand-in every CPU figure rests on).

Run by gpu_suite.py in a process of its own (the mock topology is set before JAX starts):
  python -m zjax.bench.gpu_compile --out DIR [--tiny] [--topology 1x8x1] [--deadline S]
--tiny compiles small models for 8 CPU devices instead (no GPU): every number but the GPU
ones, so that the code path is tested where no GPU is.
"""

import argparse
import dataclasses
import time
from typing import Any, Callable

from zjax.bench import gpu_record

DEVICES = 8
TENSOR = 2  # the (4, 2) (fsdp, tensor) layout
# Tried in order: "slices x hosts per slice x devices per host". One real GPU can stand for
# 8 mocked hosts of one device each; "1x1x8" needs 8 local GPUs.
TOPOLOGIES = ("1x8x1", "8x1x1", "1x1x8")


@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  loss_fn: Callable
  params: Any  # ShapeDtypeStructs (linen boxes allowed)
  batch: Any  # ShapeDtypeStructs, global
  config: Any  # ZeroConfig of the default knobs
  baseline_loss_fn: Callable  # for GSPMD: the same computation on fp32 params
  plan: dict = dataclasses.field(default_factory=dict)  # compile_schedule extras (TP)


def bench_gpt(tiny: bool, tensor: bool = False) -> Model:
  """`zjax bench`'s GPT (8 layers, d_model 128, 16 x 64 tokens; tiny: 2 layers, 32), with
  the bench's knobs; `tensor`: annotated with logical axes (vocab padded for T = 2)."""
  import zjax
  from zjax.models import gpt

  layers, d, batch, seq = (2, 32, 8, 16) if tiny else (8, 128, 16, 64)
  cfg = gpt.GPTConfig(
    n_layer=layers,
    d_model=d,
    d_ff=4 * d,
    seq_len=seq,
    logical_axes=tensor,
    vocab_multiple=TENSOR if tensor else 1,
  )
  loss_fn, params, batch_shapes = gpt.abstract_setup(cfg, batch)
  block = 4 * d**2 + 2 * d * 4 * d
  # tiny: a lower persistence threshold, so that its small blocks are gathered too
  config = zjax.ZeroConfig(
    prefetch_bucket_size=block, param_persistence_threshold=64 if tiny else 4096
  )
  plan = {"logical_axis_rules": gpt.LOGICAL_AXIS_RULES} if tensor else {}
  return Model(
    "gpt" + ("_tp" if tensor else ""), loss_fn, params, batch_shapes, config, loss_fn, plan
  )


def llama(tiny: bool, tensor: bool = False) -> Model:
  """The 1B-class Llama-style model (zjax/models/llama.py), bf16 compute over fp32 masters;
  tiny: a few thousand parameters. `tensor`: Megatron's split by path rules."""
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import zjax
  from zjax.models import llama as lm

  cfg = lm.LLAMA_TINY if tiny else lm.LLAMA_1B
  loss_fn = lm.make_loss_fn(cfg)
  plan = {}
  if tensor:
    plan = {
      "tensor_specs": [
        (r"/(wq|wk|wv|w_gate|w_up)$", P(None, "tensor")),
        (r"/(wo|w_down)$", P("tensor", None)),
        (r"^embed$", P("tensor", None)),
        (r"^head$", P(None, "tensor")),
      ]
    }
  config = zjax.ZeroConfig(compute_dtype=jnp.bfloat16)  # DeepSpeed's defaults otherwise
  if tiny:
    config = dataclasses.replace(config, prefetch_bucket_size=2000, param_persistence_threshold=64)
  return Model(
    "llama" + ("_tp" if tensor else ""),
    loss_fn,
    lm.param_shapes(cfg),
    lm.batch_shapes(cfg, DEVICES),
    config,
    lambda p, b: loss_fn(lm.cast_params(p, jnp.bfloat16), b),
    plan,
  )


def items(tiny: bool) -> list[tuple[str, Callable[[], dict]]]:
  """(name, measure) in priority order: a part cut by its time limit loses the last."""
  gpt_model, llama_model = bench_gpt(tiny), llama(tiny)
  reuse0 = lambda m: dataclasses.replace(m.config, max_reuse_distance=0)  # noqa: E731
  out = []
  for model in (gpt_model, llama_model):
    for roll in (True, False):
      for reuse_name, config in (("reuse0", reuse0(model)), ("default", model.config)):
        if model is llama_model and not roll and reuse_name == "reuse0":
          continue  # (the least informative; compile time goes to HSDP / TP instead)
        name = f"{model.name}_{'rolled' if roll else 'unrolled'}_{reuse_name}"
        config = dataclasses.replace(config, roll_layers=roll)
        out.append((name, lambda m=model, c=config: measure_zjax(m, c, layout="flat")))
    out.append((f"{model.name}_gspmd_fsdp", lambda m=model: measure_gspmd(m)))
  for model, tp in (
    (gpt_model, bench_gpt(tiny, tensor=True)),
    (llama_model, llama(tiny, tensor=True)),
  ):
    out.append(
      (
        f"{model.name}_rolled_default_hsdp",
        lambda m=model: measure_zjax(m, m.config, layout="hsdp"),
      )
    )
    out.append(
      (f"{model.name}_rolled_default_tp", lambda m=tp: measure_zjax(m, m.config, layout="tp"))
    )
  return out


# ---- meshes ---------------------------------------------------------------------------------


def mesh_for(devices, layout: str):
  import jax

  auto = jax.sharding.AxisType.Auto
  if layout == "flat":
    return jax.make_mesh((DEVICES,), ("fsdp",), devices=devices, axis_types=(auto,))
  if layout == "hsdp":
    return jax.make_mesh(
      (2, DEVICES // 2), ("replica", "fsdp"), devices=devices, axis_types=(auto, auto)
    )
  return jax.make_mesh(
    (DEVICES // TENSOR, TENSOR), ("fsdp", "tensor"), devices=devices, axis_types=(auto, auto)
  )


def layout_config(config, layout: str):
  if layout == "hsdp":
    return dataclasses.replace(config, shard_axes=("fsdp",), replicate_axes=("replica",))
  if layout == "tp":
    return dataclasses.replace(config, tensor_axes=("tensor",))
  return config


def data_axes(mesh) -> tuple:
  return tuple(a for a in mesh.axis_names if a != "tensor")


def sharded_batch(batch, mesh):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, P(data_axes(mesh)))
    ),
    batch,
  )


# ---- zjax -----------------------------------------------------------------------------------


def zjax_lowered(model: Model, config, mesh):
  """(schedule, lowered training step: adamw, abstract state, nothing allocated)."""
  import optax

  import zjax

  schedule = zjax.compile_schedule(
    model.loss_fn, model.params, model.batch, mesh=mesh, config=config, **model.plan
  )
  trainer = zjax.zero3(model.loss_fn, optax.adamw(1e-3), schedule, mesh=mesh)
  return schedule, trainer.lower(trainer.abstract_state(), sharded_batch(model.batch, mesh))


def measure_zjax(model: Model, config, layout: str) -> dict:
  import jax

  from zjax import hlo

  config = layout_config(config, layout)
  target = jax.devices()[:DEVICES]
  mesh = mesh_for(target, layout)
  start = time.perf_counter()
  schedule, lowered = zjax_lowered(model, config, mesh)
  planned = time.perf_counter()
  gpu_record.progress("planned", seconds=planned - start)
  program = hlo.compile_for_analysis(lowered)
  compiled = time.perf_counter()
  gpu_record.progress("compiled", seconds=compiled - planned)
  text = program.as_text()
  row = {
    "platform": target[0].platform,
    "mesh": dict(mesh.shape),
    "plan_seconds": planned - start,
    "compile_seconds": compiled - planned,
    **memory(program),
    **report_vs_program(schedule, text, dict(mesh.shape)),
    "barriers_lowered": hlo.barrier_count(lowered.as_text()),
    "barriers_compiled": hlo.barrier_count(text),
    **overlap(text),
  }
  gpu_record.save_text("program", text)
  if target[0].platform != "cpu":  # the stand-in: the same step, CPU analysis compile
    cpu_mesh = mesh_for(jax.devices("cpu")[:DEVICES], layout)
    cpu_schedule, cpu_lowered = zjax_lowered(model, config, cpu_mesh)
    cpu = hlo.compile_for_analysis(cpu_lowered)
    cpu_text = cpu.as_text()
    row["cpu_analysis"] = {
      **memory(cpu),
      **report_vs_program(cpu_schedule, cpu_text, dict(cpu_mesh.shape)),
    }
    row["temp_vs_cpu_analysis"] = row["temp_bytes"] / max(row["cpu_analysis"]["temp_bytes"], 1)
  return row


def memory(program) -> dict:
  m = program.memory_analysis()
  return {
    "temp_bytes": int(m.temp_size_in_bytes),
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "alias_bytes": int(m.alias_size_in_bytes),
  }


def report_vs_program(schedule, text: str, mesh_shape: dict) -> dict:
  """The program's all-gathers and reduce-scatters over the data axes (count and bytes as
  executed) beside the report's, and every collective's bytes per axis."""
  from zjax import hlo

  report = schedule.report()
  program = {
    "all_gather": [0, 0],
    "reduce_scatter": [0, 0],
    "all_reduce": [0, 0],
    "all_to_all": [0, 0],
    "collective_permute": [0, 0],
  }
  by_axis: dict = {}
  for c, times in hlo.executions(text, unknown_trips_once=True):
    axes = hlo.axes_of_groups(c.groups, mesh_shape)
    by_axis.setdefault(c.kind, {})
    by_axis[c.kind][axes] = by_axis[c.kind].get(axes, 0) + times * c.bytes
    if "tensor" in axes.split(" ")[0].split("+"):
      continue
    program[c.kind][0] += times
    program[c.kind][1] += times * c.bytes
  out = {"bytes_by_axis": by_axis}
  for kind in ("all_gather", "reduce_scatter"):
    predicted = [report[f"{kind}_count"], report[f"{kind}_bytes"]]
    out[kind] = {
      "program_count": program[kind][0],
      "program_bytes": program[kind][1],
      "report_count": predicted[0],
      "report_bytes": predicted[1],
      "equal": program[kind] == predicted,
    }
  out["all_reduce_data_axes"] = {
    "program_count": program["all_reduce"][0],
    "program_bytes": program["all_reduce"][1],
  }
  out["report_equal"] = all(out[k]["equal"] for k in ("all_gather", "reduce_scatter"))
  return out


def overlap(text: str) -> dict:
  """zjax's gathers as scheduled: asynchronous ones, and those with compute between their
  start and done (executed counts: a loop body's once per iteration)."""
  from zjax import hlo

  times = hlo.multiplicities(text)
  pairs = hlo.async_collectives(text)
  count = lambda pred: sum(times.get(a.computation) or 1 for a in pairs if pred(a))  # noqa
  sync = sum(
    t for c, t in hlo.executions(text, unknown_trips_once=True) if c.kind == "all_gather"
  ) - count(lambda a: a.kind == "all_gather")
  return {
    "all_gather_async": count(lambda a: a.kind == "all_gather"),
    "all_gather_overlapped": count(lambda a: a.kind == "all_gather" and a.compute_between > 0),
    "all_gather_sync": sync,
    "reduce_scatter_async": count(lambda a: a.kind == "reduce_scatter"),
    "reduce_scatter_overlapped": count(
      lambda a: a.kind == "reduce_scatter" and a.compute_between > 0
    ),
  }


# ---- GSPMD FSDP -----------------------------------------------------------------------------


def measure_gspmd(model: Model) -> dict:
  """JAX's FSDP by sharding annotations: every parameter and its adam moments split along
  their largest dimension divisible by 8, the batch split, jit(value_and_grad + adamw)."""
  import jax
  import optax
  from flax import linen as nn
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from zjax import hlo
  from zjax._src.layout import layout

  target = jax.devices()[:DEVICES]
  mesh = mesh_for(target, "flat")
  optimizer = optax.adamw(1e-3)
  params = nn.unbox(model.params)
  spec = lambda x: NamedSharding(
    mesh,
    layout.largest_dim_spec(x.shape, DEVICES, "fsdp")
    # noqa
    if x.ndim
    else P(),
  )
  place = lambda tree: jax.tree.map(  # noqa: E731
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec(x)), tree
  )
  params = place(params)
  opt_state = place(jax.eval_shape(optimizer.init, params))

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(model.baseline_loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
  step = jax.jit(
    train_step, out_shardings=(*shardings, NamedSharding(mesh, P())), donate_argnums=(0, 1)
  )
  start = time.perf_counter()
  program = step.lower(params, opt_state, sharded_batch(model.batch, mesh)).compile()
  text = program.as_text()
  gpu_record.save_text("program", text)
  executed = hlo.executed(text) if text else {}
  return {
    "platform": target[0].platform,
    "compile_seconds": time.perf_counter() - start,
    **memory(program),
    **{
      k: v
      for k, v in executed.items()
      if k.startswith(("all_gather", "reduce_scatter", "all_reduce"))
    },
    **overlap(text),
  }


# ---- entry ----------------------------------------------------------------------------------


def start_backend(tiny: bool, topology: str | None) -> dict:
  """Configure JAX before it starts: 8 CPU devices (the stand-in's, or tiny's target), and
  unless tiny the mocked 8-GPU topology. Raises if the GPU client does not give 8 devices."""
  import jax

  jax.config.update("jax_num_cpu_devices", DEVICES)
  if tiny:
    jax.config.update("jax_platforms", "cpu")
  else:
    jax.config.update("jax_mock_gpu_topology", topology)
  devices = jax.devices()
  if not tiny and (devices[0].platform != "gpu" or len(devices) < DEVICES):
    raise RuntimeError(
      f"mock topology {topology}: {len(devices)} {devices[0].platform} devices, not {DEVICES} GPUs"
    )
  return {
    "topology": None if tiny else topology,
    "devices": len(devices),
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "addressable": len(jax.local_devices()),
    "processes": jax.process_count(),
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--tiny", action="store_true")
  p.add_argument("--topology", default=TOPOLOGIES[0])
  p.add_argument(
    "--deadline",
    type=float,
    default=1e9,
    help="seconds; items that would start later than this minus --reserve are skipped",
  )
  p.add_argument("--reserve", type=float, default=10.0)
  p.add_argument(
    "--mock-run", action="store_true", help="only try to run a collective under the mock topology"
  )
  args = p.parse_args(argv)
  record = gpu_record.PartRecord(args.out, "mock_run" if args.mock_run else "compile")
  try:
    record.set("backend", start_backend(args.tiny, args.topology))
  except Exception as e:  # noqa: BLE001 (reported; the suite tries the next topology)
    record.fail(f"{type(e).__name__}: {e}")
    return 3
  if args.mock_run:
    record.run_item("psum_over_8", try_mock_run)
  else:
    begin = time.monotonic()
    for name, measure in items(args.tiny):
      if time.monotonic() - begin > args.deadline - args.reserve:
        record.skip(name, "the part's time limit")
        continue
      record.run_item(name, measure)
  record.finish()
  return 0


def try_mock_run() -> dict:
  """Run a psum over the 8 mocked devices from this process (which addresses some of them)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = mesh_for(jax.devices()[:DEVICES], "flat")
  sharding = NamedSharding(mesh, P("fsdp"))
  x = jax.make_array_from_callback((DEVICES, 4), sharding, lambda idx: np.ones((1, 4), np.float32))
  f = jax.jit(
    jax.shard_map(
      lambda a: jax.lax.psum(a, "fsdp"), mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp")
    )
  )
  out = f(x)
  local = [np.asarray(s.data).tolist() for s in out.addressable_shards]
  return {
    "ran": True,
    "local_result": local,
    "expected_if_real": float(DEVICES),
    "note": "mock NCCL moves no data: a result other than 8 shows that",
  }


if __name__ == "__main__":
  raise SystemExit(main())
