"""Settings of `zjax train`: an embedded default that finishes in a few minutes on a 2-core
CPU with 8 simulated devices, overridden by a config file (JSON or TOML, same keys) and
then by command-line flags."""

import dataclasses
import json
import pathlib
import tomllib


class SettingsError(ValueError):
  """Bad settings: the message says which one and what to change."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSettings:
  # model (zjax.models.gpt)
  d_model: int = 128
  n_layer: int = 4
  n_head: int = 4
  d_ff: int = 512
  seq_len: int = 128
  scan: bool = False  # stack the blocks with nn.scan (gathered one layer per iteration)
  roll_layers: bool = True  # run the unrolled blocks as one loop (ZeroConfig.roll_layers)
  gather_quantization: str = "none"  # or "int8": ZeRO++ qwZ (ZeroConfig.gather_quantization)
  reduce_quantization: str = "none"  # or "int8", "int4": ZeRO++ qgZ
  quantization_block: int = 256  # values per scale (ZeroConfig.quantization_block)
  offload_optimizer: bool = False  # fp32 masters and adam state in host memory (zero3)
  offload_params: bool = False  # the parameter copies in host memory too (ZeRO-Infinity)
  tensor_parallel: int = 1  # T: a (devices/T, T) mesh of (fsdp, tensor) axes, Megatron-style
  # run
  devices: int = 8  # simulated CPU devices (or the first N accelerators)
  steps: int = 300
  batch: int = 32  # global batch (sequences); a multiple of devices
  lr: float = 3e-3
  warmup_steps: int = 30
  min_lr_ratio: float = 0.1  # cosine decay to lr * this
  weight_decay: float = 0.01
  precision: str = "fp32"  # or "bf16": gather and compute in bf16, fp32 master weights
  seed: int = 0
  corpus_bytes: int = 4_000_000
  eval_every: int = 100
  eval_batches: int = 4
  checkpoint_every: int = 100
  out_dir: str = "zjax_run"  # metrics.json, loss.png, sample.txt, checkpoints/
  resume: bool = True  # continue from the latest checkpoint in out_dir/checkpoints
  sample_bytes: int = 240
  log_every: int = 10  # progress lines when the output is not a terminal
  max_consecutive_skips: int = 10  # stop after this many non-finite steps in a row (0: never)

  def __post_init__(self):
    positive = (
      "d_model",
      "n_layer",
      "n_head",
      "d_ff",
      "seq_len",
      "devices",
      "steps",
      "batch",
      "eval_every",
      "eval_batches",
      "checkpoint_every",
      "corpus_bytes",
      "log_every",
      "quantization_block",
      "tensor_parallel",
    )
    for name in positive:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SettingsError(f"{name} must be a positive integer, got {value!r}.")
    self._check_tensor_parallel()
    data = self.devices // self.tensor_parallel  # the batch is split over the data axis only
    if self.batch % data:
      raise SettingsError(
        f"batch {self.batch} is not divisible by the {data} data-parallel "
        f"devices: use a batch that is a multiple of {data} (e.g. "
        f"--batch {data * max(1, self.batch // data)})."
      )
    if self.d_model % self.n_head:
      raise SettingsError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}.")
    if self.precision not in PRECISIONS:
      raise SettingsError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}.")
    for name, known in (
      ("gather_quantization", GATHER_QUANTIZATIONS),
      ("reduce_quantization", REDUCE_QUANTIZATIONS),
    ):
      if getattr(self, name) not in known:
        raise SettingsError(f"{name} must be one of {list(known)}, got {getattr(self, name)!r}.")
    if self.offload_params and not self.offload_optimizer:
      raise SettingsError(
        "offload_params needs offload_optimizer: pass --offload-optimizer "
        "with --offload-params (or set both in the config file)."
      )
    if not (isinstance(self.lr, (int, float)) and self.lr > 0):
      raise SettingsError(f"lr must be a positive number, got {self.lr!r}.")
    if self.max_consecutive_skips < 0:
      raise SettingsError(
        f"max_consecutive_skips must be >= 0 (0: never stop), got {self.max_consecutive_skips}."
      )
    if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
      raise SettingsError("warmup_steps must be >= 0 and min_lr_ratio in [0, 1].")

  def _check_tensor_parallel(self):
    t = self.tensor_parallel
    if t == 1:
      return
    if self.devices % t:
      raise SettingsError(
        f"tensor_parallel {t} does not divide devices {self.devices}: the "
        f"mesh is (devices / T, T); pick a T that divides {self.devices}."
      )
    for name in ("n_head", "d_ff"):
      if getattr(self, name) % t:
        raise SettingsError(
          f"{name} {getattr(self, name)} is not divisible by "
          f"tensor_parallel {t}: the heads and the MLP width are split "
          f"over the tensor axis; pick a multiple of {t}."
        )
    if VOCAB_MULTIPLE % t:
      raise SettingsError(
        f"tensor_parallel {t} does not divide {VOCAB_MULTIPLE}, the "
        f"multiple the vocab is padded to: use 2, 4, 8, ... up to "
        f"{VOCAB_MULTIPLE}."
      )

  @property
  def checkpoint_dir(self) -> pathlib.Path:
    return pathlib.Path(self.out_dir) / "checkpoints"


# The embedding rows are padded to a multiple of this (the padding ids are masked out of the
# logits), so the vocab splits over any tensor_parallel dividing it and a checkpoint resumes
# under another tensor_parallel.
VOCAB_MULTIPLE = 64
FIELDS = {f.name: f for f in dataclasses.fields(TrainSettings)}
PRECISIONS = ("fp32", "bf16")
GATHER_QUANTIZATIONS = ("none", "int8")
REDUCE_QUANTIZATIONS = ("none", "int8", "int4")
CHOICES = {
  "precision": PRECISIONS,
  "gather_quantization": GATHER_QUANTIZATIONS,
  "reduce_quantization": REDUCE_QUANTIZATIONS,
}
HELP = {  # what each setting does (the flags' help)
  "d_model": "GPT width (embedding size)",
  "n_layer": "GPT blocks",
  "n_head": "attention heads (must divide d_model)",
  "d_ff": "MLP hidden size",
  "seq_len": "context length in bytes",
  "scan": "stack the blocks with nn.scan: zjax gathers one layer per loop iteration "
  "(less memory, faster compile) instead of one segment per block",
  "roll_layers": "run the identical unrolled blocks as one loop, as if scanned "
  "(ZeroConfig.roll_layers); --no-roll-layers: one segment per block",
  "gather_quantization": "ZeRO++ qwZ: int8 weight gathers, block-wise with float32 "
  "scales (ZeroConfig.gather_quantization)",
  "reduce_quantization": "ZeRO++ qgZ: int8 or int4 gradient all-to-all instead of the "
  "reduce-scatter, stochastic rounding (ZeroConfig.reduce_quantization)",
  "quantization_block": "values per float32 scale for both quantizations",
  "offload_optimizer": "ZeRO-Offload: fp32 master shards and adam state in host memory "
  "(pinned_host), parameter copies in the compute dtype on the device",
  "offload_params": "ZeRO-Infinity parameter offload (with --offload-optimizer): the "
  "parameter copies in host memory too, each moved to the device by its "
  "gather",
  "tensor_parallel": "ZeRO-3 x tensor parallelism: a (devices/T, T) mesh of (fsdp, tensor) "
  "axes; the vocab, heads and MLP width split over tensor (Megatron's "
  "layout, from the model's logical axis names), every leaf sharded over "
  "fsdp; the batch is split over fsdp only",
  "devices": "simulated CPU devices, or the first N accelerators",
  "steps": "optimizer steps in all (a resumed run continues up to this step)",
  "batch": "global batch in sequences (a multiple of --devices / --tensor-parallel)",
  "lr": "peak learning rate (adamw, warmup then cosine decay)",
  "warmup_steps": "linear warmup steps",
  "min_lr_ratio": "the cosine decay ends at lr x this",
  "weight_decay": "adamw weight decay",
  "precision": "fp32, or bf16: parameters gathered and computed in bf16 with fp32 master "
  "shards (ZeroConfig.compute_dtype)",
  "seed": "seed of the initial parameters and the batch order",
  "corpus_bytes": "bytes of standard-library source to train on",
  "eval_every": "validate every this many steps",
  "eval_batches": "validation batches per evaluation",
  "checkpoint_every": "checkpoint every this many steps (asynchronously)",
  "out_dir": "where metrics.json, loss.png, sample.txt and checkpoints/ go",
  "resume": "continue from the latest checkpoint in OUT_DIR/checkpoints (on any device "
  "count); --no-resume refuses a directory that holds checkpoints",
  "sample_bytes": "bytes of text to generate at the end",
  "log_every": "progress lines every this many steps when the output is not a terminal",
  "max_consecutive_skips": "stop (saving the last good state) after this many steps in a "
  "row whose loss or gradients were not finite; 0: never",
}


def load_file(path) -> dict:
  """Keys and values of a JSON or TOML config file (checked against the settings)."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise SettingsError(
      f"config file {path} does not exist: pass an existing .json or .toml file to --config."
    )
  text = path.read_text()
  try:
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
  except (ValueError, tomllib.TOMLDecodeError) as e:
    raise SettingsError(
      f"config file {path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {e}."
    ) from None
  if not isinstance(data, dict):
    raise SettingsError(f"config file {path} must hold one object of settings.")
  unknown = sorted(set(data) - set(FIELDS))
  if unknown:
    raise SettingsError(
      f"config file {path} has unknown setting(s) {unknown}; known: {sorted(FIELDS)}."
    )
  return data


