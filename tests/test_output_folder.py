"""Only the run's own files (issue 42): what a run replaces or deletes in --output_dir is what this
project wrote (checkpoints by run id, the export by its marker, the record files by their content);
the lock is never a link; a full disk at the export keeps the trained run; `~` in a path option is
the home folder; `auto` with nothing to resume says so; a read-only checkpoints/ is one line.
In this process (train.py's main through preemption.run_cli), no launch."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import other
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, modeling_utils

from common import config
from common.config import ConfigError
from common.data import build_tokenizer
from common.export import MARKER, not_an_export
from conftest import CORE_DEBUG_ARGS, DEBUG_ARGS, TRAIN_ARGS, load_recipe, parse_train
from probes import sitecustomize
from test_bad_input import mark_as_export, no_model  # noqa: F401 - a fixture
from test_seams import in_process  # noqa: F401 - a fixture
from train_extras.options import TrainConfig
from train_extras.resume import checkpoint, output_dir, preemption

SHORT = DEBUG_ARGS + ["--eval_every", "0", "--sample_length", "0", "--warmup_steps", "1"]


def run_train_py(argv: list[str]) -> int:
    return preemption.run_cli(load_recipe("train").main, argv)


def contents(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*")) if p.name != output_dir.LOCK_FILE}


# ---- the lock ----
@pytest.mark.quick
def test_a_lock_that_is_a_symbolic_link_is_one_line_and_its_target_is_untouched(tmp_path):
    folder, target = tmp_path / "run", tmp_path / "precious.txt"
    folder.mkdir()
    target.write_text("the user's own file\n")
    (folder / output_dir.LOCK_FILE).symlink_to(target)
    reason = output_dir._lock(folder)
    assert reason == (f"--output_dir {folder}: .run.lock is a symbolic link (to {target}); a run never writes "
                      "through one: remove the link, or choose another --output_dir")
    assert target.read_text() == "the user's own file\n" and not output_dir._held


# ---- names a run replaces, held by something else ----
def users_model_package(folder: Path) -> None:
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "__init__.py").write_text("from .net import Net\n")
    (folder / "model" / "net.py").write_text("class Net: pass\n")


FOREIGN = {  # what the user has there -> what the line says of it
    "model/": (users_model_package, "model/ (no export marker .accelerate_recipes_export.json; holds __init__.py, "
                                    "net.py)"),
    "run_summary.json": (lambda f: (f / "run_summary.json").write_text("my notes\n"), "run_summary.json (not JSON)"),
    "metrics.jsonl": (lambda f: (f / "metrics.jsonl").write_text('{"acc": 0.9}\n'),
                      "metrics.jsonl (no 'kind' field)"),
    "requeue.json": (lambda f: (f / "requeue.json").write_text('{"queue": "gpu"}'), "requeue.json (no 'resume_with' "
                                                                                     "field)"),
}


@pytest.mark.parametrize("name", FOREIGN)
def test_a_name_the_run_would_replace_held_by_a_users_file_is_refused_even_with_overwrite(name, tmp_path, capsys,
                                                                                         no_model):  # noqa: F811
    """The user's own `model/` package was reported as "a finished run (model/)" and, with
    --overwrite_output_dir, deleted by the export; a user's requeue.json was deleted at the start."""
    out = tmp_path / "run"
    out.mkdir()
    make, says = FOREIGN[name]
    make(out)
    before = contents(out)
    try:
        code = run_train_py(DEBUG_ARGS + ["--overwrite_output_dir", "--output_dir", str(out)])
    finally:
        while output_dir._held:
            os.close(output_dir._held.pop())
    err = capsys.readouterr().err
    assert code == 2 and err == (f"error: {out} holds {says}: nothing marks it as this project's, and a run here "
                                 "would replace it; move it away, or choose another --output_dir\n"), err
    assert contents(out) == before


