"""The report against the compiled program for rolled layers: all-gathers (count / bytes)
of the schedule's report and of the gradient step compiled for analysis (zjax.hlo), and
the step's temp, at `max_reuse_distance=0` (prefetch 8 d_model^2 elements) and with the
default knobs, every parameter sharded, 8 simulated CPU devices.

  python examples/rolled_exactness.py [--devices 8]

Models: the test layers of tests/test_rolled_exact.py (GPT-2, Llama and encoder-decoder
blocks) and tests/real_models.py's GPT, Llama, BERT and T5. Run it on an older checkout
(PYTHONPATH=that checkout) for the "before" column of docs/results.md.
"""

import argparse
import pathlib
import sys

from zjax.cli import devices

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=8)
ARGS = parser.parse_args()
devices.setup(ARGS.devices)  # before JAX starts

import zjax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import helpers  # noqa: E402
import real_models  # noqa: E402
import test_rolled_exact as layers  # noqa: E402
from test_rolling import gpt  # noqa: E402


def of_case(make):
  return lambda: (lambda c: (c.loss_fn, c.params, c.batch))(make())


MODELS = {
  "test gpt2": layers.CASES["gpt2"],
  "test llama": layers.CASES["llama"],
  "test encdec": layers.CASES["encdec"],
  "real_models gpt(3)": lambda: gpt(3),
  "real_models llama": of_case(real_models.llama),
  "real_models bert": of_case(real_models.bert),
  "real_models t5": of_case(real_models.t5),
}


def main():
  print("| model | knobs | report AG | compiled AG | RS equal | temp |")
  print("|---|---|---|---|---|---|")
  for name, make in MODELS.items():
    loss_fn, params, batch = make()
    for knobs, kw in layers.CONFIGS.items():
      config = zjax.ZeroConfig(param_persistence_threshold=0, **kw)
      schedule, compiled = helpers.analyse_zjax(
        loss_fn, params, batch, n=ARGS.devices, config=config
      )
      report, got = schedule.report(), zjax.hlo.executed(compiled.as_text())
      rs = all(
        report[f"reduce_scatter_{k}"] == got.get(f"reduce_scatter_{k}", 0)
        for k in ("count", "bytes")
      )
      print(
        f"| {name} | {knobs} | {report['all_gather_count']} / "
        f"{report['all_gather_bytes']:,} | {got.get('all_gather_count', 0)} / "
        f"{got.get('all_gather_bytes', 0):,} | {rs} | "
        f"{compiled.memory_analysis().temp_size_in_bytes / 1024:.0f} KiB |",
        flush=True,
      )


if __name__ == "__main__":
  main()
