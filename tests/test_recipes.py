"""End to end: the recipes launched with `accelerate launch` on the debug preset."""

import math

import pytest

from conftest import DEBUG_ARGS, ROOT, Run, check_export_reproduces_model, check_loss_goes_down, launch

# Loss of the first training step of DEBUG_ARGS (seed 1234): fixes init + data + loss together.
# Any change to the preset, the generator, the packing or the initialisation moves it.
FIRST_STEP_LOSS = 5.533900


def check_summary(run: Run, recipe: str, max_steps: int, precision: str):
    summary = run.summary
    setup = summary["setup"]
    assert summary["recipe"] == recipe
    assert setup["distributed_type"] == "NO" and setup["world_size"] == 1
    assert setup["mixed_precision"] == precision
    assert setup["options"]["preset"] == "debug"
    assert setup["global_batch_tokens"] == setup["global_batch_sequences"] * setup["options"]["seq_len"]
    assert [row["step"] for row in summary["losses"]] == list(range(1, max_steps + 1))
    assert all(math.isfinite(row["loss"]) and row["lr"] > 0 for row in summary["losses"])
    assert summary["eval"][0]["step"] == 0 and summary["eval"][-1]["step"] == max_steps
    assert all(row["tokens_per_s"] > 0 for row in summary["throughput"])
    (rank0,) = run.parameters_per_rank
    assert rank0["local_numel"] == rank0["global_numel"] > 0 and rank0["sharded_tensors"] == {}
    assert len(run.final[0]["probe_logits"]) == 8


@pytest.mark.quick
def test_train_summary_complete(train_run):
    check_summary(train_run, "train.py", 60, "no")
    assert train_run.summary["model"]["parameters"] < 1_000_000
    assert train_run.summary["tokens_seen"] == 60 * 8 * 64


def test_train_loss_goes_down(train_run):
    check_loss_goes_down(train_run.summary)


@pytest.mark.quick
def test_train_first_step_loss_is_the_expected_number(train_run):
    assert train_run.summary["losses"][0]["loss"] == pytest.approx(FIRST_STEP_LOSS, abs=1e-4)


def test_train_prints_setup_block(train_run):
    out = train_run.proc.stdout
    assert "distributed_type : NO" in out and "world_size       : 1" in out
    assert "global batch     : 8 sequences = 8 micro x 1 accum x 1 ranks; 512 tokens (seq_len 64)" in out


@pytest.mark.quick
def test_train_export_reloads_with_same_logits(train_run):
    check_export_reproduces_model(train_run)


def test_same_seed_gives_identical_losses(train_run, train_run_again):
    """Also the warm launch's check: train_run was forked from the warm process, train_run_again
    started by `accelerate launch` itself; the same samples, losses, evals and trained logits."""
    first = [row["loss"] for row in train_run.summary["losses"]]
    second = [row["loss"] for row in train_run_again.summary["losses"]]
    assert first == second
    assert [e["loss"] for e in train_run.summary["eval"]] == [e["loss"] for e in train_run_again.summary["eval"]]
    assert train_run.batches == train_run_again.batches
    assert train_run.final[0]["probe_logits"] == train_run_again.final[0]["probe_logits"]
    assert train_run.summary["setup"]["mixed_precision"] == train_run_again.summary["setup"]["mixed_precision"]
    assert not hasattr(train_run_again.proc, "worker_returncode") and hasattr(train_run.proc, "worker_returncode")


def test_launched_processes_import_the_checkout_under_test(train_run, train_run_again):
    """The launch environment puts this checkout first on PYTHONPATH: a launched recipe imports its
    `common` from here, not from whatever copy of the package is installed (a scratch clone of the
    repository, e.g. the mutation check's, tests its own code)."""
    for run in (train_run, train_run_again):
        assert run.summary["setup"]["code"] == {"recipe": str(ROOT / "recipes" / "train.py"),
                                                "common": str(ROOT / "common")}


def test_tokenised_data_is_cached_between_runs(hf_home, train_run, train_run_again):
    # datasets.map shows a "tokenise" progress bar only when it computes; a cache hit is silent.
    # (Which earlier launch of the session tokenised first depends on test order; the repeat never does.)
    assert "tokenise train" not in train_run_again.proc.stderr
    streams = list((hf_home / "datasets" / "accelerate_recipes" / "streams").iterdir())
    assert len(streams) >= 2  # train and held-out token streams on disk


def test_baseline_bf16(baseline_run):
    check_summary(baseline_run, "bf16_baseline.py", 30, "bf16")
    check_loss_goes_down(baseline_run.summary)
    check_export_reproduces_model(baseline_run)


def test_pretrained_start_from_local_folder(tmp_path, hf_home, train_run):
    """--model_name_or_path on a save_pretrained folder: the loaded model's held-out loss before
    any update equals the exporting run's final held-out loss (same weights, same data)."""
    args = DEBUG_ARGS + ["--model_name_or_path", train_run.summary["export"], "--max_steps", "4",
                         "--warmup_steps", "1", "--save_model", "false", "--output_dir", str(tmp_path)]
    run = Run(tmp_path, launch("train.py", args, hf_home))
    assert run.summary["eval"][0]["loss"] == pytest.approx(train_run.summary["eval"][-1]["loss"], abs=1e-5)
    assert "export" not in run.summary
