"""Train a Flax linen GPT with ZeRO-3 using the library API directly (what `zjax train`
does, in 50 lines).

  python examples/train_linen.py --steps 100 --devices 8
"""

import argparse

import jax

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--d-model", type=int, default=128)
args = parser.parse_args()
jax.config.update("jax_num_cpu_devices", args.devices)  # simulated devices (CPU)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zjax  # noqa: E402
from zjax.job.corpus import VOCAB_SIZE, batch_at, stdlib_corpus  # noqa: E402
from zjax.models.gpt import GPT, GPTConfig, make_loss_fn  # noqa: E402

cfg = GPTConfig(
  vocab_size=VOCAB_SIZE,
  seq_len=64,
  d_model=args.d_model,
  n_layer=2,
  n_head=4,
  d_ff=4 * args.d_model,
)
model = GPT(cfg)
loss_fn = make_loss_fn(model)  # (params, batch) -> loss
text = stdlib_corpus(1_000_000).train  # bytes of Python source
batch = lambda step: {"tokens": batch_at(text, step, 16, cfg.seq_len, seed=0)}

# 1. plan: trace the loss and derive the schedule (shapes only; nothing is allocated)
mesh = jax.make_mesh((args.devices,), ("fsdp",))
shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))
# DeepSpeed's default persistence threshold (1e5 elements) would replicate every parameter
# of a model this small; shard everything above 4096 elements instead.
config = zjax.ZeroConfig(param_persistence_threshold=4096)
schedule = zjax.compile_schedule(loss_fn, shapes, batch(0), mesh=mesh, config=config)
report = schedule.report()
print(
  f"{report['num_sharded_params']} of {report['num_params']} parameters sharded; "
  f"{report['all_gather_count']} all-gathers, {report['reduce_scatter_count']} "
  f"reduce-scatters per step"
)

# 2. train: optax on the local shards; the state is sharded from the start
trainer = zjax.zero3(loss_fn, optax.adamw(3e-3), schedule, mesh=mesh)
state = trainer.init_from(model.init, jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))
for step in range(args.steps):
  state, metrics = trainer.step(state, batch(step))
  if step % 10 == 0 or step == args.steps - 1:
    print(f"step {step}: loss {float(metrics['loss']):.3f}")

# 3. use: the natural-shape params work with plain model.apply
params = trainer.gather_params(state)
logits = model.apply(params, batch(0)["tokens"][:1, :-1])
print("logits", logits.shape)
