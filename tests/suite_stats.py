"""Sum the per-test statistics that ZJAX_TEST_STATS=FILE.jsonl writes (tests/conftest.py)
per test file: seconds, tests, XLA compiles (and how many of them the persistent cache
answered), subprocesses. Several files (a before and an after run) print side by side.

  ZJAX_TEST_STATS=/tmp/after.jsonl python -m pytest -q
  python tests/suite_stats.py /tmp/before.jsonl /tmp/after.jsonl
"""

import collections
import json
import sys


def per_file(path):
  files = collections.defaultdict(collections.Counter)
  for line in open(path):
    row = json.loads(line)
    stats = files[row["file"]]
    stats["tests"] += 1
    for key in ("seconds", "compiles", "cache_hits", "subprocesses"):
      stats[key] += row[key]
  return files


def main(paths):
  runs = [per_file(p) for p in paths]
  names = sorted(set().union(*runs), key=lambda f: -max(r[f]["seconds"] for r in runs))
  header = " | ".join(f"{p}: s, tests, compiles (cached), subprocesses" for p in paths)
  print(f"| file | {header} |")
  print("|---|" + "---|" * len(paths))
  for name in names + ["total"]:
    cells = []
    for run in runs:
      s = sum(run.values(), collections.Counter()) if name == "total" else run[name]
      cells.append(
        f"{s['seconds']:.0f}, {s['tests']}, {s['compiles']} ({s['cache_hits']}), "
        f"{s['subprocesses']}"
      )
    print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main(sys.argv[1:])
