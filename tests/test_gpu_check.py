"""scripts/gpu_check.py on CPU: its plan matches the README, and its own code paths run."""

import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, launch_env

SCRIPT = str(ROOT / "scripts" / "gpu_check.py")


def readme_pairs():
    """(recipe, config) pairs of the README's recipe x config table that should run on a GPU."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| recipe \\ config"))
    configs = [c.strip(" `") for c in lines[start].split("|")[2:-1]]
    pairs = set()
    for line in lines[start + 2:]:
        if not line.startswith("| `"):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        recipe = cells[0].strip("`")
        for config, cell in zip(configs, cells[1:]):
            if config != "cpu.yaml" and cell not in ("refused", "-"):
                pairs.add((recipe, config))
    return pairs


def test_dry_run_lists_every_readme_pair_in_priority_order():
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run"], capture_output=True, text=True, check=True)
    planned = [tuple(line.split()[1:3]) for line in proc.stdout.splitlines() if re.match(r"\d+\. ", line)]
    expected = readme_pairs()
    assert len(expected) >= 7
    assert expected <= set(planned), expected - set(planned)
    assert planned[0] == ("train.py", "single_gpu.yaml")  # the most important run goes first
    deepspeed = [i for i, p in enumerate(planned) if "deepspeed" in p[1]]
    assert deepspeed == list(range(len(planned) - len(deepspeed), len(planned)))  # its op build goes last


def run_check(tmp_path, hf_home, budget):
    out = tmp_path / "check"
    args = [sys.executable, SCRIPT, "--single-process-only", "--preset", "debug", "--seq-len", "64",
            "--micro-batch", "4", "--steps", "4", "--budget-seconds", str(budget), "--out", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, env=launch_env(hf_home), timeout=300)
    rows = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    return proc, rows, (out / "gpu_check.md").read_text()


def test_runs_on_cpu_with_the_debug_preset(tmp_path, hf_home):
    proc, rows, table = run_check(tmp_path, hf_home, budget=300)
    assert [(r["recipe"], r["config"], r["precision"]) for r in rows] == [
        ("train.py", "single_gpu.yaml", "bf16"), ("fp16_scaler.py", "fp16.yaml", "fp16"),
        ("bf16_baseline.py", "single_gpu.yaml", "bf16"), ("train.py", "fp16.yaml", "fp16")]
    for row in rows[0], rows[2]:
        assert row["status"] == "ok" and row["world"] == 1 and row["tokens/s"] > 0
        assert 0 < row["final loss"] < 10 and row["peak mem GiB"] > 0
        assert row["MFU"] is None  # no datasheet peak for a CPU
    # fp16 on CPU without the harness: the recipes' guard refuses it, and the row says why
    for row in rows[1], rows[3]:
        assert row["status"].startswith("failed (exit 1): fp16 without a GradScaler")
    assert proc.returncode == 1  # a failed run fails the check
    assert "| train.py | single_gpu.yaml | bf16 | 1 |" in table and table.count("\n| ") == 5
    assert "- command: `python " in table and '"torch": ' in table


def test_budget_stops_starting_runs(tmp_path, hf_home):
    proc, rows, _ = run_check(tmp_path, hf_home, budget=0)
    assert [r["status"] for r in rows] == ["skipped (budget)"] * 4
    assert proc.returncode == 0


@pytest.mark.quick
def test_model_parallel_runs_are_sized_to_the_gpus_or_skipped():
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check import model_parallel_layout

    runs = [("tensor_parallel.py", "tp.yaml"), ("train.py", "fsdp_tp.yaml"), ("train.py", "multi_node_hsdp.yaml"),
            ("pipeline_parallel.py", "ddp.yaml")]
    # one GPU (the lent H200): each says how many GPUs it needs, and the check skips it without failing
    assert [model_parallel_layout(r, c, 1, "small") for r, c in runs] == [2, 4, 4, 2]
    assert model_parallel_layout("train.py", "multi_node_hsdp.yaml", 8, "small") == (
        8, ["--num_machines", "1", "--parallelism_config_dp_replicate_size", "2", "--parallelism_config_dp_shard_size",
            "4"], [])
    # 8 GPUs, preset small (12 heads): TP 4 (8 does not divide 12), 2D 4 x 2, 8 pipeline stages
    assert model_parallel_layout("train.py", "tp.yaml", 8, "small") == (4, ["--parallelism_config_tp_size", "4"], [])
    assert model_parallel_layout("train.py", "fsdp_tp.yaml", 8, "small") == (
        8, ["--parallelism_config_dp_shard_size", "4", "--parallelism_config_tp_size", "2"], [])
    assert model_parallel_layout("pipeline_parallel.py", "ddp.yaml", 8, "small") == (
        8, [], ["--gradient_accumulation_steps", "16"])
    assert model_parallel_layout("pipeline_parallel.py", "ddp.yaml", 8, "debug")[0] == 2  # 2 layers: 2 stages
    assert model_parallel_layout("train.py", "ddp.yaml", 8, "small") == (8, [], [])  # the rest: every GPU
