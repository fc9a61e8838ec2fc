"""Checkpoints II: preemption, crashes during a save, lost ranks, resharding, bad checkpoints.

Every fault is real: signals to the real worker processes, the save stopped dead (os._exit) at
named phases through the test switch in common/checkpoint.py, SIGKILL during saves, a rank frozen
with SIGSTOP. Old checkpoints are compared by SHA-256 before and after."""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from common.config import ConfigError
from probes.sitecustomize import FAULT_PHASES
from train_extras.resume import checkpoint, preemption
from train_extras.resume import launch as job_launcher
from train_extras.options import TrainConfig
from conftest import (DEBUG_ARGS, HARNESS, PROBES, ROOT, TRAIN_ARGS, TWO_CPU_PROCESSES, TWO_PROCESS_LAUNCH,
                      TWO_RANK_ARGS, Run, check_exact_resume, check_resumed_losses, launch, launch_command,
                      launch_two_processes, parse_train, read_summary)


# ---- helpers ----
def checksums(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def snapshot(output_dir: Path) -> dict:
    """{name: checksums} of the complete checkpoints; one rotated away while we read is left out."""
    found = {}
    for path in checkpoint.list_complete(output_dir):
        try:
            found[path.name] = checksums(path)
        except FileNotFoundError:
            pass
    return found


def check_older_checkpoints_untouched(before: dict, output_dir: Path) -> list[Path]:
    """Every complete checkpoint that existed before is byte-identical (or was rotated away whole),
    and every complete one passes verify(). Returns the complete ones."""
    complete = checkpoint.list_complete(output_dir)
    assert complete, "no complete checkpoint left"
    for path in complete:
        checkpoint.verify(path)
        if path.name in before:
            assert checksums(path) == before[path.name], f"{path.name} changed"
    return complete


STARTED: list[subprocess.Popen] = []


def descendants(pid: int) -> list[int]:
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return children + [d for c in children for d in descendants(c)]


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """A failed wait must not leave a launcher or an orphaned worker training (and saving) forever."""
    yield
    while STARTED:
        proc = STARTED.pop()
        for pid in [proc.pid] + descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def start(recipe: str, args: list[str], hf_home: Path, logs: Path, **kwargs) -> subprocess.Popen:
    """`accelerate launch` in the background; output to files (a full pipe would block the run)."""
    cmd, env = launch_command(recipe, args, hf_home, **kwargs)
    logs.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(logs / "stdout", "w"),
                            stderr=open(logs / "stderr", "w"))
    STARTED.append(proc)
    return proc


def start_two_processes(recipe: str, config: str, args: list[str], hf_home: Path, logs: Path, env=None):
    return start(recipe, args, hf_home, logs, config=config, launch_args=TWO_PROCESS_LAUNCH,
                 env={**TWO_CPU_PROCESSES[config], **(env or {})})


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s")
        time.sleep(0.002)


def worker_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the launcher's workers (its child processes, for both of accelerate's launchers)."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
        ranks[int(env.get("RANK", "0"))] = pid
    return ranks


def is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def text(logs: Path, name: str = "stderr") -> str:
    return (logs / name).read_text()


def error_lines(stderr: str, prefix: str = "error: ") -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


# ---- 1. preemption ----
# The same options as two_process_runs' train.py/ddp.yaml, so its run is the uninterrupted reference.
DDP_ARGS = TWO_RANK_ARGS + ["--save_every", "30"]


