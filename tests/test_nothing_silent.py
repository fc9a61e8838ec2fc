"""Nothing silently wrong: checkpoints verified by content before a resume, one live run per output
folder, and one line for each failure a user meets (an output folder that cannot be made, a full
disk during a save, a local model path that does not exist, a process count the config's
parallelism sizes do not allow)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from common import config
from common.config import ConfigError
from conftest import (CORE_DEBUG_ARGS, DEBUG_ARGS, TRAIN_ARGS, TWO_PROCESS_LAUNCH, TWO_RANK_ARGS, Run,
                      check_exact_resume, launch, launch_two_processes, load_recipe, parse_train)
from test_resilience import STARTED, checksums, descendants, error_lines, start, wait_for, worker_pids
from train_extras.parallel import tensor_parallel
from train_extras.resume import checkpoint, output_dir


def zero_middle(file: Path, count: int = 64) -> None:
    """Bit rot or a bad copy: `count` bytes in the middle set to zero, the size unchanged."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    assert any(data[middle:middle + count]), "the bytes were already zero: the damage would change nothing"
    data[middle:middle + count] = bytes(count)
    file.write_bytes(bytes(data))


def one_process():
    return SimpleNamespace(is_main_process=True, num_processes=1, process_index=0, wait_for_everyone=lambda: None)


# ---- 1. content checksums ----
@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "random_states_0.pkl"])
def test_zeroed_bytes_inside_a_checkpoint_file_are_found_and_named(name, tmp_path, train_run):
    ckpt = tmp_path / "step_30"
    shutil.copytree(train_run.output_dir / "checkpoints" / "step_30", ckpt)
    meta = checkpoint.verify(ckpt)  # whole: it verifies
    assert meta["checksum"] == "xxh3_128" and set(meta["checksums"]) == set(meta["files"]) - {"checkpoint.json"}
    zero_middle(ckpt / name)
    with pytest.raises(ConfigError, match=f"{ckpt / name} does not match its xxh3_128 checksum"):
        checkpoint.verify(ckpt)
    if name.startswith("random_states"):  # read whole before any resume (safe_load): its CRC-32 sees it
        with pytest.raises(ConfigError, match=f"{ckpt / name} cannot be read as a zip .*Bad CRC-32"):
            checkpoint.verify(ckpt, contents=False)
    else:
        checkpoint.verify(ckpt, contents=False)  # sizes alone cannot see it: what --verify_checkpoint false checks


