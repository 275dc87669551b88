"""`zjax bench --suite gpu --out DIR`: what only a GPU can tell, in one command of under 8
minutes on one H200 (docs/results.md "On an NVIDIA H200" has the figures; docs/cli.md how
to run it). Writes DIR/gpu.json and DIR/gpu.md, rewritten as each part ends, the compiled
programs' text under DIR/hlo/ and each part's log under DIR/logs/.

Parts, each a process of its own with its own time limit (a slow part cannot starve the
rest; what a part measured before its limit is kept):
  probe              versions, the device, its memory
  compile            part 1: zjax's programs compiled for 8 GPUs on one (mock topology)
                     against the report, GSPMD FSDP and the CPU analysis compile
                     (gpu_compile.py)
  mock_run           whether a program runs under the mock topology's NCCL
  single_zjax        part 2: the 1B-class Llama on one GPU, zjax (gpu_execute.py)
  single_plain       part 2: the same, jax.jit(value_and_grad) + optax
  offload_optimizer  part 3: zjax with optimizer offload
  offload_params     part 3: and parameter offload
  offload_budget     part 3: under a device-memory budget between the measured peaks with
                     and without offload: offload fits, no offload does not

Without a GPU (or with --tiny) every part runs on CPU devices with tiny models, and the
GPU-only parts are reported as skipped with the reason: the test suite runs that mode.
The parent process never starts JAX, so each part has the whole device.
"""

import json
import os
import shutil
import subprocess
import sys
import time

from zjax.bench import gpu_record
from zjax.bench.gpu_compile import TOPOLOGIES

# (part, module, arguments, GPU time limit in seconds, needs a GPU). The GPU limits add up
# to 8 minutes; tiny runs (CPU) get TINY_LIMIT each. The compile part's items are in
# priority order (flat layouts first, HSDP and tensor parallel last).
PARTS = (
  ("probe", "zjax.bench.gpu_suite", ["--probe"], 20, False),
  ("compile", "zjax.bench.gpu_compile", [], 150, False),
  ("mock_run", "zjax.bench.gpu_compile", ["--mock-run"], 20, True),
  ("single_zjax", "zjax.bench.gpu_execute", ["--method", "zjax"], 60, False),
  ("single_plain", "zjax.bench.gpu_execute", ["--method", "plain"], 60, False),
  ("offload_optimizer", "zjax.bench.gpu_execute", ["--method", "offload_optimizer"], 55, False),
  ("offload_params", "zjax.bench.gpu_execute", ["--method", "offload_params"], 55, False),
  ("offload_budget", "zjax.bench.gpu_execute", ["--method", "budget"], 60, True),
)
TINY_LIMIT = 300
# Under a mock topology XLA's sharded autotuning waits for autotuning results from the
# mocked processes, which never come (an H200, jaxlib 0.11.2: a compile that takes 6 s
# unmocked did not end in 165 s); each process autotunes everything itself instead.
MOCK_XLA_FLAG = "--xla_gpu_shard_autotuning=false"
MEMORY_FRACTION = 0.95  # of the GPU's memory, for every part but the budget


def run_suite(out: str, tiny: bool | None = None, scale: float = 1.0, log=print) -> dict:
  """Run every part; `tiny` None: tiny exactly when the probe finds no GPU. `scale`
  multiplies every time limit. Returns what gpu.json holds."""
  for folder in ("logs", "parts", "hlo"):  # nothing of an earlier run is read as this one's
    shutil.rmtree(os.path.join(out, folder), ignore_errors=True)
  os.makedirs(os.path.join(out, "logs"))
  results = {
    "command": " ".join(["zjax"] + sys.argv[1:]) if sys.argv else "",
    "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    "parts": {},
  }
  began = time.monotonic()
  probe = _run_part(out, PARTS[0], tiny=bool(tiny), limit=PARTS[0][3] * scale * 2, log=log)
  machine = (probe.get("items") or {}).get("probe") or {}
  results["machine"] = machine
  if tiny is None:
    tiny = machine.get("platform") != "gpu"
  results["tiny"] = tiny
  results["parts"]["probe"] = probe
  _write(out, results)
  for part in PARTS[1:]:
    name, _, _, limit, gpu_only = part
    if tiny and gpu_only:
      results["parts"][name] = {
        "status": "skipped",
        "reason": "needs a GPU (tiny mode: CPU devices)",
      }
    elif name == "compile" and not tiny:
      results["parts"][name] = _compile_with_topologies(out, part, limit * scale, log)
    elif name == "offload_budget":
      results["parts"][name] = _budget(out, part, results["parts"], machine, limit * scale, log)
    else:
      results["parts"][name] = _run_part(
        out, part, tiny, TINY_LIMIT if tiny else limit * scale, log
      )
    results["wall_seconds"] = time.monotonic() - began
    _write(out, results)
  return results


