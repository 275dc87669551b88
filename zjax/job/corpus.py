"""The training text of `zjax train`: the Python standard library's own source files, read
from the running interpreter's installation (every machine with Python has them; nothing
is downloaded), as bytes.

Files are taken in sorted path order (test suites and site-packages left out) up to a byte
budget; a file goes to validation when a stable hash of its relative path says so (about
1 in 20; with a budget too small for that, the last file), so the split is the same on every
machine with the same Python. Files are joined
with the end-of-text token 256, so the vocabulary is 257 byte-level tokens.
"""

import dataclasses
import hashlib
import os
import pathlib
import sysconfig

import numpy as np

END_OF_TEXT = 256
VOCAB_SIZE = 257
_SKIPPED_DIRS = {"test", "tests", "site-packages", "idlelib", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class Corpus:
  train: np.ndarray  # uint16 tokens
  validation: np.ndarray
  source: str  # where the files came from
  num_files: int


def stdlib_corpus(max_bytes: int) -> Corpus:
  """The first `max_bytes` of standard-library source (sorted by path), split 19:1."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  train, validation, total, count = [], [], 0, 0
  for path in _sources(root):
    relative = path.relative_to(root)
    try:
      data = path.read_bytes()
    except OSError:
      continue
    digest = hashlib.sha256(str(relative.as_posix()).encode()).digest()[0]
    (validation if digest % 20 == 0 else train).append(data)
    total, count = total + len(data), count + 1
    if total >= max_bytes:
      break
  if len(train) > 1 and not validation:  # a small budget: the last file validates
    validation.append(train.pop())
  if not train or not validation:
    raise ValueError(
      f"The standard library at {root} has too little Python source for a "
      f"train/validation split ({count} files); raise corpus_bytes."
    )
  return Corpus(_tokens(train), _tokens(validation), str(root), count)


def _sources(folder: pathlib.Path):
  """The `.py` files under `folder` in sorted path order (as `sorted(folder.rglob("*.py"))`
  orders them: part by part; like it, not into symlinked folders), the skipped folders
  left out, lazily: the walk stops where the byte budget does (listing all of
  site-packages first, as `sorted(rglob)` did, took 0.4 s a run)."""
  try:
    entries = sorted(os.scandir(folder), key=lambda e: e.name)
  except OSError:
    return
  for entry in entries:
    if entry.is_dir(follow_symlinks=False):
      if entry.name not in _SKIPPED_DIRS:
        yield from _sources(pathlib.Path(entry.path))
    elif entry.name.endswith(".py"):
      yield pathlib.Path(entry.path)


def _tokens(documents) -> np.ndarray:
  joined = bytes([0]).join(documents)  # placeholder separators, replaced below
  tokens = np.frombuffer(joined, dtype=np.uint8).astype(np.uint16)
  starts = np.cumsum([len(d) + 1 for d in documents])[:-1] - 1
  tokens[starts] = END_OF_TEXT
  return tokens


def batch_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
  """int32[batch, seq_len + 1] windows of `tokens`, a deterministic function of (seed,
  step): a resumed run sees the batches the uninterrupted run would have."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
  return np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
