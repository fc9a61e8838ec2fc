"""What a run leaves as it goes, for a user whose job runs under a scheduler: `<output_dir>/metrics.jsonl`
(the history, crash-proof) and plain log lines when the output is a file, not a terminal.

metrics.jsonl: one JSON object per line, appended and flushed at every log interval and every
eval, so a run killed without a tracker still leaves its loss curve (run_summary.json stays the
record written at the end). Flushed lines survive the process; they are fsynced with every
checkpoint, so after a machine's crash the file still reaches the checkpoint resumed from. A disk
that fills stops the lines with a warning, not the run (its next checkpoint save says more). Lines, by "kind":
  train     one per step: step, loss, lr, grad_norm (pre-clip; null for a skipped step), loss_scale (fp16)
  interval  one per log interval: step (its last), steps, tokens/s (global, per device), step time,
            model TFLOP/s per device, mfu (null where the peak is unknown), eta_s, time (Unix seconds)
  eval      one per eval: step, loss, perplexity, tokens, time
A resumed run first keeps only the lines up to the step it resumes from (a crash can have logged
steps past its last checkpoint; they are trained again) and drops a line torn by a kill, then appends:
each step appears once, in order, across any number of restarts. Non-finite numbers are written
as null, so every line is strict JSON (`pandas.read_json(path, lines=True)` reads it).

Plain lines: under SLURM or Kubernetes stdout and stderr are files; tqdm's redraws (carriage
returns) fill them and never end a line. So the bar is drawn only when stderr (where tqdm draws)
is a terminal; otherwise the libraries' bars are off too and rank 0 prints one line per log interval:
  step 20/100 | loss 2.3456 | lr 1.00e-03 | grad norm 0.812 | 12,345 tok/s | MFU 12.3% | ETA 0:01:23
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


def _finite_or_none(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def kept_lines(path: Path, resumed_step: int) -> list[str]:
    """The lines of an earlier part of this run up to `resumed_step`, ending at the first line that
    is not a whole JSON object (a kill during a write leaves one at the end)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith("\n") else None
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            break
        if row.get("step", 0) <= resumed_step:
            kept.append(line)
    return kept


class MetricsFile:
    """Rank 0's appender for metrics.jsonl (does nothing elsewhere, or when `enabled` is False)."""

    def __init__(self, output_dir, resumed_step: int | None, enabled: bool):
        self.path = Path(output_dir) / METRICS_FILE
        self.file = None
        if not enabled:
            return
        # A fresh run starts the file anew (an output folder without checkpoints holds no run to go
        # on with); a resumed one keeps its past. Rewritten whole, then renamed: a kill here loses nothing.
        kept = kept_lines(self.path, resumed_step) if resumed_step is not None else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(METRICS_FILE + ".partial")
        with open(partial, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.path)
        self.file = open(self.path, "a")

    def write(self, rows: list[dict]) -> None:
        if self.file is None:
            return
        try:
            self.file.write("".join(json.dumps({k: _finite_or_none(v) for k, v in row.items()}, allow_nan=False)
                                    + "\n" for row in rows))
            self.file.flush()  # to the OS: it survives this process; sync() makes it survive the machine
        except OSError as err:  # rank 0 alone writes: stopping here would leave the other ranks waiting
            print(f"warning: {self.path}: {err.strerror}; no more lines are written to it", flush=True)
            self.file = None

    def sync(self) -> None:
        """fsync, with each checkpoint: the lines up to it survive a crash of the machine too."""
        if self.file is not None:
            try:
                os.fsync(self.file.fileno())
            except OSError:
                pass

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def draw_bar() -> bool:
    """tqdm's bar on a terminal; plain lines when stderr is a file or a pipe (a scheduler's log)."""
    return sys.stderr.isatty()


def library_bars_off() -> None:
    """Without a terminal, datasets' map and transformers' save bars go too (their redraws as well)."""
    import datasets
    import huggingface_hub
    import transformers

    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def plain_line(step: int, max_steps: int, *, loss: float, lr: float, grad_norm: float, stats: dict) -> str:
    mfu = f" | MFU {stats['mfu']:.1%}" if stats["mfu"] is not None else ""
    norm = f"{grad_norm:.3f}" if math.isfinite(grad_norm) else "skipped"
    return (f"step {step}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {norm} | "
            f"{stats['tokens_per_s']:,.0f} tok/s{mfu} | ETA {timedelta(seconds=round(stats['eta_s']))}")


def now() -> float:
    return round(time.time(), 3)
