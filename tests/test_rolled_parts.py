"""Rolled layers keep every knob: under a max_live_parameters below one whole layer (or
max_reuse_distance / prefetch_bucket_size that release or fetch sub-module by sub-module)
a rolled loop gathers its layer part by part (loop_parts.py), as the unrolled planner
gathers segment by segment.

Each case: rolled == unrolled == plain single-device JAX gradients (fp32 rtol 1e-5), the
compiled collectives equal the report, rolled and unrolled alike, and the peak of live
gathered bytes is no higher rolled than unrolled."""

import dataclasses
import json

import pytest
import real_models
from helpers import assert_parity
from test_rolling import gpt, rolled_lengths

import zjax
from zjax._src import hlo, ir
from zjax._src.errors import ScheduleError
from zjax._src.validate import bucket_elements

MODELS = {"gpt": lambda: real_models.Case(*gpt(2)), "llama": real_models.llama,
          "bert": real_models.bert}


def largest_bucket(case) -> int:
  """The elements of the largest bucket: below it nothing plans, rolled or not."""
  s = zjax.compile_schedule(case.loss_fn, case.params, case.batch, num_devices=8,
                            config=zjax.ZeroConfig(param_persistence_threshold=0))
  return max(bucket_elements(s))


def assert_exact(schedule, compiled):
  report, executed = schedule.report(), hlo.summarize(compiled)
  for kind in ("all_gather", "reduce_scatter"):
    assert (executed[f"{kind}_count"], executed[f"{kind}_bytes"]) == \
        (report[f"{kind}_count"], report[f"{kind}_bytes"]), kind


def rolled_and_unrolled(case, config, n=8):
  out = {}
  for roll in (True, False):
    c = dataclasses.replace(config, roll_layers=roll)
    schedule, compiled = assert_parity(case.loss_fn, case.params, case.batch, n=n, config=c)
    assert_exact(schedule, compiled)
    out[roll] = schedule
  assert out[True].report()["peak_live_param_bytes"] <= \
      out[False].report()["peak_live_param_bytes"]
  return out


def parted_loops(schedule):
  return [st for st in schedule.forward if st.op == ir.LOOP_OP and st.parts]


@pytest.mark.parametrize("leaves", [1, 2])
def test_gpt_at_one_and_two_largest_leaves(leaves):
  case = MODELS["gpt"]()
  cap = leaves * largest_bucket(case)
  out = rolled_and_unrolled(case, zjax.ZeroConfig(param_persistence_threshold=0,
                                                  max_live_parameters=cap))
  assert rolled_lengths(out[True]) == [2]
  if leaves == 1:  # the layer (12,576 elements) does not fit at once: gathered by parts
    assert parted_loops(out[True])


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_point_two_models_at_one_largest_leaf(name):
  case = MODELS[name]()
  config = zjax.ZeroConfig(param_persistence_threshold=0,
                           max_live_parameters=largest_bucket(case))
  out = rolled_and_unrolled(case, config, n=4)
  assert rolled_lengths(out[True]) == [3], out[True].rolling
  assert parted_loops(out[True])


def test_release_after_every_use_without_prefetch_gathers_by_parts():
  """ZeRO-3's leanest regime: every bucket gathered at its use and released after it. A
  whole-layer loop would hold a layer (and prefetch the next); parts hold one sub-module."""
  case = MODELS["gpt"]()
  config = zjax.ZeroConfig(param_persistence_threshold=0, max_reuse_distance=0,
                           prefetch_bucket_size=0)
  out = rolled_and_unrolled(case, config)
  (loop,) = parted_loops(out[True])
  assert len(loop.parts) > 1
  backward = next(st for st in out[True].backward if st.op == ir.LOOP_OP)
  assert [st.part for st in backward.body if st.op == ir.RECOMPUTE_OP] == \
      list(range(len(loop.parts)))


def test_parted_schedule_round_trips_and_edits_are_checked():
  case = MODELS["gpt"]()
  config = zjax.ZeroConfig(param_persistence_threshold=0, max_reuse_distance=0,
                           prefetch_bucket_size=0)
  s = zjax.compile_schedule(case.loss_fn, case.params, case.batch, num_devices=8,
                            config=config)
  assert zjax.Schedule.from_json(s.to_json()) == s
  data = json.loads(s.to_json())
  loop = next(st for st in data["backward"] if st["op"] == ir.LOOP_OP)
  # drop the first re-gather after the first vjp: a later vjp needs it
  first_vjp = next(j for j, st in enumerate(loop["body"]) if st["op"] == "compute")
  j = next(j for j, st in enumerate(loop["body"]) if j > first_vjp and st["op"] == "gather")
  bucket = loop["body"].pop(j)["bucket"]
  release = next(k for k, st in enumerate(loop["body"]) if k >= j and st["op"] == "release"
                 and st["bucket"] == bucket)
  loop["body"].pop(release)
  with pytest.raises(ScheduleError, match="not gathered"):
    zjax.Schedule.from_json(json.dumps(data))


def test_a_leaf_above_the_cap_stays_a_clear_error():
  case = MODELS["gpt"]()
  config = zjax.ZeroConfig(param_persistence_threshold=0,
                           max_live_parameters=largest_bucket(case) - 1)
  with pytest.raises(ScheduleError, match=r"\['embed'\]\['embedding'\].*at least"):
    zjax.compile_schedule(case.loss_fn, case.params, case.batch, num_devices=8,
                          config=config)
