"""Resuming is the same run or a refusal: a change of what is trained (seq_len, seed, data, model,
tokenizer) is refused in one line naming the setting; a change of the schedule or its length is
applied from the first resumed step and recorded as applied; an edited checkpoint.json is caught
by its own checksum. All from train_run's step-30 checkpoint (tests/conftest.py)."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from common.config import ConfigError
from common.model import build_scheduler
from synthetic import corpus_file
from train_extras.resume import checkpoint
from conftest import TRAIN_ARGS, Run, launch, parse_train

SINGLE = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1)


def step_30(run: Run):
    return run.output_dir / "checkpoints" / "step_30"


@pytest.mark.parametrize("change, named", [
    (["--seq_len", "128"], "--seq_len 64 (this run: 128)"),
    (["--seed", "7"], "--seed 1234 (this run: 7)"),
    (["--data_files", corpus_file(100)], "--data_files"),
    (["--packing", "false"], "--packing True (this run: False)"),
    (["--preset", "tiny"], "saved from preset 'debug'; this run builds preset 'tiny'"),
    (["--weight_decay", "0.0"], "--weight_decay 0.1 (this run: 0.0)"),
])
def test_a_change_of_what_is_trained_is_refused_in_one_line(change, named, train_run):
    cfg = parse_train(TRAIN_ARGS + change + ["--resume_from_checkpoint", str(step_30(train_run))])
    meta = checkpoint.verify(step_30(train_run), contents=False)
    with pytest.raises(ConfigError) as refused:
        checkpoint.check_compatible(step_30(train_run), cfg, SINGLE, meta)
    assert named in str(refused.value) and "\n" not in str(refused.value), refused.value


def test_another_model_or_tokenizer_is_refused(train_run, initial_model):
    meta = checkpoint.verify(step_30(train_run), contents=False)
    for flag in ("--model_name_or_path", "--tokenizer_name_or_path"):
        cfg = parse_train(TRAIN_ARGS + [flag, str(initial_model)])
        with pytest.raises(ConfigError, match=f"{flag} None \\(this run: '{initial_model}'\\)"):
            checkpoint.check_compatible(step_30(train_run), cfg, SINGLE, meta)


@pytest.mark.parametrize("edit", ["micro_batches_done", "step", "drop_checksum"])
def test_an_edited_checkpoint_json_is_caught(edit, train_run, tmp_path):
    copy = shutil.copytree(step_30(train_run), tmp_path / "step_30")
    checkpoint.verify(copy)  # the copy as saved verifies
    meta = json.loads((copy / "checkpoint.json").read_text())
    if edit == "drop_checksum":
        del meta["metadata_checksum"]
    else:
        meta[edit] += 1
    (copy / "checkpoint.json").write_text(json.dumps(meta, indent=1))
    what = "has no checksum of its own" if edit == "drop_checksum" else "does not match its own checksum"
    with pytest.raises(ConfigError, match=what):
        checkpoint.verify(copy, contents=False)  # sizes only still checks checkpoint.json itself


@pytest.fixture(scope="module")
def changed_resume(tmp_path_factory, hf_home, train_run):
    """train_run's step-30 checkpoint resumed with half its peak lr and a longer run (60 -> 80 steps)."""
    out = tmp_path_factory.mktemp("resume_changed")
    args = TRAIN_ARGS + ["--lr", "2e-3", "--max_steps", "80", "--eval_every", "40",
                         "--resume_from_checkpoint", str(step_30(train_run)), "--output_dir", str(out)]
    return Run(out, launch("train.py", args, hf_home))


def test_a_changed_lr_and_length_are_applied_and_said(changed_resume, train_run):
    summary = changed_resume.summary
    assert summary["resumed_from"]["changed"] == {"lr": [0.004, 0.002], "max_steps": [60, 80],
                                                  "eval_every": [30, 40]}
    assert "with this run's settings from step 31; --lr 0.004 -> 0.002; --max_steps 60 -> 80" in \
        changed_resume.proc.stdout
    # The lr every resumed step used is this run's schedule (peak 2e-3 over 80 steps) at that step.
    cfg = parse_train(TRAIN_ARGS + ["--lr", "2e-3", "--max_steps", "80"])
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    scheduler, expected = build_scheduler(optimizer, cfg), {}
    for step in range(1, 81):
        optimizer.step()
        scheduler.step()
        expected[step] = optimizer.param_groups[0]["lr"]  # logged after the step: the next step's lr
    logged = {row["step"]: row["lr"] for row in summary["losses"]}
    assert sorted(logged) == list(range(31, 81))
    assert all(abs(logged[s] - expected[s]) <= 1e-12 * expected[s] for s in logged), (logged, expected)
    # Step 31's loss is computed before its update: the very run that stopped; step 32 trained at the new lr.
    full = {row["step"]: row["loss"] for row in train_run.summary["losses"]}
    assert logged and summary["losses"][0]["loss"] == full[31]
    assert summary["losses"][1]["loss"] != full[32]


