"""The GPT example trained by several processes as one run (`zjax launch`), or by one.

  zjax launch --nproc 2 --devices-per-process 4 -- python examples/distributed_gpt.py --steps 5
  python examples/distributed_gpt.py --steps 5          # the same run in one process
  ... distributed_gpt.py --hsdp                         # a 2 x 4 mesh: one sharded copy per
                                                        # process ("node"), replicated across
  ... distributed_gpt.py --hpz                          # 2 x 4, storage over both axes,
                                                        # backward re-gathers inside a process

Each process feeds only its rows of every global batch (`zjax.distributed.global_batch`);
process 0 writes the losses and the final params to --out (JSON). With --checkpoint DIR the
run resumes from DIR's latest step, and on SIGTERM (to any process, or to `zjax launch`)
every process saves the same step there and exits 0 (`ckpt.save_if_preempted`).
"""

import argparse
import json
import os
import statistics
import time

import zjax

joined = zjax.distributed.initialize()  # first: before any JAX computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from zjax.models.gpt import GPT, GPTConfig, make_loss_fn  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument(
  "--layers",
  default="2",
  help="layers, or one count per process (a test of the schedule check), e.g. 2,3",
)
p.add_argument("--save", default=None, help="checkpoint directory to save the end state to")
p.add_argument("--restore", default=None, help="checkpoint directory to start from")
p.add_argument("--die-at-step", type=int, default=None, help="process 1 exits there (a test)")
p.add_argument(
  "--fail-at-step",
  type=int,
  default=None,
  help="process 1 raises there, while process 0 waits for it in the step's collectives (a test)",
)
p.add_argument(
  "--hsdp",
  action="store_true",
  help="shard over the devices of a process, replicate across processes (2 x 4 in one process)",
)
p.add_argument(
  "--hpz",
  action="store_true",
  help="hpZ on the --hsdp mesh: storage over both axes, backward re-gathers within a process",
)
p.add_argument(
  "--offload",
  action="store_true",
  help="optimizer offload (fp32 masters and "
  "adam state in host memory), the update streamed in sub-groups",
)
p.add_argument(
  "--offload-params",
  action="store_true",
  help="with --offload: the parameter copies in host memory too (ZeRO-Infinity)",
)
p.add_argument(
  "--checkpoint",
  default=None,
  help="resume from this directory's latest step; "
  "on SIGTERM save the step every process agrees on there and stop",
)
p.add_argument("--out", default=None)
args = p.parse_args()
if not joined:
  from zjax.cli.devices import setup

  setup(8)

layers = [int(x) for x in args.layers.split(",")]
cfg = GPTConfig(
  d_model=32, n_layer=layers[jax.process_index() % len(layers)], n_head=2, d_ff=64, seq_len=16
)
model, batch_size = GPT(cfg), 8
loss_fn = make_loss_fn(model)
two_axes = args.hsdp or args.hpz
config = zjax.ZeroConfig(
  param_persistence_threshold=256,
  replicate_axes=("data",) if two_axes else (),
  secondary_partition=args.hpz,
  sub_group_size=2000 if args.offload else 10**9,
)
if two_axes:  # one row per process: the data axis crosses processes, fsdp stays inside
  nodes = max(jax.process_count(), 2)
  mesh = jax.make_mesh((nodes, jax.device_count() // nodes), ("data", "fsdp"))
else:
  mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
tokens0 = jax.ShapeDtypeStruct((batch_size, cfg.seq_len + 1), jnp.int32)
shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))
schedule = zjax.compile_schedule(loss_fn, shapes, {"tokens": tokens0}, mesh=mesh, config=config)
trainer = zjax.zero3(
  loss_fn,
  optax.adamw(1e-2, eps=1e-6),
  schedule,
  mesh=mesh,
  offload_optimizer=args.offload,
  offload_params=args.offload_params,
)
ckpt = zjax.CheckpointManager(args.checkpoint, trainer) if args.checkpoint else None
first_step = 0
if ckpt is not None and ckpt.latest_step() is not None:  # resume where it stopped
  first_step, state = ckpt.latest_step(), ckpt.restore()
elif args.restore:
  state = zjax.CheckpointManager(args.restore, trainer).restore()
else:
  state = trainer.init_from(model.init, jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))


def local_rows(step):  # the global batch is a function of the step; take this process's rows
  rows = np.random.default_rng(step).integers(0, 257, (batch_size, cfg.seq_len + 1))
  per = batch_size // jax.process_count()
  return {
    "tokens": rows[jax.process_index() * per : (jax.process_index() + 1) * per].astype(np.int32)
  }


losses, seconds, preempted_at = [], [], None
for step in range(first_step, args.steps):
  if args.die_at_step == step and jax.process_index() == 1:
    os._exit(9)  # a crash: no cleanup, no goodbye to the others
  if args.fail_at_step == step and jax.process_index() == 1:
    print(f"failing at step {step} (t={time.time():.1f})", flush=True)
    raise RuntimeError(f"a test's failure at step {step}")  # ends this process at once
  start = time.perf_counter()
  batch = zjax.distributed.global_batch(local_rows(step), mesh, config.data_axes)
  state, metrics = trainer.step(state, batch)
  losses.append(float(metrics["loss"]))  # waits for the step
  seconds.append(time.perf_counter() - start)
  print(f"step {step}: loss {losses[-1]:.5f}", flush=True)
  if ckpt is not None and ckpt.save_if_preempted(step + 1, state):
    preempted_at = step + 1
    print(f"preempted: saved step {preempted_at}", flush=True)
    break
if ckpt is not None:
  ckpt.close()
if len(seconds) > 1:  # the first step compiles
  print(
    f"median step time {statistics.median(seconds[1:]) * 1e3:.1f} ms "
    f"({jax.process_count()} process(es) x {jax.local_device_count()} devices)"
  )
if args.save:
  with zjax.CheckpointManager(args.save, trainer) as ckpt:
    ckpt.save(int(state.step), state)
params = jax.device_get(trainer.gather_params(state))
if args.out and jax.process_index() == 0:
  flat = {
    jax.tree_util.keystr(k): np.asarray(v).tolist()
    for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
  }
  with open(args.out, "w") as f:
    json.dump(
      {
        "losses": losses,
        "params": flat,
        "processes": jax.process_count(),
        "first_step": first_step,
        "preempted_at": preempted_at,
      },
      f,
    )
