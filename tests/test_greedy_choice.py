"""Greedy verification skips the log-softmax only where that cannot change a choice."""

import mlx.core as mx
import numpy as np
from conftest import decode_tokens, mlx_lm_greedy
from tiny_models import tiny_model

import mlx_redrafter.decode as decode
from mlx_redrafter.config import SamplingConfig, TreeConfig
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.sampling import (
    choose_tokens,
    choose_tokens_quickly,
    greedy_tokens,
    normalize,
)
from mlx_redrafter.target import prepare_target

GREEDY = SamplingConfig()


def merged_logits() -> mx.array:
    """Two top logits one float apart that mlx-lm's normalization rounds together:
    30000 zeros put the logsumexp near 10.3, where floats are 2^-20 apart."""
    row = np.zeros(30000, dtype=np.float32)
    row[5] = np.float32(1e-3)
    row[9] = np.nextafter(row[5], np.float32(1))  # the raw maximum, at a later index
    return mx.array(row)[None, None]  # (B, N, V) = (1, 1, 30000)


def test_a_merged_near_tie_is_flagged_and_the_exact_choice_differs():
    logits = merged_logits()
    exact = mx.argmax(normalize(logits), axis=-1)  # what mlx-lm's greedy sampler takes
    _, unsure = greedy_tokens(logits)
    assert exact.item() == 5 and mx.argmax(logits, axis=-1).item() == 9
    assert unsure.item()
    assert choose_tokens(logits, GREEDY, None).item() == 5


def test_exact_ties_take_the_first_index_unflagged_and_near_ties_are_flagged():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 8, 5000)).astype(np.float32)  # (B, N, V)
    top = logits.max(axis=-1) + 1.0  # (B, N)
    logits[0, :, 700] = logits[0, :, 300] = top[0]  # exact ties: index 300 wins
    logits[1, 2, 900] = top[1, 2]
    logits[1, 2, 100] = np.nextafter(top[1, 2], np.float32(0))  # an earlier near-tie
    choices, unsure = greedy_tokens(mx.array(logits[:1]))
    assert not unsure.item()
    assert np.array_equal(np.array(choices), np.full((1, 8), 300))
    assert np.array_equal(np.array(choices), np.argmax(logits[:1], axis=-1))
    _, unsure = greedy_tokens(mx.array(logits[1:2]))
    assert unsure.item()
    choices, unsure = greedy_tokens(mx.array(logits[2:]))  # no ties: the raw argmax
    assert not unsure.item()
    assert np.array_equal(np.array(choices), np.argmax(logits[2:], axis=-1))


def test_unflagged_choices_equal_the_exact_ones():
    key = mx.random.key(3)
    logits = 4 * mx.random.normal((6, 64, 4096), key=key)  # (B, N, V)
    choices, unsure = greedy_tokens(logits)
    assert not unsure.item()
    assert mx.array_equal(choices, choose_tokens(logits, GREEDY, None)).item()


def test_half_precision_takes_the_exact_choice_directly():
    # bf16 floats near 1 are 2^-7 apart: the quick path is not used at all.
    logits = mx.array([[[1.0, 1.0 + 2**-7, -3.0]]], dtype=mx.bfloat16)
    choices, unsure = choose_tokens_quickly(logits, GREEDY, None)
    assert not unsure.item()
    assert mx.array_equal(choices, choose_tokens(logits, GREEDY, None)).item()


def decodes_like_mlx_lm(monkeypatch, name, replacement) -> bool:
    """Decode 12 tokens on a tiny model with decode.<name> replaced; mlx-lm's output?"""
    model = tiny_model("llama")
    prompt = [3, 17, 42, 8]
    reference = mlx_lm_greedy(model, prompt, 12)
    prepare_target(model)
    monkeypatch.setattr(decode, name, replacement)
    outputs, _ = decode_tokens(model, Drafter.create(model), [prompt], TreeConfig(3, 3), 12)
    return outputs[0] == reference


def test_fp32_greedy_decoding_never_needs_the_exact_pass(monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return choose_tokens(*args, **kwargs)

    assert decodes_like_mlx_lm(monkeypatch, "choose_tokens", counting)
    assert calls == []


def test_a_flagged_step_takes_the_exact_choices(monkeypatch):
    # Quick choices that are wrong everywhere but flagged: the loop must replace them
    # with exact ones, so the output is still mlx-lm's.
    def wrong_but_flagged(logits, sampling, keys):
        return mx.zeros(logits.shape[:2], dtype=mx.int32), mx.array(True)

    assert decodes_like_mlx_lm(monkeypatch, "choose_tokens_quickly", wrong_but_flagged)
