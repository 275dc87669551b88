"""gpu.md: the tables of `zjax bench --suite gpu`, from what gpu.json holds (any part may be
missing, cut short or failed; the tables say so)."""

from zjax._src.schedule.render import format_bytes


def markdown(results: dict) -> str:
  m = results.get("machine") or {}
  label = (
    f"{m.get('device_kind', '?')} ({m.get('platform', '?')}), jax {m.get('jax')}, "
    f"jaxlib {m.get('jaxlib')}, flax {m.get('flax')}, optax {m.get('optax')}, "
    f"{m.get('date', '')}"
  )
  lines = [
    f"# zjax bench --suite gpu{' (tiny: CPU devices)' if results.get('tiny') else ''}",
    "",
    f"Measured on {label}. Command: `{results.get('command', '')}`. Wall time "
    f"{results.get('wall_seconds', 0):.0f} s.",
    "",
  ]
  parts = results.get("parts", {})
  lines += ["## Parts", "", "| part | ended | seconds | items ok / all |", "|---|---|---|---|"]
  for name, part in parts.items():
    items = part.get("items") or {}
    ok = sum(v.get("status") == "ok" for v in items.values())
    lines.append(
      f"| {name} | {part.get('ended', part.get('status'))}"
      f"{': ' + part['reason'] if part.get('reason') else ''} | "
      f"{part.get('wall_seconds', 0):.0f} | {ok} / {len(items)} |"
    )
  lines += _compile_table(parts.get("compile") or {}, parts.get("mock_run") or {})
  lines += _single_table(parts)
  lines += _offload_table(parts)
  lines += _errors(parts)
  return "\n".join(lines) + "\n"


def _compile_table(part: dict, mock: dict) -> list[str]:
  items = part.get("items") or {}
  if not items:
    return []
  backend = part.get("backend") or {}
  out = [
    "",
    "## Part 1: the schedule on the GPU compiler",
    "",
    f"8 devices: {backend.get('devices')} {backend.get('platform')} "
    f"(mock topology {backend.get('topology')}; this process addresses "
    f"{backend.get('addressable')}). AG / RS: all-gathers / reduce-scatters over the data "
    f"axes as executed (a loop body's once per iteration), program vs report. Barriers: "
    f"optimization barriers lowered -> compiled. Async: gathers issued as start/done "
    f"pairs; overlapped: with compute scheduled between start and done. Temp: "
    f"`memory_analysis()` per device; vs CPU: over zjax's CPU analysis compile of the "
    f"same step.",
    "",
    "| program | AG count | AG bytes | RS count | RS bytes | equal | barriers | AG async "
    "/ overlapped / sync | temp | temp / GSPMD | temp / CPU analysis | compile s |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  gspmd = {
    name.split("_gspmd")[0]: v.get("temp_bytes")
    for name, v in items.items()
    if "_gspmd" in name and v.get("status") == "ok"
  }
  for name, v in items.items():
    if v.get("status") != "ok":
      out.append(f"| {name} | {v.get('status')}: {_short(v)} |" + " |" * 11)
      continue
    if "_gspmd" in name:
      out.append(
        f"| {name} | {v.get('all_gather_count', 0)} | "
        f"{format_bytes(v.get('all_gather_bytes', 0))} | "
        f"{v.get('reduce_scatter_count', 0)} | "
        f"{format_bytes(v.get('reduce_scatter_bytes', 0))} | - | - | "
        f"{v['all_gather_async']} / {v['all_gather_overlapped']} / "
        f"{v['all_gather_sync']} | {format_bytes(v['temp_bytes'])} | 1.00 | - | "
        f"{v.get('compile_seconds', 0):.1f} |"
      )
      continue
    ag, rs = v["all_gather"], v["reduce_scatter"]
    base, cpu = gspmd.get(name.split("_")[0]), v.get("temp_vs_cpu_analysis")
    cells = [
      name,
      f"{ag['program_count']} / {ag['report_count']}",
      f"{format_bytes(ag['program_bytes'])} / {format_bytes(ag['report_bytes'])}",
      f"{rs['program_count']} / {rs['report_count']}",
      f"{format_bytes(rs['program_bytes'])} / {format_bytes(rs['report_bytes'])}",
      "yes" if v["report_equal"] else "**no**",
      f"{v['barriers_lowered']} -> {v['barriers_compiled']}",
      f"{v['all_gather_async']} / {v['all_gather_overlapped']} / {v['all_gather_sync']}",
      format_bytes(v["temp_bytes"]),
      f"{v['temp_bytes'] / base:.2f}" if base else "-",
      f"{cpu:.2f}" if cpu is not None else "-",
      f"{v.get('compile_seconds', 0):.1f}",
    ]
    out.append("| " + " | ".join(cells) + " |")
  run = (mock.get("items") or {}).get("psum_over_8")
  if run:
    ran = (
      _short(run)
      if run.get("status") != "ok"
      else {k: run[k] for k in ("local_result", "expected_if_real", "note") if k in run}
    )
    out += ["", f"Running a psum under the mock topology: {run.get('status')}: {ran}"]
  return out


