"""Preemption and lost ranks. On SIGTERM or SIGUSR1: finish the optimizer step, save a checkpoint,
leave a requeue marker, exit (75). A rank that dies or hangs: the others stop with one line (exit 4)
after --collective_timeout instead of hanging (`run_cli`). Preemptible GPUs, SLURM time limits
and requeues, and Kubernetes evictions all end a job this way; none may cost more than the work
since the last step.

Who sends the signal, and to whom (accelerate 1.15 / torch 2.13, docs/toolchain.md#launcher-signals):
- SLURM (`scancel --signal=TERM`, the time limit, `#SBATCH --signal=USR1@120`) and Kubernetes
  signal processes directly: SLURM every process of the step, Kubernetes PID 1 of the container.
- With several processes `accelerate launch` runs torchelastic, which forwards SIGTERM (and
  SIGINT, SIGHUP, SIGQUIT) to every worker and SIGKILLs them 30 s later. For SIGUSR1 and for a
  longer grace period, start the launcher with
      PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300
  (without it SIGUSR1 kills the launcher at once and orphans the workers).
- With one process `accelerate launch` is a plain parent that forwards nothing, and a signal that
  kills the launcher (SIGTERM to the 1-process launcher, SIGUSR1 to torchelastic without the setting
  above) would leave the workers running as orphans. So each worker asks Linux for SIGTERM when its
  parent dies (prctl PR_SET_PDEATHSIG): the orphan then saves and stops like a signalled worker.
  Inside a container that does not help (when PID 1 exits, everything is killed at once), and
  `tini -g` alone exits with a 1-process launcher: the image runs `tini -g` with
  scripts/docker/entrypoint.sh, which waits until the signalled workers have saved.

Every rank must stop after the same step, but each learns of the signal on its own, at a different
moment. So each rank's "stop" vote rides along with the step's loss all-reduce (no extra
collective, no extra host sync) and all ranks act on the sum. An eval or a sample can outlast the
grace period (minutes on a big model): it asks `stop_check` every few batches or tokens, a one-number
all-reduce there, so every rank leaves it at the same point and the run saves at once
(docs/checkpoints.md#preemption: what is saved, by where the signal lands).

The marker (`<output_dir>/requeue.json`) is the contract with the scheduler: the worker's exit code
does not survive `accelerate launch` (it returns 1 for any failure). A job script requeues when
the marker exists; the resumed run deletes it once it has loaded the checkpoint.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from common.config import ConfigError, RecipeStop, one_line
from common.config import run_cli as config_run_cli
from common.files import write_json
from train_extras.observe.tracking import redact_strings
from train_extras.resume.checkpoint import kept
from train_extras.resume.output_dir import claimed, disk_full, remove_unused

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
REQUEUE_MARKER = "requeue.json"
EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "temporary failure, try again"


class Preempted(RecipeStop):
    """Raised after the preemption checkpoint and the marker are written: one line, exit code 75."""

    exit_code, prefix = EXIT_CODE, "stopped"


def stopped(preempted: dict, output_dir, rank: int, world_size: int) -> Preempted:
    """The line each process ends a preempted run with (one per process in a job's log)."""
    during = f" during its {preempted['interrupted']}" if preempted.get("interrupted") else ""
    signal_name, saved, marker = preempted["signal"], preempted["checkpoint"], f"{output_dir}/{REQUEUE_MARKER}"
    code = f"rank {rank} of {world_size} exits with code {EXIT_CODE}" if world_size > 1 else f"exit code {EXIT_CODE}"
    if saved is None:
        return Preempted(f"preempted ({signal_name}) before the first step{during}: nothing trained, no checkpoint; "
                         f"wrote {marker}; {code}; rerun as it was (the requeued run starts afresh)")
    return Preempted(f"preempted ({signal_name}) at step {preempted['step']}{during}: saved {saved} and {marker}; "
                     f"{code}; rerun with --resume_from_checkpoint auto")


class PreemptionWatch:
    """Records the first preemption signal; the training loop polls it once per step."""

    def __init__(self):
        self.signal_name: str | None = None
        self._vote: torch.Tensor | None = None
        self.installed = False

    def install(self) -> PreemptionWatch:
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)
        _sigterm_when_the_launcher_dies()
        self.installed = True
        return self

    def _on_signal(self, signum, frame):
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            # os.write: no buffered print inside a signal handler; a line of its own after the progress bar
            rank = f"rank {os.environ['RANK']}, " if "RANK" in os.environ else ""  # set by the launcher
            os.write(2, f"\n[{rank}pid {os.getpid()}] {self.signal_name} received: stopping after this step\n".encode())

    def vote(self, device) -> torch.Tensor:
        """1.0 if this rank was signalled; summed over ranks with the step's loss. One tensor kept on
        the device and filled in place: torch.tensor(x, device="cuda") would be a blocking copy."""
        if self._vote is None:
            self._vote = torch.zeros((), device=device)
        return self._vote.fill_(0.0 if self.signal_name is None else 1.0)

    def stop_check(self, accelerator):
        """For an eval or a sample, which can last minutes (longer than a grace period): a callable
        saying whether any rank was signalled, which every rank calls at the same batch or token.
        On several processes it is a collective (a one-number all-reduce and its host sync), so the
        ranks leave together; alone, the flag. None when signals are not watched."""
        if not self.installed:
            return None
        if accelerator.num_processes == 1:
            return lambda: self.signal_name is not None
        return lambda: accelerator.reduce(self.vote(accelerator.device), "sum").item() > 0


