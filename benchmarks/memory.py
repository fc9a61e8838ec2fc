"""Per-rank memory of every rung of the ZeRO / FSDP ladder, measured, against the planner.

    python benchmarks/memory.py                      # preset small (113.7M), 2 CPU processes, bf16, ~6 min
    python benchmarks/memory.py --precision no       # fp32

Each rung is one `accelerate launch` of recipes/train.py with its config from accelerate_configs/
(2 processes over gloo; FSDP2 and DeepSpeed through the CPU harness), with the tests' probes
loaded (tests/probes/sitecustomize.py): they record, per rank, the heap in use (glibc's mallinfo2)
before the model exists, after backward and after the optimizer step of its second step; the peak
is the process's peak RSS (run_summary.json) minus its RSS before the model. The planner
(tools/plan/) predicts the same quantities for the same model, world size and precision. On CPU
the device and the host are one memory, so the offload rungs are compared on device + host
together, and "peak" includes the host. Writes benchmarks/results/memory-<date>/ (table.md,
results.json, memory.png).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench_utils import ACCELERATE, ROOT, run, summary, write_results

sys.path.insert(0, str(ROOT))
from tools import plan  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "no"], help="accelerate's mixed_precision")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / f"memory-{time.strftime('%Y-%m-%d')}")
    args = parser.parse_args()
    precision = "fp32" if args.precision == "no" else args.precision
    shape = plan.model_shape(preset=args.preset)
    request = plan.Request(gpus=2, precision=precision, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size)
    planned = {row["rung"].config: row for row in plan.evaluate(shape, request)}
    work = Path(tempfile.mkdtemp(prefix="memory-"))
    rows, results = [], []
    for rung in plan.LADDER:
        out = work / rung.config.removesuffix(".yaml")
        env = {"ACCELERATE_USE_CPU": "true"} if rung.framework == "ddp" else {"ACCELERATE_RECIPES_CPU_HARNESS": "1"}
        probes = Path(f"{out}.probe")  # the probes chain the CPU harness
        env.update(PYTHONPATH=str(ROOT / "tests" / "probes"), ACCELERATE_RECIPES_PROBE_DIR=str(probes),
                   # Freed tensors go back to the OS, so the peak RSS follows what is alive: by default
                   # glibc raises its mmap threshold as large blocks are freed and keeps later ones in
                   # its heap (measured: +0.5 GB of RSS beyond the heap in use after backward, DDP).
                   MALLOC_MMAP_THRESHOLD_="65536")
        options = ["--preset", args.preset, "--seq_len", str(args.seq_len), "--micro_batch_size",
                   str(args.micro_batch_size), "--max_steps", "3", "--warmup_steps", "1", "--eval_every", "0",
                   "--log_every", "1", "--save_model", "false", "--output_dir", str(out),
                   # The peak is the whole run's: no end-of-run sample (it gathers every weight under
                   # ZeRO-3 and FSDP2), and no document mask: SDPA given its dense mask leaves the flash
                   # kernel, while the planner counts O(seq) attention without a mask.
                   "--sample_length", "0", "--document_mask", "false"]
        run([ACCELERATE, "launch", "--config_file", f"accelerate_configs/{rung.config}", "--num_processes", "2",
             "--num_cpu_threads_per_process", "1", "--mixed_precision", args.precision, "recipes/train.py", *options],
            env=env, log=work / f"{out.name}.log")
        s = summary(out)
        n_params = s["model"]["parameters"]
        states = plan.model_state_bytes(rung, n_params, 2, precision, shape=shape)
        want = {"rest": states["at_rest"]["device"]["total"] + states["at_rest"]["host"]["total"],
                "step": states["at_step"]["device"]["total"] + states["at_step"]["host"]["total"],
                "peak": planned[rung.config]["peak"] + planned[rung.config]["host"]}
        recorded = [[json.loads(line) for line in (probes / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
        memory_points = [{k: v for row in rows_ if "memory" in row for k, v in row["memory"].items()}
                         for rows_ in recorded]
        if "host_bytes" not in memory_points[0]["before_model"]:
            raise SystemExit("error: no host memory figure (tests/probes/facts.memory_in_use needs glibc >= 2.33)")
        ranks = []
        for rank, (points, peak) in enumerate(zip(memory_points, s["peak_memory_per_rank"])):
            base = points["before_model"]
            ranks.append({"rank": rank, "rest": points["after_step"]["host_bytes"] - base["host_bytes"],
                          "step": points["after_backward"]["host_bytes"] - base["host_bytes"],
                          "peak": peak["cpu_max_rss_bytes"] - base["rss_bytes"]})
        worst = {k: max(ranks, key=lambda r: abs(r[k] / want[k] - 1))[k] for k in want}
        deepspeed = rung.framework == "deepspeed"  # steps inside backward: no point with gradients held
        results.append({"rung": rung.label, "config": rung.config, "n_params": n_params, "planned": want,
                        "measured_per_rank": ranks, "strategy": recorded[0][-1]["final"]["strategy"],
                        "losses": [r["loss"] for r in s["losses"]]})
        rows.append([rung.label, f"`{rung.config}`",
                     f"{worst['rest'] / 1e6:,.0f}", f"{want['rest'] / 1e6:,.0f}", f"{worst['rest'] / want['rest']:.3f}",
                     "-" if deepspeed else f"{worst['step'] / 1e6:,.0f}", f"{want['step'] / 1e6:,.0f}",
                     "-" if deepspeed else f"{worst['step'] / want['step']:.3f}",
                     f"{worst['peak'] / 1e6:,.0f}", f"{want['peak'] / 1e6:,.0f}",
                     f"{worst['peak'] / want['peak']:.3f}"])
        print(" | ".join(rows[-1]), flush=True)
    notes = [
        f"Model: preset {args.preset}, {results[0]['n_params'] / 1e6:.1f}M parameters; 2 processes (1 thread each), "
        f"mixed precision {args.precision}, micro-batch {args.micro_batch_size} x seq {args.seq_len}; MB = 1e6 bytes "
        "per rank; the rank furthest from the plan is shown (results.json has both).",
        "Measured: heap in use (glibc mallinfo2) at the second step minus before the "
        "model was built: 'rest' after optimizer.zero_grad, 'grads' after backward (DeepSpeed has already stepped "
        "inside backward there, so '-'); 'peak' = peak RSS minus RSS before the model (MALLOC_MMAP_THRESHOLD_=65536: "
        "freed tensors return to the OS), i.e. it also holds activations, allocator caching and anything else the "
        "run touched (no end-of-run sample, no document mask).",
        "Planned: tools/plan/ model_state_bytes (rest, grads) and evaluate()'s peak (model states + in-flight "
        "parameters + activations + logits at the largest moment of backward, with the gradients made by then; "
        "activations counted by its probes) + host bytes. On CPU the offload rungs' host and device are one memory: "
        "compared as their sum.",
    ]
    write_results(args.out, "Memory per rank: measured vs planned",
                  ["rung", "config", "rest MB", "plan", "ratio", "grads MB", "plan", "ratio", "peak MB", "plan",
                   "ratio"], rows, notes, {"runs": results})
    plot(results, args.out / "memory.png")
    print(f"run logs: {work}")


def plot(results, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [r["rung"] for r in results]
    y = np.arange(len(labels))
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(labels) + 2), sharey=True)
    for ax, key, title in ((axes[0], "rest", "model states at rest"), (axes[1], "peak", "peak during the step")):
        measured = [max(r[key] for r in res["measured_per_rank"]) / 1e9 for res in results]
        planned = [res["planned"][key] / 1e9 for res in results]
        ax.barh(y - 0.2, measured, height=0.4, label="measured (max over ranks)")
        ax.barh(y + 0.2, planned, height=0.4, label="planner", color="tab:orange")
        ax.set(xlabel="GB per rank", title=title)
    axes[0].set_yticks(y, labels)
    axes[0].invert_yaxis()
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2)
    fig.suptitle(f"{results[0]['n_params'] / 1e6:.1f}M-parameter model, 2 processes: measured vs tools/plan/")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
