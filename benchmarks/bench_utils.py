"""Shared by the benchmark scripts: launching runs, reading their run_summary.json, describing the
machine, and writing a result folder (table.md with date, machine, versions and the exact
command; results.json; a PNG plot)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
HARNESS = {"ACCELERATE_RECIPES_CPU_HARNESS": "1", "PYTHONPATH": str(ROOT / "scripts" / "cpu_harness")}


def run(cmd: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True)
    if log is not None:
        log.write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc


def summary(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "run_summary.json").read_text())


def steady_median(summary_: dict, key: str = "tokens_per_s") -> float:
    """Median over the log intervals after the first (which holds warm-up, compilation)."""
    values = [row[key] for row in summary_["throughput"] if row.get(key) is not None]
    return float(np.median(values[1:] if len(values) > 1 else values))


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def median_seconds(fn, repeats: int = 3) -> float:
    """The median wall time of `repeats` calls of fn()."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def machine() -> dict:
    import accelerate
    import torch
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": f"{cpu}, {os.cpu_count()} logical cores",
        "gpus": ", ".join(gpus) or "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
    }


def write_results(out_dir: Path, title: str, header: list[str], rows: list[list], notes: list[str],
                  results: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    lines = [f"# {title}", "", *(f"- {k}: {v}" for k, v in info.items()),
             f"- command: `{' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}`", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    lines += ["", *notes]
    table = out_dir / "table.md"
    table.write_text("\n".join(lines) + "\n")
    (out_dir / "results.json").write_text(json.dumps({"machine": info, "argv": sys.argv, **results}, indent=1))
    print("\n".join(lines))
    return table
