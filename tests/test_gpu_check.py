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
    lines = [line for line in proc.stdout.splitlines() if re.match(r"\d+\. ", line)]
    planned = [tuple(line.split()[1:3]) for line in lines]
    expected = readme_pairs()
    assert len(expected) >= 7
    assert expected <= set(planned), expected - set(planned)
    assert lines[0] == "1. train.py single_gpu.yaml bf16 (default job)"  # the README's job goes first
    # what only a GPU can show comes before the plain rows: within the first 12, each pair complete
    first = "\n".join(lines[:12])
    for what in ("document mask off", "host syncs", "128k vocab, train)", "128k vocab, train + eval",
                 "offload, 1 thread", "first losses"):
        assert f"({what}" in first, what
    assert "accumulate_and_clip.py ddp.yaml bf16" in first  # the one failure of the first check
    offload = [i for i, p in enumerate(planned) if p[1] == "deepspeed_zero3_offload.yaml"]
    assert offload == list(range(len(planned) - len(offload), len(planned)))  # its CPU Adam build goes last


ROWS = ["--only", "2", "4", "6", "8", "9"]  # of --single-process-only's plan (the default job takes minutes on CPU)


def run_check(tmp_path, hf_home, budget):
    out = tmp_path / "check"
    args = [sys.executable, SCRIPT, "--single-process-only", *ROWS, "--preset", "debug", "--seq-len", "64",
            "--micro-batch", "4", "--steps", "4", "--budget-seconds", str(budget), "--out", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, env=launch_env(hf_home), timeout=300)
    rows = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    return proc, rows, (out / "gpu_check.md").read_text(), out


def test_runs_on_cpu_with_the_debug_preset(tmp_path, hf_home):
    proc, rows, table, out = run_check(tmp_path, hf_home, budget=300)
    assert [(r["recipe"], r["config"], r["precision"], r["what"]) for r in rows] == [
        ("train.py", "single_gpu.yaml", "bf16", ""), ("train.py", "single_gpu.yaml", "bf16", "host syncs"),
        ("train.py", "single_gpu.yaml", "bf16", "128k vocab, train + eval"),
        ("fp16_scaler.py", "fp16.yaml", "fp16", ""), ("bf16_baseline.py", "single_gpu.yaml", "bf16", "")]
    for row in rows[0], rows[1], rows[2], rows[4]:
        assert row["status"] == "ok" and row["world"] == 1 and row["tokens/s"] > 0
        assert 0 < row["final loss"] < 12
    assert rows[0]["MFU"] > 0 and rows[4]["MFU"] is None  # train.py's own; the script has no CPU datasheet peak
    assert rows[0]["peak mem GiB"] > 0 and rows[4]["peak mem GiB"] is None  # no probes: no focused recipe's memory
    assert rows[2]["final loss"] > 11  # ln(131,072) = 11.8: the 128k head, untrained
    # the census row's probes, and only its: rank 0's last step by call site
    assert [n for site, n in rows[1]["syncs"].items() if site.startswith("recipes/train.py:")] == [1]
    assert [p.name for p in (out / "runs").glob("*.probe")] == ["train__single_gpu__bf16__host-syncs.probe"]
    # fp16 on CPU without the harness: the recipes' guard refuses it, and the row says why; its log is kept
    assert rows[3]["status"].startswith("failed (exit 1): fp16 without a GradScaler")
    assert "error: fp16 without a GradScaler" in (out / "logs" / "fp16_scaler__fp16__fp16.log").read_text()
    assert proc.returncode == 1  # a failed run fails the check
    assert "| train.py | single_gpu.yaml | bf16 |  | 1 |" in table and table.count("\n| ") == 6
    assert "- command: `python " in table and '"torch": ' in table
    assert "- host syncs of a bf16 step, by site: recipes/train.py:" in table


def test_budget_stops_starting_runs(tmp_path, hf_home):
    proc, rows, _, _ = run_check(tmp_path, hf_home, budget=0)
    assert [r["status"] for r in rows] == ["skipped (budget)"] * 5
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
