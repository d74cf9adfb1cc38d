"""Tree packing, unpacking, masks and positions on small literal examples (docs/algorithm.md)."""

import mlx.core as mx
import pytest

from mlx_redrafter.config import TreeConfig
from mlx_redrafter.tree import (
    ABSENT,
    attention_mask,
    chain_tree,
    keep_best_nodes,
    key_positions,
    pack_tree,
    pad_beams,
    prefix_owners,
    sliding_window_mask,
    tree_positions,
)

BEAMS = mx.array([[[5, 7, 9], [5, 7, 2], [5, 3, 9]]])  # (B=1, W=3, L=3)


def test_prefix_owners_name_the_first_beam_with_each_prefix():
    assert prefix_owners(BEAMS).tolist() == [[[0, 0, 0], [0, 0, 1], [0, 2, 2]]]


def test_pack_tree_worked_example():
    tree = pack_tree(BEAMS, num_packed=6)
    assert tree.tokens.tolist() == [[5, 7, 9, 2, 3, 9]]
    assert tree.depths.tolist() == [[0, 1, 2, 2, 1, 2]]
    assert tree.unpack.tolist() == [[[0, 1, 2], [0, 1, 3], [0, 4, 5]]]
    assert tree.canonical.tolist() == tree.unpack.tolist()
    assert tree.num_tokens.tolist() == [6]
    # Compression N / (W*L) = 6 / 9.
    assert tree.num_tokens.item() / BEAMS.size == pytest.approx(2 / 3)


def test_ancestor_mask_worked_example():
    tree = pack_tree(BEAMS, num_packed=6)
    expected = [
        [1, 0, 0, 0, 0, 0],  # 5   root
        [1, 1, 0, 0, 0, 0],  # 7   <- 5
        [1, 1, 1, 0, 0, 0],  # 9   <- 7 <- 5
        [1, 1, 0, 1, 0, 0],  # 2   <- 7 <- 5
        [1, 0, 0, 0, 1, 0],  # 3   <- 5
        [1, 0, 0, 0, 1, 1],  # 9   <- 3 <- 5
    ]
    assert tree.ancestors.astype(mx.int32).tolist() == [expected]


def test_unpacking_gathers_every_beam_back():
    tree = pack_tree(BEAMS, num_packed=6)
    gathered = mx.take_along_axis(tree.tokens, tree.unpack.reshape(1, -1), axis=-1)
    assert gathered.reshape(BEAMS.shape).tolist() == BEAMS.tolist()


def test_positions_are_committed_length_plus_depth():
    tree = pack_tree(BEAMS, num_packed=6)
    assert tree_positions(tree, mx.array([10])).tolist() == [[10, 11, 12, 12, 11, 12]]


def test_padding_rows_of_a_batch():
    beams = mx.concatenate([BEAMS, mx.array([[[4, 4, 4], [4, 4, 4], [4, 4, 4]]])])  # (2, 3, 3)
    tree = pack_tree(beams, num_packed=7)
    assert tree.num_tokens.tolist() == [6, 3]
    assert tree.tokens.tolist() == [[5, 7, 9, 2, 3, 9, 0], [4, 4, 4, 0, 0, 0, 0]]
    assert tree.depths.tolist()[1] == [0, 1, 2, 0, 0, 0, 0]
    assert tree.unpack.tolist()[1] == [[0, 1, 2]] * 3
    # Padding attends only to itself, so it never reads or is read by real tokens.
    row = tree.ancestors[1].astype(mx.int32).tolist()
    assert row[3] == [0, 0, 0, 1, 0, 0, 0]
    assert [r[3] for r in row[:3]] == [0, 0, 0]


def test_without_prefix_sharing_every_token_is_verified_but_choices_follow_first_copy():
    tree = pack_tree(BEAMS, num_packed=9, share_prefixes=False)
    assert tree.tokens.tolist() == [[5, 7, 9, 5, 7, 2, 5, 3, 9]]
    assert tree.unpack.tolist() == [[[0, 1, 2], [3, 4, 5], [6, 7, 8]]]
    assert tree.canonical.tolist() == [[[0, 1, 2], [0, 1, 5], [0, 7, 8]]]
    assert tree.ancestors[0, 5].astype(mx.int32).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]


def test_tree_budget_cuts_the_last_beams_tails():
    tree = pack_tree(BEAMS, num_packed=4)
    assert tree.tokens.tolist() == [[5, 7, 9, 2]]
    assert tree.num_tokens.tolist() == [6]  # distinct prefixes, before the cut
    # Beam 2's nodes 4 and 5 are out of the budget: unpack points past N.
    assert tree.unpack.tolist() == [[[0, 1, 2], [0, 1, 3], [0, 4, 5]]]
    assert (tree.unpack < 4).tolist() == [[[True] * 3, [True] * 3, [True, False, False]]]


