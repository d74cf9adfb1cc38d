"""Second turns of two-turn conversations: time to first token with and without the
prompt cache.

One `DecodingSession` serves every request, as the chat's does. Each
conversation's first turn is answered with a `PromptCache`; its second turn
(the first question, the reply, the second question, through the chat template) is
then decoded twice, alternating which goes first: from that cache, and from an
empty prefill. TTFT is the wall-clock from the call to the first response (prefill
and the first step); greedy replies must be token-identical.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.nn as nn

from .drafter import Drafter
from .generate import stream_generate
from .prompt_cache import PromptCache
from .prompts import chat_tokens
from .session import DecodingSession


def _timed(
    session: DecodingSession,
    prompt: list[int],
    cache: PromptCache | None,
    max_tokens: int,
) -> tuple[float, list[int], int]:
    """(seconds to the first response, the reply's tokens, cached prompt tokens)."""
    model, drafter, tokenizer = session.model, session.drafter, session.tokenizer
    started = time.perf_counter()
    first, tokens, cached = None, [], 0
    for response in stream_generate(
        model,
        drafter,
        tokenizer,
        prompt,
        prompt_cache=cache,
        max_tokens=max_tokens,
        session=session,
    ):
        first = first if first is not None else time.perf_counter() - started
        tokens += response.tokens
        cached = response.cached_tokens
    return float(first or 0.0), tokens, cached


def second_turns(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    conversations: Sequence[tuple[str, str]],
    max_tokens: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every (first question, second question) pair; the first is a warm-up.
    One decoding session serves all of them, as in the chat."""
    session = DecodingSession(model, drafter, tokenizer)
    rows = []
    for index, (first, second) in enumerate(conversations):
        cache = PromptCache()
        messages = [{"role": "user", "content": first}]
        _, reply, _ = _timed(session, chat_tokens(tokenizer, messages), cache, max_tokens)
        messages += [
            {"role": "assistant", "content": tokenizer.decode(reply)},
            {"role": "user", "content": second},
        ]
        prompt = chat_tokens(tokenizer, messages)
        kept = PromptCache(cache.cache, list(cache.tokens))
        runs = {}
        for name in ("cached", "full") if index % 2 else ("full", "cached"):
            use = kept if name == "cached" else None
            runs[name] = _timed(session, prompt, use, max_tokens)
        (hit, hit_tokens, cached), (miss, miss_tokens, _) = runs["cached"], runs["full"]
        if index:  # the first conversation warms up
            rows.append(
                {
                    "prompt_tokens": len(prompt),
                    "cached_tokens": cached,
                    "ttft_cached": hit,
                    "ttft_full": miss,
                    "identical": hit_tokens == miss_tokens,
                }
            )
        if progress:
            progress(f"conversation {index + 1}/{len(conversations)}")
    ratios = [row["ttft_cached"] / row["ttft_full"] for row in rows]
    return {
        "conversations": len(rows),
        "max_tokens": max_tokens,
        "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in rows),
        "mean_cached_tokens": statistics.mean(r["cached_tokens"] for r in rows),
        "mean_ttft_cached": statistics.mean(r["ttft_cached"] for r in rows),
        "mean_ttft_full": statistics.mean(r["ttft_full"] for r in rows),
        "ttft_ratio": sum(r["ttft_cached"] for r in rows) / sum(r["ttft_full"] for r in rows),
        "worst_ratio": max(ratios),
        "all_identical": all(r["identical"] for r in rows),
        "rows": rows,
    }
