"""The `zjax` command."""

import argparse
import sys

from zjax._src.errors import ZjaxError
from zjax.cli import bench_cmd, inspect_cmd, launch_cmd, plan_cmd, train_cmd
from zjax.cli.target import TargetError


def build_parser() -> argparse.ArgumentParser:
  parser = _OneLineParser(prog="zjax", description="ZeRO-3 fully sharded data parallelism for JAX.")
  subparsers = parser.add_subparsers(dest="subcommand", required=True, parser_class=_OneLineParser)
  inspect_cmd.add_parser(subparsers)
  plan_cmd.add_parser(subparsers)
  train_cmd.add_parser(subparsers)
  bench_cmd.add_parser(subparsers)
  launch_cmd.add_parser(subparsers)
  return parser


class _OneLineParser(argparse.ArgumentParser):
  """Usage errors as one line that says what to change (exit code 2)."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.run(args)
  except (ZjaxError, TargetError, ValueError, TypeError) as e:
    print(f"zjax {args.subcommand}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
