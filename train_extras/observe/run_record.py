"""What a run leaves as it goes: train.py's IntervalLog (per-step numbers fetched once per log
interval into run_summary.json, the trackers, `<output_dir>/metrics.jsonl` and the bar or a plain
line), the metrics file itself (the history, crash-proof) and plain log lines when the output is a
file, not a terminal, as under a scheduler.

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

import contextlib
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from tqdm.auto import tqdm

from train_extras.observe import metrics

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


class IntervalLog:
    """Per-step numbers, kept on the device and fetched once per log interval (the one sync that
    also makes the interval's timing honest), then written to run_summary.json, metrics.jsonl, the
    trackers and the progress bar (or a plain line when the output is a file: train_extras/py),
    with throughput, MFU, memory per rank and the ETA."""

    def __init__(self, accelerator, cfg, summary, record, tokens_per_step, flops_per_token, peak_tflops, start_step):
        self.accelerator, self.cfg, self.summary, self.record = accelerator, cfg, summary, record
        self.tokens_per_step, self.flops_per_token, self.peak_tflops = tokens_per_step, flops_per_token, peak_tflops
        self.pending, self.step_times, self.interval_steps = [], [], 0
        self.start = time.perf_counter()
        self.plain = accelerator.is_main_process and not draw_bar()
        self.bar = tqdm(total=cfg.max_steps, initial=start_step, desc="train",
                        disable=not accelerator.is_main_process or self.plain)

    def add(self, step, lr, loss, grad_norm, loss_scale):
        """grad_norm: clip_grad_norm_'s result (a DTensor under FSDP2, a float under DeepSpeed, None
        for a skipped step), kept on the device like the loss."""
        self.pending.append((step, lr, loss, metrics.as_tensor(grad_norm, loss.device), loss_scale))

    def drain(self) -> list[dict]:
        """Fetch the steps added since the last call (one host sync) into run_summary.json and the
        trackers; returns their metrics.jsonl lines. Called at each log interval, and before an eval
        so that its step comes after theirs everywhere (wandb drops a step logged after a later one)."""
        if not self.pending:
            return []
        losses, norms = torch.stack([torch.stack([loss, norm]) for _, _, loss, norm, _ in self.pending]).T.tolist()
        lines = []
        for (s, lr, _, _, loss_scale), loss, norm in zip(self.pending, losses, norms):
            row = {"step": s, "loss": loss, "lr": lr, "grad_norm": norm}
            if loss_scale is not None:
                row["loss_scale"] = loss_scale
            self.summary["losses"].append(row)
            lines.append({"kind": "train", **row})
            self.accelerator.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=s)
        self.interval_steps += len(self.pending)
        self.last = {"loss": losses[-1], "lr": self.pending[-1][1], "grad_norm": norms[-1]}
        self.pending = []
        return lines

    def record_steps(self):
        """Before an eval: the steps so far into metrics.jsonl and the trackers."""
        self.record.write(self.drain())

    def flush(self, step):
        lines = self.drain()
        elapsed = time.perf_counter() - self.start
        self.start = time.perf_counter()  # what logging costs below counts in the next interval
        steps, self.interval_steps = self.interval_steps, 0
        self.step_times.append(elapsed / steps)
        stats = metrics.interval_stats(
            steps=steps, seconds=elapsed, tokens_per_step=self.tokens_per_step,
            world_size=self.accelerator.num_processes, flops_per_token=self.flops_per_token,
            peak_tflops_per_device=self.peak_tflops, steps_left=self.cfg.max_steps - step, step_times=self.step_times)
        memory = metrics.peak_memory(self.accelerator)  # every rank's (a small gather per interval)
        self.summary["throughput"].append({"step": step, **stats, "memory_per_rank": memory})
        self.record.write(lines + [{"kind": "interval", "step": step, "steps": steps, **stats, "time": now()}])
        if self.plain:
            print(plain_line(step, self.cfg.max_steps, stats=stats, **self.last), flush=True)
        self.accelerator.log({f"perf/{k}": v for k, v in stats.items() if v is not None}
                             | {f"memory/rank{m['rank']}_{k}": v for m in memory for k, v in m.items() if k != "rank"},
                             step=step)
        self.bar.set_postfix(loss=f"{self.last['loss']:.4f}", lr=f"{self.last['lr']:.2e}",
                             tok_s=f"{stats['tokens_per_s']:,.0f}",
                             **({"mfu": f"{stats['mfu']:.1%}"} if stats["mfu"] is not None else {}))
        self.bar.update(steps)

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside does not count towards the current interval."""
        t0 = time.perf_counter()
        yield
        self.start += time.perf_counter() - t0

    def close(self):
        self.bar.close()  # an error line after this starts on a line of its own
        self.record.close()