def test_a_focused_recipe_refuses_to_export_over_a_users_model_package(tmp_path, capsys, in_process):  # noqa: F811
    """The focused recipes export through common/export.py too, which replaced whatever was at
    model/: the same refusal, at start-up (before any training), the package kept."""
    out = tmp_path / "run"
    users_model_package(out)
    before = contents(out)
    argv = CORE_DEBUG_ARGS + ["--max_steps", "2", "--warmup_steps", "1", "--eval_every", "0", "--output_dir", str(out)]
    assert config.run_cli(load_recipe("bf16_baseline").main, argv) == 2
    err = capsys.readouterr().err  # the one line, and nothing before it: no data, no training
    assert err == (f"error: {out}/model (no export marker {MARKER}; holds __init__.py, net.py): nothing marks "
                   "it as an export of this project, and the export would replace it; move it away, or choose "
                   "another --output_dir\n"), err[-2000:]
    assert contents(out) == before


@pytest.mark.quick
def test_an_export_is_ours_with_its_marker_and_no_file_beside_what_it_wrote(tmp_path):
    export = tmp_path / "model"
    assert not_an_export(export) is None  # nothing there: nothing to refuse
    build_tokenizer(TrainConfig()).save_pretrained(export)
    assert not_an_export(export).startswith("no export marker .accelerate_recipes_export.json; holds ")
    mark_as_export(export)
    assert not_an_export(export) is None
    (export / "README.md").write_text("my model card\n")  # a file the user added: the folder is theirs too
    assert not_an_export(export) == "an export with files it did not write: README.md"
    (export / MARKER).write_text("{")
    assert not_an_export(export).startswith("no export marker")


# ---- checkpoints: rotation by run id ----
def tiny_accelerator() -> Accelerator:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))  # what save_state saves
    return accelerator


def test_rotation_removes_only_this_runs_checkpoints_and_says_so_once(tmp_path, capsys):
    accelerator, out = tiny_accelerator(), tmp_path / "run"
    for step in (10, 20):  # a killed run's, kept whole
        checkpoint.save(accelerator, out, step, {"run_id": "killed0000000000"})
    for step in (40, 50, 60):  # this run (resumed from another folder's step 30): --save_total_limit 1
        checkpoint.save(accelerator, out, step, {"run_id": "new0000000000000"}, keep=1)
    assert [p.name for p in checkpoint.list_complete(out)] == ["step_10", "step_20", "step_60"]
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert said == [f"note: {out / 'checkpoints'} also holds 2 checkpoint(s) of another run (step_10, step_20): "
                    "--save_total_limit rotates only this run's, those are kept"]


@pytest.mark.quick
def test_a_run_continues_its_id_only_from_its_own_folders_checkpoint(tmp_path):
    one = SimpleNamespace(num_processes=1)
    cfg = TrainConfig(output_dir=str(tmp_path / "run"))
    own, elsewhere = tmp_path / "run" / "checkpoints" / "step_30", tmp_path / "other" / "checkpoints" / "step_30"
    assert checkpoint.run_id(cfg, own, {"run_id": "abc"}, one) == "abc"
    assert checkpoint.run_id(cfg, elsewhere, {"run_id": "abc"}, one) not in ("abc", None)  # a new run here
    assert checkpoint.run_id(cfg, own, {}, one) != checkpoint.run_id(cfg, None, None, one)  # new each time


