"""File-system helpers for writes that must survive a crash."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    """Flush a file or a folder (its entries) to disk; best effort where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def match_umask(path: str | os.PathLike[str]) -> None:
    """Give a file or folder made by `tempfile.mkstemp`/`mkdtemp` (0600/0700, private)
    the permissions `open`/`mkdir` would have given it under the process umask."""
    umask = os.umask(0o077)  # read it (the only portable way sets it; strictest meanwhile)
    os.umask(umask)
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~umask)


def write_json(path: str | os.PathLike[str], data: Any, indent: int = 1) -> None:
    """Write `data` as JSON to a temporary file beside `path` (creating the folder),
    then rename it into place: readers see the old file or the new one, never half."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(data, indent=indent) + "\n")
        match_umask(temporary)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
