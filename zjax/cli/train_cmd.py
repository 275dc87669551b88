"""`zjax train`: train the GPT example on standard-library source with ZeRO-3 (see
zjax/job/). Settings: embedded defaults < --config FILE (JSON or TOML) < flags."""

import argparse
import dataclasses
import sys

from zjax.cli import devices
from zjax.job import settings as settings_lib


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
    "train",
    help="train the GPT example on the Python standard library's source",
    description="Trains a byte-level GPT with ZeRO-3 on N devices (simulated CPU devices "
    "unless accelerators are present), with progress, validation, async "
    "checkpoints and automatic resume; writes metrics.json, loss.png and "
    "sample.txt to --out-dir. With no arguments: a few minutes on 2 CPU cores.",
  )
  p.add_argument(
    "--config",
    metavar="FILE",
    help="JSON or TOML file of settings (same names as the flags, with underscores)",
  )
  for field in dataclasses.fields(settings_lib.TrainSettings):
    flag = "--" + field.name.replace("_", "-")
    text = f"{settings_lib.HELP[field.name]} (default {field.default})"
    if isinstance(field.default, bool):
      p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif field.name in settings_lib.CHOICES:
      p.add_argument(flag, choices=settings_lib.CHOICES[field.name], default=None, help=text)
    else:
      p.add_argument(
        flag, type=type(field.default), default=None, metavar=field.name.upper(), help=text
      )
  p.set_defaults(run=run)


def run(args) -> int:
  flags = {name: getattr(args, name) for name in settings_lib.FIELDS}
  try:
    file_values = settings_lib.load_file(args.config) if args.config else {}
    settings = settings_lib.make_settings(file_values, flags)
    settings_lib.check_resume(settings)
    settings_lib.prepare_directory(settings.checkpoint_dir)
  except settings_lib.SettingsError as e:
    print(f"zjax train: error: {e}", file=sys.stderr)
    return 2
  devices.setup(settings.devices)
  from rich.console import Console  # after the device setup: jax must not start earlier

  from zjax.job.run import TrainingStopped, train

  # piped output (logs, CI): no hard wrap at 80 columns
  console = Console()
  if not console.is_terminal:
    console = Console(width=160, soft_wrap=True)
  try:
    train(settings, console)
  except TrainingStopped as e:  # the last good state is saved; the message says what to check
    print(f"zjax train: error: {e}", file=sys.stderr)
    return 1
  return 0
