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
  the converter changed it, transformed back:

  - ``llama``: the rows of ``attn_q``/``attn_k`` were permuted inside each
    head so ggml's interleaved ("normal") rotary embedding could be used; the
    inverse permutation restores the HF (rotate-half) order that mlx-lm's
    ``llama`` model expects;
  - ``gemma3``: RMSNorm weights were stored as ``1 + w`` (HF's Gemma norm
    multiplies by ``1 + w``); one is subtracted again.

Every tensor's shape is checked against the config before any data is read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConversionError, UnsupportedArchitectureError
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


# --------------------------------------------------------------------------- transforms


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Q or K projection.

    Within each head of ``d`` rows, HF order puts the two halves of every
    rotary pair ``d/2`` rows apart (rows ``j`` and ``j + d/2``); the GGUF order
    puts them next to each other (rows ``2j`` and ``2j + 1``).  Viewing a head
    as ``(d/2, 2)`` and transposing it to ``(2, d/2)`` moves row ``2j + t``
    back to row ``t*d/2 + j``.  Works for weights ``(rows, in)`` and biases
    ``(rows,)``.
    """
    rows = weight.shape[0]
    if n_heads <= 0 or rows % (2 * n_heads):
        raise ConversionError(f"cannot split {rows} rows into {n_heads} heads of rotary pairs")
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def permute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """The forward permutation (HF -> GGUF order); the inverse of the above."""
    rows = weight.shape[0]
    head_dim = rows // n_heads
    rest = weight.shape[1:]
    return weight.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


# --------------------------------------------------------------------------- architectures


def _get(meta: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    if key in meta:
        return meta[key]
    if required:
        raise ConversionError(f"GGUF metadata has no {key!r}")
    return default


def _int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = _get(meta, key, default, required=default is None)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ConversionError(f"GGUF {key} varies per layer ({value}); this is not supported")
        value = value[0]
    return int(value)


def _special_ids(meta: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf_key in meta:
            out[hf_key] = int(meta[gguf_key])
    eos = []
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        if key in meta and int(meta[key]) not in eos:
            eos.append(int(meta[key]))
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def _vocab_size(meta: Mapping[str, Any], arch: str, tensors: Mapping[str, GGUFTensor]) -> int:
    if f"{arch}.vocab_size" in meta:
        return int(meta[f"{arch}.vocab_size"])
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens:
        return len(tokens)
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ConversionError("GGUF has no token_embd.weight and no vocabulary size")
    return embed.shape[0]


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ConversionError(f"GGUF rope scaling type {kind!r} is not supported (only linear)")


def _llama3_rope_from_freqs(freqs: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover Llama-3.1-style rope scaling from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores the per-frequency divisors instead of the four numbers
    that produced them; try the published parameter sets and keep the one that
    reproduces the tensor.
    """
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if np.allclose(freqs, 1.0):
        return {}
    factor = float(freqs.max())
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    for original in (8192, 4096, 2048, 16384, 32768, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            low_wavelen = original / low
            high_wavelen = original / high
            smooth = (original / wavelen - low) / (high - low)
            divisor = np.where(
                wavelen < high_wavelen,
                1.0,
                np.where(wavelen > low_wavelen, factor, 1.0 / ((1 - smooth) / factor + smooth)),
            )
            if divisor.shape == freqs.shape and np.allclose(divisor, freqs, rtol=1e-4):
                return {
                    "rope_scaling": {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": original,
                    }
                }
    raise ConversionError(
        "GGUF rope_freqs.weight does not match any known Llama-3 rope scaling; not supported"
    )


@dataclass
class Architecture:
    """How one GGUF architecture maps onto an mlx-lm / HF model type."""

    gguf_name: str
    model_type: str
    build_config: Callable[[GGUFModel], dict[str, Any]]
    layer_names: dict[str, str]  # GGUF per-layer tensor name -> HF module path
    # (tensor, GGUF name, config) -> tensor in HF layout
    transform: Callable[[np.ndarray, str, dict[str, Any]], np.ndarray]
    expected_shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    optional: Callable[[dict[str, Any]], set[str]]


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_ATTN_MLP = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _common_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden = c["hidden_size"]
    q_rows = c["num_attention_heads"] * c["head_dim"]
    kv_rows = c["num_key_value_heads"] * c["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (c["vocab_size"], hidden),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (q_rows, hidden),
                p + "self_attn.k_proj.weight": (kv_rows, hidden),
                p + "self_attn.v_proj.weight": (kv_rows, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_rows),
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.bias": (kv_rows,),
                p + "self_attn.o_proj.bias": (hidden,),
                p + "mlp.gate_proj.weight": (c["intermediate_size"], hidden),
                p + "mlp.up_proj.weight": (c["intermediate_size"], hidden),
                p + "mlp.down_proj.weight": (hidden, c["intermediate_size"]),
                p + "mlp.gate_proj.bias": (c["intermediate_size"],),
                p + "mlp.up_proj.bias": (c["intermediate_size"],),
                p + "mlp.down_proj.bias": (hidden,),
            }
        )
    return shapes


def _common_optional(c: dict[str, Any]) -> set[str]:
    optional = {"lm_head.weight"}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        optional.update(
            p + f"{m}.bias"
            for m in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        )
    return optional


# ---- llama


