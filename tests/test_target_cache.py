"""TargetCache.commit keeps exactly the accepted nodes' keys and values, and copies
nothing when they already sit where they belong."""

import mlx.core as mx
import pytest
from tiny_models import tiny_model

from mlx_redrafter.target import TargetCache, prepare_target, target_hidden
from mlx_redrafter.tree import chain_tree, pack_tree

# One row, W = 2, L = 3: beam 1 shares only the root with beam 0, so the packed
# order is [root, a, b, c, d] with beam 0 at packed 0, 1, 2 and beam 1 at 0, 3, 4.
BEAMS = mx.array([[[7, 11, 12], [7, 21, 22]]])  # (B, W, L)
PROMPT = [3, 5, 9, 14, 2]


@pytest.fixture()
def cache_after_tree():
    model = prepare_target(tiny_model("llama"))
    cache = TargetCache(model, batch_size=1)
    target_hidden(model, cache, chain_tree(mx.array([PROMPT])), causal=True)
    cache.commit([list(range(len(PROMPT)))], [len(PROMPT)])
    tree = pack_tree(BEAMS, num_packed=5)
    assert tree.tokens.tolist() == [[7, 11, 12, 21, 22]]
    mx.eval(target_hidden(model, cache, tree))
    layer = cache.layers[0]
    written = layer.keys[:, :, len(PROMPT) : len(PROMPT) + 5]  # (1, H, 5, Dh) packed K
    mx.eval(written)
    return cache, written


def test_commit_along_the_first_beam_copies_nothing(cache_after_tree):
    cache, written = cache_after_tree
    keys_before = cache.layers[0].keys
    cache.commit([[0, 1, 2]], [3])
    assert cache.layers[0].keys is keys_before
    assert cache.host_lengths == [len(PROMPT) + 3]
    assert cache.lengths.tolist() == [len(PROMPT) + 3]


def test_commit_along_another_beam_moves_its_nodes(cache_after_tree):
    cache, written = cache_after_tree
    cache.commit([[0, 3, 4]], [3])
    start = len(PROMPT)
    kept = cache.layers[0].keys[:, :, start : start + 3]  # (1, H, 3, Dh)
    expected = written[:, :, mx.array([0, 3, 4])]
    assert mx.array_equal(kept, expected).item()
    assert cache.host_lengths == [start + 3]


def test_commit_keeps_only_num_kept_entries(cache_after_tree):
    cache, written = cache_after_tree
    cache.commit([[0, 3, 4]], [2])  # the root and node 3; node 4 was not accepted
    start = len(PROMPT)
    assert cache.host_lengths == [start + 2]
    kept = cache.layers[0].keys[:, :, start : start + 2]
    assert mx.array_equal(kept, written[:, :, mx.array([0, 3])]).item()


def test_a_row_behind_the_frontier_writes_its_tree_after_its_own_context():
    # Two rows of lengths 5 and 3: each row's tree goes right after its own context
    # (slots 5-9 and 3-7), so a path along the first beam moves nothing in either.
    model = prepare_target(tiny_model("llama"))
    cache = TargetCache(model, batch_size=2)
    prompts = mx.array([PROMPT, PROMPT[:3] + [0, 0]])
    target_hidden(model, cache, chain_tree(prompts), causal=True)
    cache.commit([list(range(5))] * 2, [5, 3])
    assert cache.host_lengths == [5, 3]
    tree = pack_tree(mx.concatenate([BEAMS, BEAMS]), num_packed=5)
    mx.eval(target_hidden(model, cache, tree))
    keys = cache.layers[0].keys
    written = [keys[0, :, 5:10], keys[1, :, 3:8]]  # (H, 5, Dh) each
    mx.eval(written)
    assert mx.array_equal(written[0], written[1]).item() is False  # different contexts
    cache.commit([[0, 1, 2], [0, 1, 2]], [3, 3])
    assert cache.host_lengths == [8, 6]
    assert cache.layers[0].keys is keys  # nothing moved
    # Along another beam, each row's nodes move to the slots after its own context.
    tree = pack_tree(mx.concatenate([BEAMS, BEAMS]), num_packed=5)
    mx.eval(target_hidden(model, cache, tree))
    written = [cache.layers[0].keys[0, :, 8:13], cache.layers[0].keys[1, :, 6:11]]
    mx.eval(written)
    cache.commit([[0, 3, 4], [0, 3, 4]], [3, 3])
    keys = cache.layers[0].keys
    assert mx.array_equal(keys[0, :, 8:11], written[0][:, mx.array([0, 3, 4])]).item()
    assert mx.array_equal(keys[1, :, 6:9], written[1][:, mx.array([0, 3, 4])]).item()


def test_entries_past_num_kept_do_not_force_a_move(cache_after_tree):
    cache, _ = cache_after_tree
    keys_before = cache.layers[0].keys
    cache.commit([[0, 3, 4]], [1])  # only the root is kept, and it is in place
    assert cache.layers[0].keys is keys_before


def test_a_cache_dropped_is_freed_at_once_not_by_the_cycle_collector(trained_llama):
    """Layers refer to their cache weakly: no reference cycle keeps K/V alive until
    Python's cyclic collector happens to run."""
    import gc
    import weakref

    model, _, prompts = trained_llama
    gc.disable()
    try:
        cache = TargetCache(model, batch_size=2)
        target_hidden(model, cache, chain_tree(mx.array([prompts[0][:2], prompts[1][:2]])))
        cache.commit([[0, 1], [0, 1]], [2, 2])
        row = cache.copy_row(1)
        alive = [weakref.ref(cache), weakref.ref(row)]
        del cache, row
        assert [ref() for ref in alive] == [None, None]
    finally:
        gc.enable()
