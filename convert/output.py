"""Writing an output folder safely.

A conversion never writes into its destination directly.  It writes a complete
folder inside a hidden work directory created next to the destination (same
file system, so the final step is a ``rename``), and only then moves it into
place:

* an interrupted run leaves the destination untouched (at worst a hidden
  ``.NAME.*.partial`` work directory, removed on any normal exit, including
  Ctrl-C);
* an existing destination is refused unless ``force`` is given, and with
  ``force`` the old folder is moved aside only once the new one is complete,
  then deleted;
* :func:`publish_shared` lets several processes race to create the same cache
  folder: the first rename wins and the others adopt the winner's folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import ConversionError

_EXISTS_ERRNOS = {errno.EEXIST, errno.ENOTEMPTY}


def check_destination(out: Path, *, force: bool) -> None:
    """Refuse an existing destination unless ``force`` is set."""
    if (out.exists() or out.is_symlink()) and not force:
        raise ConversionError(f"output {out} already exists; pass --force to replace it")


@contextlib.contextmanager
def work_directory(out: Path) -> Iterator[Path]:
    """A fresh hidden directory next to ``out``; removed when the block ends."""
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    except OSError as exc:
        raise ConversionError(f"cannot create a work folder next to {out}: {exc}") from exc
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def publish(result: Path, out: Path, *, force: bool, trash: Path) -> None:
    """Move the finished folder ``result`` to ``out``.

    Without ``force`` an ``out`` that appeared in the meantime is an error.  With
    ``force`` an existing ``out`` is first renamed to ``trash`` (inside the work
    directory, deleted with it): the old folder disappears only after the new
    one is complete.
    """
    if not result.is_dir():
        raise ConversionError(f"internal error: the conversion wrote nothing to {result}")
    if out.exists() or out.is_symlink():
        if not force:
            raise ConversionError(f"output {out} already exists; pass --force to replace it")
        try:
            os.rename(out, trash)
        except OSError as exc:
            raise ConversionError(f"cannot move the old {out} aside: {exc}") from exc
    try:
        os.rename(result, out)
    except OSError as exc:
        if exc.errno in _EXISTS_ERRNOS:
            raise ConversionError(
                f"output {out} already exists; pass --force to replace it"
            ) from exc
        raise ConversionError(f"cannot move the result to {out}: {exc}") from exc


def publish_shared(result: Path, out: Path) -> bool:
    """Move ``result`` to ``out`` unless another process got there first.

    Returns True when this call created ``out``; False when ``out`` already
    existed (``result`` is then left in place for the caller to delete).
    """
    if out.exists():
        return False
    try:
        os.rename(result, out)
    except OSError as exc:
        # rename(2) refuses a non-empty target directory: another process won.
        if exc.errno in _EXISTS_ERRNOS and out.exists():
            return False
        raise ConversionError(f"cannot move the result to {out}: {exc}") from exc
    return True


@contextlib.contextmanager
def staged_output(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield a not-yet-existing path to write the complete output folder to.

    When the block finishes without error that folder replaces ``out``;
    otherwise it is deleted and ``out`` is left as it was.
    """
    out = Path(out)
    check_destination(out, force=force)
    with work_directory(out) as work:
        result = work / "result"
        yield result
        publish(result, out, force=force, trash=work / "previous")