def test_attention_mask_puts_each_rows_tree_after_its_context_and_hides_stale_slots():
    beams = mx.array([[[1, 2]], [[3, 4]]])  # (B=2, W=1, L=2)
    tree = pack_tree(beams, num_packed=2)
    lengths = mx.array([3, 1])
    mask = attention_mask(tree, lengths, frontier=3)  # (2, 1, 2, 5)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].astype(mx.int32).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # Row 1: context slot 0, its tree at slots 1-2, slots 3-4 stale.
    assert mask[1, 0].astype(mx.int32).tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert tree_positions(tree, lengths).tolist() == [[3, 4], [1, 2]]
    positions = tree_positions(tree, lengths)
    assert key_positions(positions, lengths, frontier=3)[:, :3].tolist() == [[0, 1, 2], [0, 1, 2]]


def test_sliding_window_mask_counts_positions_not_slots():
    beams = mx.array([[[1, 2]]])
    tree = pack_tree(beams, num_packed=2)
    lengths = mx.array([4])
    mask = attention_mask(tree, lengths, frontier=4)
    positions = tree_positions(tree, lengths)  # [[4, 5]]
    windowed = sliding_window_mask(mask, positions, lengths, frontier=4, window_size=3)
    # Position 4 sees positions 2, 3, 4; position 5 sees 3, 4, 5.
    assert windowed[0, 0].astype(mx.int32).tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_chain_tree_is_causal():
    tree = chain_tree(mx.array([[4, 5, 6]]))
    assert tree.depths.tolist() == [[0, 1, 2]]
    assert tree.ancestors.astype(mx.int32).tolist() == [[[1, 0, 0], [1, 1, 0], [1, 1, 1]]]


def test_absent_tokens_end_a_beam():
    # A drafted beam of 2 tokens beside a looked-up beam of 4, in one (B, 2, 4) array.
    beams = pad_beams(mx.array([[[5, 7]]]), 4)
    assert beams.tolist() == [[[5, 7, ABSENT, ABSENT]]]
    beams = mx.concatenate([beams, mx.array([[[5, 3, 9, 4]]])], axis=1)
    tree = pack_tree(
        beams, num_packed=TreeConfig(1, 2, lookup_branches=1, lookup_length=4).num_packed
    )
    assert tree.tokens.tolist() == [[5, 7, 3, 9, 4]]
    assert tree.depths.tolist() == [[0, 1, 1, 2, 3]]
    # Absent positions point at N = 5, as nodes cut by a budget do: never verified.
    assert tree.unpack.tolist() == [[[0, 1, 5, 5], [0, 2, 3, 4]]]
    assert tree.canonical.tolist() == tree.unpack.tolist()
    assert tree.num_tokens.tolist() == [5]
    # Token 9 of beam 1 sees the root, 3 and itself; nothing of beam 0's missing tail.
    assert tree.ancestors[0, 3].tolist() == [True, False, True, True, False]


def test_a_beam_ends_at_its_first_absent_token():
    # An ABSENT token ends the beam even if real ids follow, and two beams that end
    # alike share nothing past their end.
    beams = mx.array([[[5, 7, ABSENT, 2], [5, 7, ABSENT, 2]]])
    tree = pack_tree(beams, num_packed=2)
    assert tree.tokens.tolist() == [[5, 7]]
    assert tree.unpack.tolist() == [[[0, 1, 2, 2], [0, 1, 2, 2]]]
    assert pad_beams(mx.array([[[5, 7, 9]]]), 2).tolist() == [[[5, 7]]]


def test_beam_config_sizes():
    assert TreeConfig(3, 3).num_packed == 7
    assert TreeConfig(3, 3, share_prefixes=False).num_packed == 9
    assert TreeConfig(3, 3, tree_budget=5).num_packed == 5
    assert TreeConfig(1, 1).num_packed == 1
    # Lookup branches of their own length: 1 + W (L - 1) + G (Ll - 1).
    assert TreeConfig(1, 3, lookup_branches=1, lookup_length=7).num_packed == 1 + 2 + 6
    assert TreeConfig(2, 4, lookup_branches=1, lookup_length=2).num_packed == 1 + 6 + 1
    assert (
        TreeConfig(1, 3, lookup_branches=1, lookup_length=7, share_prefixes=False).num_packed == 10
    )
    assert TreeConfig(1, 3, lookup_branches=1, lookup_length=7).depth == 7
    assert TreeConfig(2, 4, lookup_branches=1, lookup_length=2).depth == 4
    # A dynamic tree verifies its n drafted prefixes (the root included) and its branches.
    assert TreeConfig(4, 4, draft_nodes=7).num_packed == 7
    assert TreeConfig(4, 4, draft_nodes=7, lookup_branches=1, lookup_length=7).num_packed == 13


