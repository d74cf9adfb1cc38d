"""Replaying greedy decoding over recorded runs: the steps a session takes, the auto
tree's choice on the same text and costs, and what a recording cannot replay."""

from __future__ import annotations

import pytest
from conftest import decode_tokens

from mlx_redrafter.auto import DRAFTER_PRIOR, AutoTree, candidate_trees
from mlx_redrafter.calibrate import SIZES, Calibration, CalibrationKey
from mlx_redrafter.config import PLAIN_DECODING, TreeConfig
from mlx_redrafter.replay import RecordShape, StepCost, record, replay, replay_trees

KEY = CalibrationKey("m", "d", "cpu:test", "float32", "none", "0")


def curve(slope: float) -> Calibration:
    """Verifying N tokens costs 10 ms x (1 + slope x (N - 1)); drafting 1 ms a level."""
    row = tuple(0.010 * (1 + slope * (n - 1)) for n in SIZES)
    widths = (1, 2, 4, 8)
    return Calibration(KEY, SIZES, (256,), (row,), widths, (0.001,) * 4, (0.001,) * 4, lookup=0.0)


TREES = (
    TreeConfig(2, 3),
    TreeConfig(1, 4),
    TreeConfig(1, 2, lookup_branches=1, lookup_length=4),
    TreeConfig(0, 1, lookup_branches=2, lookup_length=5),
)


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.label)
def test_a_replayed_tree_takes_the_steps_a_session_takes(trained_llama, tree):
    """Greedy decoding is the same tokens whatever the tree: replayed over the
    recorded runs, a tree accepts at each step what the session's step accepted.
    (Drafter beams come from hidden states of one forward over the whole text,
    equal to the session's up to float rounding: a near tie in the drafter's
    scores could rank two beams the other way; none does here.)"""
    model, drafter, prompts = trained_llama
    agree = steps = 0
    for prompt in prompts[:6]:
        outputs, events = decode_tokens(model, drafter, [prompt], tree, max_tokens=24)
        recording = record(model, drafter, prompt, outputs[0])
        replayed = replay(recording, tree, StepCost(curve(0.1)))
        session = [event.num_accepted[0] for event in events]
        assert replayed.tokens == 24 and abs(replayed.steps - len(session)) <= 1
        pairs = list(zip(replayed.accepted[:-1], session[:-1]))  # the last stops at 24
        agree, steps = agree + sum(a == b for a, b in pairs), steps + len(pairs)
    assert agree == steps


def test_the_auto_tree_replays_the_same_way_twice_and_prices_the_text(trained_llama):
    """On a flat cost curve the auto tree drafts (tau above 1), on a linear one it
    decodes plainly; replays of one recording on one cost model are identical."""
    model, drafter, prompts = trained_llama
    recordings = []
    for prompt in prompts[:4]:
        outputs, _ = decode_tokens(model, None, [prompt], PLAIN_DECODING, max_tokens=32)
        recordings.append(record(model, drafter, prompt, outputs[0]))
    results = {}
    for name, slope in (("flat", 0.0), ("flat again", 0.0), ("linear", 1.0)):
        cost = StepCost(curve(slope), tree_overhead=0.001)
        auto = AutoTree(cost.calibration, candidate_trees(True), DRAFTER_PRIOR)
        replayed = None
        for recording in recordings:
            replayed = replay(recording, auto, cost, into=replayed)
        results[name] = replayed
    assert results["flat"].tau > 1.5 and results["linear"].tau < 1.05
    assert results["flat"] == results["flat again"]


def test_a_tree_beyond_the_recorded_shape_is_refused(trained_llama):
    """What a recording cannot replay is an error naming it; a recording without a
    drafter replays a tree's lookup branches alone, as a session decodes them."""
    model, drafter, prompts = trained_llama
    outputs, _ = decode_tokens(model, None, [prompts[0]], PLAIN_DECODING, max_tokens=8)
    narrow = RecordShape(widths=(1, 2), lengths=(2, 3))
    recording = record(model, drafter, prompts[0], outputs[0], narrow)
    with pytest.raises(ValueError, match="recorded beams are 1,2 wide and 2,3 long"):
        replay(recording, TreeConfig(4, 3), StepCost(curve(0.1)))
    text = TreeConfig.parse("1x2+1x4:text")
    with pytest.raises(ValueError, match="recorded with the n-gram table, not :text"):
        replay(recording, text, StepCost(curve(0.1)))
    alone = record(model, None, prompts[0], outputs[0])
    both = TreeConfig(2, 3, lookup_branches=1, lookup_length=4)
    replayed = replay(alone, both, StepCost(curve(0.1)))
    assert set(replayed.trees) == {both.lookup_only.label}


def test_replay_trees_compares_each_tree_with_plain_decoding_on_the_same_replies(trained_llama):
    """`replay_trees` replays plain decoding first, then each tree and the auto tree
    (a new one per reply, as per request), over the same recordings."""
    model, drafter, prompts = trained_llama
    recordings = []
    for prompt in prompts[:3]:
        outputs, _ = decode_tokens(model, None, [prompt], PLAIN_DECODING, max_tokens=16)
        recordings.append(record(model, drafter, prompt, outputs[0]))
    trees = ("auto", TreeConfig(2, 3))
    results = replay_trees(recordings, trees, StepCost(curve(0.05), 0.001), drafter)
    assert list(results) == ["1x1", "auto", "2x3"]
    assert {r.tokens for r in results.values()} == {48}
    assert results["1x1"].tau == 1.0 and results["2x3"].tau > 1.2
    assert sum(results["auto"].trees.values()) == results["auto"].steps


def test_prompts_are_selected_per_category_then_limited():
    from mlx_redrafter.prompts import PromptRecord, select_prompts

    records = [
        PromptRecord(str(i), "ab"[i % 2], [{"role": "user", "content": "x"}]) for i in range(8)
    ]
    assert [r.id for r in select_prompts(records, per_category=2)] == ["0", "1", "2", "3"]
    assert [r.id for r in select_prompts(records, per_category=2, limit=3)] == ["0", "1", "2"]
    with pytest.raises(ValueError, match=r"\(--per-category\) must be >= 1"):
        select_prompts(records, per_category=0)