def test_sigterm_to_every_worker_saves_and_the_resumed_run_matches_the_uninterrupted_one(
        tmp_path, hf_home, two_process_runs):
    full = two_process_runs("train.py/ddp.yaml")
    out, logs = tmp_path / "run", tmp_path / "logs"
    proc = start_two_processes("train.py", "ddp.yaml", DDP_ARGS + ["--output_dir", str(out)], hf_home, logs)
    # mid-run, between two periodic saves: once step_30 is written (30 steps of 60 remain, ~0.5 s)
    wait_for(lambda: (out / "checkpoints" / "step_30").is_dir(), proc, "step_30 checkpoint")
    workers = worker_pids(proc)
    assert sorted(workers) == [0, 1]
    for pid in workers.values():  # as SLURM and Kubernetes do: every process gets the signal
        os.kill(pid, signal.SIGTERM)
    proc.wait(timeout=120)
    stderr = text(logs)
    assert proc.returncode != 0  # the launcher reports a failure; the marker is the requeue signal

    marker = json.loads((out / preemption.REQUEUE_MARKER).read_text())
    step = marker["step"]
    assert 30 < step < 60, marker
    assert marker["signal"] == "SIGTERM" and marker["checkpoint"] == str(out / "checkpoints" / f"step_{step}")
    # both ranks stopped after the same step, with one line each
    assert len(error_lines(stderr, f"stopped: preempted (SIGTERM) at step {step}: saved")) == 2, stderr[-3000:]
    checkpoint.verify(out / "checkpoints" / f"step_{step}")
    stopped = read_summary(out)
    assert stopped["preempted"]["step"] == step
    assert [row["step"] for row in stopped["losses"]] == list(range(1, step + 1))
    assert "export" not in stopped and not (out / "model").exists()  # an unfinished model is not exported

    resumed = Run(out, launch_two_processes(
        "train.py", "ddp.yaml", DDP_ARGS + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"], hf_home))
    check_exact_resume(full, resumed, step)  # bitwise the same losses and samples as never stopping
    assert resumed.summary["eval"][-1] == full.summary["eval"][-1]
    assert not (out / preemption.REQUEUE_MARKER).exists()  # the resumed run cleared it


def test_sigusr1_to_the_launcher_alone_reaches_the_workers_when_the_launcher_is_told_to_forward_it(
        tmp_path, hf_home):
    """SLURM's `--signal=B:USR1@120` signals the batch shell's child, the launcher, only. torchelastic
    forwards the signals named in PET_SIGNALS_TO_HANDLE (the README's command); without it SIGUSR1
    kills the launcher and orphans the workers (docs/toolchain.md#launcher-signals)."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    args = TWO_RANK_ARGS + ["--max_steps", "100000", "--eval_every", "0", "--save_model", "false",
                            "--output_dir", str(out)]
    proc = start_two_processes("train.py", "ddp.yaml", args, hf_home, logs,
                               env={"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"})
    wait_for(lambda: " tok/s" in text(logs, "stdout"), proc, "training progress")  # the loop runs
    workers = worker_pids(proc)
    proc.send_signal(signal.SIGUSR1)
    proc.wait(timeout=120)
    marker = json.loads((out / preemption.REQUEUE_MARKER).read_text())
    assert marker["signal"] == "SIGUSR1" and marker["step"] >= 10
    checkpoint.verify(marker["checkpoint"])
    assert not any(is_running(pid) for pid in workers.values())  # no orphans


def test_sigterm_to_a_one_process_launcher_still_saves(tmp_path, hf_home):
    """The 1-process launcher forwards nothing and dies at once; the worker, told by the kernel that
    its parent died (PR_SET_PDEATHSIG), saves and stops instead of training on as an orphan."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    args = DEBUG_ARGS + ["--max_steps", "100000", "--eval_every", "0", "--save_model", "false",
                         "--output_dir", str(out)]
    proc = start("train.py", args, hf_home, logs)
    wait_for(lambda: " tok/s" in text(logs, "stdout"), proc, "training progress")
    worker = worker_pids(proc)[0]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 120
    while is_running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(worker)
    marker = json.loads((out / preemption.REQUEUE_MARKER).read_text())
    checkpoint.verify(marker["checkpoint"])
    assert error_lines(text(logs), f"stopped: preempted (SIGTERM) at step {marker['step']}")


@pytest.mark.quick
def test_the_job_launcher_explains_only_the_codes_its_workers_explained(tmp_path):
    """train_extras/resume/launch.py ends in one line only when every failed worker ended with one of
    train.py's own codes (it printed its own line); a crash or a signal keeps the launcher's report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failed(*codes: int) -> ChildFailedError:
        failures = {}
        for rank, code in enumerate(codes):
            failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                                            error_file=str(tmp_path / "none"))
            failures[rank].timestamp = rank  # rank 0 first
        return ChildFailedError("train.py", failures)

    assert job_launcher.explained_code(failed(75, 75)) == 75
    assert job_launcher.explained_code(failed(2, 75)) == 2  # the first failure's
    assert job_launcher.explained_code(failed(75, -9)) is None  # a rank killed by a signal
    assert job_launcher.explained_code(failed(1)) is None  # a crash: its traceback stays
    assert job_launcher.explained_code(subprocess.CalledProcessError(75, ["python"])) == 75  # one process
    assert job_launcher.explained_code(subprocess.CalledProcessError(1, ["python"])) is None
    assert job_launcher.explained_code(RuntimeError("rendezvous")) is None
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in job_launcher.children()  # whom a signal is passed on to (and any other child)
    finally:
        child.kill()
        child.wait()


def test_the_job_launcher_forwards_sigterm_to_a_one_process_run_and_ends_in_one_line(tmp_path, hf_home):
    """train_extras/resume/launch.py (the launcher of scripts/slurm/train.sbatch): accelerate launch's
    command line; a signal to it reaches the worker, which saves; then one line and exit code 75, no
    traceback. (Several processes, through torchelastic: tests/test_slurm.py, on a real cluster.)"""
    out, logs = tmp_path / "run", tmp_path / "logs"
    args = DEBUG_ARGS + ["--max_steps", "100000", "--eval_every", "0", "--save_model", "false",
                         "--output_dir", str(out)]
    cmd, env = launch_command("train.py", args, hf_home)
    logs.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "train_extras.resume.launch", *cmd[2:]], cwd=ROOT, env=env,
                            stdout=open(logs / "stdout", "w"), stderr=open(logs / "stderr", "w"))
    STARTED.append(proc)
    wait_for(lambda: " tok/s" in text(logs, "stdout"), proc, "training progress")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == preemption.EXIT_CODE
    marker = json.loads((out / preemption.REQUEUE_MARKER).read_text())
    checkpoint.verify(marker["checkpoint"])
    stderr = text(logs)
    assert error_lines(stderr, "stopped: ") == [
        f"stopped: preempted (SIGTERM) at step {marker['step']}: saved {marker['checkpoint']} and "
        f"{out}/requeue.json; exit code 75; rerun with --resume_from_checkpoint auto"]
    assert error_lines(stderr, "launch: ") == [
        "launch: the workers stopped with exit code 75 (preempted, checkpoint saved: requeue with "
        "--resume_from_checkpoint auto)"]
    assert "Traceback" not in stderr


# A long eval: once the model has trained, each held-out batch and each generated token takes 1 s
# (tests/probes/sitecustomize.py), so the eval at step 10 (18 batches) would take 18 s to end by itself
# (a big model's, minutes). A signal is answered within 4 batches (train_extras/data/assemble.py STOP_CHECK_EVERY).
SLOW_EVAL = {"ACCELERATE_RECIPES_SLOW_EVAL": "1"}
EVAL_ARGS = ["--max_steps", "20", "--eval_every", "10", "--log_every", "10", "--save_model", "false"]


def signal_during_the_eval_at_step_10(proc, logs: Path, out: Path, ranks: list[int]) -> float:
    """SIGTERM to the workers of `ranks` once step 10's interval line is out (its eval follows at
    once); returns the seconds until the checkpoint and the requeue marker are both there."""
    wait_for(lambda: "step 10/20" in text(logs, "stdout"), proc, "step 10's interval line")
    workers = worker_pids(proc)
    for pid in [workers[rank] for rank in ranks]:
        os.kill(pid, signal.SIGTERM)
    signalled = time.monotonic()
    wait_for(lambda: (out / preemption.REQUEUE_MARKER).is_file(), proc, "the requeue marker", timeout=120)
    return time.monotonic() - signalled


def check_stopped_during_the_eval(out: Path, seconds: float) -> dict:
    marker = json.loads((out / preemption.REQUEUE_MARKER).read_text())
    assert marker["step"] == 10 and marker["checkpoint"] == str(out / "checkpoints" / "step_10"), marker
    assert seconds < 12, seconds  # 4 batches of 1 s at most, then the save (the whole eval: 18 s)
    meta = checkpoint.verify(out / "checkpoints" / "step_10")
    assert meta["eval_pending"] is True  # the resumed run evaluates step 10 first
    stopped = read_summary(out)
    assert stopped["preempted"]["interrupted"] == "eval"
    assert [e["step"] for e in stopped["eval"]] == [0]  # a part of the held-out set is no eval
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "eval"] == [0]
    return marker


def test_sigterm_during_a_long_eval_saves_within_seconds_and_the_resumed_run_evaluates_again(tmp_path, hf_home):
    out, logs = tmp_path / "run", tmp_path / "logs"
    args = DEBUG_ARGS + EVAL_ARGS + ["--output_dir", str(out)]
    proc = start("train.py", args, hf_home, logs, env=SLOW_EVAL)
    seconds = signal_during_the_eval_at_step_10(proc, logs, out, [0])
    proc.wait(timeout=60)
    check_stopped_during_the_eval(out, seconds)
    assert "returned non-zero exit status 75" in text(logs)  # the worker's code, in the launcher's line
    assert error_lines(text(logs), "stopped: preempted (SIGTERM) at step 10 during its eval: saved")
    resumed = Run(out, launch("train.py", args + ["--resume_from_checkpoint", "auto"], hf_home))
    assert [e["step"] for e in resumed.summary["eval"]] == [10, 20]
    assert [row["step"] for row in resumed.summary["losses"]] == list(range(11, 21))


def test_sigterm_to_one_rank_during_a_long_eval_stops_both_at_the_same_batch(tmp_path, hf_home):
    """Rank 1 alone is signalled; rank 0 learns it from the vote every few eval batches and both
    leave the eval together (a rank left inside it would wait in its next gather, then time out)."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    args = TWO_RANK_ARGS + EVAL_ARGS + ["--output_dir", str(out)]
    proc = start_two_processes("train.py", "ddp.yaml", args, hf_home, logs, env=SLOW_EVAL)
    seconds = signal_during_the_eval_at_step_10(proc, logs, out, [1])
    proc.wait(timeout=60)
    marker = check_stopped_during_the_eval(out, seconds)
    assert marker["signal"] == "another rank's signal"  # rank 0 writes it, and was not signalled itself
    assert error_lines(text(logs), "stopped: preempted (SIGTERM) at step 10 during its eval: saved")
    assert error_lines(text(logs), "stopped: preempted (another rank's signal) at step 10 during its eval: saved")


