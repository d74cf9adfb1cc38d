"""The prompt cache: a conversation's K/V kept between turns, only the new part prefilled.

Greedy and seeded sampled replies must be the same with and without the cache, and
the cache must really be used (the tokens it saved are counted).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_redrafter.apps.chat import ChatSession
from test_chat import chat_tokenizer

from mlx_redrafter import PromptCache, stream_batch, stream_generate
from mlx_redrafter.config import CacheConfig
from mlx_redrafter.decode import prefill


def _reply(model: Any, drafter: Any, prompt: list[int], cache: PromptCache | None, **kw: Any):
    responses = list(
        stream_generate(model, drafter, chat_tokenizer(), prompt, prompt_cache=cache, **kw)
    )
    tokens = [t for r in responses for t in r.tokens]
    return tokens, responses[-1]


def test_prefill_from_a_reused_prefix_equals_a_full_prefill(trained_llama: Any) -> None:
    model, _, _ = trained_llama
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 64, 40)]
    config = CacheConfig(prefill_step_size=16)
    earlier = prefill(model, [prompt[:30]], config)  # commits 29 tokens
    whole = prefill(model, [prompt], config)
    reused = prefill(model, [prompt], config, reuse=[(earlier.cache, 25)])
    assert reused.cache.host_lengths == whole.cache.host_lengths == [39]
    np.testing.assert_allclose(np.array(reused.hidden), np.array(whole.hidden), atol=1e-4)
    assert mx.array_equal(reused.history, whole.history).item()
    assert mx.array_equal(reused.root_tokens, whole.root_tokens).item()
    for mine, theirs in zip(reused.cache.layers, whole.cache.layers):
        np.testing.assert_allclose(
            np.array(mine.keys[:, :, :39]), np.array(theirs.keys[:, :, :39]), atol=1e-4
        )
    assert earlier.cache.host_lengths == [29]  # the reused cache itself is unchanged


def test_turns_decode_the_same_with_the_cache(trained_llama: Any) -> None:
    """Each turn's prompt extends the last one's prompt and reply: the cache holds it."""
    model, drafter, prompts = trained_llama
    cache = PromptCache()
    history: list[int] = []
    for turn, (prompt, sampled) in enumerate(zip(prompts[:4], (False, True, False, True))):
        history = history + list(prompt)
        kw = {"max_tokens": 12, "temperature": 0.8 if sampled else 0.0, "seed": 11, "tree": "2x3"}
        with_cache, last = _reply(model, drafter, history, cache, **kw)
        without, _ = _reply(model, drafter, history, None, **kw)
        assert with_cache == without, turn
        if turn:
            assert last.cached_tokens > len(history) - len(prompt) - 2
        else:
            assert last.cached_tokens == 0
        history = history + with_cache
        assert cache.tokens[: len(history) - 1] == history[:-1]  # the reply is held too


def test_a_batch_mixes_reused_and_fresh_rows(trained_llama: Any) -> None:
    model, drafter, prompts = trained_llama
    first = list(prompts[5])
    cache = PromptCache()
    reply, _ = _reply(model, drafter, first, cache, max_tokens=8)
    follow = first + reply + list(prompts[6])
    other = list(prompts[7]) * 3
    rows: dict[int, list[int]] = {0: [], 1: []}
    cached = {}
    tokenizer = chat_tokenizer()
    options: dict[str, Any] = {"max_tokens": 10, "tree": "auto"}
    for row, response in stream_batch(
        model, drafter, tokenizer, [follow, other], prompt_caches=[cache, None], **options
    ):
        rows[row] += response.tokens
        cached[row] = response.cached_tokens
    assert cached[0] > len(first) - 2 and cached[1] == 0
    for row, prompt in ((0, follow), (1, other)):
        assert rows[row] == _reply(model, drafter, prompt, None, **options)[0]


def test_the_chat_prefills_only_the_new_turn(trained_llama: Any) -> None:
    model, drafter, _ = trained_llama
    out: Any = type("Out", (), {"write": lambda self, _: None, "flush": lambda self: None})()
    cached = ChatSession(model, drafter, chat_tokenizer(), max_tokens=8, out=out)
    fresh = ChatSession(model, drafter, chat_tokenizer(), max_tokens=8, out=out, prompt_cache=None)
    for text in ("w5 w6 w7", "w8 w9", "w10 w11 w12"):
        assert cached.reply(text) == fresh.reply(text)
        assert cached.last is not None and fresh.last is not None
        assert fresh.last.last.cached_tokens == 0
    assert cached.last.last.cached_tokens > cached.last.last.prompt_tokens // 2
    cached.reset()
    assert cached.prompt_cache is not None and cached.prompt_cache.cache is None


def test_the_second_turn_benchmark(trained_llama: Any) -> None:
    from mlx_redrafter.bench_turns import second_turns

    model, drafter, _ = trained_llama
    pairs = [("w5 w6 w7", "w8 w9"), ("w10 w11", "w12 w13 w14"), ("w15", "w16 w17")]
    result = second_turns(model, drafter, chat_tokenizer(), pairs, max_tokens=6)
    assert result["conversations"] == 2 and result["all_identical"]
    for row in result["rows"]:
        assert 0 < row["cached_tokens"] < row["prompt_tokens"] - 1
        assert row["ttft_cached"] > 0 and row["ttft_full"] > 0
    assert result["ttft_ratio"] == pytest.approx(
        sum(r["ttft_cached"] for r in result["rows"]) / sum(r["ttft_full"] for r in result["rows"])
    )