def test_resuming_another_folders_checkpoint_keeps_the_killed_runs_checkpoints_here(train_run, hf_home, tmp_path,
                                                                                   monkeypatch, in_process,  # noqa: F811
                                                                                   capsys):
    """The case of the issue: a folder holding a killed run's checkpoint (step 30, below the resume
    step); train_run's step 60 resumed into it with --save_total_limit 1. Before: rotation deleted
    the killed run's step_30."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_home / "datasets")  # train_run's tokens
    out = tmp_path / "run"
    shutil.copytree(train_run.output_dir / "checkpoints" / "step_30", out / "checkpoints" / "step_30")
    killed = contents(out / "checkpoints" / "step_30")
    code = run_train_py(TRAIN_ARGS + ["--resume_from_checkpoint", str(train_run.output_dir / "checkpoints" / "step_60"),
                                      "--max_steps", "62", "--save_every", "1", "--save_total_limit", "1",
                                      "--save_model", "false", "--output_dir", str(out)])
    assert code == 0, capsys.readouterr().err
    assert [p.name for p in checkpoint.list_complete(out)] == ["step_30", "step_62"]
    assert contents(out / "checkpoints" / "step_30") == killed
    assert capsys.readouterr().out.count("also holds 1 checkpoint(s) of another run (step_30)") == 1
    runs = {json.loads((out / "checkpoints" / p / "checkpoint.json").read_text())["run_id"] for p in ("step_30",
                                                                                                      "step_62")}
    assert len(runs) == 2


# ---- a full disk at the export ----
def test_a_full_disk_at_the_export_keeps_a_checkpoint_that_a_rerun_exports(tmp_path, monkeypatch, in_process,  # noqa: F811
                                                                           capsys):
    """--save_every 0 (the default): before, the whole run was lost and the line said "rerun with
    --resume_from_checkpoint auto" with nothing to resume. The probes' full disk (half the weights
    written, then ENOSPC) hits the export's writer only."""
    out = tmp_path / "run"
    args = SHORT + ["--max_steps", "4", "--output_dir", str(out)]
    monkeypatch.setattr(other, "safe_save_file", other.safe_save_file)  # put back after the test
    monkeypatch.setattr(modeling_utils, "safe_save_file", modeling_utils.safe_save_file)
    sitecustomize._disk_full_at(".model.partial")
    assert run_train_py(args) == 2
    kept = out / "checkpoints" / "step_4"
    err = capsys.readouterr().err
    assert err.startswith(f"error: disk full while writing the export {out}/model (OSError: [Errno 28] No space left "
                          "on device") and err.count("\n") == 1, err
    assert err.endswith(f"the export was not written; the trained model is in the checkpoint {kept} (step 4): free "
                        f"space, then rerun with --resume_from_checkpoint {kept} --max_steps 4 to export it\n")
    meta = checkpoint.verify(kept)  # whole, every file's checksum
    assert meta["step"] == 4 and meta["for_export"] is True
    assert not (out / "model").exists() and not (out / ".model.partial").exists()  # the half export removed
    trained = load_file(kept / "model.safetensors")

    monkeypatch.undo()  # space again: the rerun resumes the checkpoint, trains nothing and exports it
    while output_dir._held:
        os.close(output_dir._held.pop())
    assert run_train_py(args + ["--resume_from_checkpoint", "auto"]) == 0
    assert "done: no steps to run (resumed at step 4)" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    assert all(torch.equal(exported[name], value) for name, value in trained.items())
    assert not (out / "checkpoints").exists()  # --save_every 0: kept only until the export was done


def test_no_room_for_the_checkpoint_nor_the_export_says_that_nothing_is_kept(tmp_path, monkeypatch, in_process,  # noqa: F811
                                                                            capsys):
    """The checkpoint before the export finds the disk full too: the export is still tried, and the
    last line says that nothing is kept (before: "rerun with --resume_from_checkpoint auto")."""
    out = tmp_path / "run"
    monkeypatch.setattr(other, "safe_save_file", other.safe_save_file)
    monkeypatch.setattr(modeling_utils, "safe_save_file", modeling_utils.safe_save_file)
    sitecustomize._disk_full_at(".step_4.partial")
    sitecustomize._disk_full_at(".model.partial")
    assert run_train_py(SHORT + ["--max_steps", "4", "--output_dir", str(out)]) == 2
    nothing = f"no complete checkpoint is in {out / 'checkpoints'}: free space (or quota) and rerun (it starts afresh)"
    said, err = capsys.readouterr()
    warned = [line for line in said.splitlines() if line.startswith("warning: disk full while saving")]
    assert len(warned) == 1 and warned[0].endswith(f"{nothing}; the export is tried all the same"), said[-2000:]
    assert err.startswith(f"error: disk full while writing the export {out}/model (") and err.count("\n") == 1, err
    assert err.endswith(f"the export was not written and there was no room for a checkpoint of step 4 either; "
                        f"{nothing}\n"), err
    assert checkpoint.list_complete(out) == [] and not (out / "model").exists()


