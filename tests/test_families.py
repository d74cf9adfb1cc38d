"""Families that cannot be verified as a tree are refused with the family named."""

import importlib

import mlx.core as mx
import pytest

from mlx_redrafter.target import TreeRope, UnsupportedModelError, prepare_target


def build(model_type, **config):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = module.Model(module.ModelArgs.from_dict({"model_type": model_type, **config}))
    mx.eval(model.parameters())
    return model


def test_state_space_family_is_refused():
    model = build(
        "mamba",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        state_size=4,
        num_hidden_layers=1,
        conv_kernel=2,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=2,
        tie_word_embeddings=True,
    )
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        prepare_target(model)


def test_absolute_position_family_is_refused():
    model = build(
        "gpt2",
        vocab_size=32,
        n_embd=16,
        n_head=2,
        n_layer=1,
        n_ctx=64,
        n_positions=64,
        layer_norm_epsilon=1e-5,
    )
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        prepare_target(model)


def test_preparation_is_idempotent_and_transparent():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import tiny_model

    model = tiny_model("qwen3")
    before = model(mx.array([[1, 2, 3]]))
    prepare_target(model)
    prepare_target(model)
    ropes = [m for _, m in model.named_modules() if isinstance(m, TreeRope)]
    assert len(ropes) == 2 and not any(isinstance(r.rope, TreeRope) for r in ropes)
    assert mx.array_equal(model(mx.array([[1, 2, 3]])), before).item()
