"""What zjax.autoconfig chooses for a 70B-class model (examples/llama70b_shapes.py: 80
layers, d_model 8192, a global batch of 8192 sequences of 4096 tokens, bf16 compute, fp32
masters, adam) on 1,024 and 8,192 GPUs of 80 GB, beside what a DeepSpeed ZeRO-3 user would
configure by hand, both priced by the same models (docs/autoconfig.md).

  python examples/autoconfig_70b.py [--cluster h100x8] [--memory 80GB]

The hand configuration follows DeepSpeed's documentation and the Hugging Face integration's
"auto" values: ZeRO-3 over every GPU (no hpZ / MiCS), stage3_prefetch_bucket_size
0.9 * d_model^2, stage3_param_persistence_threshold 10 * d_model, max_live_parameters and
max_reuse_distance at their 1e9 defaults, no offload, and one sequence per GPU per
micro-batch (gradient accumulation makes up the global batch), the usual setting for
70B-class models with 4k sequences.
"""

import argparse
import dataclasses
import time

import llama70b_shapes as shapes
import zjax
from zjax._src.autoconfig.search import describe_choice, predict
from zjax._src.schedule.render import format_bytes


def hand_config(base, d_model):
  return dataclasses.replace(
    base,
    prefetch_bucket_size=int(0.9 * d_model**2),
    param_persistence_threshold=10 * d_model,
    max_live_parameters=int(2e9),  # the embedding (1.05e9 elements) is gathered whole
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cluster", default="h100x8")
  parser.add_argument("--memory", default="80GB")
  parser.add_argument("--devices", type=int, nargs="*", default=[1024, 8192])
  args = parser.parse_args()
  loss_fn, params, batch, base = shapes.llama70b()
  print(
    "| GPUs | who | configuration | predicted peak | predicted step | of which exposed "
    "communication | search |\n|---|---|---|---|---|---|---|"
  )
  for n in args.devices:
    started = time.perf_counter()
    plan = zjax.autoconfig(
      loss_fn,
      params,
      batch,
      device_memory=args.memory,
      num_devices=n,
      config=base,
      cluster=args.cluster,
      platform="gpu",
    )
    seconds = time.perf_counter() - started
    print(
      f"| {n} | zjax | {describe_choice(plan)} | {format_bytes(plan.memory.total)} | "
      f"{plan.time.step:.1f} s | {plan.time.exposed_communication:.1f} s | {seconds:.1f} s |"
    )
    rows = batch["tokens"].shape[0]
    k = rows // n  # one sequence per GPU per micro-batch
    hand = predict(
      loss_fn,
      params,
      batch,
      config=hand_config(base, shapes.D_MODEL),
      axis_sizes={base.shard_axes[0]: n},
      accumulation_steps=k,
      cluster=args.cluster,
      platform="gpu",
    )
    budget = zjax._src.autoconfig.search.parse_bytes(args.memory, "--memory")
    fits = "fits" if hand.memory.total * (1 + plan.margin) <= budget else "over the budget"
    print(
      f"| {n} | DeepSpeed by hand | flat ZeRO-3 over {n}, {k} micro-batches of 1 sequence, "
      f"HF 'auto' knobs | {format_bytes(hand.memory.total)} ({fits}) | "
      f"{hand.time.step:.1f} s | {hand.time.exposed_communication:.1f} s | - |",
      flush=True,
    )
    print()
    print(plan.summary(rejected=6))
    print()


if __name__ == "__main__":
  main()
