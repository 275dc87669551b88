"""Loss curves of `zjax train` with and without quantized communication (ZeRO++ qwZ, qgZ):
the default run three times, same seed and steps, fp32 communication vs int8 weight gathers
vs int8 weight gathers + int8 gradient all-to-alls; one PNG with the curves and a table of
final losses and bytes moved per step.

  python examples/quantized_training.py --out-dir /tmp/quantized   # ~6 min on 2 CPU cores
  python examples/quantized_training.py --steps 50 --extra --n-layer 2

Each run is a separate `zjax train` process (its own out-dir under --out-dir, no resume).
"""

import argparse
import json
import pathlib
import subprocess
import sys

RUNS = {  # label -> zjax train flags
  "fp32 communication": [],
  "qwZ (int8 gathers)": ["--gather-quantization", "int8"],
  "qwZ + qgZ (int8 gathers, int8 gradients)": [
    "--gather-quantization",
    "int8",
    "--reduce-quantization",
    "int8",
  ],
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out-dir", default="zjax_quantized", help="runs and the PNG go here")
  parser.add_argument("--steps", type=int, default=None, help="zjax train --steps")
  args, extra = parser.parse_known_args()
  out = pathlib.Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  runs = {}
  for i, (label, flags) in enumerate(RUNS.items()):
    run_dir = out / f"run{i}"
    steps = ["--steps", str(args.steps)] if args.steps else []
    command = [
      sys.executable,
      "-m",
      "zjax.cli.main",
      "train",
      "--no-resume",
      "--out-dir",
      str(run_dir),
      *steps,
      *flags,
      *extra,
    ]
    print(f"{label}: {' '.join(command[3:])}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
      sys.exit(f"{label} failed:\n{done.stderr[-3000:]}")
    runs[label] = json.loads((run_dir / "metrics.json").read_text())
  rows = table(runs)
  plot(runs, out / "quantized_loss.png")
  (out / "quantized_summary.json").write_text(json.dumps(rows, indent=1))
  print(f"wrote {out / 'quantized_loss.png'} and {out / 'quantized_summary.json'}")


def table(runs) -> list[dict]:
  base = next(iter(runs.values()))["summary"]
  moved = lambda s: s["all_gather_bytes"] + s["reduce_scatter_bytes"] + s.get("all_to_all_bytes", 0)
  rows = []
  print(
    f"{'run':<44} {'final val':>10} {'vs fp32':>8} {'final train':>12} "
    f"{'bytes/step':>11} {'vs fp32':>8} {'tok/s':>8}"
  )
  for label, metrics in runs.items():
    s = metrics["summary"]
    row = {
      "run": label,
      "final_validation_loss": s["final_validation_loss"],
      "validation_vs_fp32": s["final_validation_loss"] / base["final_validation_loss"],
      "final_train_loss": s["final_train_loss"],
      "collective_bytes": moved(s),
      "bytes_vs_fp32": moved(s) / moved(base),
      "tokens_per_second": s["tokens_per_second"],
    }
    rows.append(row)
    print(
      f"{label:<44} {row['final_validation_loss']:>10.4f} "
      f"{row['validation_vs_fp32']:>8.4f} {row['final_train_loss']:>12.4f} "
      f"{row['collective_bytes']:>11,} {row['bytes_vs_fp32']:>8.3f} "
      f"{row['tokens_per_second']:>8,.0f}"
    )
  return rows


def plot(runs, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 4.5))
  for (label, metrics), color in zip(runs.items(), ("black", "tab:blue", "tab:orange")):
    train = metrics["train"]
    ax.plot(
      [p["step"] for p in train], [p["loss"] for p in train], color=color, alpha=0.35, linewidth=0.8
    )
    val = metrics["validation"]
    ax.plot(
      [p["step"] for p in val],
      [p["loss"] for p in val],
      color=color,
      marker="o",
      label=f"{label}: validation {val[-1]['loss']:.3f}",
    )
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per byte; faint: train)")
  ax.set_title("zjax train: quantized communication vs fp32 (same seed, same batches)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  main()
