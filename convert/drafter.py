"""ReDrafter drafter checkpoints -> the project's drafter folder.

Accepted sources:

* a drafter saved by the reference PyTorch implementation
  (``transformers`` ``save_pretrained``: ``config.json`` with ``model_type:
  recurrent_drafting_drafter`` plus Hugging Face fields, and
  ``model.safetensors`` or ``pytorch_model.bin``, any float dtype);
* a drafter folder written by :meth:`mlx_redrafter.drafter.Drafter.save`
  (to re-save it, quantized or in another dtype).

The parameter names are the same in both (``input_proj``, ``lm_head.{i}.linear``,
``lm_head.{n}``, ``rnn_u``, ``rnn_w``, out x in); a uniform ``drafter.`` prefix
(a drafter saved as part of a larger module) is dropped.  The result is loaded
through ``Drafter.load`` — which checks every name and shape against the
config — before it is written, so a folder that comes out loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ConversionError
from .output import check_destination, publish, work_directory
from .progress import note

FORMATS = ("reference",)
_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "exit_dim",
    "num_draft_layers",
    "rnn",
    "draft_vocab_size",
)
_PREFIXES = ("drafter.", "model.drafter.")


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder} has no config.json; not a drafter folder")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    model_type = config.get("model_type")
    if model_type != "recurrent_drafting_drafter":
        raise ConversionError(
            f"{path} has model_type {model_type!r}, expected 'recurrent_drafting_drafter'"
        )
    return config


def _read_weights(folder: Path) -> dict[str, Any]:
    import mlx.core as mx

    files = sorted(folder.glob("*.safetensors"))
    weights: dict[str, Any] = {}
    if files:
        for path in files:
            try:
                loaded = mx.load(str(path))
            except Exception as exc:
                raise ConversionError(f"cannot read {path} (corrupt?): {exc}") from exc
            if not isinstance(loaded, dict):
                raise ConversionError(f"{path} does not hold named tensors")
            weights.update(loaded)
    elif (folder / "pytorch_model.bin").is_file():
        weights = _read_torch_pickle(folder / "pytorch_model.bin")
    else:
        raise ConversionError(f"{folder} has no model.safetensors or pytorch_model.bin")
    for prefix in _PREFIXES:
        if weights and all(name.startswith(prefix) for name in weights):
            weights = {name[len(prefix) :]: value for name, value in weights.items()}
    return weights


def _read_torch_pickle(path: Path) -> dict[str, Any]:
    import mlx.core as mx

    try:
        import torch
    except ImportError as exc:
        raise ConversionError(
            f"{path} is a PyTorch pickle and reading it needs torch (pip install torch), "
            "or re-save the drafter as safetensors"
        ) from exc
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConversionError(f"cannot read {path} (corrupt?): {exc}") from exc
    out = {}
    for name, tensor in state.items():
        if tensor.dtype == torch.bfloat16:
            out[name] = mx.array(tensor.float().numpy()).astype(mx.bfloat16)
        else:
            out[name] = mx.array(tensor.numpy())
    return out


def convert_drafter(
    src: str | Path,
    out: str | Path,
    *,
    to: str = "reference",
    quantize: bool = False,
    bits: int = 4,
    group_size: int = 64,
    dtype: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the drafter at ``src`` into the drafter folder ``out``."""
    import mlx.core as mx

    try:
        from mlx_redrafter.drafter import Drafter, DrafterError
    except ImportError as exc:  # pragma: no cover - same distribution
        raise ConversionError(f"mlx_redrafter.drafter is not importable: {exc}") from exc

    if to not in FORMATS:
        raise ConversionError(f"unknown drafter format {to!r}; supported: {', '.join(FORMATS)}")
    if dtype is not None and dtype not in ("float16", "bfloat16", "float32"):
        raise ConversionError(f"dtype must be float16, bfloat16 or float32, not {dtype!r}")
    if quantize and bits not in (4, 8):
        raise ConversionError(f"--bits must be 4 or 8, not {bits}")
    if quantize and group_size not in (32, 64, 128):
        raise ConversionError(f"--group-size must be 32, 64 or 128, not {group_size}")
    source = Path(src).expanduser()
    if not source.exists():
        raise ConversionError(f"no such file or directory: {source}")
    if not source.is_dir():
        raise ConversionError(f"{source} is not a drafter folder")
    out = Path(out).expanduser()
    check_destination(out, force=force)

    config = _read_config(source)
    weights = _read_weights(source)
    if dtype is not None:
        target = getattr(mx, dtype)
        weights = {
            k: (v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v)
            for k, v in weights.items()
        }
    clean = {k: config[k] for k in _CONFIG_KEYS if config.get(k) is not None}
    with work_directory(out) as work:
        staged = work / "source"
        staged.mkdir()
        (staged / "config.json").write_text(json.dumps(clean, indent=2))
        mx.save_safetensors(str(staged / "model.safetensors"), weights, {"format": "mlx"})
        try:
            drafter = Drafter.load(staged)
        except (DrafterError, ValueError, KeyError) as exc:
            message = str(exc).replace(str(staged / "model.safetensors"), "the weights")
            message = message.replace(str(staged), str(source))
            raise ConversionError(f"{source}: {message}") from exc
        if quantize:
            note(f"[drafter] quantizing to {bits} bits, group size {group_size}", enabled=progress)
            drafter.quantize(group_size=group_size, bits=bits)
        result = work / "result"
        drafter.save(result)
        publish(result, out, force=force, trash=work / "previous")
    note(f"[done] wrote {out}", enabled=progress)
    return out
