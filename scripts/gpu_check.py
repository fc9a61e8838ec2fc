"""GPU check: what only a GPU can show, then every recipe with its config, in priority order, one row each.

    bash scripts/gpu_check.sh                                # the prepared command: at most 10 min on one GPU
    python scripts/gpu_check.py --out benchmarks/results/gpu_check-$(date +%F)
    python scripts/gpu_check.py --only 10 11 12 --out DIR     # a subset, numbered as --dry-run shows
    python scripts/gpu_check.py --dry-run                      # what it would run, in order

Each run is a real `accelerate launch` for a fixed number of steps on a preset that keeps the GPU
busy; the row is printed (and appended to --out's gpu_check.md) as soon as the run ends: recipe,
config, precision, what the row measures, world size, tokens/s, MFU, peak memory, final loss,
status. Every run's whole output is streamed into logs/<row>.log as it comes (a crash or a timeout
keeps it). The test probes are off (they cost a host sync per micro-batch), except in the rows that
count host syncs. The first rows are pairs (docs/benchmarks.md#the-gpu-check says what each proves),
compared under "Paired rows" at the end: the default job as the README runs it; document masks on
and off; the host syncs of a bf16 and an fp16 step by call site (the probes' census and CUDA's sync
debug mode); the peak memory of training with and without evals at a 128k vocabulary under the
chunked loss; offload with all threads and with one; the first 10 losses of FSDP2 and ZeRO-3.

With one GPU the distributed configs run with world size 1, which still exercises their CUDA code
paths (NCCL process group, FSDP2 DTensors, DeepSpeed's engine and CUDA/CPU ops, the fp16 GradScaler).
Tensor parallel, 2D, HSDP and the pipeline split the model over GPUs: with fewer GPUs than they need
(2, 4, 4, 2) their rows say "skipped (needs N GPUs)", which does not fail the check.
--budget-seconds stops starting new runs once the next one would not fit.

Rows come from each run's run_summary.json (never from parsing logs). tokens/s is the median of
the logging intervals after the first (which holds start-up work); MFU is train.py's own, and for
the focused recipes tokens/s x FLOPs per token / (world size x the GPU's dense datasheet peak for
that precision, train_extras/observe/metrics.py); peak memory is train.py's (the focused recipes
record none).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: find common/

@dataclass(frozen=True)
class Run:
    """One row: a recipe under a config and precision; `what` names a row that measures one thing
    against another row (options and environment added to the plain run), "" for a plain row."""
    recipe: str
    config: str
    precision: str
    what: str = ""
    options: tuple = ()
    env: tuple = ()  # (name, value) pairs
    steps: int | None = None  # None: --steps


VOCAB_128K = "vocab128k"  # a model folder the check writes: the preset with a 131,072-token vocabulary
# Priority order: what no CPU can show first, DeepSpeed's offload last (its CPU Adam op builds first).
RUNS = [
    Run("train.py", "single_gpu.yaml", "bf16", "default job", steps=0),  # the README's job, its own options
    Run("train.py", "single_gpu.yaml", "bf16"),
    Run("train.py", "single_gpu.yaml", "bf16", "document mask off", ("--document_mask", "false")),
    Run("train.py", "single_gpu.yaml", "bf16", "host syncs", env=(("ACCELERATE_RECIPES_PROBE_SYNCS", "1"),), steps=10),
    Run("train.py", "single_gpu.yaml", "bf16", "128k vocab, train", (VOCAB_128K, "--loss_chunk_size", "4096")),
    Run("train.py", "single_gpu.yaml", "bf16", "128k vocab, train + eval",
        (VOCAB_128K, "--loss_chunk_size", "4096", "--eval_every", "15", "--eval_batches", "2")),
    Run("train.py", "fsdp_offload.yaml", "bf16"),
    Run("train.py", "fsdp_offload.yaml", "bf16", "offload, 1 thread", env=(("OMP_NUM_THREADS", "1"),)),
    Run("train.py", "fsdp.yaml", "bf16", "first losses", ("--log_every", "1")),
    Run("train.py", "deepspeed_zero3.yaml", "bf16", "first losses", ("--log_every", "1")),  # torch's AdamW: no build
    Run("accumulate_and_clip.py", "ddp.yaml", "bf16"),
    Run("train.py", "fp16.yaml", "fp16", "host syncs", env=(("ACCELERATE_RECIPES_PROBE_SYNCS", "1"),), steps=10),
    Run("fsdp_full_shard.py", "fsdp.yaml", "bf16"),
    Run("ddp.py", "ddp.yaml", "bf16"),
    Run("fp16_scaler.py", "fp16.yaml", "fp16"),
    Run("accumulate_and_clip.py", "fsdp.yaml", "bf16"),
    Run("train.py", "ddp.yaml", "bf16"),
    Run("train.py", "fsdp.yaml", "fp16"),  # fp16 under FSDP2 can only be proven on GPUs
    Run("bf16_baseline.py", "single_gpu.yaml", "bf16"),
    Run("train.py", "fp16.yaml", "fp16"),
    Run("fp16_scaler.py", "ddp.yaml", "fp16"),
    Run("train.py", "fsdp_shard_grad_op.yaml", "bf16"),  # the rest of the ladder (tools/plan/)
    Run("tensor_parallel.py", "tp.yaml", "bf16"),  # model parallelism: needs several GPUs (MIN_GPUS)
    Run("train.py", "tp.yaml", "bf16"),
    Run("train.py", "fsdp_tp.yaml", "bf16"),
    Run("train.py", "multi_node_hsdp.yaml", "bf16"),  # HSDP on one machine's GPUs: 2 replicas x GPUs/2
    Run("pipeline_parallel.py", "ddp.yaml", "bf16"),
    Run("train.py", "deepspeed_zero1.yaml", "bf16"),  # DeepSpeed without offload: torch's AdamW, no op build
    Run("train.py", "deepspeed_zero2.yaml", "bf16"),
    Run("deepspeed_zero3_offload.py", "deepspeed_zero3_offload.yaml", "bf16"),
    Run("train.py", "deepspeed_zero3_offload.yaml", "bf16"),
    Run("train.py", "deepspeed_zero3_offload.yaml", "bf16", "offload, 1 thread", env=(("OMP_NUM_THREADS", "1"),)),
    Run("train.py", "deepspeed_zero3_offload.yaml", "fp16"),  # DeepSpeed's own loss scaler, GPU only
    Run("accumulate_and_clip.py", "deepspeed_zero3_offload.yaml", "bf16"),
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
COLUMNS = ["recipe", "config", "precision", "what", "world", "tokens/s", "MFU", "peak mem GiB", "final loss", "seconds",
           "status"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help="model preset for every run (default: small, ~114M)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per step")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--budget-seconds", type=float, default=480.0,
                        help="start no run that is not expected to finish within this many seconds from the start")
    parser.add_argument("--run-timeout", type=float, default=150.0, help="kill a single run after this many seconds")
    parser.add_argument("--out", type=Path, help="folder for gpu_check.md, gpu_check.jsonl and per-run logs")
    parser.add_argument("--single-process-only", action="store_true",
                        help="only the 1-process configs (used by the CPU test)")
    parser.add_argument("--only", type=int, nargs="+", metavar="N",
                        help="run only these entries of the plan (numbers as --dry-run prints them), in this order")
    parser.add_argument("--dry-run", action="store_true", help="print the runs in order and exit")
    return parser.parse_args(argv)


def planned_runs(args) -> list[Run]:
    runs = [run for run in RUNS if not args.single_process_only or run.config in SINGLE_PROCESS_CONFIGS]
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


def launch_command(run: Run, world, args, output_dir, extra_launch=(), extra_options=()) -> list[str]:
    launcher = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                str(ROOT / "accelerate_configs" / run.config)]
    if run.config.startswith("deepspeed"):
        launcher += ["--deepspeed_config_file", str(deepspeed_json_in(run.config, run.precision,
                                                                       Path(output_dir).parent))]
    else:
        launcher += ["--mixed_precision", run.precision]
    if run.config not in SINGLE_PROCESS_CONFIGS:
        launcher += ["--num_processes", str(world), *extra_launch]
    options = [str(Path(output_dir).parents[1] / VOCAB_128K) if o == VOCAB_128K else o for o in run.options]
    if VOCAB_128K in run.options:
        options = ["--model_name_or_path", *options]
    steps = args.steps if run.steps is None else run.steps
    if steps:  # 0: the job's own options (the default job)
        model = [] if VOCAB_128K in run.options else ["--preset", args.preset]
        options = [*model, "--seq_len", str(args.seq_len), "--micro_batch_size", str(args.micro_batch),
                   "--max_steps", str(steps), "--warmup_steps", str(min(5, steps)), "--eval_every", "0",
                   "--log_every", str(max(1, steps // 5)), "--save_model", "false", *options]
    options += ["--output_dir", str(output_dir), *extra_options]
    if run.recipe == "train.py":  # a rerun of the check into the same --out replaces its rows' runs
        options += ["--overwrite_output_dir", "true"]
    return launcher + [str(ROOT / "recipes" / run.recipe)] + options


def write_vocab_128k(folder: Path, preset: str) -> None:
    """The preset's model with a 131,072-token vocabulary (Llama 3's size) and the byte tokenizer:
    the logits of one micro-batch are then large enough to show whether an eval builds them whole."""
    if (folder / "config.json").exists():
        return
    from transformers import AutoModelForCausalLM

    from common.config import RecipeConfig
    from common.data import build_tokenizer
    from common.model import model_config

    cfg = RecipeConfig(preset=preset)
    AutoModelForCausalLM.from_config(model_config(cfg, 131072)).save_pretrained(folder)
    build_tokenizer(cfg).save_pretrained(folder)


def row_from_summary(summary: dict, args, gpu_name: str) -> dict:
    """The row's figures from run_summary.json: train.py's own MFU and peak memory; for the focused
    recipes (which record neither) MFU from the preset's FLOPs, and no memory (no probes run here)."""
    from common.config import RecipeConfig
    from common.model import model_config
    from train_extras.observe.flops import flops_per_token
    from train_extras.observe.metrics import peak_tflops

    setup = summary["setup"]
    world = setup["world_size"]
    rates = [t["tokens_per_s"] for t in summary["throughput"]]
    steady = rates[1:] or rates  # the first interval holds start-up work (allocator, kernels' first use)
    tokens_per_s = statistics.median(steady)
    if "mfu_median" in summary:
        mfu = summary["mfu_median"]
    else:
        flops = flops_per_token(model_config(RecipeConfig(preset=args.preset), 259), args.seq_len)
        peak = peak_tflops(gpu_name, setup["mixed_precision"])
        mfu = tokens_per_s * flops / (world * peak * 1e12) if peak else None
    ranks = summary.get("peak_memory_per_rank") or []
    memory = max((r.get("cuda_max_allocated_bytes", r["cpu_max_rss_bytes"]) for r in ranks), default=None)
    return {"world": world, "distributed_type": setup["distributed_type"], "tokens/s": round(tokens_per_s),
            "MFU": None if mfu is None else round(mfu, 4),
            "peak mem GiB": None if memory is None else round(memory / 2**30, 2),
            "final loss": round(summary["losses"][-1]["loss"], 4),
            "losses": [round(r["loss"], 4) for r in summary["losses"][:10]]}


