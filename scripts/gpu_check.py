"""GPU check: every recipe with its config on the GPUs present, in priority order, one row each.

    # all 26 runs; the first 16 took ~11 min on one H200
    python scripts/gpu_check.py --out benchmarks/results/gpu_check-$(date +%F)
    python scripts/gpu_check.py --only 10 11 12 --out DIR                      # a subset, numbered as --dry-run shows
    python scripts/gpu_check.py --dry-run                                       # what it would run, in order

Each run is a real `accelerate launch` of a recipe for a fixed number of steps on a preset that
keeps the GPU busy; the row is printed (and appended to --out) as soon as the run ends: recipe,
config, precision, world size, tokens/s, MFU, peak memory, final loss, status. With one GPU the
distributed configs run with world size 1, which still exercises their CUDA code paths (NCCL
process group, FSDP2 DTensors, DeepSpeed's engine and CUDA/CPU ops, the fp16 GradScaler). Tensor
parallel, 2D, HSDP and the pipeline split the model over GPUs: with fewer GPUs than they need (2, 4,
4, 2) their rows say "skipped (needs N GPUs)", which does not fail the check.
--budget-seconds stops starting new runs once the next one would not fit.

Rows come from each run's run_summary.json (never from parsing logs). tokens/s is the median of
the logging intervals after the first (which holds start-up work); MFU = tokens/s x FLOPs per
token / (world size x the GPU's dense datasheet peak for that precision, train_extras/observe/metrics.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: find common/

# Priority order: the most informative runs first, DeepSpeed last (its first use builds CPU ops).
# (recipe, config, mixed precision)
RUNS = [
    ("train.py", "single_gpu.yaml", "bf16"),
    ("fsdp_full_shard.py", "fsdp.yaml", "bf16"),
    ("ddp.py", "ddp.yaml", "bf16"),
    ("fp16_scaler.py", "fp16.yaml", "fp16"),
    ("accumulate_and_clip.py", "fsdp.yaml", "bf16"),
    ("train.py", "fsdp.yaml", "bf16"),
    ("train.py", "ddp.yaml", "bf16"),
    ("train.py", "fsdp.yaml", "fp16"),  # fp16 under FSDP2 can only be proven on GPUs
    ("bf16_baseline.py", "single_gpu.yaml", "bf16"),
    ("train.py", "fp16.yaml", "fp16"),
    ("fp16_scaler.py", "ddp.yaml", "fp16"),
    ("accumulate_and_clip.py", "ddp.yaml", "bf16"),
    ("train.py", "fsdp_shard_grad_op.yaml", "bf16"),  # the rest of the ladder (tools/plan/)
    ("train.py", "fsdp_offload.yaml", "bf16"),
    ("tensor_parallel.py", "tp.yaml", "bf16"),  # model parallelism: needs several GPUs (MIN_GPUS)
    ("train.py", "tp.yaml", "bf16"),
    ("train.py", "fsdp_tp.yaml", "bf16"),
    ("train.py", "multi_node_hsdp.yaml", "bf16"),  # HSDP on one machine's GPUs: 2 replicas x GPUs/2
    ("pipeline_parallel.py", "ddp.yaml", "bf16"),
    ("train.py", "deepspeed_zero1.yaml", "bf16"),  # DeepSpeed without offload: torch's AdamW, no op build
    ("train.py", "deepspeed_zero2.yaml", "bf16"),
    ("train.py", "deepspeed_zero3.yaml", "bf16"),
    ("deepspeed_zero3_offload.py", "deepspeed_zero3_offload.yaml", "bf16"),
    ("train.py", "deepspeed_zero3_offload.yaml", "bf16"),
    ("train.py", "deepspeed_zero3_offload.yaml", "fp16"),  # DeepSpeed's own loss scaler, GPU only
    ("accumulate_and_clip.py", "deepspeed_zero3_offload.yaml", "bf16"),
]
SINGLE_PROCESS_CONFIGS = {"single_gpu.yaml", "fp16.yaml", "cpu.yaml"}


def model_parallel_layout(recipe: str, config: str, gpus: int, preset: str):
    """(processes, extra launch arguments, extra recipe options) of a run, or the number of GPUs it
    needs when there are fewer. TP takes the largest power of two <= the GPUs that divides the
    preset's heads, key/value heads and MLP width; 2D is (GPUs / 2) x TP 2; the pipeline one stage per
    GPU (at most one per layer) with 2 micro-batches per stage."""
    from common.model import PRESETS

    shape = PRESETS[preset]
    if config == "tp.yaml":
        tp = 1
        while tp * 2 <= gpus and all(shape[k] % (tp * 2) == 0 for k in
                                     ("num_attention_heads", "num_key_value_heads", "intermediate_size")):
            tp *= 2
        return (tp, ["--parallelism_config_tp_size", str(tp)], []) if tp >= 2 else 2
    if config == "fsdp_tp.yaml":
        return (gpus // 2 * 2, ["--parallelism_config_dp_shard_size", str(gpus // 2),
                                "--parallelism_config_tp_size", "2"], []) if gpus >= 4 else 4
    if config == "multi_node_hsdp.yaml":  # the two "machines" as two halves of this one
        return (gpus // 2 * 2, ["--num_machines", "1", "--parallelism_config_dp_replicate_size", "2",
                                "--parallelism_config_dp_shard_size", str(gpus // 2)], []) if gpus >= 4 else 4
    if recipe == "pipeline_parallel.py":
        stages = min(gpus, shape["num_hidden_layers"])
        return (stages, [], ["--gradient_accumulation_steps", str(2 * stages)]) if stages >= 2 else 2
    return (gpus, [], [])
COLUMNS = ["recipe", "config", "precision", "world", "tokens/s", "MFU", "peak mem GiB", "final loss", "seconds",
           "status"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="model preset for every run (default: small, ~114M)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--budget-seconds", type=float, default=230.0,
                        help="start no run that is not expected to finish within this many seconds from the start")
    parser.add_argument("--run-timeout", type=float, default=150.0, help="kill a single run after this many seconds")
    parser.add_argument("--out", type=Path, help="folder for gpu_check.md, gpu_check.jsonl and per-run logs")
    parser.add_argument("--single-process-only", action="store_true",
                        help="only the 1-process configs (used by the CPU test)")
    parser.add_argument("--only", type=int, nargs="+", metavar="N",
                        help="run only these entries of the plan (numbers as --dry-run prints them), in this order")
    parser.add_argument("--dry-run", action="store_true", help="print the runs in order and exit")
    return parser.parse_args(argv)


def planned_runs(args) -> list[tuple[str, str, str]]:
    runs = [run for run in RUNS if not args.single_process_only or run[1] in SINGLE_PROCESS_CONFIGS]
    if args.only:
        bad = [n for n in args.only if not 1 <= n <= len(runs)]
        if bad:
            raise SystemExit(f"error: --only {bad[0]}: the plan has runs 1 to {len(runs)} (see --dry-run)")
        runs = [runs[n - 1] for n in args.only]
    return runs


def environment() -> dict:
    import accelerate
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'unknown'})"
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "accelerate": accelerate.__version__, "transformers": transformers.__version__}
    try:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    except ImportError:
        versions["deepspeed"] = None
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
            "gpus": torch.cuda.device_count(), "versions": versions}


def deepspeed_json_in(config: str, precision: str, folder: Path) -> Path:
    """A copy of the config's DeepSpeed JSON with `precision` set: under DeepSpeed the JSON decides
    (accelerate_configs/*.json enable bf16, and --mixed_precision cannot override an explicit value)."""
    import yaml

    ds_file = yaml.safe_load((ROOT / "accelerate_configs" / config).read_text())["deepspeed_config"]
    ds_config = json.loads((ROOT / ds_file["deepspeed_config_file"]).read_text())
    ds_config.update(bf16={"enabled": precision == "bf16"}, fp16={"enabled": precision == "fp16"})
    out = Path(folder) / f"{Path(config).stem}.{precision}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(ds_config, indent=1))
    return out


def launch_command(recipe, config, precision, world, args, output_dir, extra_launch=(), extra_options=()) -> list[str]:
    launcher = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                str(ROOT / "accelerate_configs" / config)]
    if config.startswith("deepspeed"):
        launcher += ["--deepspeed_config_file", str(deepspeed_json_in(config, precision, Path(output_dir).parent))]
    else:
        launcher += ["--mixed_precision", precision]
    if config not in SINGLE_PROCESS_CONFIGS:
        launcher += ["--num_processes", str(world), *extra_launch]
    options = ["--preset", args.preset, "--seq_len", str(args.seq_len), "--micro_batch_size", str(args.micro_batch),
               "--max_steps", str(args.steps), "--warmup_steps", str(min(5, args.steps)), "--eval_every", "0",
               "--log_every", str(max(1, args.steps // 5)), "--save_model", "false", "--output_dir", str(output_dir),
               *extra_options]
    if recipe == "train.py":  # a rerun of the check into the same --out replaces its rows' runs
        options += ["--overwrite_output_dir", "true"]
    return launcher + [str(ROOT / "recipes" / recipe)] + options


def peak_memory(summary: dict, probes: Path) -> list[dict]:
    """Per rank: train.py records its peak memory; for the other recipes the tests' probes do
    (tests/probes/sitecustomize.py, on the workers' PYTHONPATH here)."""
    if "peak_memory_per_rank" in summary:
        return summary["peak_memory_per_rank"]
    finals = [json.loads(line)["final"] for f in sorted(probes.glob("rank*.jsonl"))
              for line in f.read_text().splitlines() if "final" in json.loads(line)]
    return [final["peak_memory"] for final in finals]


def row_from_summary(summary: dict, args, gpu_name: str, memory_per_rank: list[dict]) -> dict:
    from common.config import RecipeConfig
    from train_extras.observe.metrics import peak_tflops
    from common.model import model_config
    from train_extras.observe.flops import flops_per_token

    setup = summary["setup"]
    world = setup["world_size"]
    rates = [t["tokens_per_s"] for t in summary["throughput"]]
    steady = rates[1:] or rates  # the first interval holds start-up work (allocator, kernels' first use)
    tokens_per_s = statistics.median(steady)
    flops = flops_per_token(model_config(RecipeConfig(preset=args.preset), 259), args.seq_len)
    peak = peak_tflops(gpu_name, setup["mixed_precision"])
    mfu = tokens_per_s * flops / (world * peak * 1e12) if peak else None
    memory = max(r.get("cuda_max_allocated_bytes", r["cpu_max_rss_bytes"]) for r in memory_per_rank)
    return {"world": world, "distributed_type": setup["distributed_type"], "tokens/s": round(tokens_per_s),
            "MFU": None if mfu is None else round(mfu, 4), "peak mem GiB": round(memory / 2**30, 2),
            "final loss": round(summary["losses"][-1]["loss"], 4)}


def format_row(row: dict) -> str:
    def cell(column):
        value = row.get(column)
        if value is None:
            return "-"
        return f"{100 * value:.1f}%" if column == "MFU" else str(value)

    return "| " + " | ".join(cell(c) for c in COLUMNS) + " |"


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = planned_runs(args)
    if args.dry_run:
        for i, (recipe, config, precision) in enumerate(runs, 1):
            print(f"{i}. {recipe} {config} {precision}")
        return 0

    env = environment()
    world = max(1, env["gpus"])
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + list(argv or sys.argv[1:]))
    header = [f"# GPU check, {env['date']}", "", f"- GPU: {env['gpu']} x {env['gpus']}",
              f"- versions: {json.dumps(env['versions'])}", f"- command: `{command}`",
              f"- runs: preset {args.preset}, seq_len {args.seq_len}, micro-batch {args.micro_batch}/GPU, "
              f"{args.steps} steps", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    print("\n".join(header), flush=True)
    if args.out:
        (args.out / "logs").mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.md").write_text("\n".join(header) + "\n")

    start = time.monotonic()
    durations: list[float] = []
    failures = 0
    for recipe, config, precision in runs:
        row = {"recipe": recipe, "config": config, "precision": precision}
        elapsed = time.monotonic() - start
        expected = max(durations) if durations else 0.0  # the slowest run so far predicts the next
        layout = model_parallel_layout(recipe, config, world, args.preset)
        if isinstance(layout, int):
            row["status"] = f"skipped (needs {layout} GPUs)"
        elif elapsed + expected >= args.budget_seconds:
            row["status"] = "skipped (budget)"
        else:
            name = f"{recipe.removesuffix('.py')}__{config.removesuffix('.yaml')}__{precision}"
            run_dir = (args.out or Path("outputs/gpu_check")) / "runs" / name
            cmd = launch_command(recipe, config, precision, layout[0], args, run_dir, layout[1], layout[2])
            timeout = min(args.run_timeout, max(10.0, args.budget_seconds - elapsed))
            t0 = time.monotonic()
            try:
                paths = [str(ROOT / "tests" / "probes"), str(ROOT), os.environ.get("PYTHONPATH")]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                                      env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                           "PYTHONPATH": os.pathsep.join(filter(None, paths)),
                                           "ACCELERATE_RECIPES_PROBE_DIR": f"{run_dir}.probe"})
                output, code = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as err:
                output, code = f"{err.stdout or ''}{err.stderr or ''}", None
            row["seconds"] = round(time.monotonic() - t0, 1)
            durations.append(row["seconds"])
            if args.out:
                (args.out / "logs" / f"{name}.log").write_text(" ".join(cmd) + "\n\n" + str(output)[-20000:])
            summary_file = run_dir / "run_summary.json"
            if code == 0 and summary_file.exists():
                summary = json.loads(summary_file.read_text())
                memory = peak_memory(summary, Path(f"{run_dir}.probe"))
                row.update(row_from_summary(summary, args, env["gpu"], memory))
                row["status"] = "ok"
            else:
                failures += 1
                errors = [line for line in str(output).splitlines() if line.startswith("error: ")]
                row["status"] = ("timeout" if code is None else f"failed (exit {code})") + (
                    f": {errors[0][7:]}" if errors else "")
                # The cause goes to stdout too: on a lent machine the console may be all that comes back.
                print("\n".join(f"    {line}" for line in str(output).splitlines()[-25:]), flush=True)
        print(format_row(row), flush=True)
        if args.out:
            with open(args.out / "gpu_check.md", "a") as f:
                f.write(format_row(row) + "\n")
            with open(args.out / "gpu_check.jsonl", "a") as f:
                f.write(json.dumps({**row, "env": env}) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