# ---- 2. crash safety: faults injected at each phase of a save, and real SIGKILLs ----
FAULT_ENV = "ACCELERATE_RECIPES_FAULT"  # read by the probes (tests/probes/sitecustomize.py)
FAULT_ARGS = DEBUG_ARGS + ["--lr_schedule", "constant", "--warmup_steps", "1", "--eval_every", "0",
                           "--save_model", "false", "--save_every", "2", "--save_total_limit", "2"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, hf_home):
    """A run that saved step_2 and step_4; each fault test continues a copy of it to step 6."""
    out = tmp_path_factory.mktemp("two_checkpoints")
    launch("train.py", FAULT_ARGS + ["--max_steps", "4", "--output_dir", str(out)], hf_home)
    assert [p.name for p in checkpoint.list_complete(out)] == ["step_2", "step_4"]
    return out


def continue_to_step_6(source: Path, out: Path, hf_home: Path, fault: str | None = None):
    shutil.copytree(source, out)
    env = {FAULT_ENV: fault} if fault else {}
    args = FAULT_ARGS + ["--max_steps", "6", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]
    return launch("train.py", args, hf_home, check=fault is None, env=env)


@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_a_crash_at_any_phase_of_a_save_keeps_the_older_checkpoints_and_auto_finds_the_newest(
        phase, tmp_path, hf_home, two_checkpoints):
    out = tmp_path / "run"
    before = snapshot(two_checkpoints)
    proc = continue_to_step_6(two_checkpoints, out, hf_home, fault=f"{phase}@6")
    assert proc.returncode != 0
    assert f"stops dead at {phase} of step 6" in proc.stderr, proc.stderr[-2000:]

    complete = check_older_checkpoints_untouched(before, out)
    leftovers = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("."))
    if phase == "during_rotation":  # step_6 was committed; step_2 was being removed
        assert [p.name for p in complete] == ["step_4", "step_6"]
        assert leftovers == [".step_2.deleting"]  # half deleted, and not listed as a checkpoint
    else:
        assert [p.name for p in complete] == ["step_2", "step_4"]
        assert leftovers == [".step_6.partial"]  # the fault hit mid-save
    cfg = TrainConfig(output_dir=str(out), resume_from_checkpoint="auto")
    assert checkpoint.resolve_resume(cfg) == complete[-1]


