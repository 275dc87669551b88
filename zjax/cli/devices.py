"""Device setup for commands that run programs (train, bench), before JAX's backend starts."""


def setup(num_devices: int) -> None:
  """`num_devices` simulated CPU devices (the CPU backend only; accelerators are used as
  they are). No XLA flags: zjax runs every program with XLA's own pipeline and keeps the
  schedule's order only in analysis compiles (zjax/_src/xla/xla_options.py). Must run before
  the first JAX computation."""
  import jax

  jax.config.update("jax_num_cpu_devices", max(int(num_devices), 1))
