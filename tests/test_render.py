"""The parameter-use table shows every special case a reviewer must see."""

import flax.linen as nn
import jax
import jax.numpy as jnp

import zjax
from helpers import init
from zjax._src.schedule import render


class Decoder(nn.Module):
  @nn.compact
  def __call__(self, h, w):
    return h @ w.T


class Tied(nn.Module):
  """The decoder uses the encoder's kernel: a use outside the owning module."""

  def setup(self):
    self.enc = nn.Dense(4)
    self.dec = Decoder()

  def __call__(self, x):
    return self.dec(self.enc(x), self.enc.variables["params"]["kernel"])


def test_notes_for_foreign_reused_unused_empty_scalar_int():
  model = Tied()
  x = jnp.ones((2, 4))
  params = {
    "model": init(model, jax.random.key(0), x),
    "unused": jnp.ones(3),
    "empty": jnp.ones((0,)),
    "scale": jnp.float32(1.0),
    "ids": jnp.arange(2),
  }

  def loss(p, x):
    out = model.apply(p["model"], x) * p["scale"] + p["empty"].sum()
    return out[:, p["ids"]].mean()

  trace = zjax.trace_program(loss, params, x)
  schedule = zjax.compile_schedule(loss, params, x, num_devices=8)
  table = render.render_param_table(trace, schedule)
  rows = {line.split()[0]: line for line in table.splitlines()[2:]}
  assert "used by Tied/dec" in rows["['model']['params']['enc']['kernel']"]
  assert "reused x2" in rows["['model']['params']['enc']['kernel']"]
  assert "unused (zero gradient)" in rows["['unused']"]
  assert "empty" in rows["['empty']"]
  assert "scalar" in rows["['scale']"]
  assert "non-float (no gradient)" in rows["['ids']"]
  assert "used by" not in rows["['model']['params']['enc']['bias']"]


def test_format_bytes():
  assert render.format_bytes(0) == "0 B"
  assert render.format_bytes(1536) == "1.5 KiB"
  assert render.format_bytes(3 * 2**30) == "3.0 GiB"