def test_dynamic_tree_notation_and_errors():
    tree = TreeConfig.parse("4x4@7+1x7:text")
    assert (tree.beam_width, tree.beam_length, tree.draft_nodes) == (4, 4, 7)
    assert (tree.lookup_branches, tree.lookup_branch_length, tree.lookup_table) == (1, 7, False)
    assert tree.label == "4x4@7+1x7:text"
    assert TreeConfig.parse("8x4@10").label == "8x4@10"
    assert tree.lookup_only.label == "0x1+1x7:text"
    with pytest.raises(ValueError, match="between 2 and 13"):
        TreeConfig.parse("4x4@14")
    with pytest.raises(ValueError, match="W >= 1 and L >= 2"):
        TreeConfig.parse("1x1@2")
    with pytest.raises(ValueError, match="share_prefixes"):
        TreeConfig(4, 4, share_prefixes=False, draft_nodes=5)
    with pytest.raises(ValueError, match="tree_budget"):
        TreeConfig(4, 4, draft_nodes=7, tree_budget=5)
    with pytest.raises(ValueError, match="dynamic tree"):
        TreeConfig.parse("4x4@")


# Cumulative draft log-probabilities of BEAMS' prefixes (the beams best first): 5 (0),
# 5-7 (-0.5), 5-3 (-0.7), 5-7-9 (-1.0), 5-7-2 (-1.1), 5-3-9 (-1.3).
SCORES = mx.array([[[0.0, -0.5, -1.0], [0.0, -0.5, -1.1], [0.0, -0.7, -1.3]]])


@pytest.mark.parametrize(
    "count,kept",
    [
        (1, [[5], [5], [5]]),
        (2, [[5, 7], [5, 7], [5]]),
        (3, [[5, 7], [5, 7], [5, 3]]),
        (4, [[5, 7, 9], [5, 7], [5, 3]]),
        (5, [[5, 7, 9], [5, 7, 2], [5, 3]]),
        (6, [[5, 7, 9], [5, 7, 2], [5, 3, 9]]),
        (9, [[5, 7, 9], [5, 7, 2], [5, 3, 9]]),
    ],
)
def test_a_dynamic_tree_keeps_the_most_probable_prefixes(count, kept):
    beams = keep_best_nodes(BEAMS, SCORES, count)
    expected = [row + [ABSENT] * (3 - len(row)) for row in kept]
    assert beams.tolist() == [expected]
    distinct = min(count, 6)
    tree = pack_tree(beams, num_packed=distinct)
    assert tree.num_tokens.tolist() == [distinct]


def test_a_dynamic_tree_breaks_ties_in_packed_order_so_parents_come_first():
    # Every prefix scores the same: the first `count` in packed order are kept.
    beams = keep_best_nodes(BEAMS, mx.zeros(BEAMS.shape), 4)
    assert beams.tolist() == [[[5, 7, 9], [5, 7, 2], [5, ABSENT, ABSENT]]]


def test_a_dynamic_tree_is_a_tree_of_exactly_n_prefixes_on_random_beams():
    key = mx.random.key(7)
    for trial in range(20):
        key, k1, k2 = mx.random.split(key, 3)
        beams = mx.random.randint(0, 3, (2, 5, 4), key=k1)  # few tokens: shared prefixes
        beams[:, :, 0] = 1  # one root per row
        # A log-probability per (depth, token), so equal prefixes score alike.
        table = -mx.random.uniform(shape=(4, 3), key=k2)  # (L, V)
        steps = mx.take_along_axis(table[None, None], beams[..., None], axis=-1)[..., 0]
        steps[:, :, 0] = 0.0
        scores = mx.cumsum(steps, axis=-1)  # a prefix never above its parent
        count = 2 + trial % 8
        kept = keep_best_nodes(beams, scores, count)
        full = pack_tree(beams, num_packed=20)
        tree = pack_tree(kept, num_packed=20)
        distinct = full.num_tokens.tolist()
        assert tree.num_tokens.tolist() == [min(count, n) for n in distinct]
        # Cut beams end at the cut: a kept token is always followed by kept or ABSENT ones.
        present = (kept >= 0).astype(mx.int32)
        assert mx.all(mx.cumprod(present, axis=-1) == present).item()
        # No cut prefix scores above a kept one (ties aside, they are kept in order).
        cut = (beams >= 0) & (kept < 0)
        lowest_kept = mx.min(mx.where(kept >= 0, scores, mx.inf), axis=(1, 2))  # (B,)
        highest_cut = mx.max(mx.where(cut, scores, -mx.inf), axis=(1, 2))  # (B,)
        assert mx.all(highest_cut <= lowest_kept).item()