def test_after_a_crash_mid_save_auto_resume_continues_exactly_and_clears_the_leftovers(
        tmp_path, hf_home, two_checkpoints):
    reference = tmp_path / "reference"
    continue_to_step_6(two_checkpoints, reference, hf_home)
    crashed = tmp_path / "crashed"
    continue_to_step_6(two_checkpoints, crashed, hf_home, fault="after_shard@6")  # step_6 half written
    resumed = Run(crashed, launch("train.py", FAULT_ARGS + [
        "--max_steps", "6", "--output_dir", str(crashed), "--resume_from_checkpoint", "auto"], hf_home))
    assert resumed.summary["resumed_from"]["step"] == 4
    assert resumed.summary["losses"] == read_summary(reference)["losses"]
    assert checksums(crashed / "checkpoints" / "step_6")["model.safetensors"] == \
        checksums(reference / "checkpoints" / "step_6")["model.safetensors"]
    assert sorted(p.name for p in (crashed / "checkpoints").iterdir()) == ["step_4", "step_6"]


def test_rank_0_dying_after_writing_its_fsdp2_shard_keeps_the_older_checkpoints(
        tmp_path, hf_home, two_process_runs, initial_model):
    """The sharded case: rank 0 stops dead once its shard of step 62 is written; rank 1, waiting for
    it at the barrier, stops on the failed collective. step_30 and step_60 stay as they were."""
    full = two_process_runs("train.py/fsdp.yaml")
    out = tmp_path / "run"
    shutil.copytree(full.output_dir / "checkpoints", out / "checkpoints")
    before = snapshot(out)
    assert sorted(before) == ["step_30", "step_60"]
    args = TWO_RANK_ARGS + ["--max_steps", "62", "--save_every", "2", "--model_name_or_path", str(initial_model),
                            "--save_model", "false", "--output_dir", str(out), "--resume_from_checkpoint", "auto"]
    proc = launch_two_processes("train.py", "fsdp.yaml", args, hf_home, check=False,
                                env={FAULT_ENV: "after_shard@62"})
    assert proc.returncode != 0
    assert "stops dead at after_shard of step 62" in proc.stderr
    assert any(line.startswith("error: rank 1: a collective failed") for line in error_lines(proc.stderr)), \
        proc.stderr[-3000:]
    complete = check_older_checkpoints_untouched(before, out)
    assert [p.name for p in complete] == ["step_30", "step_60"]
    assert (out / "checkpoints" / ".step_62.partial" / "pytorch_model_fsdp_0").is_dir()  # shards were written
    assert checkpoint.resolve_resume(TrainConfig(output_dir=str(out), resume_from_checkpoint="auto")) == complete[-1]


