"""Acceptance on literal trees: the walk along the target's choices."""

import mlx.core as mx

from mlx_redrafter.accept import accept
from mlx_redrafter.tree import ABSENT, pack_tree

BEAMS = mx.array([[[5, 7, 9], [5, 7, 2], [5, 3, 9]]])  # packed [5, 7, 9, 2, 3, 9]


def run(choices, beams=BEAMS, num_packed=6, share_prefixes=True):
    tree = pack_tree(beams, num_packed, share_prefixes)
    return accept(beams, tree.unpack, tree.canonical, mx.array(choices))


def test_walk_accepts_the_deepest_matching_branch():
    # Target: after 5 -> 7, after 5 7 -> 2, after 5 7 2 -> 8. Beam 1 matches twice.
    result = run([[7, 2, 0, 8, 0, 0]])
    assert result.num_accepted.tolist() == [2]
    assert result.tokens.tolist() == [[7, 2, 8]]
    assert result.path.tolist() == [[0, 1, 3]]
    assert result.last_node.tolist() == [3]
    assert result.bonus_tokens.tolist() == [8]


def test_first_choice_leaves_the_tree():
    result = run([[4, 0, 0, 0, 0, 0]])
    assert result.num_accepted.tolist() == [0]
    assert result.tokens.tolist() == [[4, 0, 0]]
    assert result.last_node.tolist() == [0]


def test_second_branch_at_the_root():
    # After 5 -> 3 (beam 2), after 5 3 -> 9 (beam 2 again), after 5 3 9 -> 1.
    result = run([[3, 0, 0, 0, 9, 1]])
    assert result.num_accepted.tolist() == [2]
    assert result.tokens.tolist() == [[3, 9, 1]]
    assert result.path.tolist() == [[0, 4, 5]]


def test_nodes_cut_by_the_budget_cannot_be_accepted():
    # Same choices as above, but nodes 4 and 5 were not verified.
    result = run([[3, 0, 0, 0]], num_packed=4)
    assert result.num_accepted.tolist() == [0]
    assert result.tokens.tolist() == [[3, 0, 0]]


def test_a_beam_is_not_accepted_past_its_end():
    # Beam 0 ends after 7 (a short drafted beam beside a longer looked-up one).
    beams = mx.array([[[5, 7, ABSENT], [5, 3, 9]]])
    tree = pack_tree(beams, num_packed=4)  # tokens [5, 7, 3, 9]
    result = accept(beams, tree.unpack, tree.canonical, mx.array([[7, 2, 9, 1]]))
    assert result.num_accepted.tolist() == [1]
    assert result.tokens.tolist() == [[7, 2, 0]]  # 7 accepted, then the bonus 2
    assert result.path.tolist()[0][:2] == [0, 1]
    # Along the longer beam the walk goes on as usual.
    result = accept(beams, tree.unpack, tree.canonical, mx.array([[3, 2, 9, 1]]))
    assert result.num_accepted.tolist() == [2]
    assert result.tokens.tolist() == [[3, 9, 1]]


def test_duplicate_copies_follow_the_first_copys_choice():
    # Unshared tree: beam 1's copy of prefix [5] is node 3; its own choice (7) is ignored,
    # only node 0's choice (3) counts, so beam 2 wins.
    tree_choices = [[3, 0, 0, 7, 2, 0, 0, 9, 1]]
    result = run(tree_choices, num_packed=9, share_prefixes=False)
    assert result.num_accepted.tolist() == [2]
    assert result.tokens.tolist() == [[3, 9, 1]]
    assert result.path.tolist() == [[6, 7, 8]]


def test_rows_accept_independently():
    beams = mx.concatenate([BEAMS, BEAMS])
    result = run([[7, 2, 0, 8, 0, 0], [6, 0, 0, 0, 0, 0]], beams=beams)
    assert result.num_accepted.tolist() == [2, 0]
    assert result.tokens.tolist() == [[7, 2, 8], [6, 0, 0]]


def test_length_one_beams_emit_the_bonus_only():
    beams = mx.array([[[5]]])
    result = run([[11]], beams=beams, num_packed=1)
    assert result.num_accepted.tolist() == [0]
    assert result.tokens.tolist() == [[11]]
