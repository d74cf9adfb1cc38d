"""Tiny random mlx-lm models of each supported family, built from mlx-lm's own classes."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

VOCAB_SIZE = 64

_COMMON: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "rope_theta": 10000.0, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "rope_theta": 10000.0},
    "qwen2": {"model_type": "qwen2", "rope_theta": 10000.0},
    "qwen3": {"model_type": "qwen3", "rope_theta": 10000.0, "head_dim": 8},
    "gemma2": {
        "model_type": "gemma2",
        "head_dim": 8,
        "query_pre_attn_scalar": 8,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rope_theta": 10000.0,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "head_dim": 8,
        "query_pre_attn_scalar": 8,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 1000.0,
    },
    "phi3": {"model_type": "phi3", "rope_theta": 10000.0},
}

_MODULES = {"mistral": "llama"}


def tiny_model(
    family: str,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    weight_scale: float = 3.0,
    **overrides: Any,
) -> nn.Module:
    """A randomly initialised mlx-lm model of `family` (fp32 by default)."""
    config = {**_COMMON, **FAMILY_CONFIGS[family], **overrides}
    module = importlib.import_module(f"mlx_lm.models.{_MODULES.get(family, family)}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    # Larger random weights than the default init, so logits are far from ties.
    params = tree_map(lambda p: p * weight_scale if p.ndim == 2 else p, model.parameters())
    model.update(params)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def parameter_count(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def tiny_tokenizer(vocab_size: int = VOCAB_SIZE, eos_token: str | None = None):  # type: ignore[no-untyped-def]
    """mlx-lm's TokenizerWrapper around a word-level tokenizer with words w0..w{V-1}."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token=eos_token)
    return TokenizerWrapper(fast)
