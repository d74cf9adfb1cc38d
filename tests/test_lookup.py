"""Lookup branches: continuations copied from each row's own text join the drafter's beams."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_tokens, mlx_lm_greedy, random_prompts
from tiny_models import FAMILY_CONFIGS, tiny_model

from mlx_redrafter.config import CacheConfig, TreeConfig
from mlx_redrafter.decode import decode_step, prefill, step_functions
from mlx_redrafter.lookup import hindsight_runs, lookup_branches
from mlx_redrafter.target import prepare_target


def lookup(rows, num_branches, beam_length, max_ngram, fallback_token=-7):
    """lookup_branches on plain lists (each row: its tokens, the root last)."""
    capacity = max(len(row) for row in rows) + 3
    context = mx.array([row + [0] * (capacity - len(row)) for row in rows])
    lengths = mx.array([len(row) for row in rows])
    fallback = mx.full((len(rows), beam_length), fallback_token)
    beams = lookup_branches(context, lengths, num_branches, beam_length, max_ngram, fallback)
    return np.array(beams).tolist()


def test_worked_examples():
    # docs/algorithm.md and the module docstring
    assert lookup([[7, 3, 9, 4, 7, 3]], 1, 3, 2) == [[[3, 9, 4]]]
    assert lookup([[5, 8, 8]], 1, 3, 2) == [[[8, 8, 8]]]  # repeats with period 1
    # A longer match beats a more recent shorter one; then the most recent.
    assert lookup([[1, 2, 5, 6, 2, 7, 1, 2]], 2, 3, 3) == [[[2, 5, 6], [2, 7, 1]]]
    # No match (and a one-token context): the fallback beam.
    assert lookup([[1, 2, 3], [4]], 1, 3, 3) == [[[-7, -7, -7]], [[-7, -7, -7]]]


def test_hindsight_runs_compare_past_branches_with_the_tokens_that_came():
    # Branches of L = 3 drafted 2 tokens back, from [7, 3, 9, 4, 7, 3] (root 3): the
    # first copies [9, 4] after the match [7, 3]; no other position matches, so the
    # second is the root repeated, [3, 3].
    rows = [[7, 3, 9, 4, 7, 3, 9, 4], [7, 3, 9, 4, 7, 3, 9, 5], [7, 3, 9, 4, 7, 3, 1, 4]]
    history = mx.array([row + [0, 0] for row in rows])  # (B, T): stale entries past the end
    lengths = mx.array([len(row) for row in rows])
    runs = np.array(hindsight_runs(history, lengths, 2, 3, 2)).tolist()
    # Row 0 came as copied (2 tokens), row 1 diverged at the second, row 2 at the first.
    assert [r[0] for r in runs] == [2, 1, 0]
    assert [r[1] for r in runs] == [0, 0, 0]


def test_hindsight_runs_agree_with_the_branches_of_the_earlier_step():
    rng = random.Random(3)
    rows = [[rng.randrange(5) for _ in range(40)] for _ in range(6)]
    history = mx.array(rows)
    runs = np.array(hindsight_runs(history, mx.array([40] * 6), 3, 5, 3))
    for row, got in zip(rows, runs.tolist()):
        past = lookup([row[:36]], 3, 5, 3, fallback_token=row[35])[0]  # root at 35
        came = row[36:40]
        expect = []
        for branch in past:
            run = 0
            while run < 4 and branch[1 + run] == came[run]:
                run += 1
            expect.append(run)
        assert got == expect


def reference(row, num_branches, beam_length, max_ngram):
    """The K best (longest n-gram, then most recent) match ends p < root, in plain Python."""
    root = len(row) - 1
    scored = []
    for p in range(root):
        best = 0
        for n in range(1, max_ngram + 1):
            if p - n + 1 < 0 or root - n + 1 < 0 or row[p - n + 1 : p + 1] != row[root - n + 1 :]:
                break
            best = n
        if best:
            scored.append((best, p))
    beams = []
    for _, p in sorted(scored, reverse=True)[:num_branches]:
        period = root - p
        beams.append([row[root]] + [row[p + 1 + k % period] for k in range(beam_length - 1)])
    return beams + [[-7] * beam_length] * (num_branches - len(beams))


def test_agrees_with_a_plain_python_search_on_random_text():
    rng = random.Random(0)
    for _ in range(60):
        rows = [[rng.randrange(4) for _ in range(rng.randint(1, 24))] for _ in range(4)]
        expected = [reference(row, 2, 4, 3) for row in rows]
        assert lookup(rows, 2, 4, 3) == expected, rows


def repetitive_prompts(count, seed):
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        motif = [rng.randrange(64) for _ in range(rng.randint(2, 4))]
        prompts.append(motif * rng.randint(2, 4) + [rng.randrange(64)])
    return prompts


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_lookup_beams_decode_exactly_like_mlx_lm(family):
    model = tiny_model(family)
    prompts = repetitive_prompts(2, seed=1) + random_prompts(1, seed=2)
    references = [mlx_lm_greedy(model, p, 32) for p in prompts]
    prepare_target(model)
    from mlx_redrafter.drafter import Drafter

    mx.random.seed(0)
    drafter = Drafter.create(model)
    with_drafter, _ = decode_tokens(
        model, drafter, prompts, TreeConfig(1, 3, lookup_branches=1), 32
    )
    alone, events = decode_tokens(model, None, prompts, TreeConfig(0, 4, lookup_branches=2), 32)
    assert with_drafter == references
    assert alone == references
    # Lookup branches longer, and shorter, than the drafter's.
    for beam in (
        TreeConfig(1, 2, lookup_branches=1, lookup_length=6),
        TreeConfig(2, 4, lookup_branches=2, lookup_length=2),
        TreeConfig(0, 2, lookup_branches=1, lookup_length=5),
    ):
        assert decode_tokens(model, drafter, prompts, beam, 32)[0] == references, beam
    # Random tiny models fall into loops, which the lookup drafts: steps emit several tokens.
    produced = sum(len(output) for output in alone)
    assert produced / len(events) > 1.3


def test_batch_rows_keep_their_own_history(trained_llama):
    model, drafter, trained_prompts = trained_llama
    prompts = repetitive_prompts(3, seed=4) + trained_prompts[:3] + [[5]]
    beam = TreeConfig(2, 3, lookup_branches=1)
    batched, _ = decode_tokens(model, drafter, prompts, beam, 30)
    for prompt, output in zip(prompts, batched):
        assert output == mlx_lm_greedy(model, prompt, 30)
    # The history a step searches is exactly prompt + output so far, root last.
    state = prefill(model, prompts[:3], CacheConfig())
    steps = step_functions(model, drafter, beam, compiled=False)
    emitted: list[list[int]] = [[] for _ in range(3)]
    for _ in range(4):
        for row, tokens in enumerate(decode_step(model, steps, state).tokens):
            emitted[row] += tokens
    state.select_rows([2, 0])
    for position, row in enumerate([2, 0]):
        text = prompts[row] + emitted[row]
        length = state.cache.host_lengths[position] + 1
        assert length == len(text)
        assert np.array(state.history[position, :length]).tolist() == text


def test_lookup_beams_in_a_running_batch(trained_llama):
    model, drafter, trained_prompts = trained_llama
    beam = TreeConfig(1, 4, lookup_branches=1)
    steps = step_functions(model, drafter, beam)
    first, later = repetitive_prompts(2, seed=6), trained_prompts[:2]
    state = prefill(model, first, CacheConfig(), row_ids=[0, 1])
    outputs: dict[int, list[int]] = {0: [], 1: [], 2: [], 3: []}
    for step in range(12):
        if step == 3:  # longer histories than the joining rows' prompts
            state.extend(prefill(model, later, CacheConfig(), row_ids=[2, 3]))
        output = decode_step(model, steps, state)
        for row, tokens in zip(state.row_ids, output.tokens):
            outputs[row] += tokens
    for row, prompt in enumerate(first + later):
        expected = mlx_lm_greedy(model, prompt, len(outputs[row]))
        assert outputs[row] == expected


def test_beam_shapes_parse_and_label():
    assert TreeConfig.parse("1x3+1") == TreeConfig(1, 3, lookup_branches=1)
    assert TreeConfig.parse(" 2X2 ") == TreeConfig(2, 2)
    assert TreeConfig.parse("plain") == TreeConfig(1, 1)
    assert TreeConfig(0, 4, lookup_branches=2).label == "0x4+2"
    assert TreeConfig(2, 3).label == "2x3"
    assert TreeConfig(1, 3, lookup_branches=1).num_packed == 1 + 2 * 2
    assert TreeConfig(1, 3, lookup_branches=1, share_prefixes=False).num_packed == 2 * 3
    for bad in ("4by4", "2x", "1x3+", "1x3+a", "x3", "1x3+1x", "1x3+x4", "1x3+1x4x2"):
        with pytest.raises(ValueError, match="is not a tree"):
            TreeConfig.parse(bad)
    with pytest.raises(ValueError, match="beam_width >= 1 or lookup_branches >= 1"):
        TreeConfig.parse("0x4")
    with pytest.raises(ValueError, match="lookup_ngram"):
        TreeConfig(1, 3, lookup_branches=1, lookup_ngram=0)
    # Lookup branches of their own length.
    long_lookup = TreeConfig(1, 3, lookup_branches=1, lookup_length=7)
    assert TreeConfig.parse("1x3+1x7") == long_lookup
    assert long_lookup.label == "1x3+1x7"
    assert TreeConfig.parse(long_lookup.label) == long_lookup
    assert TreeConfig.parse("1x3+1x3") == TreeConfig(1, 3, lookup_branches=1)
    assert TreeConfig.parse("1x3+1x3").label == "1x3+1"
    with pytest.raises(ValueError, match="set lookup_branches >= 1"):
        TreeConfig.parse("1x3+0x5")
    with pytest.raises(ValueError, match="lookup_length must be an integer >= 1"):
        TreeConfig(1, 3, lookup_branches=1, lookup_length=0)


def test_without_a_drafter_a_tree_keeps_its_lookup_branches(trained_llama):
    """drafter=None: a tree's drafter beams drop out and its lookup branches stay
    (`TreeConfig.lookup_only`); a tree without lookup branches decodes plainly."""
    model, _, _ = trained_llama
    prompts = repetitive_prompts(2, seed=8)
    plain, plain_events = decode_tokens(model, None, prompts, TreeConfig(2, 3), 24)
    assert all(n == 0 for event in plain_events for n in event.num_accepted)
    assert all(size == 1 for event in plain_events for size in event.tree_sizes)
    mixed, mixed_events = decode_tokens(
        model, None, prompts, TreeConfig(1, 3, lookup_branches=1), 24
    )
    alone, events = decode_tokens(model, None, prompts, TreeConfig(0, 3, lookup_branches=1), 24)
    assert mixed == alone == plain
    assert [e.num_accepted for e in mixed_events] == [e.num_accepted for e in events]
    assert len(events) < len(plain_events)
