"""Acceptance: walk the tree along the target's own choices.

Shapes: B batch, W beam width, L beam length, N packed tokens.

The target made one choice at every tree node (its argmax, or one independent
sample from its processed distribution). Starting at the root, the walk
descends while the target's choice at the current node is one of its children.
The drafted tokens walked through are accepted, and the target's choice at the
node where the walk stops is the bonus token. Every emitted token is the
target's own choice given exactly the tokens before it, so the output is
distributed as plain decoding (and greedy output is identical to it).

Walking the tree is the same as taking the beam with the longest run of
matches: beams that match up to depth a share the same nodes up to a.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class Acceptance(NamedTuple):
    """What one verification step keeps.

    num_accepted: (B,) drafted tokens accepted, 0..L-1 (a step emits num_accepted + 1).
    tokens:       (B, L) emitted tokens: the accepted drafted tokens, then the bonus
                  token at index num_accepted; entries after it are 0.
    path:         (B, L) packed index of the root and each accepted node (the first
                  num_accepted + 1 entries are meaningful): the K/V entries to keep.
    last_node:    (B,) packed index of the last accepted node (its hidden state
                  drafts the next step).
    bonus_tokens: (B,) the target's choice after the last accepted node.
    runs:         (B, W) drafted tokens each beam had accepted (the auto tree learns
                  each candidate's acceptance from them).
    """

    num_accepted: mx.array
    tokens: mx.array
    path: mx.array
    last_node: mx.array
    bonus_tokens: mx.array
    runs: mx.array


def runs_of(match: mx.array) -> mx.array:
    """(..., K) whether each drafted token matched the target's choice -> (...) how
    many matched before the first miss: what a candidate has accepted."""
    return mx.sum(mx.cumprod(match.astype(mx.int32), axis=-1), axis=-1)


def accept(beams: mx.array, unpack: mx.array, canonical: mx.array, choices: mx.array) -> Acceptance:
    """Accept the longest drafted prefix that the target's choices agree with.

    beams: (B, W, L) drafted beams (column 0 is the root token).
    unpack: (B, W, L) packed index of each beam prefix's node (>= N: not verified).
    canonical: (B, W, L) packed index of the node whose choice decides for that prefix.
    choices: (B, N) the target's choice at every packed node.
    """
    batch_size, beam_width, beam_length = beams.shape
    num_packed = choices.shape[1]
    verified = unpack < num_packed  # (B, W, L)
    node = mx.minimum(canonical, num_packed - 1).reshape(batch_size, -1)  # (B, W*L)
    target_next = mx.take_along_axis(choices, node, axis=-1)  # (B, W*L)
    target_next = target_next.reshape(batch_size, beam_width, beam_length)  # (B, W, L)

    # Drafted token k+1 is accepted when the target chose it after prefix k and its
    # own node was verified; a beam's run of acceptances stops at the first miss.
    match = (target_next[:, :, :-1] == beams[:, :, 1:]) & verified[:, :, 1:]  # (B, W, L-1)
    run = runs_of(match)  # (B, W)
    best = mx.argmax(run, axis=-1).astype(mx.int32)  # (B,) beams tied on run agree on it
    num_accepted = mx.take_along_axis(run, best[:, None], axis=-1)[:, 0].astype(mx.int32)

    pick = mx.broadcast_to(best[:, None, None], (batch_size, 1, beam_length))
    best_beam = mx.take_along_axis(beams, pick, axis=1)[:, 0]  # (B, L)
    path = mx.take_along_axis(unpack, pick, axis=1)[:, 0]  # (B, L)
    best_next = mx.take_along_axis(target_next, pick, axis=1)[:, 0]  # (B, L)
    bonus_tokens = mx.take_along_axis(best_next, num_accepted[:, None], axis=-1)[:, 0]  # (B,)
    last_node = mx.take_along_axis(path, num_accepted[:, None], axis=-1)[:, 0]  # (B,)

    step = mx.arange(beam_length, dtype=mx.int32)[None]  # (1, L)
    drafted = mx.concatenate([best_beam[:, 1:], mx.zeros_like(best_beam[:, :1])], axis=-1)
    accepted_count = num_accepted[:, None]
    tokens = mx.where(step < accepted_count, drafted, 0)
    tokens = mx.where(step == accepted_count, bonus_tokens[:, None], tokens)  # (B, L)
    runs = run.astype(mx.int32)
    return Acceptance(num_accepted, tokens.astype(mx.int32), path, last_node, bonus_tokens, runs)
