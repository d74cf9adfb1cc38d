"""The GGUF architectures the converter reads, and how each maps onto an HF model.

Each family says how to rebuild its HF ``config.json`` from the ``<arch>.*``
metadata keys (plus the values llama.cpp hard-codes instead of storing), which HF
module every ``blk.N.<part>`` tensor is, which tensor shapes the config implies,
and what llama.cpp's ``convert_hf_to_gguf`` changed in a tensor that must be
undone:

=========  ===============  =====================================================
GGUF       HF model_type    undone on the way back
=========  ===============  =====================================================
llama      llama / mistral  Q/K rows permuted per head for interleaved RoPE
qwen2      qwen2            nothing (rotate-half RoPE, Q/K/V biases kept)
qwen3      qwen3            nothing (Q/K norms per head)
phi3       phi3             nothing (fused QKV and gate-up kept fused; LongRoPE
                            factors stored as tensors go back into the config)
gemma2     gemma2           RMSNorm weights stored as 1 + w
gemma3     gemma3_text      RMSNorm weights stored as 1 + w
=========  ===============  =====================================================

llama.cpp writes Mistral models as ``llama``; a ``llama`` file whose
``general.name`` or ``general.basename`` names Mistral becomes ``mistral``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ConversionError, UnsupportedArchitectureError

if TYPE_CHECKING:
    from .gguf import GGUFModel

Config = dict[str, Any]
Shapes = dict[str, tuple[int, ...]]


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


def _unchanged(w: np.ndarray, gguf_name: str, c: Config) -> np.ndarray:
    return w


def _llama_transform(w: np.ndarray, gguf_name: str, c: Config) -> np.ndarray:
    if ".attn_q." in gguf_name:
        return unpermute_rotary_rows(w, c["num_attention_heads"])
    if ".attn_k." in gguf_name:
        return unpermute_rotary_rows(w, c["num_key_value_heads"])
    return w


def _gemma_transform(w: np.ndarray, gguf_name: str, c: Config) -> np.ndarray:
    # llama.cpp stores Gemma's RMSNorm weights as 1 + w
    if gguf_name.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w


# --------------------------------------------------------------------------- metadata


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


def _special_ids(meta: Mapping[str, Any]) -> Config:
    out: Config = {}
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


def _vocab_size(model: GGUFModel, arch: str) -> int:
    meta = model.metadata
    if f"{arch}.vocab_size" in meta:
        return int(meta[f"{arch}.vocab_size"])
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens:
        return len(tokens)
    embed = model.tensors.get("token_embd.weight")
    if embed is None:
        raise ConversionError("GGUF has no token_embd.weight and no vocabulary size")
    return embed.shape[0]


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> Config | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(_get(meta, f"{arch}.rope.scaling.factor", required=True))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return _yarn(meta, arch, factor)
    raise ConversionError(
        f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)"
    )


def _yarn(meta: Mapping[str, Any], arch: str, factor: float) -> Config:
    """YaRN scaling as mlx-lm's rope reads it; an attention factor other than 1 (the
    attention-scale correction some models store) has no mlx-lm counterpart here."""
    key = f"{arch}.rope.scaling"
    for name in ("attn_factor", "yarn_attn_factor"):
        value = meta.get(f"{key}.{name}")
        if value is not None and abs(float(value) - 1.0) > 1e-6:
            raise ConversionError(
                f"GGUF YaRN scaling with {key}.{name} = {float(value)} is not supported "
                "(only 1.0 converts exactly); convert the original Hugging Face model instead"
            )
    config: Config = {
        "rope_type": "yarn",
        "type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": _int(meta, f"{key}.original_context_length"),
    }
    for name, option in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = meta.get(f"{key}.{name}")
        if value is not None:
            config[option] = float(value)
    return config


def _decoder_config(
    model: GGUFModel, arch: str, *, theta: float, eps: float, context: int, head_dim: int = 0
) -> Config:
    """The keys every decoder family shares, read from ``<arch>.*`` metadata; the
    family's own defaults for what a file may leave out."""
    m = model.metadata
    heads = _int(m, f"{arch}.attention.head_count")
    hidden = _int(m, f"{arch}.embedding_length")
    config: Config = {
        "hidden_size": hidden,
        "intermediate_size": _int(m, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int(m, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(m, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _int(m, f"{arch}.attention.key_length", head_dim or hidden // heads),
        "rms_norm_eps": float(m.get(f"{arch}.attention.layer_norm_rms_epsilon", eps)),
        "rope_theta": float(m.get(f"{arch}.rope.freq_base", theta)),
        "rope_scaling": _rope_scaling(m, arch),
        "max_position_embeddings": _int(m, f"{arch}.context_length", context),
        "vocab_size": _vocab_size(model, arch),
        "tie_word_embeddings": "output.weight" not in model.tensors,
    }
    config.update(_special_ids(m))
    return config


def _rotary_dims(model: GGUFModel, arch: str, c: Config) -> int:
    return _int(model.metadata, f"{arch}.rope.dimension_count", c["head_dim"])


def _full_rotary(model: GGUFModel, arch: str, c: Config) -> None:
    rope_dims = _rotary_dims(model, arch, c)
    if rope_dims != c["head_dim"]:
        raise ConversionError(
            f"GGUF {arch} model rotates {rope_dims} of {c['head_dim']} head dimensions; "
            "partial rotary embeddings are not supported for this architecture"
        )


def _head_dim_is_split(arch: str, c: Config) -> None:
    """Families whose mlx-lm model derives the head size from hidden / heads."""
    if c["head_dim"] * c["num_attention_heads"] != c["hidden_size"]:
        raise ConversionError(
            f"GGUF {arch} model has head size {c['head_dim']} with {c['num_attention_heads']} "
            f"heads and hidden size {c['hidden_size']}; mlx-lm's {arch} model needs "
            "head size = hidden size / heads"
        )


def _llama3_rope_from_freqs(freqs: np.ndarray, theta: float, head_dim: int) -> Config:
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


# --------------------------------------------------------------------------- tensors

GLOBAL_NAMES = {
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
_LLAMA_NAMES = {**_ATTN_MLP, "ffn_norm": "post_attention_layernorm"}
_GEMMA_NAMES = {
    **_ATTN_MLP,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_PHI3_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _global_shapes(c: Config) -> Shapes:
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    return {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }


def _attention_mlp_shapes(c: Config, biases: bool = True) -> Shapes:
    """Separate Q/K/V/O and gate/up/down projections with their norms (and biases),
    every layer."""
    hidden, ff = c["hidden_size"], c["intermediate_size"]
    q_rows = c["num_attention_heads"] * c["head_dim"]
    kv_rows = c["num_key_value_heads"] * c["head_dim"]
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "o_proj": hidden}
    columns = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": q_rows}
    shapes = _global_shapes(c)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for name in _PROJECTIONS:
            shapes[p + f"self_attn.{name}.weight"] = (rows[name], columns[name])
            if biases:
                shapes[p + f"self_attn.{name}.bias"] = (rows[name],)
        for name, shape in (("gate_proj", (ff, hidden)), ("up_proj", (ff, hidden))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if biases:
                shapes[p + f"mlp.{name}.bias"] = (ff,)
        shapes[p + "mlp.down_proj.weight"] = (hidden, ff)
        if biases:
            shapes[p + "mlp.down_proj.bias"] = (hidden,)
    return shapes


def _per_layer(c: Config, shapes: Shapes, extra: Mapping[str, tuple[int, ...]]) -> Shapes:
    for i in range(c["num_hidden_layers"]):
        for name, shape in extra.items():
            shapes[f"model.layers.{i}.{name}"] = shape
    return shapes


def _optional_biases(c: Config, modules: tuple[str, ...]) -> set[str]:
    """The tied output head, and the biases a file may leave out (all or none)."""
    optional = {"lm_head.weight"}
    for i in range(c["num_hidden_layers"]):
        optional.update(f"model.layers.{i}.{module}.bias" for module in modules)
    return optional


def _llama_shapes(c: Config) -> Shapes:
    return _per_layer(
        c, _attention_mlp_shapes(c), {"post_attention_layernorm.weight": (c["hidden_size"],)}
    )


def _llama_optional(c: Config) -> set[str]:
    modules = tuple(f"self_attn.{n}" for n in _PROJECTIONS) + tuple(f"mlp.{n}" for n in _MLP)
    return _optional_biases(c, modules)


def _qwen2_optional(c: Config) -> set[str]:
    """Qwen2 always has Q/K/V biases; O and the MLP never do."""
    return _optional_biases(c, ())


def _qwen2_shapes(c: Config) -> Shapes:
    shapes = _llama_shapes(c)
    for i in range(c["num_hidden_layers"]):
        for name in ("self_attn.o_proj", *(f"mlp.{n}" for n in _MLP)):
            del shapes[f"model.layers.{i}.{name}.bias"]
    return shapes


def _qwen3_shapes(c: Config) -> Shapes:
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    extra = {
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
    }
    return _per_layer(c, _attention_mlp_shapes(c, biases=False), extra)


def _phi3_shapes(c: Config) -> Shapes:
    hidden, ff = c["hidden_size"], c["intermediate_size"]
    q_rows = c["num_attention_heads"] * c["head_dim"]
    kv_rows = c["num_key_value_heads"] * c["head_dim"]
    extra = {
        "input_layernorm.weight": (hidden,),
        "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_up_proj.weight": (2 * ff, hidden),
        "mlp.down_proj.weight": (hidden, ff),
    }
    return _per_layer(c, _global_shapes(c), extra)


def _gemma_shapes(c: Config, qk_norms: bool) -> Shapes:
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    extra = {
        "post_attention_layernorm.weight": (hidden,),
        "pre_feedforward_layernorm.weight": (hidden,),
        "post_feedforward_layernorm.weight": (hidden,),
    }
    if qk_norms:
        extra.update(
            {"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)}
        )
    return _per_layer(c, _attention_mlp_shapes(c, biases=False), extra)


def _no_optional_biases(c: Config) -> set[str]:
    return {"lm_head.weight"}


# --------------------------------------------------------------------------- configs


def _llama_config(model: GGUFModel) -> Config:
    c = _decoder_config(model, "llama", theta=10000.0, eps=1e-5, context=2048)
    _full_rotary(model, "llama", c)
    c.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in model.tensors,
        mlp_bias="blk.0.ffn_up.bias" in model.tensors,
    )
    if "rope_freqs.weight" in model.tensors:
        freqs = model.tensors["rope_freqs.weight"].dequantize()
        c.update(_llama3_rope_from_freqs(freqs, c["rope_theta"], c["head_dim"]))
    return c


def _mistral_config(model: GGUFModel) -> Config:
    c = _llama_config(model)
    window = model.metadata.get("llama.attention.sliding_window")
    c.update(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        sliding_window=int(window) if window else None,
    )
    return c


def _qwen2_config(model: GGUFModel) -> Config:
    c = _decoder_config(model, "qwen2", theta=1_000_000.0, eps=1e-6, context=32768)
    _full_rotary(model, "qwen2", c)
    _head_dim_is_split("qwen2", c)
    c.update(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_act="silu",
        use_sliding_window=False,
    )
    return c


def _qwen3_config(model: GGUFModel) -> Config:
    c = _decoder_config(model, "qwen3", theta=1_000_000.0, eps=1e-6, context=40960)
    _full_rotary(model, "qwen3", c)
    c.update(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
    )
    return c


def _phi3_config(model: GGUFModel) -> Config:
    m, a = model.metadata, "phi3"
    c = _decoder_config(model, a, theta=10000.0, eps=1e-5, context=4096)
    _head_dim_is_split(a, c)
    window = m.get(f"{a}.attention.sliding_window")
    c.update(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        hidden_act="silu",
        partial_rotary_factor=_rotary_dims(model, a, c) / c["head_dim"],
        original_max_position_embeddings=_int(
            m, f"{a}.rope.scaling.original_context_length", c["max_position_embeddings"]
        ),
        sliding_window=int(window) if window else None,
    )
    factors = [f"rope_factors_{kind}.weight" for kind in ("long", "short")]
    present = [name in model.tensors for name in factors]
    if any(present) and not all(present):
        raise ConversionError("GGUF phi3 model has only one of the LongRoPE factor tensors")
    if all(present):
        long, short = (model.tensors[name].dequantize().reshape(-1).tolist() for name in factors)
        rotary_pairs = _rotary_dims(model, a, c) // 2
        if len(long) != rotary_pairs or len(short) != rotary_pairs:
            raise ConversionError(
                f"GGUF phi3 LongRoPE factors have {len(long)} and {len(short)} entries; "
                f"the rotary dimension {2 * rotary_pairs} needs {rotary_pairs} each"
            )
        c["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
    return c


def _gemma_softcap(m: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = m.get(key, default)
    return float(value) if value is not None else None


def _gemma2_config(model: GGUFModel) -> Config:
    m, a = model.metadata, "gemma2"
    c = _decoder_config(model, a, theta=10000.0, eps=1e-6, context=8192, head_dim=256)
    _full_rotary(model, a, c)
    layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    # Not stored in the GGUF; llama.cpp hard-codes them for Gemma 2: layers alternate
    # sliding-window and global attention (the first is sliding), and queries are
    # scaled by 1/sqrt(head_dim), except the 27B model (46 layers), which uses
    # 1/sqrt(hidden_size / num_heads).
    c.update(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=hidden // heads if layers == 46 else c["head_dim"],
        sliding_window=_int(m, f"{a}.attention.sliding_window", 4096),
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        attn_logit_softcapping=_gemma_softcap(m, f"{a}.attn_logit_softcapping", 50.0),
        final_logit_softcapping=_gemma_softcap(m, f"{a}.final_logit_softcapping", 30.0),
    )
    return c


def _gemma3_pattern(m: Mapping[str, Any]) -> int:
    """Every how many layers Gemma 3 attends globally (llama.cpp: every 6th, unless
    the file stores its per-layer sliding flags)."""
    stored = m.get("gemma3.attention.sliding_window_pattern")
    if not isinstance(stored, list):
        return 6 if stored is None else int(stored)
    sliding = [bool(x) for x in stored]
    pattern = sliding.index(False) + 1 if False in sliding else 6
    if sliding != [(i + 1) % pattern != 0 for i in range(len(sliding))]:
        raise ConversionError(
            "GGUF gemma3 sliding-window layer pattern is not periodic; not supported"
        )
    return pattern


def _gemma3_config(model: GGUFModel) -> Config:
    m, a = model.metadata, "gemma3"
    c = _decoder_config(model, a, theta=1_000_000.0, eps=1e-6, context=32768, head_dim=256)
    value_dim = _int(m, f"{a}.attention.value_length", c["head_dim"])
    if value_dim != c["head_dim"]:
        raise ConversionError(
            f"GGUF gemma3 key_length {c['head_dim']} != value_length {value_dim}; not supported"
        )
    layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    pattern = _gemma3_pattern(m)
    # Not stored in the GGUF; llama.cpp hard-codes them for Gemma 3: sliding layers
    # use a rotary base of 10000; queries are scaled by 1/sqrt(head_dim), except the
    # 27B model (62 layers), which uses 1/sqrt(hidden_size / num_heads).
    c.update(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=hidden // heads if layers == 62 else c["head_dim"],
        sliding_window=_int(m, f"{a}.attention.sliding_window", 512),
        sliding_window_pattern=pattern,
        layer_types=[
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ],
        final_logit_softcapping=m.get(f"{a}.final_logit_softcapping"),
        attn_logit_softcapping=m.get(f"{a}.attn_logit_softcapping"),
    )
    return c


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture maps onto an mlx-lm / HF model type.

    gguf_name: the file's ``general.architecture`` (its metadata prefix);
    layer_names: GGUF per-layer tensor part -> HF module path;
    transform: (tensor, GGUF name, config) -> the tensor in HF layout;
    config_tensors: tensors whose values went into the config, not the weights.
    """

    gguf_name: str
    model_type: str
    build_config: Callable[[GGUFModel], Config]
    layer_names: dict[str, str]
    transform: Callable[[np.ndarray, str, Config], np.ndarray]
    expected_shapes: Callable[[Config], Shapes]
    optional: Callable[[Config], set[str]]
    config_tensors: frozenset[str] = field(default_factory=frozenset)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(
        "llama",
        "llama",
        _llama_config,
        _LLAMA_NAMES,
        _llama_transform,
        _llama_shapes,
        _llama_optional,
        frozenset({"rope_freqs.weight"}),
    ),
    "mistral": Architecture(
        "llama",
        "mistral",
        _mistral_config,
        _LLAMA_NAMES,
        _llama_transform,
        _llama_shapes,
        _llama_optional,
        frozenset({"rope_freqs.weight"}),
    ),
    "qwen2": Architecture(
        "qwen2", "qwen2", _qwen2_config, _LLAMA_NAMES, _unchanged, _qwen2_shapes, _qwen2_optional
    ),
    "qwen3": Architecture(
        "qwen3",
        "qwen3",
        _qwen3_config,
        {**_LLAMA_NAMES, **_QK_NORMS},
        _unchanged,
        _qwen3_shapes,
        _no_optional_biases,
    ),
    "phi3": Architecture(
        "phi3",
        "phi3",
        _phi3_config,
        _PHI3_NAMES,
        _unchanged,
        _phi3_shapes,
        _no_optional_biases,
        frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
    ),
    "gemma2": Architecture(
        "gemma2",
        "gemma2",
        _gemma2_config,
        _GEMMA_NAMES,
        _gemma_transform,
        lambda c: _gemma_shapes(c, qk_norms=False),
        _no_optional_biases,
    ),
    "gemma3": Architecture(
        "gemma3",
        "gemma3_text",
        _gemma3_config,
        {**_GEMMA_NAMES, **_QK_NORMS},
        _gemma_transform,
        lambda c: _gemma_shapes(c, qk_norms=True),
        _no_optional_biases,
    ),
}

SUPPORTED_ARCHITECTURES = tuple(sorted(ARCHITECTURES))


def _names_mistral(meta: Mapping[str, Any]) -> bool:
    names = (meta.get("general.name"), meta.get("general.basename"))
    return any(isinstance(n, str) and "mistral" in n.lower() for n in names)


def architecture_for(model: GGUFModel) -> Architecture:
    """The family of a GGUF file, by ``general.architecture`` (and, for ``llama``
    files, a Mistral name)."""
    arch = model.architecture
    if arch == "llama" and _names_mistral(model.metadata):
        arch = "mistral"
    spec = ARCHITECTURES.get(arch)
    if spec is None or (arch == "mistral" and model.architecture != "llama"):
        raise UnsupportedArchitectureError(
            f"GGUF architecture {model.architecture!r} is not supported; supported "
            f"architectures: {', '.join(a for a in SUPPORTED_ARCHITECTURES if a != 'mistral')} "
            "and mistral (a llama file whose name says Mistral)"
        )
    return spec
