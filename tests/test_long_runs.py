"""A long run under a scheduler: preempted (SIGTERM), requeued, killed (SIGKILL), requeued again.

One run in three parts, all with stdout and stderr going to files as under SLURM, and with every
tracker on (wandb offline): part 1 is preempted, part 2 resumes and is killed dead between two
checkpoints, part 3 resumes from the last checkpoint and finishes. Checked from those three launches:
metrics.jsonl (every interval logged before the kill, each step once across the parts), plain log
lines instead of progress-bar redraws, and one tracker run (wandb id, trackio run id, TensorBoard steps)."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
from pathlib import Path

import pytest

from conftest import DEBUG_ARGS, read_summary
from test_observability import tensorboard_scalars
from test_resilience import STARTED, descendants, start, text, wait_for, worker_pids
from train_extras.resume import checkpoint, preemption
from train_extras.observe.run_record import METRICS_FILE

MAX_STEPS = 40
ARGS = DEBUG_ARGS + ["--max_steps", str(MAX_STEPS), "--log_every", "2", "--eval_every", "10", "--save_every", "10",
                     "--save_model", "false", "--report_to", "tensorboard", "wandb", "trackio"]
PLAIN_LINE = re.compile(r"step (\d+)/40 \| loss \d+\.\d{4} \| lr \d\.\d\de-\d\d \| grad norm \d+\.\d{3} \| "
                        r"[\d,]+ tok/s \| MFU \d+\.\d% \| ETA \d+:\d\d:\d\d")


def rows(path: Path) -> list[dict]:
    """Every line of a metrics file as JSON (strict: a line that is not one fails the test)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def logged_steps(path: Path) -> int:
    """The last step a metrics file holds (0 while it holds none), read while the run writes it."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line)["step"] for line in lines[:-1]]  # the last one may be half written
    return max(steps, default=0)


def kill_dead(proc) -> None:
    """SIGKILL to the launcher and its worker at once: a node lost, nothing saved, nothing flushed."""
    for pid in [proc.pid] + descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def requeued(tmp_path_factory, hf_home):
    root = tmp_path_factory.mktemp("long_run")
    out = root / "run"
    env = {"WANDB_MODE": "offline", "TRACKIO_DIR": str(root / "trackio")}
    args = ARGS + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"]
    parts = {}

    # Part 1: preempted once its file shows a few intervals.
    logs = root / "part1"
    proc = start("train.py", args, hf_home, logs, env=env)
    wait_for(lambda: logged_steps(out / METRICS_FILE) >= 4, proc, "4 logged steps")
    os.kill(worker_pids(proc)[0], signal.SIGTERM)  # the scheduler's signal, to the worker
    proc.wait(timeout=120)
    marker = json.loads((out / preemption.REQUEUE_MARKER).read_text())
    parts[1] = {"logs": logs, "stopped_at": marker["step"], "summary": read_summary(out)}

    # Part 2: resumes, and is killed dead two log intervals past its first periodic checkpoint.
    logs = root / "part2"
    proc = start("train.py", args, hf_home, logs, env=env)
    first_save = (marker["step"] // 10 + 1) * 10
    wait_for(lambda: (out / "checkpoints" / f"step_{first_save}").is_dir()
             and logged_steps(out / METRICS_FILE) >= first_save + 4, proc, f"step {first_save + 4} logged")
    kill_dead(proc)
    STARTED.remove(proc)
    killed_text = (out / METRICS_FILE).read_text()
    parts[2] = {"logs": logs, "metrics_at_kill": killed_text}

    # Part 3: resumes from the newest complete checkpoint and finishes.
    logs = root / "part3"
    proc = start("train.py", args, hf_home, logs, env=env)
    assert proc.wait(timeout=300) == 0, text(logs)[-3000:]
    parts[3] = {"logs": logs, "summary": read_summary(out)}
    return out, parts


def test_the_metrics_file_holds_every_interval_logged_before_a_sigkill(requeued):
    out, parts = requeued
    text_at_kill = parts[2]["metrics_at_kill"]
    lines = text_at_kill.splitlines(keepends=True)
    if not lines[-1].endswith("\n"):  # a write the kill cut short: never the only line, never mid-file
        lines = lines[:-1]
    at_kill = [json.loads(line) for line in lines]  # every whole line is strict JSON
    train = [r["step"] for r in at_kill if r["kind"] == "train"]
    last = max(train)
    assert last >= parts[1]["stopped_at"] + 4
    assert train == list(range(1, last + 1))  # nothing lost before the kill, nothing twice
    intervals = [r["step"] for r in at_kill if r["kind"] == "interval"]
    # every log interval: each even step, plus the step part 1 was preempted at (its last)
    assert intervals == sorted({*range(2, last + 1, 2), parts[1]["stopped_at"]})
    printed = [int(m.group(1)) for m in map(PLAIN_LINE.fullmatch, text(parts[2]["logs"], "stdout").splitlines()) if m]
    assert printed and set(printed) <= set(intervals)  # every interval part 2 reported is in the file


def test_a_resumed_run_goes_on_with_the_metrics_file_without_repeating_or_missing_a_step(requeued):
    out, parts = requeued
    final = rows(out / METRICS_FILE)
    resumed_at = parts[3]["summary"]["resumed_from"]["step"]
    killed_last = max(json.loads(line)["step"] for line in parts[2]["metrics_at_kill"].splitlines()[:-1])
    assert killed_last > resumed_at  # the kill came after steps that part 3 trains again
    assert [r["step"] for r in final if r["kind"] == "train"] == list(range(1, MAX_STEPS + 1))
    assert [r["step"] for r in final if r["kind"] == "eval"] == [0, 10, 20, 30, 40]
    steps = [r["step"] for r in final]
    assert steps == sorted(steps)  # in step order, across the three parts
    # the lines are each part's own numbers: part 1's steps as its summary has them, part 3's as its own
    by_step = {r["step"]: r for r in final if r["kind"] == "train"}
    for part in (parts[1]["summary"], parts[3]["summary"]):
        for row in part["losses"]:
            assert by_step[row["step"]]["loss"] == row["loss"] and by_step[row["step"]]["lr"] == row["lr"]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] for r in final if r["kind"] == "interval")


def test_logs_to_a_file_are_plain_lines_per_interval_without_redraws(requeued):
    out, parts = requeued
    stdout, stderr = text(parts[3]["logs"], "stdout"), text(parts[3]["logs"], "stderr")
    assert "\r" not in stdout + stderr  # no progress bar redraw: ours, datasets' or transformers'
    logged = [int(m.group(1)) for m in map(PLAIN_LINE.fullmatch, stdout.splitlines()) if m]
    resumed_at = parts[3]["summary"]["resumed_from"]["step"]
    assert logged == list(range(resumed_at + 2, MAX_STEPS + 1, 2))  # one line per interval, in order
    for part in (1, 2):
        assert "\r" not in text(parts[part]["logs"], "stdout") + text(parts[part]["logs"], "stderr")


def test_one_wandb_run_id_across_preemption_kill_and_requeues(requeued):
    out, parts = requeued
    folders = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    ids = {name.rsplit("-", 1)[1] for name in folders}
    assert len(folders) == 3 and len(ids) == 1, folders  # one folder per part, all of one run
    stored = json.loads((checkpoint.list_complete(out)[-1] / checkpoint.METADATA).read_text())["tracker_run"]
    assert ids == {stored["id"]} and parts[3]["summary"]["tracker_run"] == stored


def test_one_trackio_run_across_the_parts(requeued):
    out, parts = requeued
    db = next((out.parent / "trackio").glob("*.db"))
    with sqlite3.connect(db) as conn:
        logged = [(run_id, step, json.loads(blob)) for run_id, step, blob in
                  conn.execute("select run_id, step, metrics from metrics")]
    assert len({run_id for run_id, _, _ in logged}) == 1
    steps = [step for _, step, values in logged if "train/loss" in values]
    # The preempted part's steps and the last part's, in the one run. The killed part's are trackio's
    # to keep or lose: it writes from a buffer (a SIGKILL loses what was not flushed), and it keeps
    # what it had flushed past the checkpoint, which the last part then logs again (the same values).
    stopped_at, resumed_at = parts[1]["stopped_at"], parts[3]["summary"]["resumed_from"]["step"]
    assert {*range(1, stopped_at + 1), *range(resumed_at + 1, MAX_STEPS + 1)} <= set(steps)
    values = {}
    for _, step, logged_values in logged:  # a step logged twice was logged with the same loss
        if "train/loss" in logged_values:
            assert values.setdefault(step, logged_values["train/loss"]) == logged_values["train/loss"]


def test_tensorboard_shows_each_step_once_after_the_kill(requeued):
    out, parts = requeued
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "accelerate-recipes"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))  # the killed part's extra steps purged
    final = {r["step"]: r["loss"] for r in rows(out / METRICS_FILE) if r["kind"] == "train"}
    assert tensorboard_scalars(out / "accelerate-recipes")["train/loss"] == pytest.approx(final, rel=1e-6)
