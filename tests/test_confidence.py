"""Draft confidence: acceptance measured by depth and draft probability ranks dynamic trees."""

import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_tokens

from mlx_redrafter.confidence import (
    BINS,
    DEPTHS,
    DraftConfidence,
    confident_scores,
    neutral_rates,
    observed_counts,
    shared_confidence,
    token_bins,
)
from mlx_redrafter.config import SamplingConfig, TreeConfig
from mlx_redrafter.tree import keep_best_nodes

# Two beams of one row: 5 -> 7 (q 0.6) -> 9 (q 0.9), and 5 -> 3 (q 0.35) -> 4 (q 0.5).
BEAMS = mx.array([[[5, 7, 9], [5, 3, 4]]])  # (1, 2, 3)
SCORES = mx.log(mx.array([[[1.0, 0.6, 0.54], [1.0, 0.35, 0.175]]]))  # (1, 2, 3)


def log_rates(depth_one: float, deeper: float) -> mx.array:
    """(1, DEPTHS, BINS): every first drafted token accepted at `depth_one`, every
    deeper one at `deeper`, whatever its draft probability."""
    table = np.full((1, DEPTHS, BINS), math.log(deeper))
    table[:, 0] = math.log(depth_one)
    return mx.array(table, dtype=mx.float32)


def test_without_measurements_the_draft_probabilities_rank_the_prefixes():
    neutral = neutral_rates(1)
    kept = keep_best_nodes(BEAMS, confident_scores(SCORES, SCORES, neutral), 3)
    assert kept.tolist() == keep_best_nodes(BEAMS, SCORES, 3).tolist()
    assert kept.tolist() == [[[5, 7, 9], [5, -1, -1]]]  # 0.54 beats 0.35: deep first


def test_measured_rates_move_the_nodes_from_deep_to_wide():
    """Where deep tokens are rarely accepted (the drafter surer of them than the
    target's choices bear out), the third node goes to the second first token."""
    wide = confident_scores(SCORES, SCORES, log_rates(depth_one=0.5, deeper=0.1))
    assert keep_best_nodes(BEAMS, wide, 3).tolist() == [[[5, 7, -1], [5, 3, -1]]]
    # Equal rates: the draft probabilities order them.
    deep = confident_scores(SCORES, SCORES, log_rates(depth_one=0.5, deeper=1.0))
    assert keep_best_nodes(BEAMS, deep, 3).tolist() == [[[5, 7, 9], [5, -1, -1]]]


def test_the_contest_picks_the_bins():
    """A sampled row's tokens are binned by how clearly they won the contest the
    target's noise perturbed: here 3 won clearly and 7 did not, so at rates equal
    to the bins' draft probabilities the second beam is kept whole."""
    contest = mx.log(mx.array([[[1.0, 0.3, 0.285], [1.0, 0.95, 0.475]]]))  # (1, 2, 3)
    centres = mx.log((mx.arange(BINS) + 0.5) / BINS)  # (K,)
    rates = mx.broadcast_to(centres, (1, DEPTHS, BINS))
    kept = keep_best_nodes(BEAMS, confident_scores(SCORES, contest, rates), 3)
    assert kept.tolist() == [[[5, -1, -1], [5, 3, 4]]]


def test_a_prefix_never_scores_above_its_parent():
    """So the kept prefixes always form a tree, whatever the rates."""
    key = mx.random.key(3)
    steps = -mx.random.uniform(0.0, 6.0, (4, 3, 5), key=key)  # (B, W, L-1) log q
    scores = mx.concatenate([mx.zeros((4, 3, 1)), mx.cumsum(steps, axis=-1)], axis=-1)
    rates = mx.log(mx.random.uniform(1e-4, 1.0, (4, DEPTHS, BINS), key=mx.random.key(4)))
    ranked = confident_scores(scores, scores, rates)  # (B, W, L)
    assert mx.all(ranked[:, :, 1:] <= ranked[:, :, :-1]).item()


def test_token_bins_are_the_draft_probability_of_each_token():
    assert token_bins(SCORES).tolist() == [[[6, 9], [3, 5]]]


