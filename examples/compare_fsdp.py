"""zjax vs GSPMD FSDP vs replicated data parallel, side by side, on one mesh and one batch.

For the GPT example (8 layers by default) on 8 simulated CPU devices it prints, per method:
per-device temp and argument bytes (`memory_analysis()`), all-gather / reduce-scatter /
all-reduce counts and bytes (from the compiled HLO), and the step time relative to GSPMD
(median of interleaved rounds A B C A B C ...). Writes the table as JSON with --json.

    python examples/compare_fsdp.py --layers 8 --devices 8 --rounds 7

GSPMD FSDP: every parameter sharded along its largest dimension divisible by N, the batch
sharded, `jax.jit(jax.value_and_grad(loss))` (XLA inserts the collectives). Data parallel:
parameters replicated, batch sharded.
"""

import argparse
import json
import os
import statistics
import sys
import time

_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"  # keep barriers on CPU (DESIGN.md)


def setup_devices(n: int):
  if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
  import jax
  jax.config.update("jax_num_cpu_devices", n)  # simulated devices where the backend is CPU


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--steps-per-round", type=int, default=3)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  setup_devices(args.devices)
  rows = compare(args)
  print(format_table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


def compare(args) -> list[dict]:
  import jax
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from gpt import GPT, GPTConfig, make_loss_fn

  import zjax

  cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, d_ff=4 * args.d_model)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (args.batch, cfg.seq_len + 1), 0,
                              cfg.vocab_size)
  params = model.init(jax.random.key(1), tokens[:, :-1])
  loss_fn, batch = make_loss_fn(model), {"tokens": tokens}
  # GSPMD's classic mode needs Auto axes (Explicit ones reject the embedding gather); zjax
  # runs on either, so all three share this mesh.
  mesh = jax.make_mesh((args.devices,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  # One layer's largest bucket ahead; release after every use (ZeRO-3's memory regime).
  largest = max(p.size for p in jax.tree.leaves(params))
  config = zjax.ZeroConfig(prefetch_bucket_size=largest, max_reuse_distance=0,
                           param_persistence_threshold=4096)
  methods = {
      "zjax": _zjax(loss_fn, params, batch, mesh, config),
      "gspmd_fsdp": _gspmd(loss_fn, params, batch, mesh, shard_params=True),
      "data_parallel": _gspmd(loss_fn, params, batch, mesh, shard_params=False),
  }
  times = _interleaved_times(methods, args.rounds, args.steps_per_round)
  rows = []
  for name, (compiled, call) in methods.items():
    row = {"method": name, **zjax.hlo.summarize(compiled)}
    row["step_seconds_median"] = statistics.median(times[name])
    rows.append(row)
  base = next(r for r in rows if r["method"] == "gspmd_fsdp")
  for r in rows:
    r["time_vs_gspmd"] = r["step_seconds_median"] / base["step_seconds_median"]
    r["temp_vs_gspmd"] = r["temp_bytes"] / base["temp_bytes"]
  return rows


def _zjax(loss_fn, params, batch, mesh, config):
  import zjax
  schedule = zjax.compile_schedule(loss_fn, params, batch, mesh=mesh, config=config)
  step = zjax.value_and_grad(loss_fn, schedule, mesh=mesh)
  sharded = zjax.shard(params, schedule, mesh)
  compiled = step.lower(sharded, batch).compile()
  return compiled, lambda: compiled(sharded, batch)


def _gspmd(loss_fn, params, batch, mesh, shard_params):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = mesh.shape["fsdp"]

  def spec(x):
    dims = [d for d in range(x.ndim) if x.shape[d] % n == 0]
    if not shard_params or not dims:
      return P()
    d = max(dims, key=lambda d: x.shape[d])
    return P(*([None] * d + ["fsdp"]))

  placed = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), params)
  placed_batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp"))), batch)
  shardings = jax.tree.map(lambda x: x.sharding, placed)
  step = jax.jit(jax.value_and_grad(loss_fn), out_shardings=(NamedSharding(mesh, P()),
                                                             shardings))
  compiled = step.lower(placed, placed_batch).compile()
  return compiled, lambda: compiled(placed, placed_batch)


def _interleaved_times(methods, rounds, steps) -> dict[str, list[float]]:
  import jax
  for _, call in methods.values():  # warm up
    jax.block_until_ready(call())
  times = {name: [] for name in methods}
  for _ in range(rounds):
    for name, (_, call) in methods.items():
      start = time.perf_counter()
      for _ in range(steps):
        out = call()
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - start) / steps)
  return times


def format_table(rows) -> str:
  cols = [("method", "method", "{}"), ("temp KiB", "temp_bytes", "{:.0f}"),
          ("arg KiB", "argument_bytes", "{:.0f}"), ("AG", "all_gather_count", "{}"),
          ("AG KiB", "all_gather_bytes", "{:.0f}"), ("RS", "reduce_scatter_count", "{}"),
          ("RS KiB", "reduce_scatter_bytes", "{:.0f}"), ("AR", "all_reduce_count", "{}"),
          ("AR KiB", "all_reduce_bytes", "{:.0f}"), ("temp/gspmd", "temp_vs_gspmd", "{:.2f}"),
          ("time/gspmd", "time_vs_gspmd", "{:.2f}")]
  kib = {"temp_bytes", "argument_bytes", "all_gather_bytes", "reduce_scatter_bytes",
         "all_reduce_bytes"}
  table = [[h for h, _, _ in cols]]
  for r in rows:
    table.append([fmt.format(r[k] / 1024 if k in kib else r[k]) for _, k, fmt in cols])
  widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
  return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table)


if __name__ == "__main__":
  sys.exit(main())