def _single_table(parts: dict) -> list[str]:
  rows = [
    (name, (parts.get(name) or {}).get("items") or {}) for name in ("single_zjax", "single_plain")
  ]
  rows = [(name, next(iter(items.values()))) for name, items in rows if items]
  if not rows:
    return []
  out = [
    "",
    "## Part 2: one GPU, executed",
    "",
    "Llama-style model (zjax/models/llama.py), bf16 compute over fp32 masters, adamw. "
    "Step time: median of the timed steps. MFU: (6 x params + 12 x layers x seq x "
    "d_model) x tokens / step time / 989 TFLOP/s. Peak: `memory_stats()` of the "
    "process.",
    "",
    "| method | params | tokens/step | step ms (min-max) | tokens/s | MFU | peak device "
    "| compiled temp | compile s |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, v in rows:
    out.append(_exec_row(v))
  if len(rows) == 2 and all(v.get("status") == "ok" for _, v in rows):
    z, p = rows[0][1], rows[1][1]
    out += [
      "",
      f"zjax / plain: step time {z['step_seconds'] / p['step_seconds']:.3f}x"
      + (
        f", peak {z['peak_device_bytes'] / p['peak_device_bytes']:.2f}x"
        if z.get("peak_device_bytes") and p.get("peak_device_bytes")
        else ""
      ),
    ]
  return out


def _exec_row(v: dict) -> str:
  if v.get("status") != "ok":
    return f"| {v.get('method', '?')} | {v.get('status')}: {_short(v)} |" + " |" * 7
  peak = v.get("peak_device_bytes")
  cells = [
    v["method"],
    f"{v['params'] / 1e9:.4g} B",
    str(v["tokens_per_step"]),
    f"{1e3 * v['step_seconds']:.1f} ({1e3 * v['step_seconds_min']:.1f}-"
    f"{1e3 * v['step_seconds_max']:.1f})",
    f"{v['tokens_per_second']:.0f}",
    f"{100 * v['mfu']:.1f}%" if "mfu" in v else "-",
    format_bytes(peak) if peak else "-",
    format_bytes(v.get("compiled_temp_bytes", 0)),
    f"{v['compile_seconds']:.1f}",
  ]
  return "| " + " | ".join(cells) + " |"


def _offload_table(parts: dict) -> list[str]:
  out = [
    "",
    "## Part 3: offload, executed",
    "",
    "Predicted peak: the parameter copies the device keeps (`offload_plan`), the batch, "
    "and the compiled step's temp. Host: `offload_plan['host_bytes']`.",
    "",
    "| run | fits | peak device (measured) | predicted | host | step ms | tokens/s |",
    "|---|---|---|---|---|---|---|",
  ]
  found = False
  for name in ("single_zjax", "offload_optimizer", "offload_params"):
    items = (parts.get(name) or {}).get("items") or {}
    for v in items.values():
      found = True
      out.append(_offload_row(v.get("method", name), dict(v, fits=v.get("status") == "ok")))
  budget = parts.get("offload_budget") or {}
  for v in (budget.get("items") or {}).values():
    found = True
    if v.get("status") != "ok":
      out.append(f"| budget | {v.get('status')}: {_short(v)} |" + " |" * 5)
      continue
    limit = format_bytes(v.get("device_bytes_limit", 0))
    for key in ("offload_optimizer", "no_offload"):
      out.append(_offload_row(f"budget {limit}: {key.replace('_', ' ')}", v[key]))
  if budget.get("reason"):
    out += ["", f"Budget check: skipped ({budget['reason']})."]
  return out if found else []


def _offload_row(label: str, v: dict) -> str:
  if not v.get("fits"):
    return f"| {label} | no: {_short(v)} |" + " |" * 5
  plan = v.get("offload_plan") or {}
  peak, predicted = v.get("peak_device_bytes"), v.get("predicted_peak_device_bytes")
  return (
    f"| {label} | yes | {format_bytes(peak) if peak else '-'} | "
    f"{format_bytes(predicted) if predicted else '-'} | "
    f"{format_bytes(plan['host_bytes']) if plan else '-'} | "
    f"{1e3 * v['step_seconds']:.1f} | {v['tokens_per_second']:.0f} |"
  )


def _errors(parts: dict) -> list[str]:
  out = []
  for name, part in parts.items():
    for item, v in (part.get("items") or {}).items():
      if v.get("status") == "error":
        out += [f"- {name} / {item}: {v['error'][:400]}"]
    for attempt in part.get("attempts") or []:
      if attempt.get("error"):
        out += [f"- {name}: topology {attempt['topology']}: {attempt['error'][:400]}"]
  return ["", "## Errors", ""] + out if out else []


def _short(v: dict) -> str:
  text = v.get("error") or v.get("reason") or ""
  return text.replace("|", "/").replace("\n", " ")[:160]
