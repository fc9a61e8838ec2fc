"""scripts/slurm/train.sbatch on a real SLURM cluster: Debian's slurm-wlm, one slurmctld and two
slurmd on this host (scripts/slurm/local_cluster.sh, which .ci/run starts before the tests).

Each job is submitted as docs/clusters.md#the-slurm-drill shows: the script unchanged, its settings
by environment (CONFIG, GPUS_PER_NODE=1, OUTPUT_DIR, HF_HOME, MAIN_PORT; the CPU backend or the CPU
harness), `--gpus-per-node=0 --cpus-per-task=1` for a machine without GPUs, and `--output` into the
test's folder instead of the checkout. 2 nodes x 1 process; DDP and FSDP2. The preemption is SLURM's
own mechanism (`scancel --batch --signal=USR1`, what `--signal=B:USR1@600` sends before the time
limit); the batch shell requeues the job itself (`scontrol requeue`), SLURM starts it again, and
train.py resumes from the checkpoint. The result must equal an uninterrupted job's, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_extras.resume import checkpoint

from conftest import HARNESS, ROOT, SYNTHETIC, launch_env
from test_multinode import free_port

CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"
SBATCH = "scripts/slurm/train.sbatch"  # as typed from the repository root
UNAVAILABLE = 3  # local_cluster.sh: SLURM cannot be had here (no root, no apt-get, no package)
# The debug model, a few hundred steps: long enough to be signalled mid-run (~25 steps/s here).
ARGS = ["--preset", "debug", "--seq_len", "64", "--micro_batch_size", "4", "--data_files", SYNTHETIC,
        "--max_steps", "200", "--warmup_steps", "6", "--eval_every", "50", "--log_every", "25",
        "--sample_length", "8"]
CPU = {"multi_node_ddp.yaml": {"ACCELERATE_USE_CPU": "true"}, "multi_node_fsdp.yaml": HARNESS}


@pytest.fixture(scope="module")
def slurm(hf_home):
    """The cluster's environment for sbatch, squeue and scontrol. .ci/run starts the cluster (as
    root); here it is started if it is not up. Skipped, saying why, only where SLURM cannot be
    installed or started (no root, no apt-get): never where .ci/run asks for it."""
    proc = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=900)
    if proc.returncode == UNAVAILABLE and not os.environ.get("ACCELERATE_RECIPES_REQUIRE_SLURM"):
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    conf = re.search(r"export SLURM_CONF=(\S+)", proc.stdout).group(1)
    env = launch_env(hf_home)
    # the interpreter running the tests is the `python` of the job's launch line
    env.update(SLURM_CONF=conf, PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    yield env
    subprocess.run(["scancel", "--user", str(os.getuid())], env=env)


SUBMITTED: list[str] = []


@pytest.fixture(autouse=True)
def cancel_leftovers(slurm):
    """A failed test's jobs end with it: left queued, they would hold the two nodes and fail every
    test after it with a timeout of its own."""
    yield
    if SUBMITTED:
        subprocess.run(["scancel", *SUBMITTED], env=slurm)
        SUBMITTED.clear()


def job_facts(env: dict, job: str) -> dict[str, str]:
    line = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True,
                          check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", line))


def submit(env: dict, config: str, out: Path, *recipe_args: str) -> tuple[str, Path]:
    env = {**env, **CPU[config], "CONFIG": f"accelerate_configs/{config}", "GPUS_PER_NODE": "1",
           "OUTPUT_DIR": str(out), "MAIN_PORT": str(free_port())}
    log = out.parent / f"{out.name}.slurm.out"
    job = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={log}",
                          SBATCH, *recipe_args], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    SUBMITTED.append(job.stdout.strip().split(";")[0])
    return SUBMITTED[-1], log


def wait_until(condition, what: str, timeout: float = 300, every: float = 0.1, explain=lambda: ""):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}{explain()}"
        time.sleep(every)
    return value


def stacks(env: dict, job: str, log: Path) -> str:
    """What a job that did not end was doing: its state, and the Python stacks of its recipe
    processes (SIGABRT makes faulthandler, which launch_env enables, print them into the log)."""
    out = log.with_name(log.name.removesuffix(".slurm.out"))  # submit's naming
    subprocess.run(["pkill", "-ABRT", "-f", f"recipes/train.py --output_dir {out} "])
    time.sleep(3)
    return f"\n{job_facts(env, job)}\n{log.read_text()[-8000:] if log.exists() else '(no log)'}"


def finished(env: dict, job: str, log: Path) -> dict[str, str]:
    """The job's facts once it has ended for good (a requeued job passes through PENDING)."""
    facts = wait_until(lambda: (f := job_facts(env, job))["JobState"] in ("COMPLETED", "FAILED", "CANCELLED",
                                                                          "TIMEOUT", "NODE_FAIL") and f,
                       f"job {job} to end", every=0.5, explain=lambda: stacks(env, job, log))
    return {**facts, "log": log.read_text()}


def train_records(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "time"} for row in rows if row["kind"] in ("train", "eval")]


def check_no_noise(log: str) -> None:
    """A planned stop and a plain run, as the job's log shows them: no traceback (the launcher's
    signal handling included), no DeepSpeed line in a run without DeepSpeed, no failed task."""
    assert "Traceback" not in log, log[-6000:]
    assert not re.search(r"deepspeed|real_accelerator", log, re.I), log[-3000:]
    assert "srun: error" not in log, log[-3000:]


