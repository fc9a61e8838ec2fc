"""How soon a run reaches a held-out loss, and how a choice (optimizer, compile, run length) moves it.

    git clone <nanoGPT> /tmp/nanoGPT                          # its code is run from there, not copied here
    python benchmarks/time_to_loss.py --nanogpt /tmp/nanoGPT  # writes benchmarks/results/time-to-loss-<date>/

Two sets of runs, interleaved (one of each in turn, --repeats rounds; medians), each launched as
a user launches it (`accelerate launch recipes/train.py`, the default accelerate config, 2 threads):

1. The default job (mini, 16 x 256, tiny Shakespeare): as it is, with --compile, with
   --optimizer muon, and BEST_DEFAULT, the fastest combination the sweep found. Target: 1.7319,
   the default job's final held-out loss when its warmup was 15 steps (before benchmarks/lr_sweep.py).
2. nanoGPT's own CPU run (its README's command: 4 layers x 128, context 64, batch 12, 2,000
   iterations, no dropout) from a nanoGPT checkout, on its split (prepare.py: the file's first 90%
   trains, the last 10% is held out), beside train.py on the same split (--txt_documents file: the
   90% as one document; the held-out part is the same last 10%) with the same shape: with nanoGPT's
   own schedule and AdamW (NANOGPT_SCHEDULE: like for like), with our defaults, and with
   BEST_NANOGPT. Target: 1.891, nanoGPT's final loss. The goal: ours there in at most half of
   nanoGPT's wall time. `--only nanogpt` (or `default`) runs one set alone.

Time axis: seconds from the launch command, start-up included; the evaluations that draw our
curves are excluded (each one's duration is its metrics.jsonl line's time minus the log line's
written just before it; the step-0 eval, which has none, counts as the median of the others).
nanoGPT's time: from its launch to each of its eval lines, its own evaluation (20 batches per
split every 250 iterations) and checkpoint writes included. Its loss is its estimate on 20 random
held-out batches (15,360 characters); ours is the whole held-out 10% (111,540 characters).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import ACCELERATE, ROOT, write_results  # noqa: E402

CORPUS = ROOT / "common" / "corpus" / "tinyshakespeare.txt"
DEFAULT_TARGET, NANOGPT_TARGET = 1.7319, 1.891
# The quickest to the target in a sweep of 300-step Muon runs (muon_lr 0.01-0.04, lr 4e-3 and 8e-3, 240 steps).
BEST_DEFAULT = ["--optimizer", "muon", "--max_steps", "300", "--lr", "8e-3"]
BEST_NANOGPT = ["--optimizer", "muon", "--max_steps", "600"]
DEFAULT_RUNS = {"default job": [], "--compile": ["--compile"], "--optimizer muon": ["--optimizer", "muon"],
                "best: " + " ".join(BEST_DEFAULT): BEST_DEFAULT}
NANOGPT_SHAPE = ["--preset", "mini", "--seq_len", "64", "--micro_batch_size", "12", "--max_steps", "2000",
                 "--txt_documents", "file"]
# nanoGPT's config/train_shakespeare_char.py: its peak and final lr, warmup and AdamW beta2 (the rest equals ours).
NANOGPT_SCHEDULE = ["--lr", "1e-3", "--warmup_steps", "100", "--min_lr_ratio", "0.1", "--adam_beta2", "0.99"]
NANOGPT_RUNS = {"train.py, nanoGPT's shape and schedule": NANOGPT_SHAPE + NANOGPT_SCHEDULE,
                "train.py, nanoGPT's shape, our defaults": NANOGPT_SHAPE,
                "train.py, best: " + " ".join(BEST_NANOGPT): NANOGPT_SHAPE + BEST_NANOGPT}
# nanoGPT's README, "I only have a macbook": its CPU run of train_shakespeare_char.py.
NANOGPT_COMMAND = ["train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
                   "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
                   "--n_head=4", "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}


def ours(args: list[str], out: Path, eval_every: int) -> dict:
    """One train.py launch: its held-out curve against seconds (evals excluded) and tokens."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [ACCELERATE, "launch", "recipes/train.py", *args, "--eval_every", str(eval_every), "--log_every", "10",
           "--sample_length", "0", "--save_model", "false", "--output_dir", str(out)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = {row["step"]: row["time"] for row in rows if row["kind"] == "interval"}
    evals = [row for row in rows if row["kind"] == "eval"]
    costs = {row["step"]: row["time"] - logged[row["step"]] for row in evals if row["step"] in logged}
    costs[0] = statistics.median(costs.values())
    tokens_per_step = json.loads((out / "run_summary.json").read_text())["setup"]["global_batch_tokens"]
    curve, spent = [], 0.0
    for row in evals:
        spent += costs[row["step"]]
        curve.append({"step": row["step"], "tokens": row["step"] * tokens_per_step, "loss": row["loss"],
                      "seconds": row["time"] - start - spent})
    return {"curve": curve, "wall_s": wall, "eval_s": spent, "command": " ".join(cmd[1:])}


