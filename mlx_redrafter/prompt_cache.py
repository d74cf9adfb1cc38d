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


class PrefixStore:
    """A server's prefix cache: the K/V of finished requests (prompt and reply), kept
    within `max_bytes`, the least recently used dropped first.

    A request takes `lookup(prompt)`: a `PromptCache` of its own that holds the entry
    sharing the longest prefix with its prompt (the entry stays: prefill reads it with
    `TargetCache.copy_row`, which writes nothing). When the request ends, `add` keeps
    what that `PromptCache` then holds, and drops the entries it extends. Used by one
    thread (the server's decode worker).
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"a prefix cache's size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: list[PromptCache] = []  # least recently used first
        self.hits = 0
        self.lookups = 0

    @property
    def nbytes(self) -> int:
        return sum(_size(entry) for entry in self.entries)

    def lookup(self, prompt: Sequence[int]) -> PromptCache:
        """A new `PromptCache` for a request of this prompt, primed with the entry that
        shares the longest prefix with it (an empty one if none shares any)."""
        self.lookups += 1
        shared = [entry.reusable(prompt) for entry in self.entries]
        if not shared or max(shared) == 0:
            return PromptCache()
        best = self.entries.pop(int(np.argmax(shared)))
        self.entries.append(best)  # most recently used
        self.hits += 1
        return PromptCache(best.cache, list(best.tokens))

    def add(self, finished: PromptCache) -> None:
        """Keep what a finished request's `PromptCache` holds, within the budget."""
        if finished.cache is None or _size(finished) > self.max_bytes:
            return
        tokens = finished.tokens
        self.entries = [
            entry
            for entry in self.entries
            if entry.tokens != tokens[: len(entry.tokens)]  # a prefix of the new one
        ]
        self.entries.append(PromptCache(finished.cache, list(tokens)))
        while self.nbytes > self.max_bytes:
            self.entries.pop(0)

    def clear(self) -> None:
        self.entries = []


def _size(entry: PromptCache) -> int:
    """Bytes of an entry's K/V."""
    return 0 if entry.cache is None else sum(a.nbytes for a in entry.cache.arrays())