def _run_part(out, part, tiny, limit, log, extra=(), env=None) -> dict:
  """Run one part's process with `limit` seconds; its record, with how it ended."""
  name, module, args, _, _ = part
  command = [sys.executable, "-m", module, "--out", out, *args, *extra] + (
    ["--tiny"] if tiny else []
  )
  child_env = dict(
    os.environ,
    PYTHONUNBUFFERED="1",
    XLA_PYTHON_CLIENT_PREALLOCATE="false",
    XLA_PYTHON_CLIENT_MEM_FRACTION=str(MEMORY_FRACTION),
    **(env or {}),
  )
  start = time.monotonic()
  log(f"[gpu suite] {name}: limit {limit:.0f} s ...")
  with open(os.path.join(out, "logs", f"{name}.log"), "a") as f:
    try:
      rc = subprocess.run(
        command, stdout=f, stderr=subprocess.STDOUT, env=child_env, timeout=limit
      ).returncode
      ended = "exit 0" if rc == 0 else f"exit {rc}"
    except subprocess.TimeoutExpired:
      ended = f"stopped at its time limit ({limit:.0f} s)"
  record = gpu_record.read_part(out, name) or {"items": {}}
  record.update(
    status="ok" if ended == "exit 0" else "incomplete",
    ended=ended,
    wall_seconds=time.monotonic() - start,
  )
  log(f"[gpu suite] {name}: {ended} after {record['wall_seconds']:.0f} s")
  return record


def _compile_with_topologies(out, part, limit, log) -> dict:
  """Part 1 under the first mock topology that gives 8 GPUs (each try a new process)."""
  deadline, attempts = time.monotonic() + limit, []
  for topology in TOPOLOGIES:
    left = deadline - time.monotonic()
    if left < 20:
      break
    record = _run_part(
      out,
      part,
      False,
      left,
      log,
      extra=["--topology", topology, "--deadline", str(left - 5)],
      env={"XLA_FLAGS": _with_flag(MOCK_XLA_FLAG)},
    )
    attempts.append({"topology": topology, "ended": record["ended"], "error": record.get("error")})
    if record.get("backend"):
      record["attempts"] = attempts
      return record
  return {"status": "failed", "attempts": attempts, "items": {}}


def _with_flag(flag: str) -> str:
  return " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), flag]))


def _budget(out, part, parts, machine, limit, log) -> dict:
  """The budget: halfway between the measured peaks with optimizer offload and without."""

  def peak(name):
    items = (parts.get(name) or {}).get("items") or {}
    return next((v.get("peak_device_bytes") for v in items.values()), None)

  with_offload, without = peak("offload_optimizer"), peak("single_zjax")
  total = machine.get("device_memory_bytes")
  if not (with_offload and without and total) or with_offload >= without:
    return {
      "status": "skipped",
      "reason": f"needs both peaks, with offload below without, "
      f"and the device's memory (got {with_offload}, {without}, {total})",
      "items": {},
    }
  budget = (with_offload + without) // 2
  record = _run_part(
    out, part, False, limit, log, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{budget / total:.4f}"}
  )
  record["budget_bytes"] = budget
  return record


def _write(out: str, results: dict) -> None:
  from zjax.bench import gpu_report

  for name, text in (
    ("gpu.json", json.dumps(results, indent=1, default=str)),
    ("gpu.md", gpu_report.markdown(results)),
  ):
    tmp = os.path.join(out, name + ".tmp")
    with open(tmp, "w") as f:
      f.write(text)
    os.replace(tmp, os.path.join(out, name))


# ---- the probe (a part of its own: the parent never starts JAX) -----------------------------


def probe() -> dict:
  import importlib.metadata as md
  import platform

  import jax

  device = jax.devices()[0]
  out = {
    "platform": device.platform,
    "device_kind": device.device_kind,
    "devices": jax.device_count(),
    "python": platform.python_version(),
    "host_cpus": os.cpu_count(),
    "date": time.strftime("%Y-%m-%d"),
  }
  for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
    try:
      out[package] = md.version(package)
    except md.PackageNotFoundError:
      out[package] = None
  stats = device.memory_stats() or {}
  if stats.get("bytes_limit"):
    out["device_bytes_limit"] = int(stats["bytes_limit"])
    out["device_memory_bytes"] = int(stats["bytes_limit"] / MEMORY_FRACTION)
  return out


def main(argv=None) -> int:
  import argparse

  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--probe", action="store_true")
  p.add_argument("--tiny", action="store_true")
  args = p.parse_args(argv)
  if args.tiny:
    import jax

    jax.config.update("jax_platforms", "cpu")
  record = gpu_record.PartRecord(args.out, "probe")
  record.run_item("probe", probe)
  record.finish()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
