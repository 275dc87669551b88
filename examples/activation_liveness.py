"""A probe toward issue 46's activation model: predict the compiled temp of a zjax step from
its traced per-device program alone (no compile), and compare with the analysis compile.

The prediction walks the step's own jaxpr (the shard_map body that zjax runs on each
device) in program order and keeps the peak of live bytes: a value lives from its equation
to its last use; the step's inputs (the shards, the batch) and outputs (the gradient
shards) are left out, as XLA counts them as arguments and outputs, not temp; an output may
take the buffer of an input of its size that dies at its equation (XLA reuses buffers, and
updates a loop's stacked buffers in place); a nested program (a scan body, a vjp's call)
adds its own peak beyond its inputs. What it does not model yet: XLA's fusion, which never
materializes most elementwise intermediates, and its reordering.

  python examples/activation_liveness.py [--devices 8]
"""

import argparse
import dataclasses

from zjax.cli import devices

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=8)
ARGS = parser.parse_args()
devices.setup(ARGS.devices)  # before JAX starts

import jax  # noqa: E402
import jax.extend.core as jex  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import zjax  # noqa: E402
from zjax._src.layout import layout  # noqa: E402
from zjax._src.program.trace import sub_jaxprs  # noqa: E402
from zjax._src.schedule import ir  # noqa: E402
from zjax.models.gpt import GPT, GPTConfig, make_loss_fn  # noqa: E402


def _bytes(v) -> int:
  return ir.aval_bytes(v.aval)


def _vars(atoms) -> list:
  return [v for v in atoms if isinstance(v, jex.Var)]


def peak_bytes(jaxpr, outside=frozenset()) -> int:
  """Peak live bytes while `jaxpr` runs its equations in order (`outside`: values that are
  not temp: the step's arguments and outputs)."""
  last = {v: k for k, eqn in enumerate(jaxpr.eqns) for v in _vars(eqn.invars)}
  last.update((v, len(jaxpr.eqns)) for v in _vars(jaxpr.outvars))
  inputs = list(jaxpr.invars) + list(jaxpr.constvars)
  live = {v: _bytes(v) for v in inputs if v in last and v not in outside}
  total = best = sum(live.values())
  for k, eqn in enumerate(jaxpr.eqns):
    nested = 0
    for _, sub, _ in sub_jaxprs(eqn):
      sub = getattr(sub, "jaxpr", sub)
      nested = max(nested, peak_bytes(sub) - sum(_bytes(v) for v in sub.invars))
    dying = sorted(live[v] for v in dict.fromkeys(_vars(eqn.invars)) if last[v] == k and v in live)
    new = 0
    for v in _vars(eqn.outvars):
      if v in outside:
        continue
      if _bytes(v) in dying:  # takes the buffer of an input dying here
        dying.remove(_bytes(v))
      else:
        new += _bytes(v)
    best = max(best, total + nested + new)
    for v in dict.fromkeys(_vars(eqn.invars)):
      if last[v] == k and v in live:
        total -= live.pop(v)
    for v in _vars(eqn.outvars):
      if last.get(v, -1) > k and v not in outside:
        live[v] = _bytes(v)
        total += live[v]
  return best


def predicted_temp(step, args) -> int:
  """The peak of the step's per-device program (its shard_map body), arguments and outputs
  left out."""
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "shard_map":
        found.append(getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"]))
      for _, sub, _ in sub_jaxprs(eqn):
        visit(getattr(sub, "jaxpr", sub))

  visit(jax.make_jaxpr(step)(*args).jaxpr)
  (body,) = found
  return peak_bytes(body, frozenset(body.invars) | frozenset(_vars(body.outvars)))


def main():
  n = ARGS.devices
  mesh = jax.make_mesh((n,), ("fsdp",))
  print("| GPT | config | predicted temp | compiled temp | ratio |\n|---|---|---|---|---|")
  for d_model, layers in ((128, 8), (256, 4)):
    cfg = GPTConfig(d_model=d_model, n_layer=layers, n_head=4, d_ff=4 * d_model, seq_len=64)
    model = GPT(cfg)
    params = jax.eval_shape(
      lambda model=model, cfg=cfg: model.init(
        jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32)
      )
    )
    batch = {"tokens": jax.ShapeDtypeStruct((8 * n, cfg.seq_len + 1), jnp.int32)}
    base = zjax.ZeroConfig(param_persistence_threshold=1000)
    for name, config in (
      ("unrolled", dataclasses.replace(base, roll_layers=False)),
      ("unrolled, reuse 0", dataclasses.replace(base, roll_layers=False, max_reuse_distance=0)),
      ("rolled", base),
      ("rolled, reuse 0", dataclasses.replace(base, max_reuse_distance=0)),
    ):
      loss = make_loss_fn(model)
      s = zjax.compile_schedule(loss, params, batch, mesh=mesh, config=config)
      step = zjax.value_and_grad(loss, s, mesh=mesh)
      args = (layout.abstract_storage(s, mesh), batch)
      compiled = zjax.hlo.compile_for_analysis(step.lower(*args))
      temp = compiled.memory_analysis().temp_size_in_bytes
      predicted = predicted_temp(step, args)
      print(
        f"| d {d_model}, {layers} layers | {name} | {predicted:,} | {temp:,} | "
        f"{predicted / temp:.2f} |"
      )


if __name__ == "__main__":
  main()
