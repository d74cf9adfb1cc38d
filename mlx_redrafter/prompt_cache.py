"""The target's K/V of one conversation, kept from one request to the next.

Shapes: T tokens held.

A request that carries a `PromptCache` prefills only the part of its prompt that
the cache does not already hold (everything after the longest prefix it shares
with the cache's tokens), and when the request ends the cache takes its K/V: the
prompt and the reply, as committed. Keys and values at a position depend only on
the tokens up to it, so any shared prefix is valid, whatever tree decoded it; the
lookup branches search the request's whole prompt as before, and the drafter
starts from the hidden state of a prefilled token (at least the prompt's last two
tokens are always prefilled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .target import TargetCache


@dataclass
class PromptCache:
    """One conversation's K/V between its turns (for a sequence of requests, one at a
    time: a chat). `cached` is how many prompt tokens the last request reused."""

    cache: TargetCache | None = None  # one row
    tokens: list[int] = field(default_factory=list)  # (T,) what `cache` holds
    cached: int = 0

    def reusable(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of `prompt` the cache holds, leaving the last two to
        prefill (the drafter needs a fresh hidden state; the last token roots a tree)."""
        limit = min(len(self.tokens), len(prompt) - 2)
        if self.cache is None or limit <= 0:
            return 0
        mine = np.asarray(self.tokens[:limit])
        theirs = np.asarray(list(prompt[:limit]))
        differ = np.flatnonzero(mine != theirs)
        return int(differ[0]) if len(differ) else limit

    def keep(self, cache: TargetCache, tokens: Sequence[int]) -> None:
        """Hold `cache` (one row, its committed slots = `tokens`) for the next request."""
        mx.eval(cache.arrays())
        self.cache, self.tokens = cache, list(tokens)

    def clear(self) -> None:
        self.cache, self.tokens, self.cached = None, [], 0
