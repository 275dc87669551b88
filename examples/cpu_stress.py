"""CPU stress harness: does every kind of zjax program run on XLA's CPU runtime without an
abort, without a non-finite step, and with bitwise the same losses every time, while the
machine is busy?

It starts its own load (busy processes, stopped at the end), runs each case K times, each
run a fresh process on 8 simulated devices, and prints a table: aborts (a crash, a hang
past --timeout, a Python error), non-finite steps, and whether every run's losses equal the
first run's bit for bit (same program, same inputs). Runs share one compilation cache.

  python examples/cpu_stress.py                         # every case K=10 (gpt 20), 4 busy
  python examples/cpu_stress.py --old-flags             # with the XLA flags zjax used to set
  git worktree add /tmp/zjax-old f5ee834 && \
  python examples/cpu_stress.py --zjax-from /tmp/zjax-old   # the code before the fix
  python examples/cpu_stress.py --cases gpt griffin --runs 2 --steps 4 --load 1 --json s.json

Cases: gpt and gpt_scan (what `zjax train` trains, rolled or nn.scan), cli (`zjax train`
itself, default settings), griffin (remat + custom_vjp + inner scan per layer, rolled), t5
(relative position bias, dropout), gqa (the NNX GQA decoder, rolled), qwz_qgz (int8 weight
gathers and gradient all-to-all), hpz (2x4 mesh), offload (optimizer and parameters in host
memory). --old-flags sets `--xla_disable_hlo_passes=cse_barrier_expander
--xla_cpu_copy_insertion_use_region_analysis=true` process-wide and lets it reach the
executed programs (zjax otherwise undoes it, xla_options.py), without the executor's old
chain of collectives. --zjax-from DIR runs the cases with the zjax package of another
checkout: f5ee834, the last commit before the fix, sets those flags itself and chains every
collective after the previous one, the configuration of the aborts and NaNs that
docs/results.md "CPU execution" explains.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD_FLAGS = (
  "--xla_disable_hlo_passes=cse_barrier_expander --xla_cpu_copy_insertion_use_region_analysis=true"
)
CASES = ("gpt", "gpt_scan", "cli", "griffin", "t5", "gqa", "qwz_qgz", "hpz", "offload")
RESULT = "CPU-STRESS-RESULT "  # the worker's last line: this prefix and JSON


# ---- the cases (in the worker process) -------------------------------------------------
def gpt_case(steps, **settings):
  """zjax train's model, knobs, optimizer and batches (zjax/job/run.py)."""
  import jax
  import jax.numpy as jnp

  from zjax.job import corpus, run
  from zjax.job.settings import TrainSettings

  s = TrainSettings(steps=max(steps, 31), **settings)
  model, _, trainer, _, _ = run._setup(s, run._mesh(s.devices, s.tensor_parallel))
  data = corpus.stdlib_corpus(s.corpus_bytes)
  state = trainer.init_from(
    model.init, jax.random.key(s.seed), jnp.zeros((1, s.seq_len), jnp.int32)
  )
  return (
    trainer,
    state,
    lambda step: {"tokens": corpus.batch_at(data.train, step, s.batch, s.seq_len, s.seed)},
  )


def hpz_case(steps):
  """zjax train's GPT and knobs on a 2 x 4 mesh, hpZ (backward re-gathers within "fsdp")."""
  import jax
  import jax.numpy as jnp
  import optax

  import zjax
  from zjax.job import corpus
  from zjax.job.settings import TrainSettings
  from zjax.models.gpt import GPT, GPTConfig, make_loss_fn

  s = TrainSettings()
  cfg = GPTConfig(
    vocab_size=corpus.VOCAB_SIZE,
    seq_len=s.seq_len,
    d_model=s.d_model,
    n_layer=s.n_layer,
    n_head=s.n_head,
    d_ff=s.d_ff,
  )
  model, mesh = GPT(cfg), jax.make_mesh((2, 4), ("data", "fsdp"))
  block = 4 * s.d_model**2 + 2 * s.d_model * s.d_ff
  config = zjax.ZeroConfig(
    prefetch_bucket_size=block,
    max_reuse_distance=block,
    param_persistence_threshold=4096,
    replicate_axes=("data",),
    secondary_partition=True,
  )
  tokens = jax.ShapeDtypeStruct((s.batch, s.seq_len + 1), jnp.int32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, s.seq_len), jnp.int32))
  loss_fn = make_loss_fn(model)
  schedule = zjax.compile_schedule(loss_fn, shapes, {"tokens": tokens}, mesh=mesh, config=config)
  trainer = zjax.zero3(
    loss_fn, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), schedule, mesh=mesh
  )
  data = corpus.stdlib_corpus(s.corpus_bytes)
  state = trainer.init_from(model.init, jax.random.key(0), jnp.zeros((1, s.seq_len), jnp.int32))
  return (
    trainer,
    state,
    lambda step: {"tokens": corpus.batch_at(data.train, step, s.batch, s.seq_len, s.seed)},
  )