def make_settings(file_values: dict, flag_values: dict) -> TrainSettings:
  values = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
  for name, value in values.items():
    expected = type(FIELDS[name].default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
      values[name] = float(value)
    elif not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
      raise SettingsError(f"setting {name} must be a {expected.__name__}, got {value!r}.")
  return TrainSettings(**values)


def check_resume(settings: "TrainSettings") -> None:
  """With resume off, an output directory that already holds checkpoints is refused (a new
  run would collide with their steps)."""
  directory = settings.checkpoint_dir
  if (
    not settings.resume
    and directory.is_dir()
    and any(p.name.isdigit() for p in directory.iterdir())
  ):
    raise SettingsError(
      f"{directory} already holds checkpoints and --no-resume was given: "
      f"choose a new --out-dir, or drop --no-resume to continue that run."
    )


def prepare_directory(directory: pathlib.Path) -> None:
  """Create `directory` (and missing parents) and prove it writable; on failure remove what
  was created and raise SettingsError (nothing is left half-made)."""
  created, probe = [], directory.absolute()
  while not probe.exists():
    created.append(probe)
    probe = probe.parent
  try:
    for path in reversed(created):
      path.mkdir()
    (directory / ".zjax-write-test").touch()
    (directory / ".zjax-write-test").unlink()
  except OSError as e:
    for path in created:
      if path.exists():
        path.rmdir()
    raise SettingsError(
      f"output directory {directory} cannot be created or written "
      f"({e.strerror}): choose another --out-dir."
    ) from None