@pytest.mark.parametrize("trial", range(3))
def test_sigkill_during_a_save(trial, tmp_path, hf_home):
    """A real kill -9 of the worker while a save is in flight (a .partial folder exists)."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    keep = ["0", "0", "3"][trial]  # the third trial also rotates
    args = DEBUG_ARGS + ["--max_steps", "100000", "--lr_schedule", "constant", "--warmup_steps", "1",
                         "--eval_every", "0", "--save_model", "false", "--save_every", "1", "--save_total_limit", keep,
                         "--output_dir", str(out)]
    proc = start("train.py", args, hf_home, logs)
    root = out / "checkpoints"
    newest_step = lambda: int(checkpoint.list_complete(out)[-1].name[5:]) if checkpoint.list_complete(out) else 0  # noqa: E731
    wait_for(lambda: newest_step() >= 3 + 2 * trial, proc, "a few checkpoints")
    before = snapshot(out)
    wait_for(lambda: any(p.name.endswith(".partial") for p in root.iterdir()), proc, "a save in flight")
    worker = worker_pids(proc)[0]
    os.kill(worker, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    complete = check_older_checkpoints_untouched(before, out)
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert leftovers, "the kill landed between saves"  # it should land inside one: we killed mid-save
    cfg = TrainConfig(output_dir=str(out), resume_from_checkpoint="auto")
    assert checkpoint.resolve_resume(cfg) == complete[-1]


# ---- 3. a lost rank ----
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_rank_stops_the_other_within_the_collective_timeout(how, tmp_path, hf_home):
    """SIGKILL: the peer's sockets close and gloo fails at once. SIGSTOP: the peer hangs with its
    sockets open, the worst case; only --collective_timeout ends the wait."""
    timeout = 10
    out, logs = tmp_path / "run", tmp_path / "logs"
    args = TWO_RANK_ARGS + ["--max_steps", "100000", "--eval_every", "0", "--save_model", "false",
                            "--collective_timeout", str(timeout), "--output_dir", str(out)]
    proc = start_two_processes("train.py", "ddp.yaml", args, hf_home, logs)
    wait_for(lambda: " tok/s" in text(logs, "stdout"), proc, "training progress")
    ranks = worker_pids(proc)
    os.kill(ranks[1], getattr(signal, how))
    lost_at = time.monotonic()
    while is_running(ranks[0]) and time.monotonic() - lost_at < timeout + 60:
        time.sleep(0.05)
    elapsed = time.monotonic() - lost_at
    if how == "SIGSTOP":
        os.kill(ranks[1], signal.SIGKILL)  # the launcher would wait 30 s for a frozen process
    proc.wait(timeout=120)
    ours = error_lines(text(logs))
    assert any(line.startswith("error: rank 0: a collective failed") for line in ours), text(logs)[-3000:]
    # generous margins: this machine is shared; the point is "bounded", not "fast"
    if how == "SIGKILL":
        assert elapsed < timeout, elapsed
    else:
        assert timeout - 1 < elapsed < timeout + 15, elapsed
        assert any("Timed out" in line for line in ours)


# ---- 4. elastic resume ----
def check_same_steps_after_a_world_size_change(full: Run, resumed: Run, half: int, tolerance: float):
    check_resumed_losses(full, resumed, half, tolerance)
    # the same samples in every step, however the step is cut into ranks
    full_steps = [sorted(sum(ids, [])) for ids in zip(*full.batches)][half:]
    assert [sorted(ids) for ids in resumed.batches[0]] == full_steps
    assert abs(resumed.summary["eval"][-1]["loss"] - full.summary["eval"][-1]["loss"]) <= tolerance


# Tolerance of a world-size change: the same arithmetic, summed in another order across ranks
# (measured: FSDP2 step 31 identical, steps 31-60 within 4.8e-7).
RESHARD_TOLERANCE = 1e-5


def test_an_fsdp2_checkpoint_of_2_ranks_resumes_on_1_rank(tmp_path, hf_home, two_process_runs, initial_model):
    full = two_process_runs("train.py/fsdp.yaml")
    args = DEBUG_ARGS + ["--micro_batch_size", "8", "--save_every", "30",  # global batch 8 as before
                         "--model_name_or_path", str(initial_model), "--output_dir", str(tmp_path),
                         "--resume_from_checkpoint", str(full.output_dir / "checkpoints" / "step_30")]
    proc = launch("train.py", args, hf_home, config="fsdp.yaml", env=HARNESS,
                  launch_args=["--num_processes", "1", "--num_cpu_threads_per_process", "2", "--mixed_precision", "no"])
    resumed = Run(tmp_path, proc)
    assert (resumed.summary["setup"]["distributed_type"], resumed.summary["setup"]["world_size"]) == ("FSDP", 1)
    assert resumed.summary["resumed_from"]["world_size"] == 2
    check_same_steps_after_a_world_size_change(full, resumed, 30, RESHARD_TOLERANCE)


def test_a_ddp_checkpoint_of_2_ranks_resumes_in_one_process(tmp_path, hf_home, two_process_runs):
    """Replicated states (model, optimizer) do not depend on the world size."""
    full = two_process_runs("train.py/ddp.yaml")
    args = DEBUG_ARGS + ["--save_every", "30", "--output_dir", str(tmp_path),
                         "--resume_from_checkpoint", str(full.output_dir / "checkpoints" / "step_30")]
    resumed = Run(tmp_path, launch("train.py", args, hf_home))
    assert resumed.summary["setup"]["world_size"] == 1 and resumed.summary["resumed_from"]["world_size"] == 2
    check_same_steps_after_a_world_size_change(full, resumed, 30, RESHARD_TOLERANCE)


def fake_accelerator(distributed_type: DistributedType, num_processes: int):
    return SimpleNamespace(distributed_type=distributed_type, num_processes=num_processes)


def test_a_zero3_checkpoint_on_another_world_size_says_what_to_run(two_process_runs):
    full = two_process_runs("train.py/deepspeed_zero3_offload.yaml")
    step_30 = full.output_dir / "checkpoints" / "step_30"
    cfg = parse_train(DEBUG_ARGS + ["--micro_batch_size", "8"])
    meta = checkpoint.verify(step_30, contents=False)
    with pytest.raises(ConfigError, match=r"saved by 2 DeepSpeed ranks; this run has 1.*resume with 2 processes, "
                                          r"or export its weights .*--max_steps 30"):
        checkpoint.check_compatible(step_30, cfg, fake_accelerator(DistributedType.DEEPSPEED, 1), meta)


@pytest.mark.quick
def test_a_world_size_change_inside_a_micro_step_is_refused_before_any_work(tmp_path):
    """An epoch that ended inside an optimizer step leaves a position that 8 ranks x 2 cannot start from."""
    from train_extras.options import TrainConfig

    meta = {"step": 6, "micro_batches_done": 26, "batches_per_epoch": 25, "files": {},
            "config": {"preset": "debug", "micro_batch_size": 2, "gradient_accumulation_steps": 2,
                       "model_name_or_path": None, "document_mask": True},  # a save records every option
            "setup": {"distributed_type": "FSDP", "world_size": 4}}
    meta["metadata_checksum"] = checkpoint.metadata_digest(meta)  # as a save writes it
    (tmp_path / "checkpoint.json").write_text(json.dumps(meta))
    cfg = TrainConfig(preset="debug", micro_batch_size=2, gradient_accumulation_steps=1)
    with pytest.raises(ConfigError, match="8 samples into an epoch.*micro-steps of 16"):
        checkpoint.check_compatible(tmp_path, cfg, fake_accelerator(DistributedType.FSDP, 8),
                                    checkpoint.verify(tmp_path, contents=False))


def test_a_run_into_a_folder_with_newer_checkpoints_is_refused(two_checkpoints):
    """A fresh run there would rotate its own new checkpoints away and `auto` would pick the old run's."""
    with pytest.raises(ConfigError, match=r"already holds step_2, step_4 past this run's start \(step 0\)"):
        checkpoint.check_output_dir(TrainConfig(output_dir=str(two_checkpoints)), 0)
    checkpoint.check_output_dir(TrainConfig(output_dir=str(two_checkpoints)), 4)  # continuing it is fine


