"""Draft (context lookup): lookup branches copied from each row's own text.

Shapes: B batch, T context buffer, G lookup branches, L beam length.

Small models repeat themselves and quote their prompt, so the tokens that
followed an earlier occurrence of the newest n-gram are often what comes next.
These branches join the drafter's beams in the tree; the target verifies them like any
other, so the output is unchanged (only how many tokens a step accepts).

Worked example (one row, max n-gram 2, G = 1, L = 3); the root is the last token:

    context = [7, 3, 9, 4, 7, 3]          length 6, root 3
    n = 2: the suffix [7, 3] also ends at position 1  -> continuation [9, 4]
    branch  = [3, 9, 4]

A continuation that reaches the root repeats with the match's period: in
[5, 8, 8] (root 8) the match [8] ends at position 1, one before the root, so
the branch is [8, 8, 8].

A longer match wins over a more recent shorter one; among equally long
matches the most recent wins, then the next most recent for the next branch.
A row without any match gets `fallback` (the drafter's best beam, or the root
repeated), which prefix sharing packs away.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .accept import runs_of


def lookup_branches(
    context: mx.array,
    lengths: mx.array,
    num_branches: int,
    beam_length: int,
    max_ngram: int,
    fallback: mx.array,
) -> mx.array:
    """The G continuations of the most recent earlier matches of each row's newest n-gram.

    context: (B, T) each row's tokens, the root (newest, not yet verified) at
        lengths[b] - 1; entries past it are ignored.
    lengths: (B,) tokens in each row's context, the root included (>= 1).
    fallback: (B, L) the beam a row gets when it has fewer than G matches.
    Returns beams (B, G, L) int32, column 0 the root.
    """
    batch_size, capacity = context.shape
    positions = mx.arange(capacity, dtype=mx.int32)[None, :]  # (1, T)
    last = lengths[:, None] - 1  # (B, 1) the root's position
    # A match ends at p (its last token at p) and is followed by at least one known
    # token: p <= root - 1. Its score prefers longer n-grams, then later positions.
    score = mx.full((batch_size, capacity), -1, dtype=mx.int32)  # (B, T)
    matched = positions < last  # (B, T) n = 0: every earlier position
    for n in range(1, max_ngram + 1):
        back = n - 1  # compare the token n-1 before p with the token n-1 before the root
        suffix_index = mx.maximum(last - back, 0)  # (B, 1)
        suffix_token = mx.take_along_axis(context, suffix_index, axis=1)  # (B, 1)
        shifted = mx.concatenate(
            [mx.full((batch_size, back), -1, dtype=context.dtype), context[:, : capacity - back]],
            axis=1,
        )  # (B, T) shifted[b, p] = context[b, p - back]
        matched = matched & (shifted == suffix_token) & (positions >= back) & (last >= back)
        score = mx.where(matched, n * capacity + positions, score)  # (B, T)
    top = mx.topk(score, num_branches, axis=-1) if num_branches < capacity else score
    top = mx.sort(top, axis=-1)[:, ::-1][:, :num_branches]  # (B, G) best first
    found = top >= 0  # (B, G)
    ends = mx.maximum(top % capacity, 0)  # (B, G) position p of each match
    # Continuation k (1..L-1) is the token k after the match. Past the root the text
    # is unknown, so it repeats with the match's period d = root - p, as runs do.
    period = mx.maximum(last - ends, 1)  # (B, G)
    offsets = mx.arange(beam_length - 1, dtype=mx.int32)  # (L-1,) k - 1
    follow = ends[:, :, None] + 1 + offsets[None, None, :] % period[:, :, None]  # (B, G, L-1)
    flat = mx.minimum(follow, capacity - 1).reshape(batch_size, -1)  # (B, G*(L-1))
    copied = mx.take_along_axis(context, flat, axis=1)
    copied = copied.reshape(batch_size, num_branches, beam_length - 1)  # (B, G, L-1)
    roots = mx.take_along_axis(context, last, axis=1)  # (B, 1)
    roots = mx.broadcast_to(roots[:, :, None], (batch_size, num_branches, 1))  # (B, G, 1)
    beams = mx.concatenate([roots, copied], axis=-1)  # (B, G, L)
    fill = mx.broadcast_to(fallback[:, None, :], beams.shape)  # (B, G, L)
    return mx.where(found[:, :, None], beams, fill).astype(mx.int32)


def hindsight_runs(
    history: mx.array,
    lengths: mx.array,
    num_branches: int,
    branch_length: int,
    max_ngram: int,
    fallback: Callable[[mx.array, mx.array, mx.array], mx.array] | None = None,
) -> mx.array:
    """How many tokens lookup branches would have had accepted, had they been drafted
    Ll - 1 tokens ago: the branches from each row's text as it was then, compared with
    the tokens that came since. Greedy decoding makes this exact for the branches
    as drafted here; under sampling it is the same chance of a match (a copied
    token is accepted with its probability).

    history: (B, T) each row's tokens, the newest at lengths[b] - 1.
    lengths: (B,) tokens in each row's history (>= Ll).
    fallback: (history, lengths then, root repeated (B, Ll)) -> the branch (B, Ll) of
        a row without a match (the n-gram table's continuation); None: the root
        repeated, as a session without a drafter drafts it.
    Returns runs (B, G): accepted tokens per branch, best branch first.
    """
    past = lengths - (branch_length - 1)  # (B,) the history as it was, its root at past - 1
    roots = mx.take_along_axis(history, past[:, None] - 1, axis=1)  # (B, 1)
    repeated = mx.broadcast_to(roots, (history.shape[0], branch_length))  # (B, Ll)
    missing = repeated if fallback is None else fallback(history, past, repeated)  # (B, Ll)
    branches = lookup_branches(history, past, num_branches, branch_length, max_ngram, missing)
    steps = mx.arange(branch_length - 1, dtype=mx.int32)  # (Ll-1,)
    since = past[:, None] + steps[None, :]  # (B, Ll-1)
    actual = mx.take_along_axis(history, since, axis=1)  # (B, Ll-1) the tokens that came
    return runs_of(branches[:, :, 1:] == actual[:, None, :])  # (B, G)
