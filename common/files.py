"""Writing files and folders so that a reader (or a crash) never sees half of one."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from pathlib import Path


def fsync(path: str | os.PathLike) -> None:  # a folder too: its entries (a rename) reach the disk
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, write) -> Path:
    """`write(tmp_path)`, fsync, then rename over `path`: the file is either the old one or whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    fsync(tmp)
    os.replace(tmp, path)
    return path


def write_json(path: str | os.PathLike, value) -> Path:  # atomic, as above
    return write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(value, indent=1)))


# A folder is replaced whole: its new version is written beside it (partial_dir), then replace_dir
# puts it in place. A folder cannot be renamed over a non-empty one, so Linux swaps the two names
# in one step (renameat2 RENAME_EXCHANGE); where the file system cannot (NFS), two renames, the old
# folder set aside as `.<name>.old` between them. recover_dir, before the next write, undoes a crash.
def partial_dir(path: str | os.PathLike) -> Path:
    return Path(path).with_name(f".{Path(path).name}.partial")


def recover_dir(path: str | os.PathLike) -> None:
    """Undo what a crash in replace_dir left: the old folder back if it was set aside and the new
    one never arrived (`.old` only ever names a whole folder), then every leftover (ours by name) removed."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    if not os.path.lexists(path) and old.is_dir() and not old.is_symlink():
        old.rename(path)
    for leftover in (partial_dir(path), old):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover)  # (not ignoring errors: a stale file left here would be published)
        else:  # a link of a leftover's name: the link only, never what it names
            leftover.unlink(missing_ok=True)


def replace_dir(path: str | os.PathLike) -> Path:
    """Put partial_dir(path), written in full, in place of the folder `path` (after recover_dir): at
    every moment `path` is the old folder or the new one, each whole (missing, with the swap done by
    two renames, between them: recover_dir puts the old one back)."""
    path = Path(path)
    new, old = partial_dir(path), path.with_name(f".{path.name}.old")
    for written in [*new.rglob("*"), new]:
        fsync(written)  # on the disk before the rename that publishes it (or a power cut publishes empty files)
    if not path.exists():
        new.rename(path)
    elif not _exchange(new, path):  # two renames instead: `path` is missing between them
        path.rename(old)
        new.rename(path)
        old.rename(new)  # so that `.old` only ever names a whole folder
    fsync(path.parent)
    shutil.rmtree(new, ignore_errors=True)  # the old folder now, whichever way it went
    return path


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of two folders in one step; False where the C library (not Linux, glibc < 2.28)
    or the file system (NFS, some FUSE) has no such call."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
