"""How long a CPU collective across processes waits for a late peer (gloo, jaxlib 0.10.2):
process 1 sleeps before the collective, process 0 reports how it ended.

  zjax launch --nproc 2 --devices-per-process 2 --timeout 100 -- \
      python examples/gloo_late_peer.py reduce_scatter 45

Measured (2026-12-04): reduce_scatter fails after 30.0 s ("Gloo ReduceScatter failed: ...
Read timeout"); all_gather and all_reduce wait the 45 s and finish.
"""

import sys
import time

import zjax

zjax.distributed.initialize()  # first: before any JAX computation

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

COLLECTIVES = {
  "reduce_scatter": lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
  "all_gather": lambda v: jax.lax.all_gather(v, "x", tiled=True),
  "all_reduce": lambda v: jax.lax.psum(v, "x"),
}


def main():
  kind, late = sys.argv[1], float(sys.argv[2])
  mesh = jax.make_mesh((jax.device_count(),), ("x",))
  step = jax.jit(jax.shard_map(COLLECTIVES[kind], mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("x")), np.ones((8 * jax.local_device_count(),), np.float32)
  )
  step(x).block_until_ready()  # compiled, and run once by both processes together
  if jax.process_index() == 1:
    time.sleep(late)
  start = time.time()
  try:
    step(x).block_until_ready()
    print(f"{kind}: finished after {time.time() - start:.1f} s", flush=True)
  except Exception as e:  # noqa: BLE001 (the point is to show the error)
    print(f"{kind}: failed after {time.time() - start:.1f} s: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
  main()
