"""`accelerate launch` for job scripts: the same command line and the same launch, but a stop the
recipe has already explained ends in one line, not in a launcher traceback.

    python -m train_extras.resume.launch --config_file accelerate_configs/multi_node_fsdp.yaml \\
        --num_machines 2 --machine_rank 0 ... recipes/train.py --resume_from_checkpoint auto

scripts/slurm/train.sbatch starts one per node. What differs from `accelerate launch` (accelerate 1.15,
torch 2.13; docs/toolchain.md#launcher-signals):
- SIGTERM and SIGUSR1 (preemption, the time limit, scancel) are passed on to the workers by this
  process, which then waits for them. torchelastic's own handling forwards them too, but then
  raises SignalException: a 30-line traceback per node in the job's log, for a planned stop. A
  1-process launch (no torchelastic) forwards nothing and dies at once. The scheduler's deadline
  still bounds the wait (SLURM's KillWait and time limit, Kubernetes' grace period).
- Workers that ended with train.py's own exit codes, after printing their own line (75 preempted
  and saved, 2 bad input, 3 training failure, 4 a rank lost), end the launch with one line and
  that code. torchelastic reports the same as a failure with a traceback and exit code 1.
  Any other ending is the launcher's own, unchanged.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from accelerate.commands.launch import launch_command, launch_command_parser

from common.config import ConfigError, TrainingError
from train_extras.resume import preemption

# train.py's exit codes after its own one line
EXPLAINED = {preemption.EXIT_CODE: "preempted, checkpoint saved: requeue with --resume_from_checkpoint auto",
             ConfigError.exit_code: "bad input", TrainingError.exit_code: "training failure",
             preemption.COLLECTIVE_FAILURE_EXIT_CODE: "a rank was lost"}
FORWARDED = preemption.SIGNALS  # what train.py saves and stops on
# What torchelastic still handles itself (its default list, less the two above): an interactive ^C.
TORCHELASTIC_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def children() -> list[int]:
    """This process's children (the workers): /proc, read whole (no /proc/<pid>/task/*/children
    needed, which some kernels lack)."""
    me, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # field 4, after the (command name)
            found.append(int(entry.name))
    return found


def forward(signum, frame) -> None:
    workers = children()
    if not workers:  # nothing started yet, or all gone: nothing to save, so stop as the signal asks
        raise SystemExit(128 + signum)
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


class _ExplainedFailures(logging.Filter):
    """torchelastic's "failed (exitcode: 75) local_rank: 0 ..." error line, for a code the worker explained."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("failed (exitcode: %s)") and record.args
                    and record.args[0] in EXPLAINED)


def explained_code(err: BaseException) -> int | None:
    """The exit code every failed worker explained itself (the first one's), else None."""
    if isinstance(err, subprocess.CalledProcessError):  # one process, no torchelastic
        codes = [err.returncode]
    else:
        failures = getattr(err, "failures", None)  # torchelastic's ChildFailedError
        if not failures:
            return None
        codes = [f.exitcode for f in sorted(failures.values(), key=lambda f: f.timestamp)]
    return codes[0] if all(code in EXPLAINED for code in codes) else None


def main(argv: list[str] | None = None) -> int:
    args = launch_command_parser().parse_args(argv)
    os.environ["PET_SIGNALS_TO_HANDLE"] = TORCHELASTIC_SIGNALS  # torchrun's default for --signals-to-handle
    for sig in FORWARDED:
        signal.signal(sig, forward)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_ExplainedFailures())
    try:
        launch_command(args)
    except Exception as err:
        code = explained_code(err)
        if code is None:
            raise
        where = f" on machine {args.machine_rank} ({socket.gethostname()})" if (args.num_machines or 1) > 1 else ""
        sys.stderr.write(f"launch: the workers{where} stopped with exit code {code} ({EXPLAINED[code]})\n")
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