def _llama_config(model: GGUFModel) -> dict[str, Any]:
    m, a = model.metadata, "llama"
    heads = _int(m, f"{a}.attention.head_count")
    hidden = _int(m, f"{a}.embedding_length")
    head_dim = _int(m, f"{a}.attention.key_length", hidden // heads)
    rope_dims = _int(m, f"{a}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ConversionError(
            f"GGUF llama model rotates {rope_dims} of {head_dim} head dimensions; "
            "partial rotary embeddings are not supported"
        )
    theta = float(m.get(f"{a}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _int(m, f"{a}.feed_forward_length"),
        "num_hidden_layers": _int(m, f"{a}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(m, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(m.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "max_position_embeddings": _int(m, f"{a}.context_length", 2048),
        "vocab_size": _vocab_size(m, a, model.tensors),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "attention_bias": "blk.0.attn_q.bias" in model.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in model.tensors,
        "rope_scaling": _rope_scaling(m, a),
    }
    if "rope_freqs.weight" in model.tensors:
        config.update(
            _llama3_rope_from_freqs(
                model.tensors["rope_freqs.weight"].dequantize(), theta, head_dim
            )
        )
    config.update(_special_ids(m))
    return config


def _llama_transform(w: np.ndarray, gguf_name: str, c: dict[str, Any]) -> np.ndarray:
    if ".attn_q." in gguf_name:
        return unpermute_rotary_rows(w, c["num_attention_heads"])
    if ".attn_k." in gguf_name:
        return unpermute_rotary_rows(w, c["num_key_value_heads"])
    return w


def _llama_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    shapes = _common_shapes(c)
    for i in range(c["num_hidden_layers"]):
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (c["hidden_size"],)
    return shapes


# ---- gemma3 (text)


def _gemma3_config(model: GGUFModel) -> dict[str, Any]:
    m, a = model.metadata, "gemma3"
    heads = _int(m, f"{a}.attention.head_count")
    hidden = _int(m, f"{a}.embedding_length")
    layers = _int(m, f"{a}.block_count")
    head_dim = _int(m, f"{a}.attention.key_length", 256)
    value_dim = _int(m, f"{a}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ConversionError(
            f"GGUF gemma3 key_length {head_dim} != value_length {value_dim}; not supported"
        )
    # Not stored in the GGUF; llama.cpp hard-codes them for Gemma 3:
    #  - every 6th layer uses global attention, the others a sliding window;
    #  - sliding layers use a rotary base of 10000;
    #  - queries are scaled by 1/sqrt(head_dim), except the 27B model (62
    #    layers), which uses 1/sqrt(hidden_size / num_heads).
    pattern = 6
    stored = m.get(f"{a}.attention.sliding_window_pattern")
    if isinstance(stored, list):
        sliding = [bool(x) for x in stored]
        if False in sliding:
            pattern = sliding.index(False) + 1
        expected = [(i + 1) % pattern != 0 for i in range(len(sliding))]
        if sliding != expected:
            raise ConversionError(
                "GGUF gemma3 sliding-window layer pattern is not periodic; not supported"
            )
    elif stored is not None:
        pattern = int(stored)
    scalar = hidden // heads if layers == 62 else head_dim
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": _int(m, f"{a}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": _int(m, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(m.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m.get(f"{a}.rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": _rope_scaling(m, a),
        "query_pre_attn_scalar": scalar,
        "sliding_window": _int(m, f"{a}.attention.sliding_window", 512),
        "sliding_window_pattern": pattern,
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "max_position_embeddings": _int(m, f"{a}.context_length", 32768),
        "vocab_size": _vocab_size(m, a, model.tensors),
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": m.get(f"{a}.final_logit_softcapping"),
        "attn_logit_softcapping": m.get(f"{a}.attn_logit_softcapping"),
        "tie_word_embeddings": "output.weight" not in model.tensors,
    }
    config.update(_special_ids(m))
    return config


def _gemma3_transform(w: np.ndarray, gguf_name: str, c: dict[str, Any]) -> np.ndarray:
    # llama.cpp stores Gemma's RMSNorm weights as 1 + w
    if gguf_name.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w


def _gemma3_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    shapes = _common_shapes(c)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "post_attention_layernorm.weight"] = (c["hidden_size"],)
        shapes[p + "pre_feedforward_layernorm.weight"] = (c["hidden_size"],)
        shapes[p + "post_feedforward_layernorm.weight"] = (c["hidden_size"],)
        shapes[p + "self_attn.q_norm.weight"] = (c["head_dim"],)
        shapes[p + "self_attn.k_norm.weight"] = (c["head_dim"],)
    return shapes


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(
        gguf_name="llama",
        model_type="llama",
        build_config=_llama_config,
        layer_names={**_ATTN_MLP, "ffn_norm": "post_attention_layernorm"},
        transform=_llama_transform,
        expected_shapes=_llama_shapes,
        optional=_common_optional,
    ),
    "gemma3": Architecture(
        gguf_name="gemma3",
        model_type="gemma3_text",
        build_config=_gemma3_config,
        layer_names={
            **_ATTN_MLP,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
        },
        transform=_gemma3_transform,
        expected_shapes=_gemma3_shapes,
        optional=_common_optional,
    ),
}

SUPPORTED_ARCHITECTURES = tuple(sorted(ARCHITECTURES))
# tensors llama.cpp adds that have no HF counterpart (consumed by the config)
_CONFIG_ONLY_TENSORS = {"rope_freqs.weight"}


def architecture_for(model: GGUFModel) -> Architecture:
    arch = model.architecture
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return spec


def hf_name(spec: Architecture, gguf_name: str, num_layers: int) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
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
        if name in _CONFIG_ONLY_TENSORS:
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
