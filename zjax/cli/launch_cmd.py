"""`zjax launch`: run P processes of a script on this machine as one jax.distributed run
(in the spirit of torchrun): coordinator address and process ids set for
`zjax.distributed.initialize()`, output streamed with a process prefix, non-zero exit if any
process fails; when one fails, the others get `--timeout` seconds before they are killed.
SIGTERM (a scheduler's preemption notice) is passed on to every process."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from zjax import distributed


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
    "launch",
    help="run a script as P local processes of one jax.distributed run",
    description="zjax launch --nproc P --devices-per-process D -- python script.py ARGS. "
    "The script calls zjax.distributed.initialize() first.",
  )
  p.add_argument("--nproc", type=int, required=True, help="number of processes P")
  p.add_argument(
    "--devices-per-process",
    type=int,
    default=1,
    help="simulated CPU devices per process (the CPU backend only)",
  )
  p.add_argument(
    "--timeout",
    type=float,
    default=60.0,
    help="seconds the others get after one process fails, and the "
    "jax.distributed initialization / heartbeat timeout",
  )
  p.add_argument("command", nargs="+", help="the command, after --")
  p.set_defaults(run=run)


def run(args) -> int:
  if args.nproc < 1:
    raise ValueError(f"--nproc must be a positive number of processes, got {args.nproc}.")
  if args.devices_per_process < 1:
    raise ValueError(
      f"--devices-per-process must be a positive integer, got {args.devices_per_process}."
    )
  if not args.timeout > 0:
    raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout:g}.")
  address = f"127.0.0.1:{_free_port()}"
  processes = []
  for rank in range(args.nproc):
    env = {
      **os.environ,
      distributed.ENV_COORDINATOR: address,
      distributed.ENV_NUM_PROCESSES: str(args.nproc),
      distributed.ENV_PROCESS_ID: str(rank),
      distributed.ENV_LOCAL_DEVICES: str(args.devices_per_process),
      distributed.ENV_TIMEOUT: str(args.timeout),
    }
    proc = subprocess.Popen(
      args.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    threading.Thread(target=_stream, args=(proc, rank), daemon=True).start()
    processes.append(proc)
  signal.signal(signal.SIGTERM, lambda *_: _pass_on(processes, signal.SIGTERM))
  return _wait(processes, args.timeout)


def _pass_on(processes, signum) -> None:
  """A scheduler's preemption notice (SIGTERM) goes to every process: JAX's preemption
  service then has them all save the same step (zjax.CheckpointManager.save_if_preempted)."""
  print(
    f"zjax launch: {signal.Signals(signum).name}: passed on to the {len(processes)} processes",
    file=sys.stderr,
    flush=True,
  )
  for p in processes:
    if p.poll() is None:
      p.send_signal(signum)


def _stream(proc, rank):
  for line in proc.stdout:
    sys.stdout.write(f"[p{rank}] {line}")
    sys.stdout.flush()


def _wait(processes, timeout) -> int:
  """0 if every process succeeds; else the first failure's code, after giving the others
  `timeout` seconds to finish (they are killed after that)."""
  failed_at, code, reported = None, 0, set()
  while True:
    codes = [p.poll() for p in processes]  # one look, so that processes that end together
    for rank, c in enumerate(codes):  # still have their failures reported
      if c not in (None, 0) and rank not in reported:
        reported.add(rank)
        wait = ""
        if failed_at is None:
          failed_at, code = time.monotonic(), c
          wait = f"; waiting up to {timeout:g} s for the others"
        print(f"zjax launch: process {rank} exited with code {c}{wait}", file=sys.stderr)
    if None not in codes:
      break
    if failed_at is not None and time.monotonic() - failed_at > timeout:
      for rank, p in enumerate(processes):
        if p.poll() is None:
          print(f"zjax launch: killing process {rank}", file=sys.stderr)
          p.kill()
      break
    time.sleep(0.1)
  for p in processes:
    p.wait()
  if failed_at is not None:
    print(
      f"zjax launch: run failed; all processes stopped "
      f"{time.monotonic() - failed_at:.1f} s after the first failure",
      file=sys.stderr,
    )
  codes = [p.returncode for p in processes]
  if code == 0:
    code = next((c for c in codes if c != 0), 0)
  return 0 if code == 0 else (code if code > 0 else 1)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
