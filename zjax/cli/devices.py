"""Device setup for commands that run programs (train, bench), before JAX's backend starts."""

import os

BARRIER_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"


def setup(num_devices: int) -> None:
  """`num_devices` simulated CPU devices (the CPU backend only; accelerators are used as
  they are), and XLA's barrier-removing pass off so that CPU programs keep the order a GPU
  would (DESIGN.md). Must run before the first JAX computation."""
  flags = os.environ.get("XLA_FLAGS", "")
  if BARRIER_FLAG not in flags:
    os.environ["XLA_FLAGS"] = (flags + " " + BARRIER_FLAG).strip()
  import jax
  jax.config.update("jax_num_cpu_devices", max(int(num_devices), 1))
