"""Shared fixtures: each (recipe, config) is launched once per session with `accelerate launch`
(~14 s of start-up each), and many tests read the one run_summary.json it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))

# The debug preset, small enough that a launched run takes seconds on 2 CPU cores.
DEBUG_ARGS = ["--preset", "debug", "--seq_len", "64", "--micro_batch_size", "8", "--synthetic_documents", "2000",
              "--max_steps", "60", "--warmup_steps", "6", "--eval_every", "30", "--log_every", "10"]


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory):
    """One Hugging Face home for the session: datasets' cache is shared between launches, and
    nothing in the user's own cache is read or written."""
    return tmp_path_factory.mktemp("hf_home")


def launch_env(hf_home: Path) -> dict:
    env = dict(os.environ)
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


# How each config runs as 2 CPU processes over gloo (FACTS.md): DDP through accelerate's own
# MULTI_CPU path; FSDP2 and DeepSpeed through the CPU harness. fp32, because bf16 autocast is ~10x
# slower on these CPUs and parity is checked at fp32 tolerances.
TWO_CPU_PROCESSES = {
    "ddp.yaml": {"ACCELERATE_USE_CPU": "true"},
    "fsdp.yaml": {"ACCELERATE_RECIPES_CPU_HARNESS": "1", "PYTHONPATH": str(ROOT / "scripts" / "cpu_harness")},
    "deepspeed_zero3_offload.yaml": {"ACCELERATE_RECIPES_CPU_HARNESS": "1",
                                     "PYTHONPATH": str(ROOT / "scripts" / "cpu_harness")},
}
TWO_PROCESS_LAUNCH = ["--num_processes", "2", "--num_cpu_threads_per_process", "1", "--mixed_precision", "no"]


def launch(recipe: str, args: list[str], hf_home: Path, config: str = "cpu.yaml", check: bool = True,
           timeout: int = 900, launch_args: list[str] | None = None, env: dict | None = None,
           recipe_path: Path | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    launch_args = launch_args if launch_args is not None else ["--num_cpu_threads_per_process", "2"]
    cmd = [ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" / config), *launch_args,
           str(recipe_path or ROOT / "recipes" / recipe), *args]
    full_env = {**launch_env(hf_home), **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        # The launcher's own traceback comes last; the workers' errors are earlier in stderr.
        worker_lines = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             + "\n".join(worker_lines[:40]) + "\n" + proc.stderr[-4000:])
    return proc


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "run_summary.json").read_text())


class Run:
    def __init__(self, output_dir: Path, proc: subprocess.CompletedProcess):
        self.output_dir = output_dir
        self.proc = proc
        self.summary = read_summary(output_dir)


@pytest.fixture(scope="session")
def train_run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("train_debug")
    return Run(out, launch("train.py", DEBUG_ARGS + ["--output_dir", str(out)], hf_home))


@pytest.fixture(scope="session")
def train_run_again(tmp_path_factory, hf_home, train_run):
    """The same command again (after train_run, so it also shows the tokenised cache is reused)."""
    out = tmp_path_factory.mktemp("train_debug_again")
    return Run(out, launch("train.py", DEBUG_ARGS + ["--output_dir", str(out)], hf_home))


@pytest.fixture(scope="session")
def baseline_run(tmp_path_factory, hf_home):
    """The bf16 baseline with the single-GPU config; on a CPU machine accelerate runs it with bf16
    autocast on the CPU (~10x slower than fp32 there, hence fewer steps)."""
    out = tmp_path_factory.mktemp("baseline_bf16")
    args = DEBUG_ARGS + ["--max_steps", "30", "--eval_every", "15", "--output_dir", str(out)]
    return Run(out, launch("bf16_baseline.py", args, hf_home, config="single_gpu.yaml"))


def launch_two_processes(recipe: str, config: str, args: list[str], hf_home: Path, **kwargs):
    """`accelerate launch` with 2 CPU processes; env overrides merge over the config's own."""
    env = {**TWO_CPU_PROCESSES[config], **kwargs.pop("env", {})}
    return launch(recipe, args, hf_home, config=config, launch_args=TWO_PROCESS_LAUNCH, env=env, **kwargs)


# Checks shared by the 1-process and the 2-process end-to-end tests.
def check_loss_goes_down(summary: dict):
    losses = [row["loss"] for row in summary["losses"]]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 1.0, summary["eval"]


def check_export_reproduces_model(run: Run):
    """The exported folder, reloaded by plain transformers, gives the trained model's logits."""
    export = run.summary["export"]
    model = AutoModelForCausalLM.from_pretrained(export["path"])
    AutoTokenizer.from_pretrained(export["path"])  # the tokenizer travels with the weights
    assert (run.output_dir / "model" / "model.safetensors").exists()
    with torch.no_grad():
        logits = model(torch.tensor([export["probe_input_ids"]])).logits[0]
    diff = (logits - torch.tensor(export["probe_logits"])).abs().max().item()
    assert diff < 1e-5, diff