def test_a_step_counts_each_drafted_token_reached_once():
    """Shared prefixes count once, cut tokens (ABSENT) not at all, and a token is
    reached when its parent was accepted."""
    beams = mx.array([[[5, 7, 9], [5, 7, 2], [5, 3, -1]]])  # (1, 3, 3)
    scores = mx.log(mx.array([[[1.0, 0.95, 0.475], [1.0, 0.95, 0.285], [1.0, 0.05, 0.05]]]))
    runs = mx.array([[2, 1, 0]])  # 7 and 9 accepted, 2 and 3 missed
    counts = np.array(observed_counts(beams, scores, runs, mx.array([False])))
    reached, accepted = counts[:, 0]  # greedy rows
    assert counts[:, 1].sum() == 0  # nothing from sampled rows
    assert {tuple(i) for i in np.argwhere(reached)} == {(0, 9), (0, 0), (1, 5), (1, 3)}
    assert reached.sum() == 4  # 7 (once, though two beams hold it), 3, then 9 and 2
    assert {tuple(i) for i in np.argwhere(accepted)} == {(0, 9), (1, 5)}
    assert accepted.sum() == 2


def test_rates_start_at_the_draft_probability_and_follow_the_counts():
    confidence = DraftConfidence(strength=8.0, decay=1.0)
    centres = (np.arange(BINS) + 0.5) / BINS
    assert np.allclose(confidence.rates(), np.broadcast_to(centres, (2, DEPTHS, BINS)))
    counts = np.zeros((2, 2, DEPTHS, BINS))
    counts[0, 0, 1, 9] = 1000.0  # greedy second tokens drafted at q >= 0.9 ...
    counts[1, 0, 1, 9] = 100.0  # ... accepted one time in ten
    confidence.observe(counts)
    rates = confidence.rates()
    assert rates[0, 1, 9] == pytest.approx(0.1, abs=0.01)
    assert rates[0, 0, 9] == pytest.approx(0.1, abs=0.02)  # the bin's pooled rate
    assert rates[1, 1, 9] == pytest.approx(0.95)  # sampled rows saw nothing
    assert np.allclose(np.exp(np.array(confidence.log_rates())), rates, rtol=1e-5)


def test_sharded_ranks_take_rank_zeros_counts():
    """Ranks that decoded apart before a sharded session take rank 0's counts."""
    mine, theirs = DraftConfidence(), DraftConfidence()
    counts = np.zeros((2, 2, DEPTHS, BINS))
    counts[0, 0, 0, 3], counts[1, 0, 0, 3] = 10.0, 9.0
    theirs.observe(counts)
    mine.agree(lambda values: [float(x) for x in theirs.counts.ravel()])
    assert np.array_equal(mine.counts, theirs.counts)
    assert np.array_equal(np.array(mine.log_rates()), np.array(theirs.log_rates()))


def test_a_session_measures_what_its_verified_beams_had_accepted(trained_llama):
    """With one beam and no lookup branch, the first drafted token is reached on
    every step and accepted on every step that accepted a drafted token."""
    model, drafter, prompts = trained_llama
    confidence = shared_confidence(model, drafter)  # fresh for each test (conftest)
    confidence.decay = 1.0
    _, events = decode_tokens(model, drafter, prompts[:3], TreeConfig(1, 3), 24)
    counts = confidence.counts
    accepted = [n for event in events for n in event.num_accepted]
    reached_first, accepted_first = counts[0, 0, 0].sum(), counts[1, 0, 0].sum()
    assert reached_first == len(accepted)
    assert accepted_first == sum(n >= 1 for n in accepted) > 0
    assert counts[1, 0, 1].sum() == sum(n >= 2 for n in accepted)
    assert counts[:, 1].sum() == 0  # every row greedy


def test_dynamic_trees_stay_lossless_sampling_with_measured_rates(trained_llama):
    """The tree decides only how many tokens one forward verifies: with rates measured
    by earlier sessions, a sampled dynamic tree decodes exactly what plain
    sampling with the same key does."""
    model, drafter, prompts = trained_llama
    rules = SamplingConfig(temperature=0.8)
    key = mx.random.key(11)
    decode_tokens(model, drafter, prompts[:4], TreeConfig(3, 4), 24, rules, key)  # measures
    assert shared_confidence(model, drafter).counts[:, 1].sum() > 0
    dynamic, _ = decode_tokens(
        model, drafter, prompts[4:6], TreeConfig(4, 4, draft_nodes=6), 24, rules, key
    )
    plain, _ = decode_tokens(model, drafter, prompts[4:6], TreeConfig(1, 1), 24, rules, key)
    assert dynamic == plain
