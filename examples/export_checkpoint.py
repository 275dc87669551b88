"""From a zjax checkpoint to plain Flax params: export a `zjax train` checkpoint (or any
zjax.CheckpointManager directory) without devices, save it as a plain orbax checkpoint,
load that back without zjax, and run `model.apply`.

  zjax train --steps 50 --out-dir run && python examples/export_checkpoint.py run
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

import zjax
from zjax.job.run import model_config
from zjax.models.gpt import GPT

parser = argparse.ArgumentParser()
parser.add_argument("run_dir", help="a `zjax train --out-dir` directory")
parser.add_argument(
  "--save-to", default=None, help="plain checkpoint path (default: RUN_DIR/plain_params)"
)
args = parser.parse_args()
run = pathlib.Path(args.run_dir)
save_to = pathlib.Path(args.save_to or run / "plain_params").absolute()

params = zjax.export_params(run / "checkpoints", save_to=save_to)  # numpy, one leaf at a time
print("exported", sum(x.size for x in jax.tree.leaves(params)), "parameters to", save_to)

plain = ocp.StandardCheckpointer().restore(save_to)  # no zjax involved from here on
settings = json.loads((run / "metrics.json").read_text())["settings"]
model = GPT(model_config(settings))  # the GPT those settings train
tokens = jnp.asarray([list(b"def main():")], jnp.int32)
logits = model.apply(plain, tokens)
print("next byte after 'def main():' ->", repr(chr(int(logits[0, -1].argmax()))))
