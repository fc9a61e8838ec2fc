"""Where the learning-rate and warmup defaults come from: a sweep at two shapes of train.py's run.

    python benchmarks/lr_sweep.py             # writes benchmarks/results/lr-sweep-<date>/ (about an hour, 2 cores)

Each cell is one `accelerate launch recipes/train.py` (the default accelerate config, 2 threads,
the default seed) with `--lr` and `--warmup_ratio` set and everything else at its default (cosine to 0.1 x
--lr, AdamW betas 0.9/0.95, weight decay 0.1, clipping at 1.0); its figure is the final held-out
loss (the whole held-out split, nats per character). Two shapes:

1. The default job: preset mini, 16 x 256 characters, 720 steps (4,096 tokens per step).
2. nanoGPT's CPU run: preset mini (its 4 layers x 128), 12 x 64 characters, 2,000 steps (768
   tokens per step), on nanoGPT's split (time_to_loss.py's NANOGPT_SHAPE).

Beside the grid, at nanoGPT's shape: the defaults before the sweep (`--lr 4e-3 --warmup_steps 15`)
and nanoGPT's own schedule and optimizer (config/train_shakespeare_char.py: lr 1e-3, 100 warmup
steps, cosine to 1e-4, beta2 0.99), so the comparison with nanoGPT is like for like.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import ROOT, write_results  # noqa: E402
from time_to_loss import NANOGPT_SCHEDULE, NANOGPT_SHAPE, ours  # noqa: E402

SHAPES = {"default job (16 x 256, 720 steps)": ([], 240),
          "nanoGPT's shape (12 x 64, 2,000 steps)": (NANOGPT_SHAPE, 500)}
LRS = {"default job (16 x 256, 720 steps)": ["2e-3", "4e-3", "8e-3"],
       "nanoGPT's shape (12 x 64, 2,000 steps)": ["1e-3", "2e-3", "4e-3", "8e-3"]}
RATIOS = ["0.02", "0.05", "0.1"]
REFERENCES = {"nanoGPT's shape (12 x 64, 2,000 steps)": {
    "defaults before the sweep: --lr 4e-3 --warmup_steps 15": ["--lr", "4e-3", "--warmup_steps", "15"],
    "nanoGPT's schedule: " + " ".join(NANOGPT_SCHEDULE): NANOGPT_SCHEDULE}}


def report(out: Path, results: dict) -> None:
    header = ["shape", "--lr", *(f"--warmup_ratio {r}" for r in RATIOS)]
    rows = []
    for shape, cells in results["grid"].items():
        for lr in LRS[shape]:
            losses = [cells.get(f"{lr} {r}") for r in RATIOS]
            rows.append([shape, lr, *(f"{c['curve'][-1]['loss']:.4f}" if c else "" for c in losses)])
    for shape, runs in results["references"].items():
        for name, run in runs.items():
            rows.append([shape, name, f"{run['curve'][-1]['loss']:.4f}", "", ""])
    notes = ["Final held-out loss (nats per character) of one seed per cell; lower is better.",
             "Commands and held-out curves (an eval every 240 steps, 500 at nanoGPT's shape): results.json."]
    write_results(out, "Learning rate x warmup sweep at the default job's and nanoGPT's shapes", header, rows,
                  notes, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / f"lr-sweep-{date.today()}")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lr_sweep_"))
    results = {"grid": {shape: {} for shape in SHAPES}, "references": {shape: {} for shape in REFERENCES}}
    for shape in reversed(list(SHAPES)):  # nanoGPT's shape first: its runs are the shorter
        shape_args, eval_every = SHAPES[shape]
        for name, extra in REFERENCES.get(shape, {}).items():
            results["references"][shape][name] = ours(shape_args + extra, work / "run", eval_every)
            print(f"{shape}, {name}: {results['references'][shape][name]['curve'][-1]['loss']:.4f}", flush=True)
        for lr in LRS[shape]:
            for ratio in RATIOS:
                run = ours(shape_args + ["--lr", lr, "--warmup_ratio", ratio], work / "run", eval_every)
                results["grid"][shape][f"{lr} {ratio}"] = run
                print(f"{shape}, --lr {lr} --warmup_ratio {ratio}: {run['curve'][-1]['loss']:.4f}", flush=True)
                report(args.out, results)  # an interrupted sweep keeps its cells
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
