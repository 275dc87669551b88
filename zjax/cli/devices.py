"""Device setup for commands that run programs (train, bench), before JAX's backend starts."""

import glob
import importlib.metadata
import os

BARRIER_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"
_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu")
_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel*", "/dev/vfio/[0-9]*")


def setup(num_devices: int) -> None:
  """`num_devices` simulated CPU devices (the CPU backend only; accelerators are used as
  they are), and, on CPU only, XLA's barrier-removing pass off so that CPU programs keep the
  order a GPU would (DESIGN.md). GPU compilers need that pass (they reject optimization
  barriers left in the program), so it stays on where an accelerator will be used. Must
  run before the first JAX computation."""
  flags = os.environ.get("XLA_FLAGS", "")
  if BARRIER_FLAG not in flags and not accelerator_expected():
    os.environ["XLA_FLAGS"] = (flags + " " + BARRIER_FLAG).strip()
  import jax
  jax.config.update("jax_num_cpu_devices", max(int(num_devices), 1))


def accelerator_expected() -> bool:
  """Whether JAX will pick an accelerator backend, judged before it starts (XLA reads its
  flags once): JAX_PLATFORMS if set, else an installed accelerator plugin and a device."""
  platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms:
    return platforms[0] != "cpu"
  plugins = any((d.metadata["Name"] or "").lower().startswith(_PLUGINS)
                for d in importlib.metadata.distributions())
  return plugins and any(glob.glob(pattern) for pattern in _DEVICE_FILES)
