"""What does train.py cost over a plain PyTorch loop? Interleaved A/B runs, median ratio of tokens/s.

    python benchmarks/overhead.py                       # tiny preset, fp32, 1 process, 2 threads, 5 pairs
    python benchmarks/overhead.py --pairs 7 --preset small --micro_batch_size 4
    python benchmarks/overhead.py --small_steps         # small steps: train.py's step against the bare step

Each pair runs the plain loop (benchmarks/plain_loop.py, `python`, OMP_NUM_THREADS=T) and train.py
(`accelerate launch --config_file accelerate_configs/cpu.yaml --num_cpu_threads_per_process T`) on
the same model, data, batch, optimizer, schedule and clipping, in alternating order (ABBA...) so a
drift of the shared machine's speed does not favour one side. Each side's figure is the median
tokens/s over its log intervals after the first (warm-up); the ratio train.py / plain is taken per
pair and reported as min / median / max. Writes benchmarks/results/overhead-<date>/ (table.md,
results.json, overhead.png).

--small_steps: where a step is short, the loop's own cost shows. For each shape (the `mini` preset,
micro-batch 12 x 64 tokens, and `debug` / `tiny` at small batches), train.py's step time against the
bare step of the same model (benchmarks/plain_loop.py --bare: forward, backward, fused AdamW,
zero_grad), in alternating pairs; each side the median step time over its log intervals after the
first; the ratio train.py / bare per pair, reported as its median. Writes
benchmarks/results/overhead-small-<date>/.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_utils import ACCELERATE, ROOT, run, steady_median, summary, write_results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=16)
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--small_steps", action="store_true", help="the small-step table (see above)")
    parser.add_argument("--train_args", default="", help="extra train.py options (e.g. --compile true)")
    parser.add_argument("--only", default=None, help="with --small_steps: one preset's shape (mini, debug, tiny)")
    args = parser.parse_args()
    if args.small_steps:
        return small_steps(args)
    args.out = args.out or ROOT / "benchmarks" / "results" / f"overhead-{time.strftime('%Y-%m-%d')}"

    common = ["--preset", args.preset, "--seq_len", str(args.seq_len), "--micro_batch_size", str(args.micro_batch_size),
              "--max_steps", str(args.max_steps), "--warmup_steps", "3", "--log_every", "5", "--eval_every", "0",
              "--save_model", "false"]
    work = Path(tempfile.mkdtemp(prefix="overhead-"))
    args.out.mkdir(parents=True, exist_ok=True)

    def plain(i):
        out = work / f"plain{i}"
        run([sys.executable, "benchmarks/plain_loop.py", *common, "--output_dir", str(out)],
            env={"OMP_NUM_THREADS": str(args.threads)}, log=work / f"plain{i}.log")
        return steady_median(summary(out))

    def recipe(i):
        out = work / f"train{i}"
        run([ACCELERATE, "launch", "--config_file", "accelerate_configs/cpu.yaml", "--num_cpu_threads_per_process",
             str(args.threads), "recipes/train.py", *common, "--output_dir", str(out)], log=work / f"train{i}.log")
        return steady_median(summary(out))

    pairs = []
    for i in range(args.pairs):
        if i % 2 == 0:
            a = plain(i)
            b = recipe(i)
        else:
            b = recipe(i)
            a = plain(i)
        pairs.append((a, b))
        print(f"pair {i + 1}/{args.pairs}: plain {a:,.0f} tokens/s, train.py {b:,.0f} tokens/s, ratio {b / a:.4f}",
              flush=True)

    ratios = [b / a for a, b in pairs]
    rows = [[i + 1, f"{a:,.0f}", f"{b:,.0f}", f"{b / a:.4f}"] for i, (a, b) in enumerate(pairs)]
    rows.append(["min / median / max", "", "", f"{min(ratios):.4f} / {np.median(ratios):.4f} / {max(ratios):.4f}"])
    write_results(
        args.out, f"train.py overhead against a plain PyTorch loop ({args.preset}, fp32, 1 process, "
                  f"{args.threads} threads, batch {args.micro_batch_size} x {args.seq_len})",
        ["pair", "plain loop tokens/s", "train.py tokens/s", "ratio"], rows,
        ["Ratio = train.py / plain loop, per pair (alternating order); each side the median over its log "
         "intervals after the first."],
        {"pairs": [{"plain": a, "train": b} for a, b in pairs], "ratio_median": float(np.median(ratios))})
    plot(pairs, args.out / "overhead.png")
    print(f"run logs: {work}")


SMALL_SHAPES = [("mini", 12, 64), ("debug", 8, 64), ("tiny", 4, 64)]  # (preset, micro-batch, seq_len)


def small_step_ms(side: str, shape: tuple, i: int, args, work: Path) -> float:
    """One run of `side` ("bare" or "train.py") on `shape`; its median step time in ms after warm-up."""
    preset, micro, seq = shape
    common = ["--preset", preset, "--seq_len", str(seq), "--micro_batch_size", str(micro),
              "--max_steps", str(max(args.max_steps, 200)), "--warmup_steps", "3", "--log_every", "20",
              "--eval_every", "0", "--save_model", "false", "--sample_length", "0"]
    out_dir = work / f"{preset}_{side}{i}"
    threads = str(args.threads)
    if side == "bare":
        cmd, env = [sys.executable, "benchmarks/plain_loop.py", "--bare", *common], {"OMP_NUM_THREADS": threads}
    else:
        launcher = [ACCELERATE, "launch", "--config_file", "accelerate_configs/cpu.yaml",
                    "--num_cpu_threads_per_process"]
        cmd, env = [*launcher, threads, "recipes/train.py", *common, *args.train_args.split()], None
    run(cmd + ["--output_dir", str(out_dir)], env=env, log=work / f"{preset}_{side}{i}.log")
    return micro * seq / steady_median(summary(out_dir)) * 1e3


def small_steps(args):
    work = Path(tempfile.mkdtemp(prefix="overhead-small-"))
    out = args.out or ROOT / "benchmarks" / "results" / f"overhead-small-{time.strftime('%Y-%m-%d')}"
    rows, results = [], []
    for shape in [s for s in SMALL_SHAPES if args.only in (None, s[0])]:
        pairs = []
        for i in range(args.pairs):
            order = ("bare", "train.py") if i % 2 == 0 else ("train.py", "bare")
            measured = {side: small_step_ms(side, shape, i, args, work) for side in order}
            pairs.append((measured["bare"], measured["train.py"]))
            print(f"{shape} pair {i + 1}/{args.pairs}: bare {pairs[-1][0]:.2f} ms, train.py {pairs[-1][1]:.2f} ms, "
                  f"ratio {pairs[-1][1] / pairs[-1][0]:.3f}", flush=True)
        ratios = [b / a for a, b in pairs]
        rows.append([f"{shape[0]}, {shape[1]} x {shape[2]}", f"{np.median([a for a, _ in pairs]):.2f}",
                     f"{np.median([b for _, b in pairs]):.2f}",
                     f"{min(ratios):.3f} / {np.median(ratios):.3f} / {max(ratios):.3f}"])
        results.append({"shape": shape, "pairs": pairs, "ratio_median": float(np.median(ratios))})
    title = f"train.py's step against the bare step, small steps (fp32, 1 process, {args.threads} threads"
    write_results(out, title + (f", train.py {args.train_args}" if args.train_args else "") + ")",
                  ["shape", "bare step, ms", "train.py step, ms", "ratio min / median / max"], rows,
                  [f"{args.pairs} alternating pairs per shape, {max(args.max_steps, 200)} steps each, log every 20; "
                   "each side the median step time over its log intervals after the first. bare = "
                   "benchmarks/plain_loop.py --bare (forward, backward, fused AdamW, zero_grad); train.py adds "
                   "clipping at --max_grad_norm 1.0, the schedule, the token-normalised loss, the NaN and preemption "
                   "check, the log."], {"shapes": results})
    print(f"run logs: {work}")


def plot(pairs, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = np.arange(1, len(pairs) + 1)
    left.plot(x, [a for a, _ in pairs], "o-", label="plain loop")
    left.plot(x, [b for _, b in pairs], "s-", label="train.py")
    left.set(xlabel="pair", ylabel="tokens/s", title="throughput per pair")
    left.legend()
    ratios = [b / a for a, b in pairs]
    right.bar(x, ratios)
    right.axhline(1.0, color="black", lw=0.8)
    right.axhline(0.97, color="red", lw=0.8, ls="--", label="0.97")
    right.set(xlabel="pair", ylabel="train.py / plain",
              ylim=(min(0.9, min(ratios) - 0.02), max(1.05, max(ratios) + 0.02)),
              title="ratio")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
