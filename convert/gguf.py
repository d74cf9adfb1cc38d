"""GGUF file -> Hugging Face layout (config.json, model.safetensors, tokenizer).

The MLX folder is then produced from that layout by mlx-lm's own converter
(see :mod:`convert.api`), so the GGUF path only has to undo what llama.cpp's
``convert_hf_to_gguf`` did:

* **config** — rebuilt from the ``<arch>.*`` metadata keys (plus the few
  values llama.cpp hard-codes instead of storing, documented per architecture);
* **tokenizer** — rebuilt from ``tokenizer.ggml.*`` (:mod:`convert.tokenizer`);
* **weights** — every tensor is dequantized to float32 with the ``gguf``
  package (the llama.cpp project's reference NumPy code: exact for F32, F16,
  BF16, Q4_0/1, Q5_0/1, Q8_0 and the K-quants), renamed to the HF name and, where
  the converter changed it, transformed back (per family:
  :mod:`convert.gguf_families`).

Every tensor's shape is checked against the config before any data is read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConversionError
from .gguf_families import (
    GLOBAL_NAMES,
    SUPPORTED_ARCHITECTURES,
    Architecture,
    architecture_for,
    permute_rotary_rows,
    unpermute_rotary_rows,
)
from .progress import Progress, note
from .tokenizer import save_tokenizer

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")


# --------------------------------------------------------------------------- reading


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: name, HF-order shape, storage type, raw data."""

    name: str
    shape: tuple[int, ...]  # row-major (out, in) order, i.e. GGUF dims reversed
    type_name: str
    _raw: Any  # gguf.ReaderTensor

    def dequantize(self) -> np.ndarray:
        import gguf

        try:
            values = gguf.dequantize(self._raw.data, self._raw.tensor_type)
        except NotImplementedError as exc:
            raise ConversionError(
                f"tensor {self.name}: GGUF type {self.type_name} cannot be dequantized ({exc})"
            ) from exc
        except (ValueError, IndexError, TypeError) as exc:
            raise ConversionError(
                f"tensor {self.name}: data is corrupt or truncated ({exc})"
            ) from exc
        values = np.asarray(values, dtype=np.float32)
        if values.size != math.prod(self.shape):
            raise ConversionError(
                f"tensor {self.name}: {values.size} values where its shape "
                f"{self.shape} needs {math.prod(self.shape)} (corrupt or truncated GGUF)"
            )
        return values.reshape(self.shape)


@dataclass
class GGUFModel:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ConversionError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch


def _field_value(field: Any) -> Any:
    import gguf

    if hasattr(field, "contents"):
        return field.contents()
    # older gguf releases: decode by hand
    kinds = list(field.types)
    if kinds and kinds[0] == gguf.GGUFValueType.ARRAY:
        sub = kinds[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kinds and kinds[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def read_gguf(path: str | Path) -> GGUFModel:
    """Parse a GGUF file's metadata and tensor table (tensor data stays on disk)."""
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"no such file: {path}")
    if not path.is_file():
        raise ConversionError(f"not a file: {path}")
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - gguf is a dependency
        raise ConversionError(
            "reading GGUF files needs the 'gguf' package: pip install gguf"
        ) from exc
    try:
        reader = gguf.GGUFReader(str(path))
        metadata = {key: _field_value(field) for key, field in reader.fields.items()}
        tensors = {}
        for tensor in reader.tensors:
            shape = tuple(int(d) for d in reversed(list(tensor.shape)))
            tensors[tensor.name] = GGUFTensor(tensor.name, shape, tensor.tensor_type.name, tensor)
    except ConversionError:
        raise
    except Exception as exc:  # the reader raises many kinds on a damaged file
        raise ConversionError(
            f"{path} is not a readable GGUF file (corrupt or truncated?): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return GGUFModel(path, metadata, tensors)


def hf_name(spec: Architecture, gguf_name: str, num_layers: int) -> str:
    """The Hugging Face name of GGUF tensor `gguf_name` ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight") in a `spec` model of `num_layers`
    layers; a name the architecture does not have is a `ConversionError`."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match:
        layer, part, kind = int(match.group(1)), match.group(2), match.group(3)
        module = spec.layer_names.get(part)
        if module is not None and layer < num_layers:
            return f"model.layers.{layer}.{module}.{kind}"
    raise ConversionError(
        f"GGUF tensor {gguf_name!r} is not expected in a {spec.gguf_name} model "
        f"with {num_layers} layers"
    )


def plan_tensors(model: GGUFModel, spec: Architecture, config: dict[str, Any]) -> dict[str, str]:
    """GGUF name -> HF name for every tensor, after checking names and shapes."""
    layers = int(config["num_hidden_layers"])
    expected = spec.expected_shapes(config)
    optional = spec.optional(config)
    plan: dict[str, str] = {}
    for name, tensor in model.tensors.items():
        if name in spec.config_tensors:
            continue
        target = hf_name(spec, name, layers)
        want = expected.get(target)
        if want is None:
            raise ConversionError(
                f"GGUF tensor {name!r} has no place in the {spec.model_type} model"
            )
        if tuple(tensor.shape) != tuple(want):
            raise ConversionError(
                f"tensor {name} has shape {list(tensor.shape)} but the config "
                f"(from the GGUF metadata) needs {list(want)}"
            )
        plan[name] = target
    present = set(plan.values())
    missing = sorted(set(expected) - present - optional)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConversionError(f"GGUF file lacks {len(missing)} tensor(s) the model needs: {shown}")
    # a bias must be present in every layer or in none
    for suffix in ("self_attn.q_proj.bias", "mlp.up_proj.bias"):
        have = [n for n in present if n.endswith(suffix)]
        if have and len(have) != layers:
            raise ConversionError(f"GGUF file has {suffix} in only some layers")
    return plan


def config_from_gguf(model: GGUFModel) -> tuple[Architecture, dict[str, Any]]:
    spec = architecture_for(model)
    try:
        config = spec.build_config(model)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"{model.path}: malformed GGUF metadata: {exc}") from exc
    config = {k: v for k, v in config.items() if v is not None or k == "rope_scaling"}
    config["torch_dtype"] = "float32"
    return spec, config


def gguf_to_hf(
    src: str | Path,
    out_dir: str | Path,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Write ``out_dir`` (which must not exist) as a float32 HF checkpoint of ``src``.

    Returns the config that was written.
    """
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    note(f"[gguf] reading {src}", enabled=progress)
    model = read_gguf(src)
    spec, config = config_from_gguf(model)
    plan = plan_tensors(model, spec, config)

    out_dir.mkdir(parents=True)
    note(
        f"[gguf] architecture {model.architecture} -> {spec.model_type}; rebuilding the tokenizer",
        enabled=progress,
    )
    save_tokenizer(
        model.metadata, model.architecture, out_dir, config.get("max_position_embeddings")
    )

    weights: dict[str, np.ndarray] = {}
    bar = Progress("[gguf] dequantizing", len(plan), enabled=progress)
    for gguf_name, target in plan.items():
        tensor = model.tensors[gguf_name]
        values = spec.transform(tensor.dequantize(), gguf_name, config)
        if not np.isfinite(values).all():
            raise ConversionError(
                f"tensor {gguf_name} contains NaN or infinite values (corrupt GGUF?)"
            )
        weights[target] = np.ascontiguousarray(values, dtype=np.float32)
        bar.update(f"{gguf_name} ({tensor.type_name})")
    bar.close()

    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    with open(out_dir / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return config


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GGUFModel",
    "gguf_to_hf",
    "permute_rotary_rows",
    "read_gguf",
    "unpermute_rotary_rows",
]