def nanogpt(checkout: Path, work: Path) -> dict:
    """nanoGPT's CPU run from its checkout, in a copy (its data folder gets our file as input.txt)."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(checkout, work, ignore=shutil.ignore_patterns(".git"))
    data = work / "data" / "shakespeare_char"
    shutil.copy(CORPUS, data / "input.txt")  # prepare.py would download it
    subprocess.run([sys.executable, "prepare.py"], cwd=data, env=ENV, check=True, capture_output=True)
    cmd = [sys.executable, "-u", *NANOGPT_COMMAND]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=work, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    curve, lines = [], []
    for line in proc.stdout:
        lines.append(line)
        match = re.match(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", line)
        if match:
            step = int(match[1])
            curve.append({"step": step, "tokens": step * 12 * 64, "loss": float(match[3]),
                          "seconds": time.time() - start})
    wall = time.time() - start
    if proc.wait() != 0 or not curve:
        raise SystemExit(f"nanoGPT failed: {' '.join(cmd)}\n{''.join(lines[-40:])}")
    return {"curve": curve, "wall_s": wall, "eval_s": 0.0, "command": " ".join(cmd[2:])}


def time_to(curve: list[dict], target: float) -> float | None:
    """Seconds at the first eval at or below `target` (None: never reached)."""
    return next((point["seconds"] for point in curve if point["loss"] <= target), None)


def spread(values: list) -> str:
    if any(v is None for v in values):
        return f"not reached in {sum(v is None for v in values)} of {len(values)}"
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def table_rows(runs: dict, target: float) -> list[list]:
    rows = []
    for name, repeats in runs.items():
        reached = [time_to(r["curve"], target) for r in repeats]
        finals = [r["curve"][-1]["loss"] for r in repeats]
        rows.append([name, spread(reached), f"{statistics.median(r['wall_s'] for r in repeats):.1f}",
                     f"{statistics.median(finals):.4f}", f"{repeats[0]['curve'][-1]['tokens']:,}"])
    return rows


def plot(parts: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(parts), 2, figsize=(13, 4.2 * len(parts)), squeeze=False)
    for row, (title, (runs, target)) in enumerate(parts.items()):
        for col, axis in enumerate(("seconds", "tokens")):
            ax = axes[row][col]
            for name, repeats in runs.items():
                median_run = sorted(repeats, key=lambda r: time_to(r["curve"], target) or 1e9)[len(repeats) // 2]
                points = [p for p in median_run["curve"] if p["step"] > 0]
                ax.plot([p[axis] for p in points], [p["loss"] for p in points], marker=".", label=name)
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
            ax.set_ylim(target - 0.35, target + 0.9)
            ax.set_xlabel("wall-clock seconds from launch (evals excluded)" if axis == "seconds" else "tokens")
            ax.set_ylabel("held-out loss (nats/char)")
            ax.set_title(f"{title}: target {target}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(args, default_runs: dict, split_runs: dict, rounds: int) -> None:
    """The table, plot and results.json of the rounds done so far."""
    header = ["run", "seconds to target, min / median / max", "wall s (median)", "final loss (median)",
              "tokens"]
    rows, parts, commit = [], {}, None
    if default_runs:
        rows += [["**default job, target 1.7319**", "", "", "", ""], *table_rows(default_runs, DEFAULT_TARGET)]
        parts["default job"] = (default_runs, DEFAULT_TARGET)
    if "nanoGPT" in split_runs:
        commit = subprocess.run(["git", "-C", str(args.nanogpt), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
    if split_runs:
        rows += [["**nanoGPT's CPU run and split, target 1.891**", "", "", "", ""],
                 *table_rows(split_runs, NANOGPT_TARGET)]
        parts["nanoGPT's CPU run"] = (split_runs, NANOGPT_TARGET)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(parts, args.out / "time_to_loss.png")
    notes = [f"{rounds} of {args.repeats} interleaved rounds; each round runs every row once, in this order.",
             "Seconds: from the launch command to the end of the first eval at or below the target, start-up "
             "included, our evaluations excluded (see the script's docstring); wall: the whole launch, evals "
             "included (eval every 30 steps, 50 on nanoGPT's split, where its eval_interval is 250).",
             f"nanoGPT: commit {commit}, `python {' '.join(NANOGPT_COMMAND)}`" if commit else "nanoGPT: not run.",
             "Commands: results.json (each run's command and curve); time_to_loss.png (the median run of each)."]
    write_results(args.out, "Time to a held-out loss: the default job, Muon, --compile, and nanoGPT's CPU run",
                  header, rows, notes, {"default_job": default_runs, "nanogpt_split": split_runs,
                                        "nanogpt_commit": commit})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (git clone); without it part 2 is skipped")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=("default", "nanogpt"), help="run one of the two sets alone")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / f"time-to-loss-{date.today()}")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="time_to_loss_"))
    default_runs = {name: [] for name in DEFAULT_RUNS if args.only != "nanogpt"}
    split_runs = {name: [] for name in (["nanoGPT"] if args.nanogpt else []) + list(NANOGPT_RUNS)
                  if args.only != "default"}
    for repeat in range(args.repeats):
        for i, (name, run_args) in enumerate((n, DEFAULT_RUNS[n]) for n in default_runs):
            default_runs[name].append(ours(run_args, work / f"default{i}", eval_every=30))
            print(f"round {repeat + 1}, {name}: {time_to(default_runs[name][-1]['curve'], DEFAULT_TARGET)} s",
                  flush=True)
        if "nanoGPT" in split_runs:
            split_runs["nanoGPT"].append(nanogpt(args.nanogpt, work / "nanogpt"))
        for i, (name, run_args) in enumerate((n, NANOGPT_RUNS[n]) for n in split_runs if n != "nanoGPT"):
            split_runs[name].append(ours(run_args, work / f"split{i}", eval_every=50))
        print(f"round {repeat + 1}: " + ", ".join(f"{n} {time_to(r[-1]['curve'], NANOGPT_TARGET)} s"
                                                  for n, r in split_runs.items()), flush=True)
        report(args, default_runs, split_runs, rounds=repeat + 1)  # an interrupted benchmark keeps its rounds
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
