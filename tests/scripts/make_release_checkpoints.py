"""Make a release's checkpoints, which every later version must resume exactly or refuse in one line
(tests/test_release_checkpoints.py):

    python tests/scripts/make_release_checkpoints.py [--out tests/data/release_checkpoints/<short commit>]

Run it from a checkout whose product code (recipes/, common/, train_extras/) is the commit named: the
folder is named after it and its README.md records it (and any uncommitted change).

It writes, under --out:
- initial_model/: a Llama of 2 layers, hidden 4, 2 heads sharing 1 key/value head, tied embeddings,
  the byte tokenizer of 259 ids (1,344 parameters): every run starts from it (--model_name_or_path,
  a path relative to the repository root, which the tests launch from), so the checkpoints are
  small and the uninterrupted runs are reproducible from step 0;
- for each launch of RUNS: <name>/step_3.tar.xz, the step-3 checkpoint of a 6-step run of
  recipes/train.py, byte for byte as the run wrote it, and <name>/release.json: the launch (config,
  launch options, environment, train.py options without --output_dir), the checkpoint's step and
  the per-step losses of all 6 steps of the same run, which never stopped: the reference a resumed
  run must equal;
- README.md: how they were made (commit, date, the command lines, versions).

The launches are the tests' own (tests/conftest.py `launch_command`: offline, the probes and the
CPU harness on PYTHONPATH, a fresh Hugging Face home), run with the real `accelerate launch`. The
data is the default corpus, tiny Shakespeare shipped in common/corpus/, which a checkpoint records
as no files at all (data_files []), so it resolves the same in every clone (a --data_files path is
recorded as its absolute real path and compared as such on resume).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import TWO_CPU_PROCESSES, launch_command, read_summary  # noqa: E402

RELEASES = Path("tests") / "data" / "release_checkpoints"  # relative to the repository root
STEPS, SAVE_AT = 6, 3
ARCHIVE = f"step_{SAVE_AT}.tar.xz"


# Scripts DeepSpeed copies into every ZeRO save (its own code, Apache-2.0): not needed to resume, and
# this repository holds only code written here, so they are left out of the archive.
COPIED_CODE = ("zero_to_fp32.py", "zero_to_torch.py")


def drop_copied_code(folder: Path) -> None:
    """Remove COPIED_CODE from a checkpoint folder and from its checkpoint.json (file sizes, checksums),
    whose own checksum is then computed again as a save computes it."""
    from train_extras.resume import checkpoint

    meta = json.loads((folder / checkpoint.METADATA).read_text())
    for name in COPIED_CODE:
        if (folder / name).exists():
            (folder / name).unlink()
            meta["files"].pop(name)
            meta.get("checksums", {}).pop(name, None)
    meta.pop("metadata_checksum", None)
    meta["metadata_checksum"] = checkpoint.metadata_digest(meta)
    (folder / checkpoint.METADATA).write_text(json.dumps(meta, indent=1))  # as checkpoint.save writes it


def archive(folder: Path, target: Path) -> None:
    """The checkpoint folder as written, byte for byte, in a tar.xz: torch.distributed.checkpoint
    spends ~1.6 KB of headers on every tensor (FSDP2's 2-rank checkpoint of 1,344 parameters takes
    372 KB as files, 35 KB packed). Owners, times and modes are normalised, so the same bytes
    make the same archive; checkpoint.json's checksums still cover every file that comes out."""
    def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        info.mode = 0o755 if info.isdir() else 0o644
        return info

    with tarfile.open(target, "w:xz", preset=9) as tar:  # members sorted by name (tarfile's recursion)
        tar.add(folder, arcname=folder.name, filter=normalise)


def run_args(model: str, micro_batch_size: int) -> list[str]:
    """train.py's options (all but --output_dir): a 6-step run saving at step 3 and keeping no export."""
    return ["--model_name_or_path", model, "--seq_len", "32", "--micro_batch_size", str(micro_batch_size),
            "--max_steps", str(STEPS), "--warmup_steps", "1", "--save_every", str(SAVE_AT), "--eval_every", "0",
            "--log_every", "1", "--sample_length", "0", "--save_model", "false"]