def test_auto_falls_back_to_the_newest_checkpoint_that_verifies_and_sets_the_damaged_one_aside(
        tmp_path, train_run, capsys):
    out = tmp_path / "run"
    shutil.copytree(train_run.output_dir / "checkpoints", out / "checkpoints")
    zero_middle(out / "checkpoints" / "step_60" / "optimizer.bin")
    before = checksums(out / "checkpoints" / "step_60")
    cfg = parse_train(TRAIN_ARGS + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    path, meta = checkpoint.resume_point(cfg, one_process())
    assert path == out / "checkpoints" / "step_30" and meta["step"] == 30
    said = capsys.readouterr().out
    assert "step_60 is damaged" in said and "optimizer.bin does not match" in said and "resuming from" in said
    assert checksums(out / "checkpoints" / "step_60.damaged") == before  # kept as it was, out of auto's way
    assert [p.name for p in checkpoint.list_complete(out)] == ["step_30"]


def test_no_checkpoint_that_verifies_is_an_error_and_nothing_moves(tmp_path, train_run):
    out = tmp_path / "run"
    shutil.copytree(train_run.output_dir / "checkpoints", out / "checkpoints")
    for step in (30, 60):
        zero_middle(out / "checkpoints" / f"step_{step}" / "model.safetensors")
    cfg = parse_train(TRAIN_ARGS + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    with pytest.raises(ConfigError, match="no checkpoint in .* verifies .*nothing was moved"):
        checkpoint.resume_point(cfg, one_process())
    assert [p.name for p in checkpoint.list_complete(out)] == ["step_30", "step_60"]


def test_verification_can_be_switched_off(tmp_path, train_run):
    ckpt = tmp_path / "step_30"
    shutil.copytree(train_run.output_dir / "checkpoints" / "step_30", ckpt)
    zero_middle(ckpt / "optimizer.bin")
    cfg = parse_train(TRAIN_ARGS + ["--resume_from_checkpoint", str(ckpt), "--verify_checkpoint", "false"])
    assert checkpoint.resume_point(cfg, one_process())[0] == ckpt
    cfg = parse_train(TRAIN_ARGS + ["--resume_from_checkpoint", str(ckpt)])
    with pytest.raises(ConfigError, match="optimizer.bin does not match"):
        checkpoint.resume_point(cfg, one_process())


def test_a_zeroed_optimizer_is_refused_in_one_line_before_any_work(tmp_path, hf_home, train_run):
    """The issue's case: 64 bytes zeroed in optimizer.bin, which torch.load reads without complaint."""
    ckpt = tmp_path / "checkpoints" / "step_30"
    shutil.copytree(train_run.output_dir / "checkpoints" / "step_30", ckpt)
    zero_middle(ckpt / "optimizer.bin")
    proc = launch("train.py", TRAIN_ARGS + ["--resume_from_checkpoint", str(ckpt), "--output_dir", str(tmp_path / "o")],
                  hf_home, check=False)
    ours = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(ours) == 1, proc.stderr[-3000:]
    assert f"{ckpt / 'optimizer.bin'} does not match its xxh3_128 checksum" in ours[0]
    assert "setup" not in proc.stdout and not (tmp_path / "o" / "run_summary.json").exists()


def test_an_fsdp2_rank_shard_damaged_in_place_makes_auto_resume_the_checkpoint_before_it(
        tmp_path, hf_home, two_process_runs, initial_model):
    full = two_process_runs("train.py/fsdp.yaml")
    out = tmp_path / "run"
    for step in (30, 60):
        shutil.copytree(full.output_dir / "checkpoints" / f"step_{step}", out / "checkpoints" / f"step_{step}")
    shard = out / "checkpoints" / "step_60" / "optimizer_0" / "__1_0.distcp"  # rank 1's part of the optimizer
    zero_middle(shard)
    args = TWO_RANK_ARGS + ["--save_every", "30", "--sample_length", "8", "--model_name_or_path", str(initial_model),
                            "--output_dir", str(out), "--resume_from_checkpoint", "auto"]
    resumed = Run(out, launch_two_processes("train.py", "fsdp.yaml", args, hf_home))
    assert f"{shard} does not match its xxh3_128 checksum" in resumed.proc.stdout
    assert resumed.summary["resumed_from"]["step"] == 30
    check_exact_resume(full, resumed, 30)  # steps 31-60 trained again, exactly as the first time
    assert (out / "checkpoints" / "step_60.damaged").is_dir()


# ---- 2. one live run per output folder ----
def run_args(out: Path, steps: int) -> list[str]:
    """A run that writes nothing into its folder while it trains (no eval, save or log interval)."""
    return DEBUG_ARGS + ["--max_steps", str(steps), "--warmup_steps", "1", "--eval_every", "0", "--save_every", "0",
                         "--log_every", "100000", "--sample_length", "0", "--save_model", "false",
                         "--output_dir", str(out)]


def folder_state(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def test_a_second_run_into_a_live_runs_folder_exits_2_and_writes_nothing_and_a_killed_holder_blocks_nothing(
        tmp_path, hf_home):
    out, logs = tmp_path / "run", tmp_path / "holder"
    holder = start("train.py", run_args(out, 100000), hf_home, logs)
    # metrics.jsonl is the holder's last write before its first log interval (never, here)
    wait_for(lambda: (out / "metrics.jsonl").is_file(), holder, "the holder training")
    worker = worker_pids(holder)[0]
    before = folder_state(out)

    second = launch("train.py", run_args(out, 2), hf_home, check=False)
    ours = error_lines(second.stderr)
    assert second.returncode != 0 and len(ours) == 1, second.stderr[-3000:]
    assert f"--output_dir {out} is in use by another run (host {os.uname().nodename}, PID {worker}" in ours[0]
    assert folder_state(out) == before  # the second run wrote nothing (the holder writes nothing meanwhile)

    for pid in [holder.pid] + descendants(holder.pid):  # the holder dies without a word: its lock goes with it
        os.kill(pid, signal.SIGKILL)
    holder.wait(timeout=60)
    STARTED.remove(holder)
    after = launch("train.py", run_args(out, 2), hf_home)
    assert "done: 2 steps" in after.stdout
    assert json.loads((out / output_dir.LOCK_FILE).read_text())["pid"] != worker


def test_the_lock_says_who_holds_it_and_is_free_once_its_holder_is_gone(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen(  # another process holding the folder, as a live run does
        [sys.executable, "-c", "import sys, time; sys.path[:0] = sys.argv[2:]; "
         "from train_extras.resume import output_dir; "
         "assert output_dir._lock(__import__('pathlib').Path(sys.argv[1])) is None; print('held', flush=True); "
         "time.sleep(600)", str(folder), str(Path(__file__).parents[1])],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        reason = output_dir._lock(folder)
        assert reason.startswith(f"--output_dir {folder} is in use by another run") and f"PID {holder.pid}" in reason
    finally:
        holder.kill()
        holder.wait()
    assert output_dir._lock(folder) is None  # a dead holder's lock: gone with it
    assert json.loads((folder / output_dir.LOCK_FILE).read_text())["pid"] == os.getpid()
    os.close(output_dir._held.pop())  # this test process holds it no longer


# ---- 3. one line for each failure ----
@pytest.mark.quick
def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    folder = tmp_path / "file" / "run"
    assert output_dir._lock(folder).startswith(f"--output_dir {folder}: cannot create or write it (Not a directory")
    assert not output_dir._held


def test_an_output_folder_under_a_file_stops_the_recipe_before_the_model_is_built(tmp_path, hf_home):
    (tmp_path / "file").write_text("x")
    proc = launch("train.py", DEBUG_ARGS + ["--output_dir", str(tmp_path / "file" / "run")], hf_home, check=False)
    ours = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(ours) == 1, proc.stderr[-3000:]
    assert "cannot create or write it (Not a directory" in ours[0]
    assert "Traceback" not in proc.stderr.split("error: ")[0]  # nothing of ours before the line
    assert "parameters" not in proc.stdout  # the setup block (printed once the data is ready) never came


@pytest.mark.parametrize("path", ["./no/such/model", "/no/such/model", "../no/such"])
def test_a_missing_local_model_folder_is_named_as_such(path, tmp_path, capsys):
    code = config.run_cli(load_recipe("train").main, CORE_DEBUG_ARGS + ["--model_name_or_path", path,
                                                                       "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --model_name_or_path {path}: no such local folder")
    assert "Repo id" not in err


@pytest.mark.quick
@pytest.mark.parametrize("sizes, world, needed", [({"TP": "2"}, "1", 2), ({"TP": "4"}, "2", 4),
                                                  ({"DP_SHARD": "2", "TP": "2"}, "2", 4),
                                                  ({"DP_REPLICATE": "2", "DP_SHARD": "2"}, "8", 4)])
def test_a_process_count_the_parallelism_sizes_do_not_allow_is_one_line_before_the_mesh(sizes, world, needed,
                                                                                         monkeypatch):
    def launched_with(env):  # the environment accelerate launch gives the recipe: env's variables of these alone
        for name in [n for n in os.environ if n.startswith(("ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_",
                                                                 "WORLD_SIZE"))]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "WORLD_SIZE": world,
           **{f"PARALLELISM_CONFIG_{k}_SIZE": v for k, v in sizes.items()}}
    launched_with(env)
    with pytest.raises(ConfigError, match=f"needs {needed} processes; this launch has {world}: launch with "
                                          f"--num_processes {needed}"):
        tensor_parallel.check_launch_sizes("train.py")
    launched_with({**env, "WORLD_SIZE": str(needed)})
    tensor_parallel.check_launch_sizes("train.py")  # the right count: fine
    launched_with({"WORLD_SIZE": world})
    tensor_parallel.check_launch_sizes("train.py")  # no parallelism_config: nothing to check


def test_tp_yaml_with_the_wrong_process_count_is_one_line(tmp_path, hf_home):
    """tp_size 4 on 2 processes: torch would stop inside accelerate ("Mesh should not be bigger than
    default world size"), a traceback per rank."""
    proc = launch("train.py", DEBUG_ARGS + ["--output_dir", str(tmp_path / "out")], hf_home, config="tp.yaml",
                  launch_args=TWO_PROCESS_LAUNCH + ["--parallelism_config_tp_size", "4"], check=False,
                  env={"ACCELERATE_USE_CPU": "true"})
    ours = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(ours) == 2 and len(set(ours)) == 1, proc.stderr[-3000:]  # one per rank
    assert "needs 4 processes; this launch has 2: launch with --num_processes 4" in ours[0]
    assert "Mesh should not" not in proc.stderr and not (tmp_path / "out").exists()


def mount_tmpfs(mount: Path, size: str) -> bool:
    """A small tmpfs, where the machine lets us mount one (root, or a container with CAP_SYS_ADMIN)."""
    mount.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("which", ["the first save", "a later save"])
def test_a_disk_that_fills_is_one_line_and_keeps_the_complete_checkpoints(which, tmp_path, hf_home):
    """Each debug checkpoint takes ~1.5 MB. On a 1 MB tmpfs the first save fills the disk half-way
    (torch.save's error names no cause); on 2.5 MB the first fits and the second is refused before
    it writes anything (less space than the last checkpoint took). Without a tmpfs: an ENOSPC
    injected into safetensors' writer by the probes (tests/probes/sitecustomize.py), half the file
    written first, at that save."""
    disk = tmp_path / "disk"
    mounted = mount_tmpfs(disk, "1m" if which == "the first save" else "2560k")
    step = 10 if which == "the first save" else 20
    try:
        out = disk / "run"
        proc = launch("train.py", DEBUG_ARGS + ["--max_steps", "40", "--save_every", "10", "--save_total_limit", "1",
                                                "--eval_every", "0", "--sample_length", "0", "--output_dir", str(out)],
                      hf_home, check=False, env={} if mounted else {"ACCELERATE_RECIPES_DISK_FULL_AT": f"step_{step}"})
        ours = error_lines(proc.stderr)
        assert proc.returncode != 0 and len(ours) == 1, proc.stderr[-3000:]
        final = out / "checkpoints" / f"step_{step}"
        if mounted and step == 20:  # the check before the save
            assert f"not enough space to save {final}: " in ours[0] and "nothing was written" in ours[0]
        else:  # the disk filled during the save
            assert f"disk full while saving {final} (" in ours[0] and "the partial save was removed" in ours[0]
        complete = checkpoint.list_complete(out)
        assert [p.name for p in complete] == (["step_10"] if step == 20 else [])
        assert all(checkpoint.verify(p) for p in complete)  # whole, content and all
        if complete:  # what a rerun goes on from, named; or that there is nothing (not "rerun with auto")
            assert ours[0].endswith(f"1 complete checkpoint(s) kept, the newest {complete[-1]}: free space (or quota) "
                                    "and rerun with --resume_from_checkpoint auto"), ours[0]
        else:
            assert ours[0].endswith(f"no complete checkpoint is in {out / 'checkpoints'}: free space (or quota) and "
                                    "rerun (it starts afresh)"), ours[0]
        assert not list((out / "checkpoints").glob(".step_*"))  # no partial left behind
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)