def test_a_change_of_global_batch_is_refused(two_process_runs):
    step_30 = two_process_runs("train.py/ddp.yaml").output_dir / "checkpoints" / "step_30"
    cfg = parse_train(DEBUG_ARGS + ["--micro_batch_size", "4"])  # 4 x 1 rank: half the saved batch of 8
    meta = checkpoint.verify(step_30, contents=False)
    with pytest.raises(ConfigError, match="global batch of 8 sequences; this run has 4"):
        checkpoint.check_compatible(step_30, cfg, fake_accelerator(DistributedType.NO, 1), meta)


# ---- 5. damaged checkpoints ----
def damage_truncate(ckpt: Path) -> str:
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    return "model.safetensors has 1000 bytes, the save wrote"


def damage_delete_optimizer(ckpt: Path) -> str:
    (ckpt / "optimizer.bin").unlink()
    return "optimizer.bin is missing"


def break_header(ckpt: Path) -> None:
    """Same size, broken header."""
    file = ckpt / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[:8] = b"\xff" * 8
    file.write_bytes(bytes(data))


def damage_in_place(ckpt: Path) -> str:
    break_header(ckpt)
    return "model.safetensors does not match its xxh3_128 checksum"  # found before anything loads


def damage_in_place_unverified(ckpt: Path) -> str:
    """With --verify_checkpoint false only the reader can tell: its failure is still one line."""
    break_header(ckpt)
    return "could not be loaded (SafetensorError"


