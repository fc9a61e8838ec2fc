"""Throughput and MFU of train.py by preset, precision and strategy (and torch.compile).

    python benchmarks/throughput.py                 # the CPU grid below (~8 min on 2 cores)
    python benchmarks/throughput.py --gpu           # a GPU grid: single GPU and, with 2+ GPUs, DDP/FSDP2/ZeRO-3

Each row is one `accelerate launch` of recipes/train.py; its figures come from run_summary.json:
tokens/s (median of the log intervals after the first), MFU (model FLOP/s per device over the
peak: datasheet for GPUs, the matmul ceiling measured at start on CPU), peak memory of rank 0.
2-process rows on CPU run 1 thread per process (the machine's 2 cores), FSDP2 through the CPU
harness. Writes benchmarks/results/throughput-<date>/ (table.md, results.json, throughput.png).
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench_utils import ACCELERATE, HARNESS, ROOT, run, steady_median, summary, write_results

CPU_2 = ["--num_processes", "2", "--num_cpu_threads_per_process", "1"]
# (label, preset, precision, strategy config, launch args, extra env, extra options)
CPU_GRID = [
    ("tiny fp32 1 proc", "tiny", "no", "cpu.yaml", ["--num_cpu_threads_per_process", "2"], {}, []),
    ("tiny fp32 1 proc --compile", "tiny", "no", "cpu.yaml", ["--num_cpu_threads_per_process", "2"], {}, ["--compile"]),
    # eager again: compile's effect is judged against the eager runs on both sides of it (A B A)
    ("tiny fp32 1 proc (again)", "tiny", "no", "cpu.yaml", ["--num_cpu_threads_per_process", "2"], {}, []),
    ("tiny bf16 1 proc", "tiny", "bf16", "cpu.yaml", ["--num_cpu_threads_per_process", "2"], {}, ["--max_steps", "10"]),
    ("tiny fp32 DDP 2 proc", "tiny", "no", "ddp.yaml", CPU_2, {"ACCELERATE_USE_CPU": "true"}, []),
    ("tiny fp32 FSDP2 2 proc", "tiny", "no", "fsdp.yaml", CPU_2, HARNESS, []),
    ("small fp32 1 proc", "small", "no", "cpu.yaml", ["--num_cpu_threads_per_process", "2"], {},
     ["--micro_batch_size", "4", "--max_steps", "12", "--log_every", "3"]),
]
GPU_GRID = [
    ("small bf16 1 GPU", "small", "bf16", "single_gpu.yaml", [], {}, []),
    ("small bf16 1 GPU --compile", "small", "bf16", "single_gpu.yaml", [], {}, ["--compile"]),
    ("1b bf16 1 GPU", "1b", "bf16", "single_gpu.yaml", [], {}, ["--micro_batch_size", "8", "--seq_len", "2048"]),
    ("small fp16 1 GPU", "small", "fp16", "fp16.yaml", [], {}, []),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="run the GPU grid instead of the CPU one")
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / f"throughput-{time.strftime('%Y-%m-%d')}")
    args = parser.parse_args()
    grid = GPU_GRID if args.gpu else CPU_GRID
    ceilings = {} if args.gpu else best_cpu_ceilings()
    work = Path(tempfile.mkdtemp(prefix="throughput-"))
    args.out.mkdir(parents=True, exist_ok=True)
    rows, results = [], []
    for i, (label, preset, precision, config, launch_args, env, extra) in enumerate(grid):
        out = work / f"run{i}"
        options = ["--preset", preset, "--seq_len", "256", "--micro_batch_size", "16",
                   "--max_steps", str(args.max_steps),
                   "--warmup_steps", "3", "--log_every", "5", "--eval_every", "0", "--save_model", "false", *extra,
                   "--output_dir", str(out)]
        run([ACCELERATE, "launch", "--config_file", f"accelerate_configs/{config}", *launch_args,
             "--mixed_precision", precision, "recipes/train.py", *options], env=env, log=work / f"run{i}.log")
        s = summary(out)
        tokens_per_s = steady_median(s)
        mfu = steady_median(s, "mfu")
        peak = s["peak_memory_per_rank"][0]
        rss = peak.get("cuda_max_allocated_bytes", peak["cpu_max_rss_bytes"])
        world = s["setup"]["world_size"]
        row = {"label": label, "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / world,
               "mfu": mfu, "model_tflops_per_device": steady_median(s, "model_tflops_per_device"),
               "peak_tflops_per_device": s["peak_flops_per_device"]["tflops"],
               "peak_source": s["peak_flops_per_device"]["source"], "peak_memory_rank0_bytes": rss,
               "final_loss": s["losses"][-1]["loss"], "distributed_type": s["setup"]["distributed_type"]}
        threads = 1 if "2 proc" in label else 2
        ceiling = ceilings.get((precision, threads))
        row["best_ceiling_tflops"] = ceiling
        row["flops_over_best_ceiling"] = row["model_tflops_per_device"] / ceiling if ceiling else None
        results.append(row)
        rows.append([label, row["distributed_type"], f"{tokens_per_s:,.0f}", f"{row['tokens_per_s_per_device']:,.0f}",
                     f"{row['model_tflops_per_device'] * 1000:.1f}", f"{row['peak_tflops_per_device'] * 1000:.1f}",
                     f"{mfu:.1%}",
                     f"{row['flops_over_best_ceiling']:.1%}" if ceiling else "-",
                     f"{rss / 2**30:.2f}", f"{row['final_loss']:.3f}"])
        print(f"{label}: {tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%}", flush=True)
    notes = ["Model GFLOP/s = flops_per_token (6N + attention) x tokens/s per device. Peak = datasheet on GPUs; on CPU "
             "a 1024x1024 matmul in the run's dtype, measured at start with the process's threads (so a 1-thread "
             "process of a 2-process run is measured against 1 thread). Memory: CUDA max allocated on GPUs, peak "
             "RSS on CPU (rank 0)."]
    write_results(args.out, "train.py throughput and MFU",
                  ["run", "strategy", "tokens/s", "tokens/s per device", "model GFLOP/s per device",
                   "peak GFLOP/s per device", "MFU", "vs best ceiling", "peak memory GiB", "last loss"], rows,
                  notes + ceiling_notes(ceilings), {"runs": results, "best_cpu_ceilings_tflops": {
                      f"{p}/{t} threads": v for (p, t), v in ceilings.items()}})
    plot(results, args.out / "throughput.png")
    print(f"run logs: {work}")


def best_cpu_ceilings(bursts: int = 10) -> dict:
    """The machine's matmul ceiling, measured here at leisure (best of many bursts): a run's own
    start-up measurement is short and lands on whatever the shared machine was doing then."""
    import torch

    sys.path.insert(0, str(ROOT))
    from train_extras.observe.metrics import measure_matmul_tflops

    found = {}
    for precision, dtype in (("no", torch.float32), ("bf16", torch.bfloat16)):
        for threads in (2, 1):
            torch.set_num_threads(threads)
            found[(precision, threads)] = max(measure_matmul_tflops(torch.device("cpu"), dtype, seconds=0.2)[0]
                                              for _ in range(bursts))
    return found


def ceiling_notes(ceilings: dict) -> list[str]:
    if not ceilings:
        return []
    text = ", ".join(f"{'fp32' if p == 'no' else p} {t} thread{'s' if t > 1 else ''} {v * 1000:.0f} GFLOP/s"
                     for (p, t), v in ceilings.items())
    return ["", "Best 1024x1024 matmul ceilings of this machine (best of 50 bursts of 0.2 s, before the runs): "
                f"{text}. "
                "'vs best ceiling' = model GFLOP/s per device over that ceiling for the run's precision and threads; "
                "'MFU' uses the run's own start-up measurement."]


def plot(results, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.5 * len(results) + 1.5))
    labels = [r["label"] for r in results]
    left.barh(labels, [r["tokens_per_s_per_device"] for r in results])
    left.set(xlabel="tokens/s per device", title="throughput")
    left.invert_yaxis()
    # On CPU the run's own start-up ceiling is noisy (a shared machine): plot against the best
    # ceiling measured at leisure by this script where there is one.
    on_cpu = all(r.get("flops_over_best_ceiling") is not None for r in results)
    right.barh(labels, [100 * (r["flops_over_best_ceiling"] if on_cpu else r["mfu"]) for r in results],
               color="tab:orange")
    right.set(xlabel="model FLOP/s / best matmul ceiling, %" if on_cpu else "MFU %",
              title="model FLOPs utilisation", yticklabels=[])
    right.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
