"""What content checksums cost: save and resume of a >= 1 GB checkpoint with and without them.

    python benchmarks/checkpoint_checksums.py            # the `small` preset (~114M parameters), 5 rounds

One process, in-process: the `small` preset with fused AdamW after one step (model 0.46 GB, optimizer
state 0.91 GB: a 1.4 GB checkpoint, train.py's own layout), saved with train_extras/resume/checkpoint.py's
`save` into a temporary folder. "Without" is the same save with the checksums replaced by what the
save did before them (fsync each file). Resume = `verify` (sizes only, or sizes and checksums) then
`load` of the same checkpoint, with the page cache warm (right after a save, the usual case for a requeue on the same
machine) and cold (caches dropped first, where the machine allows it: the case of a new machine).
Then the same seen by a user: a train.py checkpoint of `small` resumed by train.py itself (launch to
one step done), verification off and on. Modes alternate within each round; medians. Writes
benchmarks/results/checkpoint-checksums-<date>/.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_utils import ROOT, write_results

sys.path.insert(0, str(ROOT))
ROUNDS = 5


def drop_caches() -> bool:
    """Empty the page cache (root only): the next read comes from the disk."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def whole_resume(work: Path, cold: bool) -> dict:
    """A train.py checkpoint of the `small` preset, resumed by train.py itself, verification off and on."""
    from bench_utils import ACCELERATE, run

    small = ["--preset", "small", "--seq_len", "64", "--micro_batch_size", "1", "--warmup_steps", "0",
             "--eval_every", "0", "--sample_length", "0", "--save_model", "false", "--log_every", "1"]
    launch = [ACCELERATE, "launch", "--config_file", "accelerate_configs/cpu.yaml", "recipes/train.py", *small]
    run(launch + ["--max_steps", "1", "--save_every", "1", "--output_dir", str(work / "source")])
    step_1 = work / "source" / "checkpoints" / "step_1"
    times = {f"resumed run, {cache}, {mode}": [] for cache in ("warm", "cold") for mode in ("sizes only", "checksums")}
    for round_ in range(ROUNDS):
        for cache in ("warm", "cold") if cold else ("warm",):
            for verify in ("false", "true") if round_ % 2 == 0 else ("true", "false"):
                out = work / f"resumed_{round_}_{cache}_{verify}"
                if cache == "cold":
                    drop_caches()
                t0 = time.perf_counter()
                run(launch + ["--max_steps", "2", "--resume_from_checkpoint", str(step_1),
                              "--verify_checkpoint", verify, "--output_dir", str(out)])
                mode = "checksums" if verify == "true" else "sizes only"
                times[f"resumed run, {cache}, {mode}"].append(time.perf_counter() - t0)
                shutil.rmtree(out)
        print(f"resumed runs, round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items() if v),
              flush=True)
    return times


def main():
    import torch
    from accelerate import Accelerator

    from common import model as modeling
    from train_extras.resume import checkpoint
    from train_extras.options import TrainConfig

    torch.manual_seed(0)
    cfg = TrainConfig(preset="small", micro_batch_size=1, seq_len=64)
    accelerator = Accelerator(cpu=True)
    model = modeling.build_model(cfg, 259)
    optimizer = modeling.build_optimizer(model, cfg, accelerator.device)
    scheduler = modeling.build_scheduler(optimizer, cfg)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    ids = torch.randint(0, 259, (1, 65))
    modeling.causal_lm_loss(model, ids[:, :-1], ids[:, 1:]).backward()
    optimizer.step()  # the AdamW state exists now: a full-size checkpoint

    digests = checkpoint._digests

    def fsync_only(folder, names, accelerator, sync=False):  # the save before checksums
        for name in names:
            with open(folder / name, "rb") as f:
                os.fsync(f.fileno())
        return {}

    work = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=os.environ.get("BENCH_DIR")))
    times = {key: [] for key in ("save, without", "save, with", "resume warm, sizes only",
                                 "resume warm, checksums", "resume cold, sizes only", "resume cold, checksums")}
    size, cold = 0, True
    for round_ in range(ROUNDS):
        for with_sums in (False, True):
            out = work / f"r{round_}_{int(with_sums)}"
            checkpoint._digests = digests if with_sums else fsync_only
            t0 = time.perf_counter()
            path = checkpoint.save(accelerator, out, 1, metadata={"config": {}})
            times[f"save, {'with' if with_sums else 'without'}"].append(time.perf_counter() - t0)
            checkpoint._digests = digests
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            for cache in ("warm", "cold"):  # the same checkpoint resumed both ways: --verify_checkpoint false / true
                for contents in (False, True) if with_sums else ():
                    if cache == "cold" and not (cold := drop_caches() and cold):
                        continue
                    t0 = time.perf_counter()
                    checkpoint.verify(path, accelerator, contents=contents)
                    checkpoint.load(accelerator, path, optimizer, scheduler, cfg)
                    key = f"resume {cache}, {'checksums' if contents else 'sizes only'}"
                    times[key].append(time.perf_counter() - t0)
            shutil.rmtree(out)
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v), flush=True)
    times.update(whole_resume(work, cold))
    medians = {key: statistics.median(v) for key, v in times.items() if v}
    rows = []
    for what in ("save", "resume warm", "resume cold", "resumed run, warm", "resumed run, cold"):
        base, new = ("without", "with") if what == "save" else ("sizes only", "checksums")
        if f"{what}, {base}" in medians:
            a, b = medians[f"{what}, {base}"], medians[f"{what}, {new}"]
            rows.append([what, f"{a:.2f}", f"{b:.2f}", f"{b / a:.3f}"])
    notes = [f"Checkpoint: {size / 1e9:.2f} GB (`small` preset, one process: model.safetensors, optimizer.bin, "
             f"scheduler, RNG), on {work}'s file system. Median of {ROUNDS} rounds, modes alternating.",
             "save = accelerate's save_state + fsync of every file + checkpoint.json + rename; 'with' also reads each "
             "file back (xxh3-128, 8 threads at most) in the same pass as its fsync.",
             "resume = verify + load (accelerate's load_state). warm: right after the save; cold: page cache dropped "
             "first" + ("" if cold else " (not measured: dropping the page cache needs root)") + ".",
             "resumed run = the whole of `accelerate launch recipes/train.py --preset small --resume_from_checkpoint "
             "<step_1> --max_steps 2` (start-up, verify, load, one step), wall clock, --verify_checkpoint false / true "
             "alternating."]
    day = time.strftime("%Y-%m-%d")
    write_results(ROOT / "benchmarks" / "results" / f"checkpoint-checksums-{day}",
                  "Content checksums: save and resume of a 1.4 GB checkpoint",
                  ["", "seconds, without", "seconds, with checksums", "ratio"], rows, notes,
                  {"checkpoint_bytes": size, "seconds": times, "medians": medians})


if __name__ == "__main__":
    main()
