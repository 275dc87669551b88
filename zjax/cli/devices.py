"""Device setup for commands that run programs (train, bench), before JAX's backend starts."""

import glob
import importlib.metadata
import os

# On CPU: keep optimization barriers (XLA's CPU pipeline removes them, so CPU programs would
# not keep the order a GPU does, DESIGN.md), and with them kept, use region analysis in copy
# insertion: without it, a loop carrying several values (a rolled run of GQA layers) read
# buffers already reused, giving NaN losses in 5 of 12 steps (measured, jax 0.10.2).
# XLA's CPU runtime also races when a device comes back to a collective of a while loop
# before the others have left it (rendezvous aborts "id < num_threads"). Which programs
# hit it depends on the CPU scheduler: with the concurrency-optimized scheduler off, the
# default `zjax train` aborted in its first steps; on, a rolled GQA test model on 4 devices
# did (tests/conftest.py turns it off for the tests, which that model is one of). The
# commands keep XLA's default scheduler.
CPU_ORDERING_FLAGS = ("--xla_disable_hlo_passes=cse_barrier_expander",
                      "--xla_cpu_copy_insertion_use_region_analysis=true")
_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu")
_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel*", "/dev/vfio/[0-9]*")


def setup(num_devices: int) -> None:
  """`num_devices` simulated CPU devices (the CPU backend only; accelerators are used as
  they are), and, on CPU only, XLA's barrier-removing pass off so that CPU programs keep the
  order a GPU would (DESIGN.md). GPU compilers need that pass (they reject optimization
  barriers left in the program), so it stays on where an accelerator will be used. Must
  run before the first JAX computation."""
  if not accelerator_expected():
    add_xla_flags(CPU_ORDERING_FLAGS)
  import jax
  jax.config.update("jax_num_cpu_devices", max(int(num_devices), 1))


def add_xla_flags(flags) -> None:
  """Append `flags` to XLA_FLAGS (those not already there)."""
  current = os.environ.get("XLA_FLAGS", "")
  missing = [f for f in flags if f not in current]
  os.environ["XLA_FLAGS"] = " ".join([current, *missing]).strip()


def accelerator_expected() -> bool:
  """Whether JAX will pick an accelerator backend, judged before it starts (XLA reads its
  flags once): JAX_PLATFORMS if set, else an installed accelerator plugin and a device."""
  platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms:
    return platforms[0] != "cpu"
  plugins = any((d.metadata["Name"] or "").lower().startswith(_PLUGINS)
                for d in importlib.metadata.distributions())
  return plugins and any(glob.glob(pattern) for pattern in _DEVICE_FILES)