def test_what_a_changed_resume_used_is_what_it_records(changed_resume):
    assert changed_resume.summary["setup"]["options"]["lr"] == 0.002
    newest = checkpoint.verify(changed_resume.output_dir / "checkpoints" / "step_80")
    assert newest["config"]["lr"] == 0.002 and newest["config"]["max_steps"] == 80


def test_a_checkpoint_from_before_document_masks_resumes_only_without_them(train_run):
    """A checkpoint saved before --document_mask existed records neither the option nor what kept
    documents apart ("documents"): it trained without masks. The default (auto) continues it so,
    --document_mask true is refused, false continues it. One saved with --document_mask true
    (before auto) trained with them: false is refused, auto and true continue it."""
    saved = checkpoint.verify(step_30(train_run), contents=False)
    assert saved["documents"] == "position_ids" and saved["config"]["document_mask"] == "auto"
    before_auto = {key: value for key, value in saved.items() if key != "documents"}
    legacy = {**before_auto, "config": {k: v for k, v in saved["config"].items() if k != "document_mask"}}
    masked = {**before_auto, "config": {**saved["config"], "document_mask": True}}
    assert checkpoint.saved_documents(legacy, parse_train([])) == "none"
    assert checkpoint.saved_documents(masked, parse_train([])) == "position_ids"
    for meta, refused, said in ((legacy, "true", r"that see each other: resume with --document_mask auto \(or false\)"),
                                (masked, "false", r"kept apart \(position_ids\): resume with --document_mask auto")):
        with pytest.raises(ConfigError, match=said):
            checkpoint.check_compatible(step_30(train_run), parse_train(TRAIN_ARGS + ["--document_mask", refused]),
                                        SINGLE, meta)
        for value in {"auto", "true", "false"} - {refused}:
            checkpoint.check_compatible(step_30(train_run), parse_train(TRAIN_ARGS + ["--document_mask", value]),
                                        SINGLE, meta)


def test_the_same_options_on_other_data_are_refused(tmp_path, train_run):
    """A glob that now matches another file (before any work), or a file rewritten with more text
    (once the data is built): the options are equal, the data is not. The checkpoint records the
    files the options resolved to and the number of blocks they made."""
    saved = checkpoint.verify(step_30(train_run), contents=False)
    assert saved["data"] == {"data_files": [os.path.realpath(corpus_file(2000))], "eval_data_files": [],
                             "train_blocks": train_run.summary["data"]["train_blocks"],
                             "chat_template_sha256": None, "mixture": None,
                             "packing": "concatenate"}  # text from one source
    (tmp_path / "a.txt").write_text("one document\n\nanother\n")
    cfg = parse_train(TRAIN_ARGS + ["--data_files", str(tmp_path / "*.txt")])
    meta = {**saved, "config": {**saved["config"], "data_files": cfg.data_files},
            "data": checkpoint.data_identity(cfg, 10)}
    checkpoint.check_compatible(tmp_path, cfg, SINGLE, meta)  # as it was
    checkpoint.check_same_data(tmp_path, meta, checkpoint.data_identity(cfg, 10))
    with pytest.raises(ConfigError, match="trained on other data: 10 training blocks, this run has 11"):
        checkpoint.check_same_data(tmp_path, meta, checkpoint.data_identity(cfg, 11))
    (tmp_path / "b.txt").write_text("a new shard\n")
    with pytest.raises(ConfigError, match=r"--data_files \[.*a.txt'\] \(this run: \[.*a.txt', .*b.txt'\]\)"):
        checkpoint.check_compatible(tmp_path, cfg, SINGLE, meta)
    # the same file named another way is the same data
    relative = parse_train(TRAIN_ARGS + ["--data_files", os.path.relpath(corpus_file(2000))])
    checkpoint.check_compatible(step_30(train_run), relative, SINGLE, saved)


def test_a_max_steps_below_the_checkpoint_is_refused(train_run):
    cfg = parse_train(TRAIN_ARGS + ["--max_steps", "20", "--warmup_steps", "2"])
    meta = checkpoint.verify(step_30(train_run), contents=False)
    with pytest.raises(ConfigError, match="is at step 30, past --max_steps 20: nothing to train; to export it, "
                                          "resume with --max_steps 30"):
        checkpoint.check_compatible(step_30(train_run), cfg, SINGLE, meta)
    checkpoint.check_compatible(step_30(train_run), parse_train(TRAIN_ARGS + ["--max_steps", "30"]), SINGLE, meta)


def test_a_checkpoint_from_before_its_own_checksum_still_resumes(train_run, tmp_path):
    """checkpoint.json of an earlier version (no checksum of its own, no data record): taken as it is."""
    copy = shutil.copytree(step_30(train_run), tmp_path / "step_30")
    meta = json.loads((copy / "checkpoint.json").read_text())
    old = {k: v for k, v in meta.items() if k not in ("metadata_checksum", "data")}
    (copy / "checkpoint.json").write_text(json.dumps(old, indent=1))
    assert checkpoint.verify(copy)["step"] == 30
    checkpoint.check_compatible(copy, parse_train(TRAIN_ARGS), SINGLE, checkpoint.verify(copy, contents=False))