@pytest.mark.parametrize("config", CPU)
def test_a_preempted_job_is_requeued_and_ends_as_an_uninterrupted_one(slurm, tmp_path, config):
    reference, reference_log = submit(slurm, config, tmp_path / "uninterrupted", *ARGS)
    out = tmp_path / "preempted"
    job, log = submit(slurm, config, out, *ARGS)  # waits in the queue while the reference runs
    whole = finished(slurm, reference, reference_log)
    assert (whole["JobState"], whole["ExitCode"], whole["Restarts"]) == ("COMPLETED", "0:0", "0"), whole["log"]

    # mid-run, after at least 20 steps, as SLURM does before the time limit
    wait_until(lambda: (out / "metrics.jsonl").exists() and len(train_records(out)) > 20, "step 20", timeout=180)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    done = finished(slurm, job, log)
    text = done["log"]
    assert (done["JobState"], done["ExitCode"], done["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    assert (done["NodeList"], done["NumNodes"]) == ("node[1-2]", "2")

    # Both nodes launched, once per start of the job; every rank stopped with its own line.
    for node, rank in (("node1", 0), ("node2", 1)):
        assert text.count(f"{node}: machine rank {rank} of 2, starting the launcher") == 2, text[-4000:]
    marker_step = int(re.search(r"^stopped: preempted \(SIGUSR1\) at step (\d+): saved", text, re.M).group(1))
    assert 20 < marker_step < 200
    saved = out / "checkpoints" / f"step_{marker_step}"
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}, pid \d+\] SIGUSR1 received: stopping after this step$", text, re.M)
        assert (f"stopped: preempted (SIGUSR1) at step {marker_step}: saved {saved} and {out}/requeue.json; "
                f"rank {rank} of 2 exits with code 75; rerun with --resume_from_checkpoint auto") in text, text[-4000:]
        assert re.search(rf"^launch: the workers on machine {rank} \(\S+\) stopped with exit code 75 \(preempted",
                         text, re.M)
    assert f"requeueing job {job}" in text
    assert f"resumed from {saved} at step {marker_step}" in text
    check_no_noise(text)
    check_no_noise(whole["log"])

    # Each step logged once across both starts, every value equal to the uninterrupted job's.
    records, uninterrupted = train_records(out), train_records(tmp_path / "uninterrupted")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 201))
    assert records == uninterrupted
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["resumed_from"]["step"] == marker_step
    evals = json.loads((tmp_path / "uninterrupted" / "run_summary.json").read_text())["eval"]
    assert summary["eval"] == [e for e in evals if e["step"] > marker_step]  # the resumed part's own record
    assert not (out / "requeue.json").exists()  # the resumed run cleared it


def test_a_bad_option_ends_every_node_with_one_line_and_none_waits(slurm, tmp_path):
    job, log = submit(slurm, "multi_node_ddp.yaml", tmp_path / "bad", *ARGS, "--no_such_option", "1")
    done = finished(slurm, job, log)
    text = done["log"]
    # 2, or 143 when srun's --kill-on-bad-exit (the first node to end with 2) terminated the other
    # node's launcher while it was ending with 2 itself (seen once): either way, both said why
    assert (done["JobState"], done["Restarts"]) == ("FAILED", "0") and done["ExitCode"] in ("2:0", "143:0"), text
    errors = re.findall(r"^error: unknown option\(s\) for train\.py: --no_such_option 1 \(see train\.py --help\)$",
                        text, re.M)
    assert len(errors) == 2, text  # one per node (each node's first process)
    assert re.search(r"^launch: the workers on machine \d \(\S+\) stopped with exit code 2 \(bad input\)$", text, re.M)
    assert "Traceback" not in text
    started, ended = (time.mktime(time.strptime(done[k], "%Y-%m-%dT%H:%M:%S")) for k in ("StartTime", "EndTime"))
    assert ended - started < 60, text  # nobody waited for a rank that never came


def test_a_cancelled_job_saves_and_is_not_requeued(slurm, tmp_path):
    """scancel: SLURM sends SIGTERM to every process of the job, the batch shell included, and
    SIGKILL after KillWait (30 s here). The workers save within it; the shell does not requeue."""
    out = tmp_path / "cancelled"
    job, log = submit(slurm, "multi_node_ddp.yaml", out, *ARGS)
    wait_until(lambda: (out / "metrics.jsonl").exists() and len(train_records(out)) > 20, "step 20", timeout=180)
    subprocess.run(["scancel", job], env=slurm, check=True)
    done = finished(slurm, job, log)
    text = done["log"]
    assert (done["JobState"], done["Restarts"]) == ("CANCELLED", "0"), text
    step = json.loads((out / "requeue.json").read_text())["step"]  # the workers saved ...
    assert checkpoint.verify(out / "checkpoints" / f"step_{step}")["step"] == step
    for rank in (0, 1):
        assert re.search(rf"^stopped: preempted \(SIGTERM\) at step {step}: saved .*; rank {rank} of 2 exits with "
                         "code 75;", text, re.M), text[-4000:]
    assert "requeueing" not in text  # ... and the job stays cancelled
    assert "Traceback" not in text, text[-4000:]