# name: (accelerate config, launch options, environment, micro-batch per rank). Global batch 4 in each;
# the 2-process launches are conftest's launch_two_processes (the CPU harness, gloo, fp32).
TWO = ["--num_processes", "2", "--num_cpu_threads_per_process", "1", "--mixed_precision", "no"]
RUNS = {
    "cpu": ("cpu.yaml", ["--num_cpu_threads_per_process", "2"], {}, 4),
    "fsdp": ("fsdp.yaml", TWO, TWO_CPU_PROCESSES["fsdp.yaml"], 2),
    "deepspeed_zero3_offload": ("deepspeed_zero3_offload.yaml", TWO, TWO_CPU_PROCESSES["deepspeed_zero3_offload.yaml"],
                                2),
}


def make_initial_model(folder: Path) -> None:
    """The tiny Llama every run starts from (seed 0), with the byte tokenizer train.py uses by default."""
    import torch
    from transformers import AutoModelForCausalLM, ByT5Tokenizer, LlamaConfig

    tokenizer = ByT5Tokenizer(extra_ids=0)  # 256 bytes + pad, eos, unk
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=8, max_position_embeddings=64,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.02,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def versions() -> dict:
    import torch

    found = {name: metadata.version(name) for name in ("torch", "accelerate", "transformers", "deepspeed",
                                                         "datasets", "safetensors", "numpy")}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {**found, "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def shown(cmd: list[str], env: dict, places: dict) -> str:
    """The command line as a shell takes it from the repository root, with the environment it adds to
    the caller's; `places` ({path: placeholder}) names the temporary folders."""
    import os
    import shlex

    def plain(text: str) -> str:
        for path, name in places.items():
            text = text.replace(str(path), name)
        return text.replace(str(ROOT) + os.sep, "").replace(str(ROOT), ".")

    line = [plain(part) for part in cmd]
    line[0] = "accelerate"
    extra = [f"{key}={shlex.quote(plain(env[key]))}" for key in sorted(env) if os.environ.get(key) != env[key]]
    return " ".join(extra + [shlex.quote(part) for part in line])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="default: tests/data/release_checkpoints/<short HEAD>")
    out_rel = Path(parser.parse_args().out or RELEASES / git("rev-parse", "--short=7", "HEAD"))
    out = ROOT / out_rel if not out_rel.is_absolute() else out_rel
    if out.exists():
        sys.exit(f"error: {out} exists: remove it first (a release's checkpoints are made once)")
    commit = git("rev-parse", "HEAD")
    changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    made = {"commit": commit, "uncommitted_changes": changed,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **versions()}
    out.mkdir(parents=True)
    model = out / "initial_model"
    make_initial_model(model)
    # relative: the tests launch from the repository root (absolute only for a trial --out elsewhere)
    model_arg = str(model.relative_to(ROOT)) if ROOT in model.parents else str(model)
    work = Path(tempfile.mkdtemp(prefix="release_checkpoints."))
    lines = {}
    for name, (config, launch_args, env, micro) in RUNS.items():
        args = run_args(model_arg, micro)
        run_dir = work / name / "run"  # a folder of the run's own, as a user's output_dir
        run_dir.parent.mkdir()
        full = args + ["--output_dir", str(run_dir)]
        cmd, full_env = launch_command("train.py", full, work / "hf_home", config, launch_args, dict(env))
        lines[name] = shown(cmd, full_env, {run_dir: "<run>", work / "hf_home": "<hf_home>"})
        started = time.monotonic()  # a real `accelerate launch`, from the repository root
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True)
        took = time.monotonic() - started
        if proc.returncode != 0:
            sys.exit(f"error: {lines[name]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        summary = read_summary(run_dir)
        made["train_blocks"] = summary["data"]["train_blocks"]
        losses = {str(row["step"]): row["loss"] for row in summary["losses"]}
        assert list(losses) == [str(s) for s in range(1, STEPS + 1)], losses
        (out / name).mkdir()
        drop_copied_code(run_dir / "checkpoints" / f"step_{SAVE_AT}")
        archive(run_dir / "checkpoints" / f"step_{SAVE_AT}", out / name / ARCHIVE)
        record = {"config": config, "launch_args": launch_args, "env": env, "args": args,
                  "checkpoint": f"step_{SAVE_AT}", "archive": ARCHIVE, "step": SAVE_AT, "losses": losses,
                  "command": lines[name], "made": made}
        (out / name / "release.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {took:.0f} s, losses {losses}", flush=True)
    write_readme(out, out_rel, made, lines)
    shutil.rmtree(work)
    sizes = [p.stat().st_size for p in out.rglob("*") if p.is_file()]
    print(f"{sum(sizes):,} bytes in {len(sizes)} files under {out_rel}")


def write_readme(out: Path, out_rel: Path, made: dict, lines: dict) -> None:
    tree = ("clean" if not made["uncommitted_changes"] else
            "with these uncommitted changes: " + ", ".join(f"`{c}`" for c in made["uncommitted_changes"]))

    def losses(name: str) -> str:
        return ", ".join(repr(v) for v in json.loads((out / name / "release.json").read_text())["losses"].values())

    runs = "\n".join(f"- `{name}/` ({RUNS[name][0]}):\n\n  ```bash\n  {lines[name]}\n  ```\n\n"
                     f"  losses of steps 1-{STEPS}: {losses(name)}\n" for name in RUNS)
    versions_line = ", ".join(f"{k} {made[k]}" for k in ("torch", "accelerate", "transformers", "deepspeed", "datasets",
                                                          "safetensors", "numpy", "python"))
    text = f"""# Release checkpoints of {made['commit'][:7]}

Written by recipes/train.py of commit `{made['commit']}` (working tree {tree}) on {made['date']},
with `python tests/scripts/make_release_checkpoints.py --out {out_rel.as_posix()}`.
Every later version must resume each of them exactly, or refuse it in one line with a non-zero exit
(`tests/test_release_checkpoints.py`). Do not edit them: make a new release's folder instead.

Versions: {versions_line}; {made['platform']}, {made['cpu']} (torch CPU capability {made['torch_cpu_capability']}).

- `initial_model/`: a Llama of 2 layers, hidden 4, 2 attention heads sharing 1 key/value head, MLP 8,
  tied embeddings, 64 positions, the byte tokenizer (259 ids); 1,344 parameters, drawn with
  `torch.manual_seed(0)`. Each run starts from it (`--model_name_or_path {out_rel.as_posix()}/initial_model`,
  relative to the repository root, from which the tests launch).
- Each run: {STEPS} steps of 4 sequences of 32 tokens (global batch), saving at step {SAVE_AT}; only
  `step_{SAVE_AT}/` is kept, packed byte for byte as written in `step_{SAVE_AT}.tar.xz` (checkpoint.json
  with its checksums included; torch.distributed.checkpoint spends ~1.6 KB of headers on every
  tensor, so FSDP2's takes 372 KB as files, 35 KB packed). The test unpacks it into a temporary
  output folder and resumes it there with `--resume_from_checkpoint auto`.
  `release.json` holds the launch and the per-step losses of all {STEPS} steps of that same run (which
  never stopped): a resume of `step_{SAVE_AT}` must give steps {SAVE_AT + 1}-{STEPS} exactly.
- Data: the default corpus, tiny Shakespeare in `common/corpus/` (its sha256 is checked at load). A
  checkpoint records the data as the files the options resolve to, by absolute real path
  (`data_files: []` here) and the number of training blocks ({made['train_blocks']:,} at 32 tokens): no path
  of this machine is compared when another clone resumes them.
- Launches as the tests make them (tests/conftest.py `launch_command`, run with the real
  `accelerate launch` from the repository root): offline, a fresh `HF_HOME`,
  `PYTHONPATH` = the repository root and `tests/probes` (which chain the CPU harness), fp32. The
  2-process ones as conftest's `launch_two_processes` makes them: 2 CPU processes over gloo, one
  thread each, through the CPU harness (`ACCELERATE_RECIPES_CPU_HARNESS=1`). DeepSpeed reads a copy of
  `accelerate_configs/deepspeed_zero3_offload.json` with bf16 and fp16 disabled (conftest's
  `deepspeed_json_in`, the temporary JSON named in its line). DeepSpeed copies its own
  `zero_to_fp32.py` and `zero_to_torch.py` into every ZeRO save: they are removed before packing,
  with their entries in checkpoint.json, whose own checksum is computed again as a save does
  (`drop_copied_code`): other projects' code, not needed to resume.

{runs}
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
