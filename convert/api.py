"""``convert_model``: HF folder, Hub id or GGUF file -> MLX model folder.

Hugging Face sources go straight to mlx-lm's own converter
(:func:`mlx_lm.convert.convert`: load, cast, quantize, save).  A GGUF file is
first rewritten as a float32 Hugging Face checkpoint in a scratch folder
(:func:`convert.gguf.gguf_to_hf`) and then goes through the very same mlx-lm
converter, so both routes produce folders that ``mlx_lm.load`` opens.

All writing happens in a hidden work folder next to the destination, which is
renamed into place only when complete (:mod:`convert.output`).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path
from typing import Any

from .errors import ConversionError
from .gguf import gguf_to_hf
from .output import check_destination, publish, work_directory
from .progress import note

DTYPES = ("float16", "bfloat16", "float32")
BITS = (4, 8)
# GGUF weights are dequantized to float32; keep that unless told otherwise
# (exact, and the fastest dtype on MLX's CPU backend).
GGUF_DEFAULT_DTYPE = "float32"

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_gguf(src: str | Path) -> bool:
    return str(src).lower().endswith(".gguf")


def _check_options(quantize: bool, bits: int, group_size: int, dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if quantize:
        if bits not in BITS:
            raise ConversionError(f"--bits must be 4 or 8, not {bits}")
        if group_size not in (32, 64, 128):
            raise ConversionError(f"--group-size must be 32, 64 or 128, not {group_size}")


def _resolve_source(src: str | Path) -> tuple[str, str]:
    """('gguf' | 'hf-dir' | 'hub', normalized source)."""
    text = str(src)
    path = Path(text).expanduser()
    if is_gguf(text):
        if not path.exists():
            raise ConversionError(f"no such file: {path}")
        if not path.is_file():
            raise ConversionError(f"not a file: {path}")
        return "gguf", str(path)
    if path.exists():
        if not path.is_dir():
            raise ConversionError(f"{path} is neither a model folder nor a .gguf file")
        if not (path / "config.json").is_file():
            raise ConversionError(f"{path} has no config.json; not a Hugging Face model folder")
        return "hf-dir", str(path)
    if _HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        return "hub", text
    raise ConversionError(f"no such file or directory: {path}")


def _mlx_lm_convert(
    src: str,
    dst: Path,
    *,
    quantize: bool,
    bits: int,
    group_size: int,
    dtype: str | None,
    progress: bool,
) -> None:
    """Run mlx-lm's converter; its chatter goes to stderr, its failures become ours."""
    from mlx_lm.convert import convert as mlx_convert

    sink: Any = sys.stderr if progress else io.StringIO()
    try:
        with contextlib.redirect_stdout(sink):
            mlx_convert(
                src,
                mlx_path=str(dst),
                quantize=quantize,
                q_group_size=group_size if quantize else None,
                q_bits=bits if quantize else None,
                dtype=dtype,
            )
    except ConversionError:
        raise
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        message = str(exc).strip().splitlines()
        first = message[0] if message else type(exc).__name__
        raise ConversionError(f"mlx-lm could not convert {src}: {first}") from exc
    except Exception as exc:
        # Hub errors (network, unknown repo, gated model) and anything else
        # raised while loading a user's checkpoint are reported, not dumped.
        text = str(exc).strip().splitlines()
        first = text[0] if text else ""
        raise ConversionError(f"could not convert {src}: {type(exc).__name__}: {first}") from exc


def convert_model(
    src: str | Path,
    out: str | Path,
    *,
    quantize: bool = False,
    bits: int = 4,
    group_size: int = 64,
    dtype: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert ``src`` into the MLX model folder ``out`` and return ``out``.

    ``src`` is a Hugging Face model folder, a Hub id (``org/name``, downloaded
    by mlx-lm / huggingface_hub) or a ``.gguf`` file.  ``dtype`` defaults to the
    checkpoint's own dtype for Hugging Face sources and to float32 for GGUF.
    ``out`` must not exist unless ``force`` is set.
    """
    _check_options(quantize, bits, group_size, dtype)
    kind, source = _resolve_source(src)
    out = Path(out).expanduser()
    check_destination(out, force=force)
    with work_directory(out) as work:
        result = work / "result"
        if kind == "gguf":
            staged = work / "hf"
            gguf_to_hf(source, staged, progress=progress)
            note("[mlx] converting with mlx-lm", enabled=progress)
            _mlx_lm_convert(
                str(staged),
                result,
                quantize=quantize,
                bits=bits,
                group_size=group_size,
                dtype=dtype or GGUF_DEFAULT_DTYPE,
                progress=progress,
            )
        else:
            _mlx_lm_convert(
                source,
                result,
                quantize=quantize,
                bits=bits,
                group_size=group_size,
                dtype=dtype,
                progress=progress,
            )
        publish(result, out, force=force, trash=work / "previous")
    note(f"[done] wrote {out}", enabled=progress)
    return out
