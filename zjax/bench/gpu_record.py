"""Results of one part of `zjax bench --suite gpu`, written as they come: a part runs in a
process of its own, which its time limit may kill, so `DIR/parts/PART.json` is rewritten
after every item and the suite reads whatever is there when the process ends."""

import gzip
import json
import os
import time
import traceback

_current = {"dir": None, "item": None, "record": None}


class PartRecord:
  """`DIR/parts/NAME.json`: {"part", "items": {item: result}, "done", "error", ...}."""

  def __init__(self, out_dir: str, part: str):
    self.path = os.path.join(out_dir, "parts", f"{part}.json")
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    _current["dir"] = os.path.join(out_dir, "hlo")
    self.data = {"part": part, "items": {}, "done": False, "started": time.time()}
    _current["record"] = self
    self._write()

  def set(self, key: str, value) -> None:
    self.data[key] = value
    self._write()

  def run_item(self, name: str, measure) -> None:
    """`measure()`'s dict as item `name`, with its seconds; an exception is recorded (type,
    message, the traceback's last lines) and the part goes on with the next item."""
    _current["item"] = name
    self.data.setdefault("progress", {})[name] = {}
    start = time.perf_counter()
    try:
      result = {"status": "ok", **measure()}
    except Exception as e:  # noqa: BLE001 (recorded: one failing item must not end the part)
      result = {
        "status": "error",
        "error": f"{type(e).__name__}: {str(e)[:2000]}",
        "traceback": traceback.format_exc(limit=-6)[-4000:],
      }
    result["seconds"] = time.perf_counter() - start
    self.data["items"][name] = result
    self.data["progress"].pop(name, None)
    self._write()
    _current["item"] = None

  def skip(self, name: str, reason: str) -> None:
    self.data["items"][name] = {"status": "skipped", "reason": reason}
    self._write()

  def fail(self, error: str) -> None:
    self.data["error"] = error
    self._write()

  def finish(self) -> None:
    self.data["done"] = True
    self._write()

  def _write(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, indent=1, default=_plain)
    os.replace(tmp, self.path)  # a reader never sees half a file


def progress(stage: str, **values) -> None:
  """Note how far the current item got (seconds since it began, and `values`), so that a
  part stopped at its limit still says where: DIR/parts/PART.json["progress"][item]."""
  record, item = _current["record"], _current["item"]
  if record is None or item is None:
    return
  record.data["progress"][item][stage] = {
    "at_seconds": time.time() - record.data["started"],
    **values,
  }
  record._write()


def _plain(x):
  try:
    return float(x)
  except (TypeError, ValueError):
    return str(x)


def save_text(suffix: str, text: str) -> None:
  """Keep a compiled program's text (gzip) under DIR/hlo/ITEM_SUFFIX.txt.gz, so that it can
  be analysed again where no GPU is."""
  if _current["dir"] is None or not text:
    return
  os.makedirs(_current["dir"], exist_ok=True)
  name = f"{_current['item'] or 'program'}_{suffix}.txt.gz"
  with gzip.open(os.path.join(_current["dir"], name), "wt") as f:
    f.write(text)


def read_part(out_dir: str, part: str) -> dict | None:
  path = os.path.join(out_dir, "parts", f"{part}.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)