def model_case(name):
  """A model of tests/real_models.py, released after every use, adamw with clipping."""
  import jax
  import optax

  import zjax

  sys.path.insert(0, str(ROOT / "tests"))  # the outside-style test models
  import real_models

  case = {**real_models.CASES, **real_models.STRESS_CASES}[name]()
  mesh = jax.make_mesh((8,), ("fsdp",))
  config = zjax.ZeroConfig(param_persistence_threshold=0, max_reuse_distance=0)
  schedule = zjax.compile_schedule(case.loss_fn, case.params, case.batch, mesh=mesh, config=config)
  trainer = zjax.zero3(
    case.loss_fn,
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)),
    schedule,
    mesh=mesh,
  )

  def batch_at(step):  # a fresh dropout key each step (t5); the same data
    return {k: jax.random.fold_in(v, step) if k == "dropout" else v for k, v in case.batch.items()}

  return trainer, trainer.init(case.params), batch_at


BUILDERS = {
  "gpt": lambda steps: gpt_case(steps),
  "gpt_scan": lambda steps: gpt_case(steps, scan=True),
  "qwz_qgz": lambda steps: gpt_case(steps, gather_quantization="int8", reduce_quantization="int8"),
  "offload": lambda steps: gpt_case(steps, offload_optimizer=True, offload_params=True),
  "hpz": hpz_case,
  "griffin": lambda steps: model_case("griffin"),
  "t5": lambda steps: model_case("t5"),
  "gqa": lambda steps: model_case("nnx_gqa"),
}


def worker(case: str, steps: int, old_flags: bool) -> None:
  """One run: train `steps` steps; print the losses (hex, exact) and the non-finite count."""
  from zjax.cli import devices

  devices.setup(8)
  if old_flags:  # let the process-wide flags reach the executed programs, as they used to
    from zjax._src.xla import xla_options

    xla_options.execution_options = lambda: {}
  trainer, state, batch_at = BUILDERS[case](steps)
  losses, nonfinite = [], 0
  for step in range(steps):
    state, metrics = trainer.step(state, batch_at(step))
    losses.append(float(metrics["loss"]).hex())
    nonfinite += not bool(metrics["finite"])
  print(RESULT + json.dumps({"losses": losses, "nonfinite": nonfinite}), flush=True)


# ---- the harness (parent process) ------------------------------------------------------
def one_run(case, args, env) -> dict:
  """Run one case in a fresh process -> {"ok", "why", "losses", "nonfinite", "seconds"}."""
  start = time.perf_counter()
  out_dir = tempfile.mkdtemp(prefix="zjax-stress-") if case == "cli" else None
  command = (
    [sys.executable, "-m", "zjax.cli.main", "train", "--out-dir", out_dir]
    if case == "cli"
    else [sys.executable, __file__, "--worker", case, "--steps", str(args.steps)]
    + (["--old-flags"] if args.old_flags else [])
  )
  try:  # (`python -m` imports from the working directory first)
    proc = subprocess.run(
      command,
      env=env,
      capture_output=True,
      text=True,
      timeout=args.timeout,
      cwd=args.zjax_from or ROOT,
    )
  except subprocess.TimeoutExpired:
    return {
      "ok": False,
      "why": f"hung past {args.timeout:g} s",
      "losses": None,
      "nonfinite": 0,
      "seconds": time.perf_counter() - start,
    }
  seconds = time.perf_counter() - start
  if proc.returncode != 0:
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    why = next(
      (line for line in lines if "Check failed" in line or "timeout" in line.lower()),
      lines[-1] if lines else "",
    )
    return {
      "ok": False,
      "why": f"exit {proc.returncode}: {why[:160]}",
      "losses": None,
      "nonfinite": 0,
      "seconds": seconds,
    }
  if case == "cli":
    metrics = json.loads((pathlib.Path(out_dir) / "metrics.json").read_text())
    losses = [float(row["loss"]).hex() for row in metrics["train"]]
    nonfinite = metrics["summary"].get("skipped_steps", 0)
  else:
    result = json.loads(
      next(line for line in reversed(proc.stdout.splitlines()) if line.startswith(RESULT))[
        len(RESULT) :
      ]
    )
    losses, nonfinite = result["losses"], result["nonfinite"]
  return {"ok": True, "why": "", "losses": losses, "nonfinite": nonfinite, "seconds": seconds}


