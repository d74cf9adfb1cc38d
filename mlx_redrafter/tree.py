"""Dynamic tree attention: pack beams into a prefix tree, and the tree's masks.

Shapes: B batch, W beam width, L beam length, N packed tokens (static per
TreeConfig), T committed context.

Worked example (docs/algorithm.md has more): one row, W = 3, L = 3,

    beams = [[5, 7, 9],        beam 0
             [5, 7, 2],        beam 1 shares [5, 7] with beam 0
             [5, 3, 9]]        beam 2 shares [5] with beam 0

    packed tokens = [5, 7, 9, 2, 3, 9]       (N = 6 of W*L = 9)
    depths        = [0, 1, 2, 2, 1, 2]
    unpack        = [[0, 1, 2],              packed index of beam i's prefix of length k+1
                     [0, 1, 3],
                     [0, 4, 5]]

Beams of different lengths (short drafter beams beside long lookup branches) share
one (B, W, L) array: a shorter beam is padded with ABSENT (-1) tokens, which are
never packed; their `unpack` is N, as for a node that did not fit the budget.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

ABSENT = -1  # no token at this (beam, depth): the beam ended before it


def pad_beams(beams: mx.array, length: int) -> mx.array:
    """Beams (B, W, L) cut or padded with ABSENT to (B, W, length)."""
    batch_size, beam_width, beam_length = beams.shape
    if length <= beam_length:
        return beams[:, :, :length]
    padding = mx.full((batch_size, beam_width, length - beam_length), ABSENT, dtype=beams.dtype)
    return mx.concatenate([beams, padding], axis=-1)  # (B, W, length)


class PackedTree(NamedTuple):
    """The beams of one step as a prefix tree, padded to a static N per row.

    tokens:      (B, N) packed token ids; padding is 0.
    depths:      (B, N) depth of each packed token (0 is the root); padding is 0.
    unpack:      (B, W, L) packed index of the node for beam i's prefix of length k+1;
                 an index >= N means the node did not fit the tree budget, and N
                 that the beam has no token there (ABSENT).
    canonical:   (B, W, L) packed index of the first copy of that prefix: the target's
                 choice there decides for every copy (equal to unpack when prefixes
                 are shared; differs only when duplicates are verified); N where
                 the beam has no token.
    ancestors:   (B, N, N) bool, [b, p, q] is True when packed token q is p itself or
                 one of its ancestors (padding attends only to itself).
    num_tokens:  (B,) distinct prefixes in each row (may exceed N when pruned).
    """

    tokens: mx.array
    depths: mx.array
    unpack: mx.array
    canonical: mx.array
    ancestors: mx.array
    num_tokens: mx.array


def prefix_owners(beams: mx.array) -> mx.array:
    """For every (beam i, depth k), the lowest beam j with the same prefix beams[:, :k+1].

    beams: (B, W, L) -> (B, W, L) int32 beam indices (j <= i).
    """
    batch_size, beam_width, beam_length = beams.shape
    beam_index = mx.arange(beam_width, dtype=mx.int32)
    equal = beams[:, :, None, :] == beams[:, None, :, :]  # (B, W, W, L) [b, i, j, k]
    same_prefix = mx.cumprod(equal.astype(mx.int32), axis=-1) > 0  # (B, W, W, L)
    candidates = mx.where(same_prefix, beam_index[None, None, :, None], beam_width)
    return mx.min(candidates, axis=2).astype(mx.int32)  # (B, W, L)


class Prefixes(NamedTuple):
    """Which (beam, depth) positions of beams (B, W, L) hold a prefix, and whose.

    present: (B, W, L) the beam has a token there (it ends at its first ABSENT).
    is_new:  (B, W*L) the prefix first appears at this position (its owner's own).
    owner:   (B, W*L) flat (beam, depth) index of the position that owns the prefix.
    """

    present: mx.array
    is_new: mx.array
    owner: mx.array


def prefixes_of(beams: mx.array, owners: mx.array) -> Prefixes:
    """The `Prefixes` of beams (B, W, L) whose prefixes belong to `owners` (B, W, L):
    `prefix_owners(beams)` to share them, or each beam itself to share nothing."""
    batch_size, beam_width, beam_length = beams.shape
    beam_index = mx.arange(beam_width, dtype=mx.int32)[None, :, None]  # (1, W, 1)
    depth_index = mx.arange(beam_length, dtype=mx.int32)  # (L,)
    present = mx.cumprod((beams >= 0).astype(mx.int32), axis=-1) > 0  # (B, W, L)
    is_new = ((owners == beam_index) & present).reshape(batch_size, -1)  # (B, W*L)
    owner = (owners * beam_length + depth_index).reshape(batch_size, -1)  # (B, W*L)
    return Prefixes(present, is_new, owner)


def keep_best_nodes(beams: mx.array, scores: mx.array, count: int) -> mx.array:
    """A dynamic tree: keep the `count` distinct prefixes of the beams with the highest
    scores (e.g. `confidence.confident_scores`), as EAGLE-2 reranks its draft tree,
    and end each beam (ABSENT) where its next prefix was not kept.

    beams: (B, W, L); scores: (B, W, L), a prefix never above its parent (so the kept
    prefixes form a tree); count: n >= 1, the root included -> beams (B, W, L).
    Ties go to the prefix packed first (beam by beam, depth by depth), which puts a
    parent before its child. A row with fewer distinct prefixes keeps them all.
    """
    batch_size, beam_width, beam_length = beams.shape
    flat_size = beam_width * beam_length
    present, is_new, owner_flat = prefixes_of(beams, prefix_owners(beams))
    flat_scores = scores.astype(mx.float32).reshape(batch_size, flat_size)  # (B, W*L)
    # Rank of each distinct prefix: the distinct ones above it, then those tied before it.
    this, other = flat_scores[:, :, None], flat_scores[:, None, :]  # (B, W*L, 1), (B, 1, W*L)
    flat_index = mx.arange(flat_size, dtype=mx.int32)
    earlier = flat_index[None, :] < flat_index[:, None]  # (W*L, W*L) [i, j]: j before i
    ahead = ((other > this) | ((other == this) & earlier)) & is_new[:, None, :]
    rank = mx.sum(ahead, axis=-1)  # (B, W*L)
    kept_new = is_new & (rank < count)  # (B, W*L)
    kept = mx.take_along_axis(kept_new, owner_flat, axis=-1)  # (B, W*L)
    kept = kept.reshape(batch_size, beam_width, beam_length) & present  # (B, W, L)
    kept = mx.cumprod(kept.astype(mx.int32), axis=-1) > 0  # a beam ends at its first cut
    return mx.where(kept, beams, ABSENT).astype(beams.dtype)


def pack_tree(beams: mx.array, num_packed: int, share_prefixes: bool = True) -> PackedTree:
    """Pack beams (B, W, L) into a prefix tree of num_packed tokens per row.

    Packed order is beam by beam, depth by depth, keeping only positions whose
    prefix first appears in that beam. Rows with fewer distinct prefixes are
    padded; rows with more are cut at num_packed (the tails of the last beams).
    A beam ends at its first ABSENT (negative) token: nothing from there is packed.
    """
    batch_size, beam_width, beam_length = beams.shape
    flat_size = beam_width * beam_length
    beam_index = mx.arange(beam_width, dtype=mx.int32)[None, :, None]  # (1, W, 1)
    depth_index = mx.arange(beam_length, dtype=mx.int32)  # (L,)
    first_owners = prefix_owners(beams)  # (B, W, L)
    owners = first_owners if share_prefixes else mx.broadcast_to(beam_index, beams.shape)
    present, is_new, owner_flat = prefixes_of(beams, owners)

    # Packed index of every new position, and of every position's owner node.
    packed_index = mx.cumsum(is_new.astype(mx.int32), axis=-1) - 1  # (B, W*L)
    unpack = mx.take_along_axis(packed_index, owner_flat, axis=-1)  # (B, W*L)
    unpack = unpack.reshape(batch_size, beam_width, beam_length)  # (B, W, L)
    unpack = mx.where(present, unpack, num_packed)
    first_flat = (first_owners * beam_length + depth_index).reshape(batch_size, flat_size)
    canonical = mx.take_along_axis(packed_index, first_flat, axis=-1)  # (B, W*L)
    canonical = canonical.reshape(batch_size, beam_width, beam_length)  # (B, W, L)
    canonical = mx.where(present, canonical, num_packed)
    num_tokens = mx.sum(is_new, axis=-1).astype(mx.int32)  # (B,)

    # Gather new positions to the front, in flat (beam, depth) order.
    flat_index = mx.arange(flat_size, dtype=mx.int32)
    order = mx.argsort(mx.where(is_new, flat_index, flat_size + flat_index), axis=-1)
    order = order[:, :num_packed].astype(mx.int32)  # (B, N) flat position of packed token p
    slot = mx.arange(num_packed, dtype=mx.int32)
    real = slot[None, :] < num_tokens[:, None]  # (B, N)
    flat_beams = beams.reshape(batch_size, flat_size)  # (B, W*L)
    tokens = mx.where(real, mx.take_along_axis(flat_beams, order, axis=-1), 0)  # (B, N)
    depths = mx.where(real, order % beam_length, 0)  # (B, N)

    # Ancestors of packed token p: the nodes on its own beam's path up to its depth.
    beam_of = order // beam_length  # (B, N)
    paths = mx.take_along_axis(
        unpack, mx.broadcast_to(beam_of[:, :, None], (batch_size, num_packed, beam_length)), axis=1
    )  # (B, N, L) packed index of each depth along p's beam
    on_path = depth_index[None, None, :] <= depths[:, :, None]  # (B, N, L)
    hits = (paths[..., None] == slot) & on_path[..., None]  # (B, N, L, N)
    ancestors = mx.any(hits, axis=2)  # (B, N, N)
    ancestors = mx.where(real[:, :, None], ancestors, slot[:, None] == slot[None, :])
    return PackedTree(tokens, depths, unpack, canonical, ancestors, num_tokens)


def chain_tree(tokens: mx.array) -> PackedTree:
    """A tree that is one path: every token sees all before it (prefill).

    tokens: (B, N) -> PackedTree with W = 1, L = N.
    """
    batch_size, length = tokens.shape
    index = mx.arange(length, dtype=mx.int32)
    depths = mx.broadcast_to(index[None], (batch_size, length))
    causal = mx.broadcast_to(index[:, None] >= index[None, :], (batch_size, length, length))
    return PackedTree(
        tokens=tokens,
        depths=depths,
        unpack=depths[:, None, :],
        canonical=depths[:, None, :],
        ancestors=causal,
        num_tokens=mx.full((batch_size,), length, dtype=mx.int32),
    )


def tree_positions(tree: PackedTree, lengths: mx.array) -> mx.array:
    """Rotary positions of packed tokens: committed length + depth. -> (B, N)"""
    return lengths[:, None] + tree.depths


def packed_slots(lengths: mx.array, num_packed: int, frontier: int) -> mx.array:
    """Where each cache slot stands relative to its row's packed tokens, which sit
    right after the row's committed ones, at [lengths[b], lengths[b] + N): slot s
    of row b holds packed token s - lengths[b] when that is in [0, N), a committed
    token when it is negative, and a stale entry otherwise.
    lengths: (B,) -> (B, frontier + N)"""
    slots = mx.arange(frontier + num_packed, dtype=mx.int32)[None, :]  # (1, T + N)
    return slots - lengths[:, None]  # (B, T + N)


def attention_mask(tree: PackedTree, lengths: mx.array, frontier: int) -> mx.array:
    """Boolean mask for the packed tokens over the cache after they are written.

    Row b's committed tokens occupy slots [0, lengths[b]) and its packed tokens
    [lengths[b], lengths[b] + N); the slots after them are stale and hidden, and
    frontier = max(lengths).
    lengths: (B,) -> (B, 1, N, frontier + N)
    """
    batch_size, num_packed = tree.tokens.shape
    relative = packed_slots(lengths, num_packed, frontier)  # (B, T + N)
    packed = (relative >= 0) & (relative < num_packed)  # (B, T + N)
    index = mx.clip(relative, 0, num_packed - 1)[:, None, :]  # (B, 1, T + N)
    index = mx.broadcast_to(index, (batch_size, num_packed, index.shape[-1]))  # (B, N, T + N)
    ancestors = mx.take_along_axis(tree.ancestors, index, axis=-1)  # (B, N, T + N)
    mask = (relative < 0)[:, None, :] | (packed[:, None, :] & ancestors)  # (B, N, T + N)
    return mask[:, None]  # (B, 1, N, T + N)


def key_positions(positions: mx.array, lengths: mx.array, frontier: int) -> mx.array:
    """Rotary position of every cache slot during a forward. -> (B, frontier + N)

    Committed slot s holds position s; slot lengths[b] + q holds positions[b, q];
    stale slots get a position that their mask hides anyway.
    """
    num_packed = positions.shape[1]
    relative = packed_slots(lengths, num_packed, frontier)  # (B, T + N)
    index = mx.clip(relative, 0, num_packed - 1)  # (B, T + N)
    packed = mx.take_along_axis(positions, index, axis=1)  # (B, T + N)
    return mx.where(relative < 0, relative + lengths[:, None], packed)


def sliding_window_mask(
    mask: mx.array, positions: mx.array, lengths: mx.array, frontier: int, window_size: int
) -> mx.array:
    """Restrict a mask (B, 1, N, T + N) to keys less than window_size positions back."""
    keys = key_positions(positions, lengths, frontier)  # (B, T + N)
    near = (positions[:, :, None] - keys[:, None, :]) < window_size  # (B, N, T + N)
    return mask & near[:, None]