def format_row(row: dict) -> str:
    def cell(column):
        value = row.get(column)
        if value is None:
            return "-"
        return f"{100 * value:.1f}%" if column == "MFU" else str(value)

    return "| " + " | ".join(cell(c) for c in COLUMNS) + " |"


def run_name(run: Run) -> str:
    what = run.what.replace(" ", "-").replace(",", "").replace("+", "and")
    return "__".join(filter(None, [run.recipe.removesuffix(".py"), run.config.removesuffix(".yaml"), run.precision,
                                   what]))


def launch(run: Run, cmd: list[str], run_dir: Path, log: Path, timeout: float) -> int | None:
    """The run, its whole output streamed into `log` as it comes (a crash or a timeout keeps it all);
    the exit code, None on a timeout. Probes (tests/probes/) only where the row counts host syncs:
    they cost a host sync per micro-batch themselves, so no timed row has them."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **dict(run.env)}
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]
    if "ACCELERATE_RECIPES_PROBE_SYNCS" in env:
        paths.insert(0, str(ROOT / "tests" / "probes"))
        env["ACCELERATE_RECIPES_PROBE_DIR"] = f"{run_dir}.probe"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write(" ".join(f"{k}={v}" for k, v in run.env) + (" " if run.env else "") + " ".join(cmd) + "\n\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\n(gpu_check: killed after {timeout:.0f} s)\n")
            return None


def sync_census(probe_dir: Path) -> dict:
    """Rank 0's host syncs of its last step, by call site (tests/probes/sitecustomize.py; on a GPU with
    CUDA's own sync debug mode too: its warnings are counted as `cuda sync` at their site)."""
    lines = (probe_dir / "rank0.jsonl").read_text().splitlines() if (probe_dir / "rank0.jsonl").exists() else []
    steps = [json.loads(line)["syncs"] for line in lines if '"syncs"' in line]
    return steps[-1]["sites"] if steps else {}


