"""One live run per output folder, a folder the run can write, and a full disk: each one line.

`claim` runs before anything is written or built. Global rank 0 creates --output_dir (a path that
cannot be created or written, such as one under a file or on a read-only mount, is one line) and
takes an exclusive OS lock (flock) on `<output_dir>/.run.lock`, held for the life of the process.
The kernel releases it when the process ends, however it ends (SIGKILL, the OOM killer; on NFS the
server drops a dead client's locks), so a lock left by a dead run never blocks. A second run into
the folder (a double submit, a requeued job whose old copy still runs) gets one line naming the
holder's host and PID, and exits 2 having written nothing. Only rank 0 locks, so a multi-machine
run on a shared file system has one holder; the other ranks get the outcome by broadcast. A file
system without locks (Lustre mounted without `-o flock`) gets a warning; the run goes on unguarded.
A folder the run created and left holding only the lock (bad input found later) is removed.
The lock is opened without following a symbolic link (O_NOFOLLOW): a `.run.lock` that is a link is
one line, and what it points to is never opened, let alone truncated.

`check_ours` then refuses a folder where a name the run writes (model/, run_summary.json,
metrics.jsonl, requeue.json) is taken by something this project did not write, with or without
--overwrite_output_dir; and `check_not_finished` keeps a finished run from being overwritten: see
their docstrings and docs/checkpoints.md#what-a-run-writes-into---output_dir.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from accelerate.utils import broadcast_object_list

from common.config import ConfigError, same_on_every_rank
from common.export import not_an_export

LOCK_FILE = ".run.lock"
_held = []  # the locked descriptors: open until the process ends
_created = []  # folders this run made (remove_unused)
claimed = []  # the folder this process's run writes into (the last line of a failure names what it holds)


def remove_unused() -> None:
    """After a failure: a folder this run created and left with nothing but its lock (bad input
    found after the claim, say an empty dataset) is removed, as if the run had never started."""
    while _created:
        folder = _created.pop()
        try:
            if [p.name for p in folder.iterdir()] == [LOCK_FILE]:
                while _held:
                    os.close(_held.pop())
                (folder / LOCK_FILE).unlink()
                folder.rmdir()
        except OSError:
            pass


def _lock(folder: Path) -> str | None:
    """Take the folder's lock; None, or the one-line reason this run may not use the folder."""
    try:
        if not folder.exists():
            folder.mkdir(parents=True)
            _created.append(folder)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:  # O_NOFOLLOW's answer: the lock is a symbolic link
            return (f"--output_dir {folder}: {LOCK_FILE} is a symbolic link (to {os.readlink(folder / LOCK_FILE)}); "
                    "a run never writes through one: remove the link, or choose another --output_dir")
        return f"--output_dir {folder}: cannot create or write it ({err.strerror}: {err.filename})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:  # written by the holder just after it locked: may still be empty, or not ours
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        holder = holder if isinstance(holder, dict) else {}
        stamp = holder.get("since")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if isinstance(stamp, (int, float)) else "?"
        return (f"--output_dir {folder} is in use by another run (host {holder.get('host', '?')}, PID "
                f"{holder.get('pid', '?')}, since {since}): wait for it to end or stop it, or choose another "
                "--output_dir")
    except OSError as err:
        print(f"warning: {folder} cannot be locked ({err.strerror}): nothing stops a second run from writing "
              "into it at the same time", flush=True)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode(), 0)
    except OSError as err:
        return f"--output_dir {folder}: cannot write it ({err.strerror})"
    _held.append(fd)
    return None


def claim(folder: str | Path, accelerator) -> None:
    """Every rank calls this; raises ConfigError on every rank if rank 0 may not use the folder."""
    reason = _lock(Path(folder)) if accelerator.is_main_process else None
    if accelerator.num_processes > 1:
        reason = broadcast_object_list([reason])[0]
    if reason:
        raise ConfigError(reason)
    claimed.append(Path(folder))


SUMMARY, METRICS, REQUEUE, EXPORT = "run_summary.json", "metrics.jsonl", "requeue.json", "model"


@same_on_every_rank()  # every rank reads the same folder
def check_ours(cfg) -> None:
    """Each name in --output_dir that a run replaces or deletes is this project's, or the run is
    refused (--overwrite_output_dir included) in one line naming it: `model/` an export with its
    marker (common/export.py's not_an_export, which the export itself checks too), run_summary.json a
    JSON object with its "recipe", metrics.jsonl empty or starting with a JSON object with its "kind",
    requeue.json a JSON object with its "resume_with".
    Any other name is never touched and stops nothing. (Checkpoints: checkpoint.py, by run id.)"""
    folder = Path(cfg.output_dir)
    found = []
    export = not_an_export(folder / EXPORT)
    if export:
        found.append(f"{EXPORT}/ ({export})")
    for name, key in ((SUMMARY, "recipe"), (METRICS, "kind"), (REQUEUE, "resume_with")):
        why = _not_ours(folder / name, key)
        if why:
            found.append(f"{name} ({why})")
    if found:
        raise ConfigError(f"{folder} holds {'; '.join(found)}: nothing marks it as this project's, and a run here "
                          "would replace it; move it away, or choose another --output_dir")


def _not_ours(path: Path, key: str) -> str | None:
    """None when `path` is missing or a file of ours (its first line, for metrics.jsonl); else why not."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_file():
        return "a symbolic link" if path.is_symlink() else "not a file"
    try:
        with open(path, "rb") as f:
            text = f.readline() if path.name == METRICS else f.read()
        value = json.loads(text) if text.strip() or path.name != METRICS else {key: None}
    except (OSError, ValueError):
        return "not JSON"
    return None if isinstance(value, dict) and key in value else f"no {key!r} field"


@same_on_every_rank()  # every rank reads the same folder
def check_not_finished(cfg, resume_path: str | Path | None) -> None:
    """A finished run in --output_dir is not overwritten without --overwrite_output_dir: its
    run_summary.json (written when a run ends, with or without an export) or its model/ export. A run
    that resumes one of the folder's own checkpoints continues that run (and may replace both); one
    resumed from elsewhere is a new run here. Not finished: a preempted run's summary (its checkpoint
    continues it; checkpoint.check_output_dir guards those), --eval_only's eval_summary.json (it never
    calls this). Every rank reads the same files: the output folder is on a file system they all see."""
    folder = Path(cfg.output_dir)
    found = [name for name, finished in ((SUMMARY, _finished_summary(folder / SUMMARY)),
                                         (f"{EXPORT}/", (folder / EXPORT).is_dir())) if finished]
    own = resume_path is not None and own_checkpoint(folder, resume_path)
    if found and not own and not cfg.overwrite_output_dir:
        raise ConfigError(f"{folder} holds a finished run ({', '.join(found)}): pass --overwrite_output_dir to "
                          "replace it, or choose another --output_dir")


def own_checkpoint(folder: str | Path, checkpoint: str | Path) -> bool:
    """Whether `checkpoint` is one of the checkpoints of the output folder `folder`."""
    return Path(checkpoint).resolve().parent == (Path(folder) / "checkpoints").resolve()


def _finished_summary(path: Path) -> bool:
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):  # not ours: check_ours has refused it already
        return True
    return not (isinstance(summary, dict) and "preempted" in summary)


def disk_full(err: BaseException) -> bool:
    """ENOSPC, as each writer reports it: OSError, safetensors' SafetensorError ("No space left on
    device (os error 28)"), torch.save's RuntimeError ("file write failed", with no errno)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


def free_bytes(folder: str | Path) -> int | None:
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize
