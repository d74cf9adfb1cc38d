"""A sampling row drafts with the noise its target samples with (Gumbel-max coupling).

The target's choice at a node of depth k is argmax(w + g), with g the noise keyed by
the node's position. A drafter that perturbs its tempered logits with the same g
drafts exactly the target's sample when its distribution is the target's, and the
target's likeliest token (what greedy drafting proposes) only as often as that token
is sampled. The output never depends on the drafts (test_sampling.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_redrafter.beam_search import beam_search
from mlx_redrafter.sampling import (
    SampledRows,
    categorical_by_position,
    draft_noise,
    gumbel_noise,
    position_keys,
)

VOCAB = 12
ROWS = 400


class FixedDrafter:
    """A drafter whose next-token logits are always `logits` (V,): the target's own."""

    def __init__(self, logits: mx.array, draft_ids: list[int] | None = None):
        self.logits = logits
        size = len(draft_ids) if draft_ids else None
        self.config = type("Config", (), {"vocab_size": VOCAB, "draft_vocab_size": size})()
        self.draft_vocab_ids = mx.array(draft_ids or [], dtype=mx.int32)

    def recurrent_step(self, state: mx.array, embedding: mx.array) -> mx.array:
        return state + embedding

    def draft_logits(self, hidden: mx.array, state: mx.array) -> mx.array:
        ids = self.draft_vocab_ids if self.config.draft_vocab_size else mx.arange(VOCAB)
        return mx.broadcast_to(self.logits[ids], (*state.shape[:-1], ids.shape[0]))

    def to_target_ids(self, draft_tokens: mx.array) -> mx.array:
        if self.config.draft_vocab_size is None:
            return draft_tokens
        return self.draft_vocab_ids[draft_tokens]


def rows(temperatures: list[float], lengths: list[int]) -> SampledRows:
    keys = mx.stack([mx.random.key(seed) for seed in range(len(temperatures))])  # (B, 2)
    inverse = [0.0 if t == 0 else 1.0 / t for t in temperatures]
    return SampledRows(keys, mx.array(lengths, dtype=mx.int32), mx.array(inverse))


def embed(tokens: mx.array) -> mx.array:
    return mx.zeros((*tokens.shape, 4))


def test_draft_noise_is_the_noise_of_each_parent_node():
    sampled = rows([1.0, 0.0, 0.5], [7, 3, 40])
    noise = draft_noise(sampled, 3, VOCAB, None)  # (B, 3, V)
    for depth in range(3):
        keys = position_keys(sampled.keys, sampled.positions[:, None] + depth)  # (B, 1, 2)
        expected = gumbel_noise(keys, VOCAB)[:, 0]  # (B, V)
        assert mx.array_equal(noise[0, depth], expected[0])
        assert mx.array_equal(noise[2, depth], expected[2])
    assert not mx.any(noise[1])  # a greedy row drafts without noise
    ids = [5, 0, 11]
    reduced = draft_noise(sampled, 3, VOCAB, mx.array(ids))  # (B, 3, Vd)
    assert mx.array_equal(reduced, noise[..., mx.array(ids)])


def test_a_drafter_with_the_target_distribution_drafts_its_sample():
    logits = mx.array(np.random.default_rng(0).normal(0, 1.5, VOCAB), dtype=mx.float32)
    temperature = 0.8
    lengths = list(range(10, 10 + ROWS))
    sampled = rows([temperature] * ROWS, lengths)
    hidden, root = mx.zeros((ROWS, 4)), mx.zeros((ROWS,), dtype=mx.int32)
    drafter = FixedDrafter(logits)
    coupled = beam_search(drafter, embed, hidden, root, 1, 2, sampled=sampled)  # (B, 1, 2)
    greedy = beam_search(drafter, embed, hidden, root, 1, 2)
    # The target's sample at the root node (position = each row's length).
    weights = mx.broadcast_to(logits / temperature, (ROWS, 1, VOCAB))
    node_keys = position_keys(sampled.keys, sampled.positions[:, None])  # (B, 1, 2)
    target = categorical_by_position(weights, node_keys)[:, 0]  # (B,)
    assert mx.array_equal(coupled[:, 0, 1], target)
    # Greedy drafting matches only as often as the likeliest token is sampled.
    greedy_rate = mx.mean(greedy[:, 0, 1] == target).item()
    likeliest = mx.max(mx.softmax(logits / temperature)).item()
    assert likeliest < 0.7 and abs(greedy_rate - likeliest) < 0.08  # 3 sd at 400 rows
    assert len(set(target.tolist())) > 4  # the rows really sample differently


def test_coupled_beams_cover_the_sample_with_a_reduced_vocabulary():
    logits = mx.array(np.random.default_rng(1).normal(0, 1.0, VOCAB), dtype=mx.float32)
    ids = [3, 9, 1, 4, 7, 0]
    sampled = rows([1.0] * ROWS, [5] * ROWS)
    hidden, root = mx.zeros((ROWS, 4)), mx.zeros((ROWS,), dtype=mx.int32)
    coupled = beam_search(FixedDrafter(logits, ids), embed, hidden, root, 1, 2, sampled=sampled)
    weights = mx.broadcast_to(logits, (ROWS, 1, VOCAB))
    node_keys = position_keys(sampled.keys, sampled.positions[:, None])  # (B, 1, 2)
    target = categorical_by_position(weights, node_keys)
    in_vocab = np.isin(np.array(target[:, 0]), ids)
    drafted = np.array(coupled[:, 0, 1])
    # Whenever the sample is a draft-vocabulary token, the drafter drafted it.
    assert in_vocab.sum() > ROWS // 4
    assert (drafted[in_vocab] == np.array(target[:, 0])[in_vocab]).all()


def test_small_seeds_do_not_share_noise_across_positions():
    """Seed s at position p and seed s' at position p ^ s ^ s' once drew the same noise."""
    keys = mx.stack([mx.random.key(seed) for seed in range(64)])  # (64, 2)
    positions = mx.broadcast_to(mx.arange(64, dtype=mx.int32)[None], (64, 64))  # (64, 64)
    every = position_keys(keys, positions).reshape(-1, 2)  # (64 * 64, 2)
    distinct = {tuple(key) for key in every.tolist()}
    assert len(distinct) == 64 * 64


def test_greedy_rows_draft_as_without_sampling():
    logits = mx.array(np.random.default_rng(2).normal(0, 1.0, VOCAB), dtype=mx.float32)
    sampled = rows([0.0, 1.0, 0.0], [3, 4, 5])
    hidden, root = mx.zeros((3, 4)), mx.zeros((3,), dtype=mx.int32)
    drafter = FixedDrafter(logits)
    mixed = beam_search(drafter, embed, hidden, root, 3, 3, sampled=sampled)
    plain = beam_search(drafter, embed, hidden, root, 3, 3)
    assert mx.array_equal(mixed[0], plain[0]) and mx.array_equal(mixed[2], plain[2])
