"""File-system helpers for writes that must survive a crash."""

from __future__ import annotations

import os
from pathlib import Path


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
