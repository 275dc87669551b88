"""The shape of zjax's code (issue 45's evidence): lines in zjax/, files over 400 lines, the
longest function, and which files each feature touches.

A line touches a feature when an identifier in its code (not its comments or strings)
names it: tensor parallelism `tensor`, hpZ `secondary`, quantization `quantiz`, offload
`offload`, loops `loop`, `roll` or `scan`. Each feature gets (files, lines) touching it.

  python examples/code_shape.py [ROOT ...]   # each ROOT a checkout (default: this one)
"""

import ast
import io
import pathlib
import re
import sys
import tokenize

FEATURES = {
  "TP": r"tensor",
  "hpZ": r"secondary",
  "quantization": r"quantiz",
  "offload": r"offload",
  "loops": r"loop|roll|scan",
}


def identifiers(text: str) -> dict[int, set[str]]:
  """Line number -> the names in its code, lower-cased (comments and strings left out)."""
  out = {}
  for t in tokenize.generate_tokens(io.StringIO(text).readline):
    if t.type == tokenize.NAME:
      out.setdefault(t.start[0], set()).add(t.string.lower())
  return out


def feature_lines(ids: dict[int, set[str]], pattern: str) -> int:
  return sum(any(re.search(pattern, n) for n in names) for names in ids.values())


def longest_function(path: pathlib.Path, text: str) -> tuple[int, str]:
  out = (0, "")
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      out = max(out, (node.end_lineno - node.lineno + 1, f"{path}:{node.name}"))
  return out


def shape(root: pathlib.Path) -> dict:
  files = sorted((root / "zjax").rglob("*.py"))  # the library, its CLI and bench
  texts = {f.relative_to(root): f.read_text() for f in files}
  lines = {f: len(t.splitlines()) for f, t in texts.items()}
  names = {f: identifiers(t) for f, t in texts.items()}
  return {
    "files": len(files),
    "lines": sum(lines.values()),
    "over 400 lines": sum(n > 400 for n in lines.values()),
    "longest function": max(longest_function(f, t) for f, t in texts.items()),
    **{
      feature: (  # (files, lines) naming it
        sum(feature_lines(ids, pattern) > 0 for ids in names.values()),
        sum(feature_lines(ids, pattern) for ids in names.values()),
      )
      for feature, pattern in FEATURES.items()
    },
  }


if __name__ == "__main__":
  roots = [pathlib.Path(r) for r in sys.argv[1:]] or [pathlib.Path(__file__).parents[1]]
  for root in roots:
    print(root, shape(root))
