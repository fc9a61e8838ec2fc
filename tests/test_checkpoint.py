"""Checkpoints: exact resume in every strategy, data position, rotation, auto-resume, export.

Each resume test starts a second run from the half-way checkpoint of a run that other tests
already launched (same options), and compares steps N+1..2N and the sample ids of every batch."""

import json

import pytest

from synthetic import corpus_file
from conftest import (DEBUG_ARGS, FP16_ARGS, HARNESS, TRAIN_ARGS, TWO_RANK_ARGS, Run, check_exact_resume,
                      check_export_reproduces_model, launch, launch_two_processes)


def resume_args(args, full: Run, half: int, out):
    return args + ["--resume_from_checkpoint", str(full.output_dir / "checkpoints" / f"step_{half}"),
                   "--output_dir", str(out)]


def test_resume_is_exact_on_one_process(tmp_path, hf_home, train_run):
    resumed = Run(tmp_path, launch("train.py", resume_args(TRAIN_ARGS, train_run, 30, tmp_path), hf_home))
    check_exact_resume(train_run, resumed, 30)
    assert resumed.summary["eval"][-1]["loss"] == train_run.summary["eval"][-1]["loss"]


@pytest.mark.parametrize("config, tolerance", [
    ("ddp.yaml", 0.0),
    ("fsdp.yaml", 0.0),
    ("deepspeed_zero3_offload.yaml", 0.0),
])
def test_resume_is_exact_on_two_processes(config, tolerance, tmp_path, hf_home, two_process_runs, initial_model):
    full = two_process_runs(f"train.py/{config}")
    args = TWO_RANK_ARGS + ["--save_every", "30", "--sample_length", "8"]  # as the full run
    if config != "ddp.yaml":
        args += ["--model_name_or_path", str(initial_model)]  # as the full run; load_state replaces the weights
    resumed = Run(tmp_path, launch_two_processes("train.py", config, resume_args(args, full, 30, tmp_path), hf_home))
    check_exact_resume(full, resumed, 30, tolerance)


def test_resume_is_exact_with_fp16(tmp_path, hf_home, fp16_train_run):
    args = FP16_ARGS + ["--micro_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_grad_norm", "1.0",
                        "--save_every", "10"]
    proc = launch("train.py", resume_args(args, fp16_train_run, 10, tmp_path), hf_home, config="fp16.yaml",
                  launch_args=["--cpu", "--num_cpu_threads_per_process", "2"], env=HARNESS)
    resumed = Run(tmp_path, proc)
    check_exact_resume(fp16_train_run, resumed, 10)
    full_scales = {r["step"]: r["loss_scale"] for r in fp16_train_run.summary["losses"]}
    assert all(r["loss_scale"] == full_scales[r["step"]] for r in resumed.summary["losses"])  # scaler restored


# A small corpus: 46 batches of 8 per epoch, so step 45 sits just before the epoch boundary.
SMALL_EPOCH_ARGS = ["--preset", "debug", "--seq_len", "64", "--micro_batch_size", "8", "--data_files", corpus_file(100),
                    "--max_steps", "50", "--warmup_steps", "5", "--eval_every", "0", "--log_every", "5",
                    "--num_workers", "2", "--save_every", "45", "--save_model", "false"]


def test_resume_just_before_an_epoch_boundary_with_workers(tmp_path_factory, hf_home):
    full_dir, resumed_dir = tmp_path_factory.mktemp("epoch_full"), tmp_path_factory.mktemp("epoch_resumed")
    full = Run(full_dir, launch("train.py", SMALL_EPOCH_ARGS + ["--output_dir", str(full_dir)], hf_home))
    batches_per_epoch = full.summary["data"]["train_blocks"] // 8
    assert 45 < batches_per_epoch < 50  # the resumed part crosses into the next epoch
    resumed = Run(resumed_dir, launch("train.py", resume_args(SMALL_EPOCH_ARGS, full, 45, resumed_dir), hf_home))
    check_exact_resume(full, resumed, 45)