def _sigterm_when_the_launcher_dies() -> None:
    """Linux only: have the kernel send SIGTERM to this process when its parent (the launcher) exits."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # not fatal: the signal still works when sent to the worker itself
    if os.getppid() != parent:  # the launcher died before the request: act on it now
        os.kill(os.getpid(), signal.SIGTERM)


def write_marker(output_dir: str | Path, step: int, checkpoint_path: Path | None, signal_name: str) -> Path:
    """checkpoint_path None: stopped before the first step, nothing to resume (auto starts afresh)."""
    return write_json(Path(output_dir) / REQUEUE_MARKER, redact_strings({  # atomic: never half a marker
        "step": step,
        "checkpoint": None if checkpoint_path is None else str(checkpoint_path),
        "signal": signal_name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "resume_with": "--resume_from_checkpoint auto",
    }))


def clear_marker(output_dir: str | Path) -> None:
    """A run that has started (or resumed) must not be requeued for an old preemption."""
    (Path(output_dir) / REQUEUE_MARKER).unlink(missing_ok=True)


# ---- a lost rank ----
COLLECTIVE_FAILURE_EXIT_CODE = 4


def _is_collective_failure(err: BaseException) -> bool:
    """A collective that failed because a peer died (connection closed) or hung (timeout)."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    # gloo's words for a dead peer and for a collective timeout; NCCL's watchdog aborts the process itself
    return isinstance(err, RuntimeError) and dist.is_initialized() and any(
        needle in text for needle in ("connection closed by peer", "connection reset by peer", "timed out waiting",
                                      "broken pipe"))


def run_cli(main, argv: list[str] | None = None) -> int:
    """config.run_cli, plus: a collective that failed because another rank died or hung (after
    --collective_timeout) ends this rank with one line and exit code 4 instead of a hang; a full
    disk anywhere is one line (exit 2)."""
    def main_or_lost_rank(argv):
        try:
            main(argv)
        except Exception as err:
            remove_unused()  # an output folder this run made and never wrote into
            if disk_full(err) and not isinstance(err, RecipeStop):  # a record file on a full disk
                then = kept(claimed[-1]) if claimed else "free space (or quota) and rerun"
                raise ConfigError(f"disk full: {one_line(err)}; {then}") from None
            if not _is_collective_failure(err):
                raise
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else "?"
            traceback.print_exc()  # where it failed; our one line follows, on a line of its own
            sys.stderr.write(f"\nerror: rank {rank}: a collective failed ({one_line(err)}): another rank died or "
                             "stopped responding (see the first error above, or --collective_timeout); stopping\n")
            sys.stderr.flush()
            # Skip the interpreter's teardown: destroying a process group whose peer is gone can hang.
            os._exit(COLLECTIVE_FAILURE_EXIT_CODE)

    return without_teardown(config_run_cli(main_or_lost_rank, argv))


_KEPT_GROUPS = []


def keep_process_group() -> None:
    """Hold the default process group until the process ends (without_teardown). After
    destroy_process_group, DDP's Reducer may be its last owner; freeing that (gc, or the end of
    main) frees the gloo group while holding the GIL, and its destructor joins worker threads of
    which one may still be freeing a finished collective's tensors, which needs the GIL: a hang
    (seen in 2-node SLURM jobs: rank 1 never exited after the run's last line)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _KEPT_GROUPS.append(dist.group.WORLD)


def without_teardown(code: int) -> int:
    """A run that used a process group ends here, without the interpreter's teardown, which would
    free the groups (the hang keep_process_group describes). Everything the run writes is written
    and closed by then."""
    import torch.distributed as dist

    if not (_KEPT_GROUPS or (dist.is_available() and dist.is_initialized())):
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