@pytest.mark.parametrize("damage", [damage_truncate, damage_delete_optimizer, damage_in_place,
                                    damage_in_place_unverified])
def test_a_damaged_checkpoint_is_refused_naming_the_file(damage, tmp_path, hf_home, train_run):
    ckpt = tmp_path / "checkpoints" / "step_30"
    shutil.copytree(train_run.output_dir / "checkpoints" / "step_30", ckpt)
    message = damage(ckpt)
    before = checksums(ckpt)
    unverified = ["--verify_checkpoint", "false"] if damage is damage_in_place_unverified else []
    proc = launch("train.py", TRAIN_ARGS + ["--resume_from_checkpoint", str(ckpt),
                                            "--output_dir", str(tmp_path / "out")] + unverified,
                  hf_home, check=False)
    assert proc.returncode != 0
    ours = error_lines(proc.stderr)
    assert len(ours) == 1 and message in ours[0] and str(ckpt) in ours[0], proc.stderr[-3000:]
    assert not (tmp_path / "out" / "run_summary.json").exists()  # nothing trained on a partial load
    assert checksums(ckpt) == before  # the bad checkpoint itself is left for inspection


def test_a_missing_fsdp_shard_is_named(tmp_path, two_process_runs):
    ckpt = tmp_path / "step_30"
    shutil.copytree(two_process_runs("train.py/fsdp.yaml").output_dir / "checkpoints" / "step_30", ckpt)
    shard = sorted((ckpt / "pytorch_model_fsdp_0").glob("*.distcp"))[-1]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"{shard} is missing"):
        checkpoint.verify(ckpt)


@pytest.mark.quick
def test_a_fault_switch_with_an_unknown_phase_fails_loudly(monkeypatch):
    """A typo in the test switch must not turn a fault test into a plain run that passes: the
    probe stops the process at start-up (before it patches anything)."""
    monkeypatch.setenv(FAULT_ENV, "before_renam@6")
    monkeypatch.delenv("ACCELERATE_RECIPES_PROBE_DIR", raising=False)
    with pytest.raises(RuntimeError, match="unknown phase"):
        runpy.run_path(str(PROBES / "sitecustomize.py"))
