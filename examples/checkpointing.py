"""Checkpointing the GPT example: save, restore on another device count, export; timed.

Trains the 4-layer GPT example a few steps on 8 simulated devices, saves asynchronously,
restores on 8 and on 4 devices, and exports plain params, printing the save / restore
times and the peak host memory growth of an export in a fresh process next to the
model size.

    python examples/checkpointing.py [--dir /tmp/zjax-ckpt] [--layers 4] [--d-model 128]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--steps", type=int, default=2)
  args = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from devices import setup_devices

  setup_devices(8)
  directory = args.dir or tempfile.mkdtemp(prefix="zjax-ckpt-")
  try:
    for line in run(directory, args):
      print(line, flush=True)
  finally:
    if args.dir is None:
      shutil.rmtree(directory, ignore_errors=True)
  return 0


def run(directory, args):
  import jax
  import numpy as np
  import optax

  import zjax
  from gpt import GPT, GPTConfig, abstract_setup

  cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, d_ff=4 * args.d_model)
  loss, shapes, batch_shapes = abstract_setup(cfg, batch_size=8)

  def trainer_on(n):
    mesh = jax.make_mesh((n,), ("fsdp",), devices=jax.devices()[:n])
    schedule = zjax.compile_schedule(
      loss, shapes, batch_shapes, mesh=mesh, config=zjax.ZeroConfig()
    )
    return zjax.zero3(loss, optax.adamw(1e-3), schedule, mesh=mesh)

  trainer = trainer_on(8)
  tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
  state = trainer.init_from(GPT(cfg).init, jax.random.key(0), tokens[:, :-1])
  for _ in range(args.steps):
    state, metrics = trainer.step(state, {"tokens": tokens})
  jax.block_until_ready(state)
  model_bytes = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(shapes))
  mib = model_bytes / 2**20
  yield f"GPT {args.layers} layers, d_model {args.d_model}: {mib:.2f} MiB of fp32 params" + (
    " (+ 2x adamw)"
  )

  ckpt = zjax.CheckpointManager(directory, trainer, max_to_keep=2)
  ckpt.save(0, state)  # warm-up: compiles the checksum program
  ckpt.wait_until_finished()
  start = time.perf_counter()
  ckpt.save(args.steps, state)
  returned = time.perf_counter() - start
  ckpt.wait_until_finished()
  written = time.perf_counter() - start
  yield f"save: returns after {returned * 1e3:.0f} ms, written after {written * 1e3:.0f} ms"
  for n in (8, 4):
    target = trainer_on(n)
    ckpt.restore(target)  # warm-up compile
    start = time.perf_counter()
    restored = jax.block_until_ready(ckpt.restore(target))
    yield f"restore on {n} devices: {(time.perf_counter() - start) * 1e3:.0f} ms"
  ckpt.close()

  peak, exported_bytes = export_in_fresh_process(directory)
  yield (
    f"export (fresh process, no mesh): peak RSS grew {peak / 2**20:.2f} MiB while "
    f"reading {exported_bytes / 2**20:.2f} MiB of params (largest parameter "
    f"{max(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(shapes)) / 2**20:.2f} MiB)"
  )
  exported = zjax.export_params(directory)
  same = all(
    np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(target.gather_params(restored)))
  )
  yield f"export equals gather_params: {same}"


_EXPORT = """
import sys
import jax, zjax

def status(field):  # kB, from Linux's per-process accounting
  for line in open("/proc/self/status"):
    if line.startswith(field):
      return int(line.split()[1]) * 1024

before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
  f.write("5")  # resets the peak (VmHWM) to the current RSS
params = zjax.export_params(sys.argv[1])
print(status("VmHWM") - before, sum(x.nbytes for x in jax.tree.leaves(params)))
"""


def export_in_fresh_process(directory):
  """(peak RSS growth during export_params, bytes exported), in a process that did nothing
  else (imports done before the baseline)."""
  out = subprocess.run(
    [sys.executable, "-c", _EXPORT, directory],
    capture_output=True,
    text=True,
    check=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  grown, exported = out.stdout.split()[-2:]
  return int(grown), int(exported)


if __name__ == "__main__":
  sys.exit(main())
