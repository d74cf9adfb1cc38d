"""Draft (n-gram table): what the target itself wrote after the newest tokens.

Shapes: B batch, T context buffer, K table entries, C stored continuation length,
Ll lookup branch length.

A lookup branch copies the row's own text (`lookup.py`), which fails when the row's
newest token has not been seen before in its prompt or output: mostly in the first
sentences of a reply. The distilled replies the drafter was trained on are a much
larger text of the same writer. This table keeps, for every n-gram (n = 1..order)
of those replies, the continuation that followed it most often, chosen token by
token (the most frequent next token, then the most frequent one after that among
the occurrences that agree so far). A lookup branch without a match in the row's
text takes the table's continuation of the longest n-gram it knows. The target
verifies it like any other beam, so the output never depends on the table.

Worked example (order 2, C = 2, min_count 1),
replies [[5, 6, 7], [5, 6, 7], [5, 6, 8], [9, 6, 8]]:

    n = 1: 5 -> [6, 7]  (6 always follows; then 7 twice, 8 once)
           6 -> [7]     (7 twice, 8 twice: the smaller id wins the tie; after 7
                          the reply ends, so the rest is ABSENT)
           9 -> [6, 8]
    n = 2: (5, 6) -> [7]     (as for 6 alone: pruned, the lookup falls back to n = 1)
           (9, 6) -> [8]     (kept: it differs from 6's continuation)
           (6, 7), (6, 8) end a reply: nothing follows, no entry

The table is stored next to the drafter's weights (`ngrams.safetensors`, built by
`mlx-redrafter ngrams`). Keys are 32-bit hashes of the n-gram: two n-grams that
collide only make a beam wrong, never the output.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np

from .files import match_umask
from .tree import ABSENT, pad_beams

NGRAMS_FILE = "ngrams.safetensors"
_SEED = 0x9E3779B9
_PRIME = 0x01000193
_NO_TOKEN_16 = 0xFFFF  # ABSENT in a uint16 file


class NgramTableError(ValueError):
    """An n-gram table that cannot be built, read or used with this target."""


@dataclass(frozen=True)
class NgramTable:
    """Continuations of n-grams of the target's own replies.

    keys: (K,) uint32 n-gram hashes (`ngram_hash`), sorted ascending, distinct.
    continuations: (K, C) int32 target token ids, ABSENT past the end of a reply.
    order: the longest n-gram the table holds.
    bucket_starts: (2**bits + 1,) int32, the first key whose top `bits` bits are
        at least each bucket's number: a key's entry lies in
        [bucket_starts[b], bucket_starts[b + 1]) for its bucket b.
    bucket_size: the most keys any bucket holds (the lookup's static probe count).
    Build it with `index_table`.
    """

    keys: mx.array
    continuations: mx.array
    order: int
    bucket_starts: mx.array
    bucket_size: int

    @property
    def size(self) -> int:
        return int(self.keys.shape[0])

    @property
    def length(self) -> int:
        """C: tokens stored per continuation."""
        return int(self.continuations.shape[1])

    @property
    def bucket_bits(self) -> int:
        return int(self.bucket_starts.shape[0] - 1).bit_length() - 1


def index_table(keys: np.ndarray, continuations: np.ndarray, order: int) -> NgramTable:
    """The table of sorted distinct keys (K,) and their continuations (K, C), with
    ~one bucket per key so that a lookup reads a few neighbouring keys only."""
    if keys.ndim != 1 or keys.size == 0 or np.any(np.diff(keys.astype(np.int64)) <= 0):
        raise NgramTableError("an n-gram table needs distinct keys in ascending order")
    bits = max(1, min(24, int(keys.size - 1).bit_length()))
    buckets = keys.astype(np.uint32) >> np.uint32(32 - bits)  # (K,)
    starts = np.searchsorted(buckets, np.arange(2**bits + 1), side="left").astype(np.int32)
    bucket_size = max(1, int(np.max(np.diff(starts))))
    return NgramTable(
        mx.array(keys.astype(np.uint32)),
        mx.array(continuations.astype(np.int32)),
        order,
        mx.array(starts),
        bucket_size,
    )


def ngram_hash_numpy(tokens: np.ndarray) -> np.ndarray:
    """(..., n) token ids -> (...,) uint32 key of each n-gram (n is part of the key)."""
    n = tokens.shape[-1]
    key = np.full(tokens.shape[:-1], (_SEED * n) & 0xFFFFFFFF, dtype=np.uint32)
    for j in range(n):
        key = (key ^ (tokens[..., j].astype(np.uint32) + np.uint32(1))) * np.uint32(_PRIME)
    return key


def ngram_hash(tokens: mx.array) -> mx.array:
    """The same key as `ngram_hash_numpy`, on the device: (..., n) -> (...,) uint32."""
    n = tokens.shape[-1]
    key = mx.full(tokens.shape[:-1], (_SEED * n) & 0xFFFFFFFF, dtype=mx.uint32)
    for j in range(n):
        token = tokens[..., j].astype(mx.uint32) + mx.array(1, dtype=mx.uint32)
        key = mx.bitwise_xor(key, token) * mx.array(_PRIME, dtype=mx.uint32)
    return key


def _greedy_continuation(followers: np.ndarray) -> np.ndarray:
    """(m, C) what followed m occurrences (ABSENT past a reply's end) -> (C,) the
    most frequent first token, then the most frequent next among those that agree."""
    length = followers.shape[1]
    result = np.full(length, ABSENT, dtype=np.int64)
    rows = followers
    for k in range(length):
        column = rows[:, k]
        column = column[column >= 0]
        if column.size == 0:
            break
        values, counts = np.unique(column, return_counts=True)
        best = values[np.argmax(counts)]  # ties: the smallest id (np.unique sorts)
        result[k] = best
        rows = rows[rows[:, k] == best]
    return result


def build_ngram_table(
    replies: Sequence[Sequence[int]], order: int = 2, length: int = 6, min_count: int = 2
) -> NgramTable:
    """Count every n-gram (n = 1..order) of the replies and keep its usual continuation.

    replies: token ids the target wrote (no prompts). length: C, tokens kept per
    continuation. min_count: n-grams with n >= 2 seen fewer times are left out
    (every seen token keeps its entry). An n-gram whose continuation equals its
    (n-1)-gram suffix's is left out too: the lookup falls back to the shorter one.
    """
    if order < 1 or length < 1 or min_count < 1:
        raise NgramTableError("order, length and min_count must be >= 1")
    pieces: list[np.ndarray] = []
    for reply in replies:
        pieces.append(np.asarray(reply, dtype=np.int64))
        pieces.append(np.array([ABSENT], dtype=np.int64))  # replies never run into each other
    if sum(len(reply) for reply in replies) == 0:
        raise NgramTableError("no reply tokens to count")
    corpus = np.concatenate(pieces)  # (S,) with ABSENT after every reply
    padded = np.concatenate([corpus, np.full(length, ABSENT, dtype=np.int64)])
    offsets = np.arange(1, length + 1)
    entries: dict[int, tuple[int, np.ndarray]] = {}  # key -> (n, continuation)
    by_ngram: list[dict[bytes, np.ndarray]] = [{}]
    for n in range(1, order + 1):
        ends = np.arange(n - 1, len(corpus) - 1)  # (M,) the n-gram's last position
        window = corpus[ends[:, None] - np.arange(n - 1, -1, -1)[None, :]]  # (M, n)
        valid = np.all(window >= 0, axis=1) & (corpus[ends + 1] >= 0)
        window, ends = window[valid], ends[valid]
        if not len(window):
            break  # no n-gram is followed by a token: no longer one is either
        order_index = np.lexsort(window.T[::-1])  # group equal n-grams
        window, ends = window[order_index], ends[order_index]
        starts = np.flatnonzero(np.any(np.diff(window, axis=0) != 0, axis=1)) + 1
        bounds = np.concatenate([[0], starts, [len(window)]])
        continuations: dict[bytes, np.ndarray] = {}
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if n >= 2 and hi - lo < min_count:
                continue
            gram = window[lo]
            followers = padded[ends[lo:hi, None] + offsets[None, :]]  # (m, C)
            # What follows a reply's end is not part of the continuation.
            followers = np.where(np.cumprod(followers >= 0, axis=1) > 0, followers, ABSENT)
            continuation = _greedy_continuation(followers)
            continuations[gram.tobytes()] = continuation
            if n >= 2:
                # What the lookup gives without this entry: the longest suffix it knows.
                shorter = next(
                    (
                        by_ngram[m][gram[n - m :].tobytes()]
                        for m in range(n - 1, 0, -1)
                        if gram[n - m :].tobytes() in by_ngram[m]
                    ),
                    None,
                )
                if shorter is not None and np.array_equal(shorter, continuation):
                    continue
            key = int(ngram_hash_numpy(gram[None, :])[0])
            kept = entries.get(key)
            if kept is None or kept[0] < n:  # a hash collision: the longer n-gram wins
                entries[key] = (n, continuation)
        by_ngram.append(continuations)
    if not entries:
        raise NgramTableError("no reply has two tokens: nothing to continue")
    keys = np.array(sorted(entries), dtype=np.uint32)
    table = np.stack([entries[int(k)][1] for k in keys]).astype(np.int32)  # (K, C)
    return index_table(keys, table, order)


def lookup_continuations(
    table: NgramTable, context: mx.array, lengths: mx.array
) -> tuple[mx.array, mx.array]:
    """The table's continuation of each row's longest known newest n-gram.

    context: (B, T) tokens, the newest at lengths[b] - 1; lengths: (B,) >= 1.
    Returns continuations (B, C) int32 and found (B,) bool (rows the table knows
    nothing about get ABSENT).
    """
    order = table.order
    last = lengths[:, None] - 1  # (B, 1)
    back = mx.arange(order - 1, -1, -1)[None, :]  # (1, order) oldest first
    positions = last - back  # (B, order) the order-gram ending at the newest token
    tokens = mx.take_along_axis(context, mx.maximum(positions, 0), axis=1)  # (B, order)
    keys = mx.stack(
        [ngram_hash(tokens[:, order - n :]) for n in range(1, order + 1)], axis=1
    )  # (B, order) key of the n-gram for n = 1..order
    known = mx.stack([positions[:, order - n] >= 0 for n in range(1, order + 1)], axis=1)
    bucket = (keys >> (32 - table.bucket_bits)).astype(mx.int32)  # (B, order)
    start = table.bucket_starts[bucket]  # (B, order)
    stop = table.bucket_starts[bucket + 1]  # (B, order)
    probe = start[:, :, None] + mx.arange(table.bucket_size)[None, None, :]  # (B, order, P)
    candidates = table.keys[mx.minimum(probe, table.size - 1)]  # (B, order, P)
    same = (candidates == keys[:, :, None]) & (probe < stop[:, :, None])  # (B, order, P)
    hit = known & mx.any(same, axis=2)  # (B, order)
    index = start + mx.argmax(same, axis=2)  # (B, order) the entry, where hit
    # The longest n-gram found: the highest n with a hit.
    rank = mx.where(hit, mx.arange(1, order + 1)[None, :], 0)  # (B, order)
    best = mx.argmax(rank, axis=1)  # (B,)
    found = mx.max(rank, axis=1) > 0  # (B,)
    chosen = mx.take_along_axis(index, best[:, None], axis=1)[:, 0]  # (B,)
    continuations = table.continuations[chosen]  # (B, C)
    absent = mx.full(continuations.shape, ABSENT, dtype=mx.int32)
    return mx.where(found[:, None], continuations, absent), found


def table_branches(
    table: NgramTable, context: mx.array, lengths: mx.array, fallback: mx.array
) -> mx.array:
    """Each row's root followed by the table's continuation, or `fallback` where the
    table knows nothing: (B, T), (B,), (B, Ll) -> (B, Ll) int32 (ABSENT past the end)."""
    beam_length = fallback.shape[1]
    continuations, found = lookup_continuations(table, context, lengths)  # (B, C), (B,)
    roots = mx.take_along_axis(context, lengths[:, None] - 1, axis=1).astype(mx.int32)  # (B, 1)
    beams = mx.concatenate([roots, continuations], axis=1)  # (B, 1 + C)
    beams = pad_beams(beams[:, None], beam_length)[:, 0]  # (B, Ll)
    return mx.where(found[:, None], beams, fallback.astype(mx.int32))


def save_ngram_table(table: NgramTable, folder: str | os.PathLike[str]) -> Path:
    """Write `ngrams.safetensors` into `folder` (a temporary file, then a rename)."""
    target = Path(folder) / NGRAMS_FILE
    continuations = np.array(table.continuations)
    if continuations.max(initial=0) < _NO_TOKEN_16:
        marked = np.where(continuations < 0, _NO_TOKEN_16, continuations)  # (K, C)
        stored = mx.array(marked.astype(np.uint16))
    else:
        stored = table.continuations
    handle, staging = tempfile.mkstemp(prefix=".ngrams.", suffix=".safetensors", dir=folder)
    os.close(handle)
    try:
        match_umask(staging)
        mx.save_safetensors(
            staging,
            {"keys": table.keys, "continuations": stored},
            {"format": "mlx", "order": str(table.order)},
        )
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return target


def load_ngram_table(path: str | os.PathLike[str], vocab_size: int | None = None) -> NgramTable:
    """Read a table written by `save_ngram_table`; vocab_size checks it fits a target."""
    try:
        arrays, metadata = cast(
            tuple[dict[str, mx.array], dict[str, str]], mx.load(str(path), return_metadata=True)
        )
    except Exception as error:  # MLX raises RuntimeError/ValueError for corrupt files
        raise NgramTableError(f"cannot read the n-gram table {path}: {error}") from None
    if set(arrays) != {"keys", "continuations"} or "order" not in metadata:
        raise NgramTableError(f"{path} is not an n-gram table (keys, continuations, order)")
    keys, stored = arrays["keys"], arrays["continuations"]
    if keys.ndim != 1 or stored.ndim != 2 or stored.shape[0] != keys.shape[0] or keys.size == 0:
        raise NgramTableError(f"{path}: keys (K,) and continuations (K, C) do not match")
    continuations = stored.astype(mx.int32)
    if stored.dtype == mx.uint16:
        continuations = mx.where(stored == _NO_TOKEN_16, ABSENT, continuations)
    if vocab_size is not None and bool(mx.any(continuations >= vocab_size).item()):
        raise NgramTableError(f"{path} holds token ids >= the target's vocabulary ({vocab_size})")
    return index_table(
        np.array(keys).astype(np.uint32), np.array(continuations), int(metadata["order"])
    )
