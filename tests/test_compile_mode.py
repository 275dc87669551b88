"""The suite compiles with LLVM's optimizations off (`jax_disable_most_optimizations`, set by
conftest.py to halve XLA's compile time). That is only sound if XLA's HLO pipeline is
unchanged by it: the optimized HLO (collectives, barriers, fusions, while loops) and the
memory assignment that the report, memory and exactness tests judge must be the very ones
a fully optimized compile produces, and the numbers must agree to fp32 rounding. Checked
here on programs that stress the pipeline: layers rolled at max_reuse_distance=0 on a
two-axis HSDP mesh (barriers in while bodies) and a ResNet (convolutions, the patch-matmul
rule, batch statistics), each compiled both ways, for running and for analysis."""

import re

import jax
import numpy as np
import pytest

import real_models
import zjax
from helpers import assert_trees_close, fully_optimized_compiles, init
from zjax.models.gpt import GPT, GPTConfig, make_loss_fn


def _gpt_case():
  cfg = GPTConfig(n_layer=3, d_model=32, n_head=4, d_ff=128, seq_len=16)
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (8, cfg.seq_len + 1), 0, cfg.vocab_size)
  params = init(model, jax.random.key(1), tokens[:, :-1])
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  config = zjax.ZeroConfig(
    param_persistence_threshold=1024, max_reuse_distance=0, replicate_axes=("data",)
  )
  return make_loss_fn(model), params, {"tokens": tokens}, None, mesh, config


def _resnet_case():
  case = real_models.resnet18(batch_size=16, width=8, image=16)
  mesh = jax.make_mesh((8,), ("fsdp",))
  config = zjax.ZeroConfig(param_persistence_threshold=0, max_reuse_distance=0)
  return case.loss_fn, case.params, case.batch, case.extra, mesh, config


def _without_metadata(hlo_text):
  """The program itself: no op metadata, no source-location tables (FileNames..StackFrames)."""
  text = re.sub(r", metadata=\{[^}]*\}", "", hlo_text)
  keep = ("HloModule", "%", "ENTRY", "}", "  ")
  return "\n".join(line for line in text.splitlines() if line.startswith(keep))


def _compile(case):
  """(executed program text, its memory, analysis program text, its memory, loss, grads),
  the step built afresh (schedule, placement, jitted step) in the current compile mode."""
  loss_fn, params, batch, extra, mesh, config = case
  args, kw = ((batch,), {}) if extra is None else ((batch, extra), {"extra": extra})
  schedule = zjax.compile_schedule(loss_fn, params, batch, mesh=mesh, config=config, **kw)
  step = zjax.value_and_grad(loss_fn, schedule, mesh=mesh)
  sharded = zjax.shard(params, schedule, mesh)
  lowered = step.lower(sharded, *args)
  executed, analysed = lowered.compile(), zjax.hlo.compile_for_analysis(lowered)
  loss, grads = step(sharded, *args)
  return (
    _without_metadata(executed.as_text()),
    executed.memory_analysis(),
    _without_metadata(analysed.as_text()),
    analysed.memory_analysis(),
    loss if extra is None else loss[0],  # ((loss, new statistics), grads)
    zjax.unshard(grads, schedule),
  )


def _memory(stats):
  fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
  return {f: getattr(stats, f) for f in fields}


@pytest.mark.slow
@pytest.mark.parametrize("build", [_gpt_case, _resnet_case], ids=["gpt-hsdp-reuse0", "resnet"])
def test_the_suites_compile_mode_changes_no_hlo_and_no_memory(build):
  assert jax.config.values["jax_disable_most_optimizations"]  # the suite's mode
  case = build()  # (the model's init: the same arrays for both)
  fast = _compile(case)
  with fully_optimized_compiles():
    full = _compile(case)
  assert "all-gather" in fast[0] and "reduce-scatter" in fast[2]  # the programs compared
  assert fast[0] == full[0], "the executed program's optimized HLO differs"
  assert _memory(fast[1]) == _memory(full[1])
  assert fast[2] == full[2], "the analysis program's optimized HLO differs"
  assert _memory(fast[3]) == _memory(full[3])
  np.testing.assert_allclose(fast[4], full[4], rtol=1e-6)
  assert_trees_close(fast[5], full[5], rtol=1e-5, atol=1e-6)