def test_rotation_keeps_the_newest_by_step_number_and_auto_resumes(tmp_path, hf_home):
    args = DEBUG_ARGS + ["--max_steps", "11", "--warmup_steps", "2", "--eval_every", "0", "--save_every", "1",
                         "--save_total_limit", "2", "--save_model", "false", "--output_dir", str(tmp_path)]
    launch("train.py", args, hf_home)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_10", "step_11"]  # step_9 went; as text "step_9" would outrank "step_10"
    meta = json.loads((tmp_path / "checkpoints" / "step_11" / "checkpoint.json").read_text())
    assert meta["step"] == 11 and meta["config"]["save_total_limit"] == 2
    # auto: the newest complete checkpoint of output_dir, then on to the new max_steps
    more = Run(tmp_path, launch("train.py", args + ["--max_steps", "13", "--resume_from_checkpoint", "auto"], hf_home))
    assert more.summary["resumed_from"]["step"] == 11
    assert [row["step"] for row in more.summary["losses"]] == [12, 13]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_12", "step_13"]


def test_export_from_a_saved_checkpoint(tmp_path, hf_home, train_run):
    """The small export command: resume a checkpoint with --max_steps at its step; nothing trains."""
    args = TRAIN_ARGS + ["--max_steps", "30", "--save_every", "0"]
    run = Run(tmp_path, launch("train.py", resume_args(args, train_run, 30, tmp_path), hf_home))
    assert run.summary["losses"] == [] and run.summary["resumed_from"]["step"] == 30
    assert "done: no steps to run (resumed at step 30)" in run.proc.stdout
    check_export_reproduces_model(run)


@pytest.mark.quick
def test_resume_from_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    from common.config import ConfigError
    from conftest import parse_train

    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        parse_train(["--resume_from_checkpoint", str(tmp_path)])


def test_a_checkpoint_from_another_model_or_strategy_is_refused(tmp_path, hf_home, train_run):
    """One line, before any model is built, and the checkpoint is left as it was."""
    step_30 = train_run.output_dir / "checkpoints" / "step_30"
    before = sorted((p.name, p.stat().st_size) for p in step_30.iterdir())
    other_model = launch("train.py", resume_args(TRAIN_ARGS + ["--preset", "tiny"], train_run, 30, tmp_path / "a"),
                         hf_home, check=False)
    # a replicated (single-process) checkpoint cannot feed FSDP2's sharded loader
    other_strategy = launch_two_processes("train.py", "fsdp.yaml",
                                          resume_args(TWO_RANK_ARGS, train_run, 30, tmp_path / "b"), hf_home,
                                          check=False)
    for proc, message in ((other_model, "was saved from preset 'debug'; this run builds preset 'tiny'"),
                          (other_strategy, "was saved with distributed_type NO; this run has FSDP")):
        assert proc.returncode != 0
        ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert ours and all(message in line and "checkpoint.json" in line for line in ours), proc.stderr[-2000:]
        assert proc.stdout.strip() == ""  # nothing ran: not even the setup block
    assert sorted((p.name, p.stat().st_size) for p in step_30.iterdir()) == before


@pytest.mark.quick
def test_each_rank_hashes_the_checkpoint_files_it_wrote(tmp_path, monkeypatch):
    """A checkpoint's checksums are taken by the rank that wrote each file (its rank is in the name;
    the main process writes the rest): no rank reads another machine's writes over a shared file
    system, inside a preemption's grace. Names as FSDP2, DeepSpeed, TP and accelerate write them."""
    from types import SimpleNamespace

    from train_extras.resume import checkpoint

    owners = {"pytorch_model_fsdp_0/__1_0.distcp": 1, "pytorch_model_fsdp_0/__0_0.distcp": 0,
              "optimizer_0/__1_0.distcp": 1, "pytorch_model_fsdp_0/.metadata": 0,
              "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt": 1,
              "pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt": 0,
              "pytorch_model/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": 1,  # (DeepSpeed under bf16)
              "tensor_parallel/__1_0.distcp": 1, "random_states_1.pkl": 1, "random_states_0.pkl": 0,
              "model.safetensors": 0, "optimizer.bin": 0, "scheduler.bin": 0, "scaler.pt": 0}
    assert {name: checkpoint.writer_rank(name, 2) for name in owners} == owners
    for name in owners:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    monkeypatch.setattr(checkpoint, "gather_object", lambda parts: parts)  # (one process stands for rank 1)
    hashed = checkpoint._digests(tmp_path, sorted(owners), SimpleNamespace(num_processes=2, process_index=1))
    assert sorted(hashed) == sorted(name for name, rank in owners.items() if rank == 1)
    assert hashed["random_states_1.pkl"] == checkpoint.file_digest(tmp_path / "random_states_1.pkl")
