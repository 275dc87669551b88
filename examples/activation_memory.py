"""Compiled temp per device of the gradient step, zjax (default knobs and
`max_reuse_distance=0`) vs GSPMD FSDP, on the models of tests/real_models.py and the GPT
example (8 simulated CPU devices, each program compiled for analysis: zjax.hlo).

  python examples/activation_memory.py [--models resnet_syncbn bert ...] [--devices 8]
                                       [--json out.json]

Per model: GSPMD's temp, then per zjax setting (the defaults; `max_reuse_distance=0`; that
with `param_persistence_threshold=0`, every parameter sharded; that with
`prefetch_bucket_size=0`) its temp, how many layers rolled and the ratio to GSPMD.
GSPMD FSDP: every parameter sharded along its largest dimension divisible by N, the batch
over the devices, `jax.value_and_grad` jitted (zjax bench's baseline).
"""

import argparse
import functools
import json
import pathlib
import sys

from zjax.cli import devices


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="*", default=None)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--json", default=None, help="also write the rows here")
  return parser.parse_args()


ARGS = parse_args()
devices.setup(ARGS.devices)  # before JAX starts

import jax  # noqa: E402

import zjax  # noqa: E402
from zjax._src.schedule import ir  # noqa: E402
from zjax._src.schedule.render import format_bytes  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import real_models  # noqa: E402

SETTINGS = {  # the defaults; release after every use; that with every parameter sharded; and
  # without prefetch (each bucket gathered at its use only)
  "default": zjax.ZeroConfig(),
  "reuse0": zjax.ZeroConfig(max_reuse_distance=0),
  "sharded": zjax.ZeroConfig(max_reuse_distance=0, param_persistence_threshold=0),
  "lean": zjax.ZeroConfig(
    max_reuse_distance=0, param_persistence_threshold=0, prefetch_bucket_size=0
  ),
}


def gpt_case():
  from zjax.models.gpt import GPT, GPTConfig, make_loss_fn

  cfg = GPTConfig(n_layer=4, d_model=64, n_head=4, d_ff=256, seq_len=32)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (16, cfg.seq_len + 1), 0, cfg.vocab_size)
  params = jax.jit(model.init)(jax.random.key(1), tokens[:, :-1])
  return real_models.Case(make_loss_fn(model), params, {"tokens": tokens})


MODELS = {
  "gpt": gpt_case,
  **real_models.CASES,
  **real_models.STRESS_CASES,
  "llama": real_models.llama,
  "bert": real_models.bert,
  "mlp5": real_models.mlp5,
  # ResNet-18's layout on 32x32 images at a quarter, an eighth and a sixteenth of its
  # width (activations dominate), at half its width on 16x16 images and at its full
  # width (weights dominate)
  "resnet18": real_models.resnet18,
  "resnet18_narrow": functools.partial(real_models.resnet18, width=8),
  "resnet18_w4": functools.partial(real_models.resnet18, width=4),
  "resnet18_wide": functools.partial(real_models.resnet18, width=32, image=16),
  "resnet18_full": functools.partial(real_models.resnet18, width=64),
}


def mesh(axis_type=jax.sharding.AxisType.Explicit):
  return jax.make_mesh(
    (ARGS.devices,), ("fsdp",), devices=jax.devices()[: ARGS.devices], axis_types=(axis_type,)
  )


def args_of(case, params):
  return (params, case.batch) if case.extra is None else (params, case.batch, case.extra)


def zjax_temp(case, config):
  m = mesh()
  schedule = zjax.compile_schedule(
    case.loss_fn, case.params, case.batch, mesh=m, config=config, extra=case.extra
  )
  step = zjax.value_and_grad(case.loss_fn, schedule, mesh=m)
  program = zjax.hlo.compile_for_analysis(
    step.lower(*args_of(case, zjax.shard(case.params, schedule, m)))
  )
  rolled = sum(
    st.length
    for st in schedule.forward
    if st.op == ir.LOOP_OP
    and any(schedule.buckets[b].layers for b in schedule.segments[st.segment].buckets)
  )
  return zjax.hlo.summarize(program)["temp_bytes"], rolled


def gspmd_temp(case):
  return real_models.gspmd_fsdp_temp(case, mesh(jax.sharding.AxisType.Auto))


def main():
  rows = []
  names = ARGS.models or list(MODELS)
  print(
    f"{'model':14} {'gspmd':>10}"
    + "".join(f" {k:>10} {'rolled':>6} {'/gspmd':>6}" for k in SETTINGS),
    flush=True,
  )
  for name in names:
    case = MODELS[name]()
    row = dict(model=name, gspmd_temp=gspmd_temp(case))
    line = f"{name:14} {format_bytes(row['gspmd_temp']):>10}"
    for key, config in SETTINGS.items():
      temp, rolled = zjax_temp(case, config)
      row.update({f"{key}_temp": temp, f"{key}_rolled_layers": rolled})
      line += f" {format_bytes(temp):>10} {rolled:>6} {temp / row['gspmd_temp']:>6.2f}"
    rows.append(row)
    print(line, flush=True)
  if ARGS.json:
    pathlib.Path(ARGS.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