def comparisons(rows: list[dict]) -> list[str]:
    """What the paired rows show, beside each other (docs/benchmarks.md#the-gpu-check says what each proves)."""
    def find(recipe, config, precision, what=""):
        return next((r for r in rows if (r["recipe"], r["config"], r["precision"], r.get("what", "")) ==
                     (recipe, config, precision, what) and r.get("status") == "ok"), None)

    def ratio(a, b, key):
        return f"{a[key] / b[key]:.3f}" if a and b and a.get(key) and b.get(key) else "-"

    lines = ["", "## Paired rows", ""]
    plain, off = find("train.py", "single_gpu.yaml", "bf16"), find("train.py", "single_gpu.yaml", "bf16",
                                                                    "document mask off")
    lines.append(f"- document mask on / off, tokens/s: {ratio(plain, off, 'tokens/s')}")
    train, both = (find("train.py", "single_gpu.yaml", "bf16", "128k vocab, train"),
                   find("train.py", "single_gpu.yaml", "bf16", "128k vocab, train + eval"))
    lines.append(f"- 128k vocabulary, chunked loss: peak with evals / peak of training alone: "
                 f"{ratio(both, train, 'peak mem GiB')}")
    for config in ("fsdp_offload.yaml", "deepspeed_zero3_offload.yaml"):
        threads = ratio(find("train.py", config, "bf16"), find("train.py", config, "bf16", "offload, 1 thread"),
                        "tokens/s")
        lines.append(f"- {config}, all threads / 1 thread, tokens/s: {threads}")
    for config in ("fsdp.yaml", "deepspeed_zero3.yaml"):
        run = find("train.py", config, "bf16", "first losses")
        lines.append(f"- first losses, train.py {config}: {run['losses'] if run else '-'}")
    for precision in ("bf16", "fp16"):
        config = "single_gpu.yaml" if precision == "bf16" else "fp16.yaml"
        run = find("train.py", config, precision, "host syncs")
        census = run.get("syncs") if run else None
        lines.append(f"- host syncs of a {precision} step, by site: " + (
            "; ".join(f"{site} x{n}" for site, n in census.items()) if census else "-"))
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = planned_runs(args)
    if args.dry_run:
        for i, run in enumerate(runs, 1):
            print(f"{i}. {run.recipe} {run.config} {run.precision}" + (f" ({run.what})" if run.what else ""))
        return 0

    env = environment()
    world = max(1, env["gpus"])
    out = args.out or Path("outputs/gpu_check")
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0]))] + list(argv or sys.argv[1:]))
    header = [f"# GPU check, {env['date']}", "", f"- GPU: {env['gpu']} x {env['gpus']}",
              f"- versions: {json.dumps(env['versions'])}", f"- command: `{command}`",
              f"- runs: preset {args.preset}, seq_len {args.seq_len}, micro-batch {args.micro_batch}/GPU, "
              f"{args.steps} steps", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    print("\n".join(header), flush=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text("\n".join(header) + "\n")

    start = time.monotonic()
    durations: list[float] = []
    failures = 0
    rows = []
    for run in runs:
        row = {"recipe": run.recipe, "config": run.config, "precision": run.precision, "what": run.what}
        elapsed = time.monotonic() - start
        expected = max(durations) if durations else 0.0  # the slowest run so far predicts the next
        layout = model_parallel_layout(run.recipe, run.config, world, args.preset)
        if isinstance(layout, int):
            row["status"] = f"skipped (needs {layout} GPUs)"
        elif elapsed + expected >= args.budget_seconds:
            row["status"] = "skipped (budget)"
        else:
            name = run_name(run)
            run_dir = out / "runs" / name
            if VOCAB_128K in run.options:
                write_vocab_128k(out / VOCAB_128K, args.preset)
            cmd = launch_command(run, layout[0], args, run_dir, layout[1], layout[2])
            timeout = min(args.run_timeout * (2 if run.steps == 0 else 1), max(10.0, args.budget_seconds - elapsed))
            t0 = time.monotonic()
            code = launch(run, cmd, run_dir, out / "logs" / f"{name}.log", timeout)
            row["seconds"] = round(time.monotonic() - t0, 1)
            durations.append(row["seconds"])
            output = (out / "logs" / f"{name}.log").read_text(errors="replace")
            summary_file = run_dir / "run_summary.json"
            if code == 0 and summary_file.exists():
                row.update(row_from_summary(json.loads(summary_file.read_text()), args, env["gpu"]))
                if dict(run.env).get("ACCELERATE_RECIPES_PROBE_SYNCS"):
                    row["syncs"] = sync_census(Path(f"{run_dir}.probe"))
                row["status"] = "ok"
            else:
                failures += 1
                errors = [line for line in output.splitlines() if line.startswith("error: ")]
                row["status"] = ("timeout" if code is None else f"failed (exit {code})") + (
                    f": {errors[0][7:]}" if errors else "")
                # The cause goes to stdout too: on a lent machine the console may be all that comes back.
                print("\n".join(f"    {line}" for line in output.splitlines()[-25:]), flush=True)
        rows.append(row)
        print(format_row(row), flush=True)
        with open(out / "gpu_check.md", "a") as f:
            f.write(format_row(row) + "\n")
        with open(out / "gpu_check.jsonl", "a") as f:
            f.write(json.dumps({**row, "env": env}) + "\n")
    paired = comparisons(rows)
    print("\n".join(paired), flush=True)
    with open(out / "gpu_check.md", "a") as f:
        f.write("\n".join(paired) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
