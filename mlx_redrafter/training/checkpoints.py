"""Checkpoints: <folder>/ckpt-<step>/ (the drafter, the optimizer state and the
trainer's state) and a LATEST pointer, both replaced atomically, so a run can be
interrupted at any moment and resumed from the newest complete checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from ..drafter import Drafter
from ..files import fsync_path, match_umask

LATEST = "LATEST"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


class CheckpointError(ValueError):
    """A checkpoint could not be written or read."""


def _stage(
    staging: Path, drafter: Drafter, optimizer: optim.Optimizer, state: dict[str, Any]
) -> None:
    """Write one checkpoint's files into `staging` and flush them to disk."""
    match_umask(staging)
    drafter.save(staging / "drafter", overwrite=True)
    mx.save_safetensors(
        str(staging / OPTIMIZER_FILE), dict(tree_flatten(optimizer.state)), {"format": "mlx"}
    )
    (staging / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    for path in [*staging.rglob("*")]:
        if path.is_file():
            fsync_path(path)
    fsync_path(staging / "drafter")
    fsync_path(staging)


def _point_latest(root: Path, name: str) -> None:
    """Replace the LATEST pointer by rename, then flush the folder."""
    pointer = root / f".{LATEST}.partial"
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    fsync_path(root)


def write_checkpoint(
    folder: str | os.PathLike[str],
    step: int,
    drafter: Drafter,
    optimizer: optim.Optimizer,
    state: dict[str, Any],
    keep: int = 1,
) -> Path:
    """Write checkpoint `step` under `folder`; the previous one stays valid until
    the new one is complete (staging folder, fsync, rename, then the LATEST
    pointer is replaced by rename). Disk errors leave the previous one intact."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{step:07d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=root))
    try:
        _stage(staging, drafter, optimizer, state)
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        _point_latest(root, name)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        (root / f".{LATEST}.partial").unlink(missing_ok=True)
        previous = latest_checkpoint(root)
        kept = f"; the previous checkpoint {previous} is intact" if previous else ""
        raise CheckpointError(f"cannot write checkpoint {name} in {root}: {error}{kept}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    checkpoints = sorted(p for p in root.glob("ckpt-*") if p.is_dir())
    for old in checkpoints[:-keep] if keep > 0 else []:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The checkpoint LATEST points to, or None."""
    root = Path(folder)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def read_checkpoint(path: Path) -> tuple[Drafter, dict[str, mx.array], dict[str, Any]]:
    """(drafter, flat optimizer state, trainer state) of one checkpoint folder."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        drafter = Drafter.load(path / "drafter")
        optimizer_state = cast(dict[str, mx.array], mx.load(str(path / OPTIMIZER_FILE)))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read checkpoint {path}: {error}") from None
    return drafter, optimizer_state, state


def refuse_to_overwrite(folder: str | os.PathLike[str], resume: bool) -> None:
    """A new run (not `resume`) must not start in a folder that holds a checkpoint."""
    if not resume and (Path(folder) / LATEST).exists():
        raise FileExistsError(
            f"{folder} already holds a checkpoint: pass --resume to continue it, "
            "or choose another --output"
        )
