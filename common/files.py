"""Writing files so that a reader (or a crash) never sees half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, write) -> Path:
    """`write(tmp_path)`, fsync, then rename over `path`: the file is either the old one or whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_json(path: str | os.PathLike, value) -> Path:  # atomic, as above
    return write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(value, indent=1)))