# ---- `auto` with nothing to resume; `~` ----
def test_auto_with_nothing_to_resume_says_so_and_starts_and_a_save_every_0_run_leaves_no_checkpoint(
        tmp_path, in_process, capsys):  # noqa: F811
    out = tmp_path / "mistyped"
    assert run_train_py(SHORT + ["--max_steps", "2", "--resume_from_checkpoint", "auto", "--output_dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"note: --resume_from_checkpoint auto: no checkpoint in {out}/checkpoints (a new folder); starting " \
           "afresh\n" in said and "done: 2 steps" in said
    assert not (out / "checkpoints").exists()  # the checkpoint before the export: removed once it was done
    assert not_an_export(out / "model") is None and (out / "model" / MARKER).is_file()


@pytest.mark.quick
def test_a_tilde_in_a_path_option_is_the_home_folder_from_yaml_and_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data.txt").write_text("some text\n\nmore text\n")
    (tmp_path / "run.yaml").write_text("output_dir: ~/runs/a\ndata_files: [~/data.txt]\n")
    cfg = parse_train(["--config", str(tmp_path / "run.yaml")])
    assert cfg.output_dir == f"{tmp_path}/runs/a" and cfg.data_files == [f"{tmp_path}/data.txt"]
    cfg = parse_train(["--output_dir", "~/runs/b", "--resume_from_checkpoint", "auto"])
    assert cfg.output_dir == f"{tmp_path}/runs/b"


# ---- a checkpoints/ folder that cannot be written ----
@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` read-only: a read-only bind mount where the machine allows one (root, or
    CAP_SYS_ADMIN), else its permissions (which bind everyone but root)."""
    folder.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode == 0:
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True, capture_output=True)
            yield "Read-only file system"
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=False)
    else:
        folder.chmod(0o555)
        try:
            yield "Permission denied"
        finally:
            folder.chmod(0o755)


def test_a_read_only_checkpoints_folder_is_one_line_before_any_work(tmp_path, capsys, no_model):  # noqa: F811
    out = tmp_path / "run"
    with read_only(out / "checkpoints") as why:
        try:
            code = run_train_py(DEBUG_ARGS + ["--save_every", "10", "--output_dir", str(out)])
        finally:
            while output_dir._held:
                os.close(output_dir._held.pop())
    err = capsys.readouterr().err
    assert code == 2 and err == (f"error: {out / 'checkpoints'} cannot be written ({why}): the run saves its "
                                 "checkpoints there (at --save_every, at a preemption, before the export); make it "
                                 "writable, or choose another --output_dir\n"), err


def test_a_checkpoints_folder_that_turns_read_only_during_the_run_is_one_line_at_the_save(tmp_path):
    accelerator, out = tiny_accelerator(), tmp_path / "run"
    checkpoint.save(accelerator, out, 10, {"run_id": "r"})
    with read_only(out / "checkpoints") as why:
        with pytest.raises(ConfigError) as stop:
            checkpoint.save(accelerator, out, 20, {"run_id": "r"})
    assert str(stop.value).startswith(f"cannot write {out / 'checkpoints' / 'step_20'} ({why}: ")
    assert str(stop.value).endswith(f"): 1 complete checkpoint(s) kept, the newest "
                                    f"{out / 'checkpoints' / 'step_10'}: make it writable and rerun with "
                                    "--resume_from_checkpoint auto")