def start_load(processes: int) -> list:
  return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]


def summarize(case, runs) -> dict:
  finished = [r for r in runs if r["ok"]]
  first = finished[0]["losses"] if finished else None
  return {
    "case": case,
    "runs": len(runs),
    "aborts": len(runs) - len(finished),
    "nonfinite_steps": sum(r["nonfinite"] for r in finished),
    "nonfinite_losses": sum(
      1 for r in finished for h in r["losses"] if not _finite(float.fromhex(h))
    ),
    "deterministic": bool(finished) and all(r["losses"] == first for r in finished),
    "final_loss": float.fromhex(first[-1]) if first else None,
    "median_seconds": statistics.median(r["seconds"] for r in runs),
    "failures": sorted({r["why"] for r in runs if not r["ok"]})[:3],
  }


def _finite(x: float) -> bool:
  return x == x and abs(x) != float("inf")


def print_table(rows, args) -> None:
  flags = (
    "old flags (barriers kept process-wide)"
    if args.old_flags
    else f"zjax from {args.zjax_from}"
    if args.zjax_from
    else "XLA's CPU pipeline"
  )
  print(
    f"\nCPU stress: {flags}; {args.load} busy processes; {args.steps} steps per run "
    f"(cli: zjax train's defaults)"
  )
  print(
    f"{'case':<9} {'runs':>4} {'aborts':>6} {'non-finite':>10} {'bitwise same':>12} "
    f"{'final loss':>10} {'s/run':>6}"
  )
  for r in rows:
    loss = f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-"
    print(
      f"{r['case']:<9} {r['runs']:>4} {r['aborts']:>6} {r['nonfinite_steps']:>10} "
      f"{'yes' if r['deterministic'] else 'NO':>12} {loss:>10} "
      f"{r['median_seconds']:>6.0f}"
    )
    for why in r["failures"]:
      print(f"          {why}")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
  parser.add_argument("--runs", type=int, default=10, help="runs per case (K)")
  parser.add_argument("--gpt-runs", type=int, default=20, help="runs of the gpt case")
  parser.add_argument("--steps", type=int, default=40, help="trainer steps per run")
  parser.add_argument("--load", type=int, default=4, help="busy processes beside the runs")
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
  parser.add_argument("--old-flags", action="store_true", help=OLD_FLAGS)
  parser.add_argument(
    "--zjax-from",
    metavar="DIR",
    help="a checkout whose zjax package the runs import (e.g. an old commit)",
  )
  parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args.worker, args.steps, args.old_flags)
    return 0
  env = {
    **os.environ,
    "JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="zjax-stress-xla-"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "PYTHONPATH": os.pathsep.join(
      filter(None, [args.zjax_from, str(ROOT), os.environ.get("PYTHONPATH")])
    ),
  }
  env["XLA_FLAGS"] = OLD_FLAGS if args.old_flags else ""
  load, rows = start_load(args.load), []
  try:
    for case in args.cases:
      runs = args.gpt_runs if case == "gpt" else args.runs
      results = [one_run(case, args, env) for _ in range(runs)]
      rows.append(summarize(case, results))
      if len(args.cases) > 1:  # progress: each case's row as it finishes
        print_table(rows[-1:], args)
  finally:
    for p in load:
      p.kill()
  print_table(rows, args)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  clean = all(r["aborts"] == 0 and r["nonfinite_steps"] == 0 and r["deterministic"] for r in rows)
  return 0 if clean else 1


if __name__ == "__main__":
  sys.exit(main())
