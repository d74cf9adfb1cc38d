"""The auto tree: the choice on synthetic cost curves and acceptance, the running
estimate that switches speculation off and on, the calibration and its cache."""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from conftest import mlx_lm_greedy

from mlx_redrafter import DecodingSession, Request, StopConfig, TreeConfig
from mlx_redrafter import calibrate as calibrate_module
from mlx_redrafter.auto import (
    DRAFTER_PRIOR,
    LOOKUP_PRIOR,
    LOOKUP_SAMPLED,
    STEP_FADE,
    AcceptanceEstimate,
    AutoTree,
    Candidates,
    MeasuredCosts,
    candidate_trees,
    expected_tokens,
    greedy_and_sampled_planes,
    plane_of,
    prior_cube,
    prior_planes,
    rates,
)
from mlx_redrafter.calibrate import (
    DEPTH,
    SIZES,
    Calibration,
    CalibrationKey,
    cached_calibration,
    convex_fit,
    format_calibration,
    prefill_chunk,
    smooth_curves,
    sweep,
)
from mlx_redrafter.config import PLAIN_DECODING
from mlx_redrafter.drafter import Drafter, DrafterError
from mlx_redrafter.lookup import hindsight_runs
from mlx_redrafter.metrics import AcceptanceTable, survival
from mlx_redrafter.policy import StepRecord
from mlx_redrafter.training.evaluate import measure_acceptance

KEY = CalibrationKey("m", "d", "cpu:test", "float32", "none", "0")


def synthetic(cost_of_n, draft: float = 0.0) -> Calibration:
    """A calibration whose verification of N tokens costs cost_of_n(N) seconds."""
    row = tuple(float(cost_of_n(n)) for n in SIZES)
    widths = (1, 2, 4, 8)
    return Calibration(KEY, SIZES, (256,), (row,), widths, (draft,) * 4, (draft,) * 4, lookup=0.0)


GOOD_DRAFTER = AcceptanceTable(
    beams=tuple(tuple(0.9**d * (1 - 0.5**w) ** (1 / d) for d in range(1, 7)) for w in range(1, 9)),
    lookup=((0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.04, 0.03, 0.02),),
)


def auto_tree(calibration: Calibration, prior=GOOD_DRAFTER, has_drafter=True) -> AutoTree:
    return AutoTree(calibration, candidate_trees(has_drafter), prior)


def plane(auto: AutoTree, length: int) -> int:
    """The auto tree's plane of acceptance for beams of `length` tokens."""
    return int(plane_of(auto.candidates.beam_lengths, np.array([length]))[0])


# -- the choice -----------------------------------------------------------------------


def test_a_flat_cost_curve_chooses_a_wide_tree():
    choice = auto_tree(synthetic(lambda n: 0.010)).choose(1)
    assert choice.num_packed >= 32 and choice.beam_width >= 4


def test_a_linear_cost_curve_chooses_plain_decoding():
    # Verifying N tokens costs N times one: no tree can pay.
    assert auto_tree(synthetic(lambda n: 0.010 * n)).choose(1) == PLAIN_DECODING


def test_a_moderate_curve_chooses_a_small_tree_and_batches_shrink_it():
    tree = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.05 * (n - 1)))).choose(1)
    assert 1 < tree.num_packed < 64
    # Eight rows verify 8 x N tokens: on a curve that grows past ~16 tokens, smaller.
    bent = synthetic(lambda n: 0.010 * max(1.0, n / 16))
    alone, batched = auto_tree(bent).choose(1), auto_tree(bent).choose(8)
    assert batched.num_packed < alone.num_packed


def weakened(table: AcceptanceTable, factor: float) -> AcceptanceTable:
    return replace(table, beams=tuple(tuple(p * factor for p in row) for row in table.beams))


def test_leaving_plain_decoding_pays_for_its_switch():
    """A tree that beats plain decoding by more than the margin, but not once the two
    unpipelined plain steps around its stint are paid, is not taken from plain
    decoding; the same tree already running is kept."""
    curve = replace(synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1))), plain_share=0.8)
    found = 0
    for factor in np.linspace(0.2, 1.0, 81):
        auto = auto_tree(curve, weakened(GOOD_DRAFTER, factor))
        speeds, costs = auto.speeds(1, 0), auto.costs(1, 0)
        extra = auto.switch_seconds(1, 0) / auto.every
        assert extra == pytest.approx(2 * costs[0] * 0.25 / auto.every)
        best = int(np.argmax(speeds))
        paid = speeds[best] * costs[best] / (costs[best] + extra)
        if not speeds[best] > 1.03 * speeds[0] > paid:
            continue
        found += 1
        assert auto.choose(1) == PLAIN_DECODING
        running = auto_tree(curve, weakened(GOOD_DRAFTER, factor))
        running.current[1], running._latest = best, best
        for _ in range(8):
            assert running.choose(1) == auto.candidates.trees[best]
    assert found >= 1


def test_a_new_batch_size_is_chosen_for_at_once_from_the_running_tree():
    bent = synthetic(lambda n: 0.010 * max(1.0, n / 16))
    auto = auto_tree(bent)
    alone = auto.choose(1)
    batched = auto.choose(8)  # no wait of `every` steps for a new batch size
    assert batched.num_packed < alone.num_packed
    assert auto.choose(1) == alone  # each batch size keeps its own stint
    # The incumbent for a new batch size is the tree chosen last: kept unless another
    # promises the margin more.
    auto = AutoTree(bent, candidate_trees(True), GOOD_DRAFTER, margin=0.1)
    speeds = auto.speeds(4, 0)
    best = int(np.argmax(speeds))
    near = [i for i, v in enumerate(speeds) if i not in (0, best) and v * 1.1 > speeds[best]]
    far = [i for i, v in enumerate(speeds) if i != 0 and v * 1.1 < speeds[best]]
    for incumbent, kept in ((near[0], near[0]), (far[0], best)):
        auto._latest = incumbent
        auto.current.pop(4, None)
        assert auto.choose(4) == auto.candidates.trees[kept]


def test_pipelined_plain_steps_make_plain_decoding_cheaper_than_its_forward():
    """Plain steps overlap the host's work with the device's (`plain_share` of a
    one-token forward per step): a small tree that beats a plain step priced at its
    whole forward loses to one priced at its measured share."""
    curve = synthetic(lambda n: 0.010 * (1 + 0.25 * (n - 1)))
    tree = auto_tree(curve).choose(1)
    assert tree != PLAIN_DECODING
    assert auto_tree(replace(curve, plain_share=0.6)).choose(1) == PLAIN_DECODING
    costs = auto_tree(replace(curve, plain_share=0.6)).calibrated(1, 256)
    assert costs[0] == pytest.approx(0.006)  # index 0: plain decoding


def test_plain_steps_are_timed_through_the_decoding_loop(trained_llama, calibration_folder):
    """The pipelined plain step is measured and priced at a share of N = 1."""
    from mlx_redrafter.calibrate import _plain_step

    model = trained_llama[0]
    assert 0.0 < _plain_step(model, 32, repeats=1) < 1.0
    calibration, _ = cached_calibration(model)
    assert 0.0 < calibration.plain_share <= 1.0
    assert "plain decoding:" in format_calibration(calibration)


def test_without_a_drafter_the_candidates_are_lookup_trees_and_plain():
    trees = candidate_trees(has_drafter=False).trees
    assert PLAIN_DECODING in trees
    assert all(t.beam_width == 0 for t in trees if t != PLAIN_DECODING)
    choice = auto_tree(synthetic(lambda n: 0.010), LOOKUP_PRIOR, has_drafter=False).choose(1)
    assert choice.beam_width == 0 and choice.lookup_branches >= 1


def test_expected_tokens_from_the_joint_acceptance():
    trees = [PLAIN_DECODING, TreeConfig(1, 3), TreeConfig(1, 2, lookup_branches=1, lookup_length=3)]
    candidates = Candidates.of(trees)
    table = AcceptanceTable(beams=((0.5, 0.25),), lookup=((0.4, 0.2),))
    planes = prior_planes(table, candidates.beam_lengths, (1, 1), 2)
    independent = expected_tokens(candidates, planes)
    # 1x2+1x3: depth 1 from either (1 - 0.5 * 0.6), depth 2 from the branch alone.
    assert independent.tolist() == pytest.approx([1.0, 1.75, 1.0 + 0.7 + 0.2])
    # Measured together, the union accepts less: the kinds often propose the same token.
    joint = replace(table, joint=(((0, 0), (0.4, 0.2)), ((0.5, 0.25), (0.55, 0.3))))
    planes = prior_planes(joint, candidates.beam_lengths, (1, 1), 2)
    assert expected_tokens(candidates, planes).tolist() == pytest.approx(
        [1.0, 1.75, 1.0 + 0.55 + 0.2]
    )


def test_lookup_trees_start_from_the_drafters_own_measurement_of_branches_alone():
    """Beside beams a branch without a match copies the best beam, so a table's
    lookup rows overrate trees without beams: those start from its rows measured
    alone, or, for a table without them, from the built-in prior."""
    candidates = Candidates.of(
        [PLAIN_DECODING, TreeConfig(1, 3), TreeConfig(0, 1, lookup_branches=1, lookup_length=3)]
    )
    beside = AcceptanceTable(beams=((0.5, 0.25),), lookup=((0.6, 0.4),))
    alone = replace(beside, alone=((0.05, 0.01),))  # below even the sampled prior
    assert AcceptanceTable.from_dict(alone.to_dict()) == alone
    for name in ("beams", "lookup", "alone"):
        with pytest.raises(ValueError, match=f"every row of '{name}' must have the same depth"):
            AcceptanceTable.from_dict({**alone.to_dict(), name: [[0.5, 0.25], [0.5]]})
    rows = {}
    for name, table in (("beside", beside), ("alone", alone)):
        planes, _, _ = greedy_and_sampled_planes(table, None, (1, 1), candidates.beam_lengths)
        rows[name] = [plane[0, 0, 1, :2] for plane in planes]  # a branch alone, depths 1-2
    assert rows["alone"][0].tolist() == pytest.approx([0.05, 0.01])
    assert rows["beside"][0].tolist() == pytest.approx(LOOKUP_PRIOR.lookup[0][:2])
    # Sampled steps of a drafter without a sampled table: the built-in sampled rows,
    # not the greedy measurement.
    for name in rows:
        assert rows[name][1].tolist() == pytest.approx(LOOKUP_SAMPLED.lookup[0][:2])


def test_each_beam_length_reads_the_acceptance_measured_with_it():
    """Beam search keeps fewer distinct first tokens the longer its beams: a table
    measured with beams of 2 tokens rates the first level of W x 2 trees; lengths
    between two measured ones are interpolated, longer ones take the longest."""
    long = ((0.3, 0.2, 0.1),) * 4  # beams of 4 tokens: the first level collapses
    short = AcceptanceTable(beams=((0.3,), (0.5,), (0.6,), (0.7,)), steps=5)
    table = AcceptanceTable(beams=long, lookup=((0.1, 0.05),), by_length=(short,))
    assert table.beam_length == 4 and list(table.beams_by_length()) == [2, 4]
    assert AcceptanceTable.from_dict(table.to_dict()) == table
    trees = [PLAIN_DECODING, *(TreeConfig(4, n) for n in (2, 3, 4, 6))]
    candidates = Candidates.of(trees)
    assert candidates.beam_lengths == (2, 3, 4, 6)
    planes = prior_planes(table, candidates.beam_lengths, (4, 1), 3)  # (4, 5, 2, 3)
    assert planes[:, 4, 0, 0].tolist() == pytest.approx([0.7, 0.5, 0.3, 0.3])
    assert planes[:, 1, 0, 0].tolist() == pytest.approx([0.3] * 4)
    assert np.all(planes[:, 0] == planes[2, 0])  # lookup branches alone: one row
    tokens = expected_tokens(candidates, planes)
    assert tokens[1] == pytest.approx(1.7)  # 4x2: its own plane, not the 4-token one's 0.3
    assert tokens[3] == pytest.approx(1.6) and np.all(planes[3] == planes[2])
    auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.02 * (n - 1))), table)
    assert auto.prior(0.0)[1][auto._index[TreeConfig(4, 2)]] == pytest.approx(1.7)
    # Steps of 4x2 teach the plane of length 2; others learn only the shared scale.
    auto.choose(1)
    auto.record(StepRecord(TreeConfig(4, 2), 1, 0.01, np.ones((1, 4), dtype=int), 0))
    reached = auto.acceptance.beams.reached.sum(axis=(1, 2, 3))
    assert reached[plane(auto, 2)] > 0 and reached.sum() == reached[plane(auto, 2)]
    bad = (
        [[0.5]],  # not a table
        [short.to_dict(), short.to_dict()],  # one length twice
        [table.to_dict()],  # a table of its own
        [replace(short, temperature=1.0).to_dict()],  # another temperature
    )
    for by_length in bad:
        with pytest.raises(ValueError, match="by_length"):
            AcceptanceTable.from_dict({**table.to_dict(), "by_length": by_length})


def test_lookup_branches_alone_learn_alike_whatever_the_planes():
    """Lookup-only cells have no beam length: they are counted once, and their
    estimate is the same with one plane of beam length or six (and in every plane)."""
    table = AcceptanceTable(beams=((0.5, 0.25, 0.125),), lookup=((0.3, 0.1, 0.05),))
    cube = prior_cube(table, 1, 1, 3)  # (2, 2, 3)
    one, six = (
        AcceptanceEstimate(cube[None], (2,)),
        AcceptanceEstimate(np.stack([cube] * 6), range(2, 8)),
    )
    for estimate in (one, six):
        for _ in range(4):
            estimate.observe(np.zeros((1, 0), dtype=int), np.zeros((1, 1), dtype=int), 1, 4)
    assert six.alone.reached.shape == (2, 3) and six.beams.reached.shape == (6, 1, 2, 3)
    assert six.survival()[:, 0] == pytest.approx(np.stack([one.survival()[0, 0]] * 6))
    assert one.survival()[0, 0, 1, 0] < cube[0, 1, 0]


# -- the running estimate ---------------------------------------------------------------


def test_lookup_branches_alone_are_not_credited_with_the_drafters_beam():
    """A drafter's table measures lookup branches beside beams (a branch without a
    match copies the best beam); trees of branches alone start from the built-in
    prior where it is lower, and trees with beams keep the table's joint cells."""
    auto = auto_tree(synthetic(lambda n: 0.010), GOOD_DRAFTER)
    cube = prior_cube(GOOD_DRAFTER, 8, 4, DEPTH)
    capped = auto.acceptance.survival()[-1]  # beams of 7 tokens, as the table measured
    assert capped[0, 1, 0] == pytest.approx(min(0.2, LOOKUP_PRIOR.lookup[0][0]))
    assert np.all(capped[0, 1:] <= cube[0, 1:] + 1e-9)
    assert capped[1:] == pytest.approx(AcceptanceEstimate(cube[None], (7,)).survival()[0, 1:])
    alone = AutoTree(synthetic(lambda n: 0.010), candidate_trees(False), LOOKUP_PRIOR)
    assert alone.acceptance.survival()[0, 0, 1, 0] == pytest.approx(LOOKUP_PRIOR.lookup[0][0])


def test_the_estimate_follows_what_it_observes():
    table = AcceptanceTable(beams=((0.5, 0.25, 0.125),), lookup=((0.3, 0.1, 0.05),))
    estimate = AcceptanceEstimate(prior_cube(table, 1, 1, 3)[None], (4,))
    none = np.zeros((4, 0), dtype=int)
    for _ in range(50):
        estimate.fade()
        estimate.observe(np.full((4, 1), 3), none, 4, 1)  # every beam accepts all 3
    # About 176 row-steps observed against the prior's 8: close to all accepted.
    assert estimate.survival()[0, 1, 0] == pytest.approx([1, 1, 1], abs=0.07)
    assert estimate.survival()[0, 1, 0, 0] > 0.97
    for _ in range(400):
        estimate.fade()
        estimate.observe(np.zeros((4, 1), dtype=int), np.zeros((4, 1), dtype=int), 4, 4)
    cube = estimate.survival()[0]
    assert cube[1, 0, 0] < 0.05 and cube[0, 1, 0] < 0.05 and cube[1, 1, 0] < 0.05
    assert cube[0, 0].tolist() == [0, 0, 0]


def test_lucky_steps_do_not_raise_the_depths_they_did_not_observe():
    """Four steps whose one-token beams were all accepted raise depth 1, while the
    deeper depths keep the prior's rates: raised at every depth, a rate would
    compound into tokens no step has shown."""
    table = AcceptanceTable(beams=((0.5, 0.25, 0.125),))
    cube = prior_cube(table, 1, 0, 3)  # (2, 1, 3)
    estimate = AcceptanceEstimate(cube[None], (2,))
    none = np.zeros((1, 0), dtype=int)
    for _ in range(4):
        estimate.observe(np.ones((1, 1), dtype=int), none, 2, 1)
    after = estimate.survival()[0]
    assert after[1, 0, 0] > cube[1, 0, 0]
    assert rates(after)[1, 0, 1:] == pytest.approx(rates(cube)[1, 0, 1:])


def test_a_step_is_observed_only_as_deep_as_its_candidates_reach():
    table = AcceptanceTable(beams=((0.5, 0.25, 0.125),), lookup=((0.3, 0.1, 0.05),))
    cube = prior_cube(table, 1, 1, 3)
    estimate = AcceptanceEstimate(np.stack([cube, cube]), (2, 4))
    # A beam of 2 tokens (depth 1) and a branch of 4 tokens (depths 1-3).
    estimate.observe(np.array([[1]]), np.array([[3]]), 2, 4)
    beams, alone = estimate.beams, estimate.alone
    assert beams.reached[0, 0, 0].tolist() == [1, 0, 0]  # the beam alone: depth 1
    assert alone.reached[1].tolist() == [1, 1, 1]  # the branch alone: all three
    assert beams.reached[0, 0, 1].tolist() == [1, 0, 0]  # together: as deep as both reach
    assert beams.passed[0, 0, 1].tolist() == [1, 0, 0]
    # Beams are counted in the plane of their length; branches alone once, read by
    # every plane.
    assert beams.reached[1].sum() == 0
    assert estimate.survival()[1, 0, 1] == pytest.approx(estimate.survival()[0, 0, 1])


def steps_where_nothing_is_accepted(auto: AutoTree, in_hindsight: bool) -> list[TreeConfig]:
    """600 steps on which no candidate is accepted (and, checked in hindsight, no
    lookup branch would have been): the trees chosen."""
    chosen = []
    for _ in range(600):
        tree = auto.choose(1)
        chosen.append(tree)
        runs = np.zeros((1, tree.num_branches), dtype=int)
        auto.record(StepRecord(tree, 1, float(auto.costs(1, 0)[auto._index[tree]]), runs, 0))
        lookup_tree = auto.hindsight(tree)
        if lookup_tree is not None and in_hindsight:
            auto.record_hindsight(np.zeros((1, lookup_tree.lookup_branches), int), lookup_tree)
    return chosen


def test_speculation_switches_off_where_nothing_is_accepted_and_is_retried():
    auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1))))
    assert auto.choose(1) != PLAIN_DECODING
    late = steps_where_nothing_is_accepted(auto, in_hindsight=False)[200:]
    plain = sum(tree == PLAIN_DECODING for tree in late) / len(late)
    assert plain > 0.9  # off where it does not pay ...
    assert plain < 1.0  # ... but tried again now and then


def test_lookup_acceptance_is_learned_in_hindsight_while_decoding_plainly():
    # On this curve the built-in prior does not make lookup pay: plain decoding.
    curve = synthetic(lambda n: 0.010 * (1 + 0.3 * (n - 1)))
    checked, unchecked = (auto_tree(curve, LOOKUP_PRIOR, has_drafter=False) for _ in "ab")
    assert checked.choose(1) == PLAIN_DECODING == unchecked.choose(1)
    none = np.zeros((1, 0), dtype=int)
    for auto, in_hindsight in ((checked, True), (unchecked, False)):
        for _ in range(40):  # text that copies itself: every branch would be accepted
            tree = auto.choose(1)
            runs = np.full((1, tree.num_branches), tree.depth - 1) if tree.num_branches else none
            auto.record(
                StepRecord(tree, 1, float(auto.calibrated(1, 0)[auto._index[tree]]), runs, 0)
            )
            branches = auto.hindsight(tree)
            if branches is not None and in_hindsight:
                auto.record_hindsight(np.full((1, branches.lookup_branches), 9), branches)
    assert checked.choose(1).lookup_branches >= 1
    assert unchecked.choose(1) == PLAIN_DECODING  # what the hindsight check is for


def test_drafter_trees_are_still_retried_while_hindsight_sees_no_copying():
    # Lookup branches checked in hindsight must not keep the drafter's estimate down.
    auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1))))
    late = steps_where_nothing_is_accepted(auto, in_hindsight=True)[200:]
    assert sum(tree == PLAIN_DECODING for tree in late) / len(late) > 0.9
    assert any(tree.beam_width >= 1 and tree.beam_length > 1 for tree in late)


def test_hindsight_is_asked_every_few_steps_without_lookup_branches():
    """Every 4 steps without lookup branches (a check covers the steps since the
    last one); a step with lookup branches starts the count again."""
    auto = auto_tree(synthetic(lambda n: 0.010), LOOKUP_PRIOR, has_drafter=False)
    asked = [auto.hindsight(PLAIN_DECODING) for _ in range(24)]
    assert [i + 1 for i, a in enumerate(asked) if a is not None] == [4, 8, 12, 16, 20, 24]
    assert asked[3] is not None and asked[3].lookup_branches == 4
    assert asked[3].lookup_branch_length == 10
    lookup_tree = TreeConfig(0, 1, lookup_branches=1, lookup_length=7)
    assert auto.hindsight(PLAIN_DECODING) is None
    assert all(auto.hindsight(lookup_tree) is None for _ in range(8))
    asked = [auto.hindsight(PLAIN_DECODING) for _ in range(8)]
    assert [i + 1 for i, a in enumerate(asked) if a is not None] == [4, 8]


def test_drafter_acceptance_is_learned_from_probes_while_decoding_plainly():
    """Drafter probes tell the estimate what drafter trees would have accepted: after
    a stretch where nothing was accepted, text the drafter guesses brings them back
    at once with probes, and not without."""
    curve = synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1)))
    probed, unprobed = auto_tree(curve), auto_tree(curve)
    for auto in (probed, unprobed):
        steps_where_nothing_is_accepted(auto, in_hindsight=True)
    probed_plane = plane(probed, 5)  # its probes: 2x5 (the prior's best tree has 7 tokens, capped)
    before = probed.acceptance.survival()[probed_plane, 1, 0, 0]
    first_drafted = {}
    for name, auto in (("probed", probed), ("unprobed", unprobed)):
        for step in range(24):  # text the drafter guesses: every drafted token accepted
            tree = auto.choose(1)
            if tree.beam_width and tree.beam_length > 1:
                first_drafted.setdefault(name, step)
            runs = np.full((1, tree.num_branches), tree.depth - 1)
            auto.record(StepRecord(tree, 1, float(auto.costs(1, 0)[auto._index[tree]]), runs, 0))
            probe = auto.probe(tree)
            if probe is not None and name == "probed":
                width, length = probe.beam_width, probe.beam_length
                auto.record_probe(np.full((1, width), length - 1), probe)
    assert probed.acceptance.survival()[probed_plane, 1, 0, 0] > before + 0.3
    assert first_drafted["probed"] < first_drafted.get("unprobed", 24)


def test_probes_are_scheduled_and_never_drafted_where_verification_cannot_pay():
    """After 4 steps without drafter beams, then 8, then every 16 (a step with drafter
    beams starts again from 4), for sampled steps too once they have seen the drafter's
    beams; none on a cost curve where no drafter tree can pay."""
    auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1))))
    asked = [auto.probe(PLAIN_DECODING) for _ in range(44)]
    assert [i + 1 for i, a in enumerate(asked) if a is not None] == [4, 12, 28, 44]
    assert asked[3] is not None and asked[3].beam_width == 2
    assert all(auto.probe(TreeConfig(1, 3)) is None for _ in range(8))
    asked = [auto.probe(TreeConfig(0, 1, lookup_branches=1, lookup_length=7)) for _ in range(4)]
    assert asked[3] is not None and asked[3].beam_width == 2
    # Sampled steps are probed at once until they have seen the drafter, then alike.
    sampling = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1))))
    sampling.choose(1, temperature=1.0)
    assert sampling.probe(PLAIN_DECODING) is not None
    sampling.record_probe(np.ones((8, 2), dtype=int), TreeConfig(2, 5))  # 8 rows seen
    asked = [sampling.probe(PLAIN_DECODING) for _ in range(12)]
    assert [i + 1 for i, a in enumerate(asked) if a is not None] == [3, 11]
    linear = auto_tree(synthetic(lambda n: 0.010 * n))  # verification costs N x one token
    assert all(linear.probe(PLAIN_DECODING) is None for _ in range(100))
    assert auto_tree(synthetic(lambda n: 0.010), LOOKUP_PRIOR, False).probe(PLAIN_DECODING) is None


def test_probes_draft_beams_as_long_as_the_best_drafter_tree():
    """A probe teaches the plane of acceptance the choice moves to when the drafter
    guesses the text: its beams are as long as those of the drafter tree the prior
    ranks best (long where the drafter guesses deep, short where it guesses one
    token; at most 5)."""
    curve = synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1)))
    shallow = AcceptanceTable(beams=tuple((0.5 + 0.05 * w, 0.02, 0.01) for w in range(8)))
    lengths = {}
    for name, table in (("deep", GOOD_DRAFTER), ("shallow", shallow)):
        auto = auto_tree(curve, table)
        auto.choose(1)
        probe = [auto.probe(PLAIN_DECODING) for _ in range(4)][3]
        speeds = auto.prior(0.0)[1] / auto.calibrated(1, 0)
        best = auto.candidates.trees[int(np.argmax(np.where(auto.candidates.width, speeds, 0)))]
        assert probe == TreeConfig(2, min(best.beam_length, 5))
        lengths[name] = probe.beam_length
    assert lengths["deep"] >= 5 and lengths["shallow"] <= 3


def test_sampled_steps_whose_prior_says_plain_still_probe_and_learn_the_drafter():
    """Sampled steps are probed wherever the greedy prior (a sample is the drafted
    token less often than the argmax is) says a drafter tree could pay, not only
    where their own prior does: a weak table measured sampling starts them plain,
    and probes that show the drafter guessing well bring a drafter tree in. Where
    even the greedy prior cannot pay (verification linear in N), no probes."""
    weak = replace(weakened(GOOD_DRAFTER, 0.3), temperature=1.0)
    curve = synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1)))
    for guessed, drafts in ((3, True), (0, False)):
        auto = AutoTree(curve, candidate_trees(True), GOOD_DRAFTER, weak)
        trees = []
        for _ in range(40):  # two rows
            tree = auto.choose(2, temperature=1.0)
            trees.append(tree)
            seconds = float(auto.calibrated(2, 0, 1.0)[auto._index[tree]])
            auto.record(
                StepRecord(tree, 2, seconds, np.zeros((2, tree.num_branches), dtype=int), 0)
            )
            probe = auto.probe(tree)
            if probe is not None:
                auto.record_probe(np.full((2, probe.beam_width), guessed), probe)
        assert trees[0] == PLAIN_DECODING
        assert any(t.beam_width and t.beam_length > 1 for t in trees[-8:]) == drafts
    linear = AutoTree(synthetic(lambda n: 0.010 * n), candidate_trees(True), GOOD_DRAFTER, weak)
    linear.choose(1, temperature=1.0)
    assert all(linear.probe(PLAIN_DECODING) is None for _ in range(100))


def test_sampled_steps_trust_a_greedy_drafter_table_only_after_seeing_its_beams():
    """A drafter without a table measured sampling: its sampled steps decode without
    drafter beams until probes have shown them the beams in `strength` row-steps
    (drafted at every chance until then), and learn from what they see; what they
    see does not move the greedy estimate."""
    for runs, drafts in (([[2, 1], [3, 0]], True), ([[0, 0], [0, 0]], False)):
        auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1))))
        assert auto.choose(1) != PLAIN_DECODING  # greedy: the prior makes a wide tree pay
        greedy = auto.estimates[0].survival().copy()
        for _ in range(4):  # 2 rows each: 8 row-steps, the prior's strength
            tree = auto.choose(2, temperature=1.0)
            assert not tree.beam_width or tree.beam_length == 1  # not trusted yet
            probe = auto.probe(tree)  # at once, not after 4 steps
            assert probe is not None
            auto.record_probe(np.array(runs), probe)
        tree = auto.choose(3, temperature=1.0)
        assert (tree.beam_width >= 1 and tree.beam_length > 1) == drafts
        assert auto.estimates[0].survival() == pytest.approx(greedy)
        assert auto.estimates[1].beams.reached[:, 0:2, 0, 0].sum() == pytest.approx(16, rel=0.05)
    measured = replace(GOOD_DRAFTER, temperature=1.0)  # a prior measured sampling: no wait
    flat = AutoTree(synthetic(lambda n: 0.010), candidate_trees(True), GOOD_DRAFTER, measured)
    assert flat.choose(1, temperature=1.0).beam_width


def test_sampled_steps_start_from_the_table_measured_at_their_temperature():
    """The drafter's table measured sampling (here at 1.0) is the sampled steps'
    prior; below that temperature it is mixed with the greedy table in proportion."""
    weak = replace(weakened(GOOD_DRAFTER, 0.3), temperature=1.0)
    curve = synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1)))
    auto = AutoTree(curve, candidate_trees(True), GOOD_DRAFTER, weak)
    assert auto.choose(1) != PLAIN_DECODING
    assert auto.choose(2, temperature=1.0) == PLAIN_DECODING  # the weak table's view
    greedy, sampled = (prior_cube(t, 8, 4, DEPTH) for t in (GOOD_DRAFTER, weak))
    with pytest.raises(ValueError, match="measured sampling"):
        AutoTree(curve, candidate_trees(True), GOOD_DRAFTER, GOOD_DRAFTER)  # a greedy table
    at_one = auto.estimates[1].survival(auto.prior(1.0)[0])
    assert at_one[0, 1, 0, 0] == pytest.approx(sampled[1, 0, 0])
    half = (greedy[1, 0, 0] + sampled[1, 0, 0]) / 2  # at 0.25: a share of √0.25
    rate, _ = auto.prior(0.25)
    assert auto.estimates[1].survival(rate)[0, 1, 0, 0] == pytest.approx(half)
    assert auto.estimates[0].survival()[0, 1, 0, 0] == pytest.approx(greedy[1, 0, 0])


def test_a_tree_whose_steps_cost_more_than_other_trees_gives_way():
    """Another tree's steps cost what the calibration says, the chosen tree's three
    times that: its own factor stands apart from the others' and it gives way."""
    auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.02 * (n - 1))))
    slow = auto.choose(1)
    other = TreeConfig(1, 2)
    assert slow not in (PLAIN_DECODING, other)
    index = auto._index[slow]
    ran = {other}  # trees the session has run, as it tells `built`
    for step in range(8):
        runs = np.full((1, other.num_branches), 1)
        seconds = float(auto.calibrated(1, 0)[auto._index[other]])
        auto.record(StepRecord(other, 1, seconds, runs, 0, built=step == 0))
    for _ in range(40):
        tree = auto.choose(1)
        runs = np.full((1, tree.num_branches), tree.depth - 1)  # everything accepted
        seconds = float(auto.calibrated(1, 0)[auto._index[tree]])
        built = tree not in ran
        ran.add(tree)
        auto.record(StepRecord(tree, 1, 3 * seconds if tree == slow else seconds, runs, 0, built))
    # Its first step (building its functions) taught nothing, the others its cost: at
    # most `STEP_SPAN` a step, enough after two steps to give way.
    assert auto.measured.own[index] > 1.5 and auto.factor[index] > 1.2
    assert auto.entry == 0 and auto.choose(1) != slow


def test_the_first_tree_step_after_plain_ones_teaches_the_switch_not_the_tree():
    """A stint's first step drafts what later steps had prefetched: its extra time is
    learned as the switch's cost (`entry`, paid by `switch_seconds`), and the tree's
    own cost is learned from the steps after it. The tree's first step in the
    session (told as built: it may build its functions) teaches neither."""
    auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1))))
    tree = auto.choose(1)
    index = auto._index[tree]
    runs = np.full((1, tree.num_branches), tree.depth - 1)
    predicted, plain = (float(auto.calibrated(1, 0)[i]) for i in (index, 0))
    none = np.zeros((1, 0), dtype=int)
    assert auto.switch_seconds(1, 0) == 0.0  # plain_share 1, nothing measured yet
    for stint in range(40):
        auto.record(StepRecord(PLAIN_DECODING, 1, plain, none, 0))
        for k in range(4):
            extra = (0.200 if stint == 0 else 0.015) if k == 0 else 0.0
            auto.record(StepRecord(tree, 1, predicted + extra, runs, 0, built=stint == k == 0))
        if stint == 0:
            assert auto.entry == 0.0 and auto.factor[index] == pytest.approx(1.0)
    assert auto.entry == pytest.approx(0.015, rel=0.05)
    assert auto.factor[index] == pytest.approx(1.0, abs=0.01)
    assert abs(auto.overhead[1]) < 1e-3
    assert auto.switch_seconds(1, 0) == pytest.approx(0.015, rel=0.05)


def test_sessions_of_a_model_share_measured_step_costs_but_not_acceptance(monkeypatch):
    """A session per request (as `generate` makes) starts from the step costs earlier
    ones measured on this model, drafter and machine; acceptance follows each
    request's own text. Another model starts afresh; a model keeps the costs of
    decoding without a drafter beside those of its latest drafter (as `bench
    --also-no-drafter` alternates them), and they go when the model goes."""
    import gc

    from tiny_models import tiny_model

    from mlx_redrafter import auto as auto_module

    curve = synthetic(lambda n: 0.010 * (1 + 0.02 * (n - 1)))
    monkeypatch.setattr(auto_module, "cached_calibration", lambda *args, **kwargs: (curve, None))
    model, other = tiny_model("llama"), tiny_model("llama")
    first = AutoTree.for_model(model, None)
    tree = first.choose(1)
    index = first._index[tree]
    runs = np.full((1, tree.num_branches), tree.depth - 1)
    seconds = float(first.calibrated(1, 0)[index])
    for _ in range(12):
        first.record(StepRecord(tree, 1, 2 * seconds, runs, 0))
    assert first.factor[index] > 1.1 and first.estimates[0].alone.reached.sum() > 0
    second = AutoTree.for_model(model, None)
    assert second.factor[index] == first.factor[index]
    assert second.overhead[1] == first.overhead[1] > 0
    assert second.estimates[0].alone.reached.sum() == 0  # its own text's acceptance
    assert AutoTree.for_model(other, None).factor[index] == 1.0
    drafter = Drafter.create(model)
    with_drafter = AutoTree.for_model(model, drafter)
    assert np.all(with_drafter.factor == 1.0) and with_drafter.overhead[1] == 0.0
    with_drafter.measured.entry = 0.5
    assert AutoTree.for_model(model, None).factor[index] == first.factor[index]
    assert AutoTree.for_model(model, drafter).entry == 0.5
    identity = id(model)
    del model, first, second, with_drafter
    gc.collect()
    assert not any(key[0] == identity for key in auto_module._MEASURED)


def test_the_switch_from_plain_decoding_is_spread_over_the_stints_measured():
    """Leaving plain decoding costs the stint of trees its unpipelined neighbours and
    its first step's draft, once per stint: spread over the `every` steps a tree
    runs at least until stints have been measured, then over their running mean."""
    auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1))))
    tree = auto.choose(1)
    runs = np.full((1, tree.num_branches), tree.depth - 1)
    none = np.zeros((1, 0), dtype=int)
    assert auto.measured.stint is None
    for length in (20, 10):
        auto.record(StepRecord(PLAIN_DECODING, 1, 0.010, none, 0))
        for _ in range(length):
            auto.record(StepRecord(tree, 1, 0.012, runs, 0))
    assert auto.measured.stint == 20  # the second stint has not ended yet
    auto.record(StepRecord(PLAIN_DECODING, 1, 0.010, none, 0))
    assert auto.measured.stint == pytest.approx(20 + 0.2 * (10 - 20))
    # A switch that costs 20 steps' worth: not worth it for a stint of 4 steps, worth
    # it for stints of 400.
    short, long = (auto_tree(synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1)))) for _ in "ab")
    for auto, stint in ((short, None), (long, 400.0)):
        auto.measured.entry, auto.measured.stint = 0.2, stint
    assert short.choose(1) == PLAIN_DECODING and long.choose(1) != PLAIN_DECODING


def test_measured_step_times_beyond_the_curve_count_as_overhead():
    auto = auto_tree(synthetic(lambda n: 0.010))
    tree = auto.choose(1)
    for _ in range(100):
        auto.record(StepRecord(tree, 1, 0.030, np.zeros((1, tree.num_branches), dtype=int), 0))
    # Priced a little nearer the calibration than measured (shrunk by 4 steps' worth).
    assert auto.overhead[1] == pytest.approx(0.020, rel=0.1)
    assert auto.overhead[0] == 0.0  # a tree's host work is not charged to plain steps
    # Plain steps that look ahead alternate long and short: their average counts.
    for seconds in [0.022, 0.002] * 200:
        auto.record(StepRecord(PLAIN_DECODING, 1, seconds, np.zeros((1, 0), dtype=int), 0))
    assert auto.overhead[0] == pytest.approx(0.002, abs=0.001)
    assert auto.factor[0] == 1.0
    # 400 steps later the trees' overhead has faded back toward the calibration's.
    assert 0.0 < auto.overhead[1] < 0.005


def test_a_stalled_step_moves_the_price_of_trees_by_a_fraction_of_a_step(monkeypatch):
    """Steps cost 2 ms beyond an 80 ms calibration, and the machine stalls some of
    them for 300 ms (another process, a page fault): one later tree step in eight, one
    stint's first step in four, one plain step in ten. The tree steps' overhead stays
    under 12 ms (a running mean of all of them learns over 30), the tree's factor near
    1, the switch's extra under 8 ms and plain steps' overhead (clipped at a whole
    step) under 10 ms, so a stall does not turn the session plain. A tree step that
    lastingly costs 20 ms more is still learned within 40 steps."""
    from mlx_redrafter import auto as auto_module

    def learned(stall: float, extra: float, steps: int) -> tuple[float, ...]:
        auto = auto_tree(synthetic(lambda n: 0.080 * (1 + 0.01 * (n - 1))))
        tree = auto.choose(1)
        index, none = auto._index[tree], np.zeros((1, 0), dtype=int)
        runs = np.full((1, tree.num_branches), 1)
        predicted, plain = (float(auto.calibrated(1, 0)[i]) for i in (index, 0))
        for k in range(steps):  # stints of 5 tree steps between plain steps
            if k % 5 == 0:  # one plain step in ten stalls
                seconds = plain + extra + (stall if k % 50 == 0 else 0.0)
                auto.record(StepRecord(PLAIN_DECODING, 1, seconds, none, 0))
            # One stint's first step in four stalls, and one later tree step in eight.
            stalled = k % 20 == 0 or k % 10 == 7
            seconds = predicted + extra + (stall if stalled else 0.0)
            auto.record(StepRecord(tree, 1, seconds, runs, 0))
        excess = auto.measured.excess
        return excess[1], auto.measured.own[index] - 1, auto.entry, excess[0]

    tree, factor, entry, plain = learned(0.300, 0.002, 200)
    assert tree < 0.012 and abs(factor) < 0.05 and entry < 0.008 and plain < 0.010
    assert learned(0.0, 0.020, 40)[0] == pytest.approx(0.020, rel=0.05)
    monkeypatch.setattr(auto_module, "STEP_SPAN", np.inf)  # running means, unclipped
    tree, _, entry, _ = learned(0.300, 0.002, 200)
    assert tree > 0.030 and entry > 0.012


def test_steps_that_built_functions_teach_acceptance_and_no_cost():
    """A step the session tells as `built` ran some tree's functions for the first
    time (a plain step's look-ahead, a tree's first step, a new probe tree): its
    seconds of tracing and compiling are no step's cost, and would price what ran
    them dear for as long as something else wins. Its runs still teach acceptance."""
    auto = auto_tree(synthetic(lambda n: 0.010))
    tree = auto.choose(1)
    runs, none = np.full((1, tree.num_branches), 1), np.zeros((1, 0), dtype=int)
    auto.record(StepRecord(PLAIN_DECODING, 1, 0.5, none, 0, built=True))
    auto.record(StepRecord(PLAIN_DECODING, 1, 0.010, none, 0))
    before = auto.acceptance.survival().copy()
    auto.record(StepRecord(tree, 1, 3.0, runs, 0, built=True))
    auto.record(StepRecord(PLAIN_DECODING, 1, 0.9, none, 0, built=True))
    # One plain step learned (its excess 0), faded by the two steps after it.
    assert auto.overhead[0] == 0.0 and auto.measured.excess_steps[0] == pytest.approx(STEP_FADE**2)
    assert auto.entry == 0.0 and auto.overhead[1] == 0.0
    assert not np.allclose(auto.acceptance.survival(), before)
    auto.record(StepRecord(PLAIN_DECODING, 1, 0.014, none, 0))
    assert auto.overhead[0] > 0.0


def test_the_switchs_extra_is_learned_against_what_tree_steps_measure():
    """Tree steps cost 20 ms beyond the calibration and a stint's first step 15 ms
    more. Long plain stretches fade the tree steps' price toward the calibration,
    yet a stint's first step is compared with what tree steps measure: its extra
    is the 15 ms, not 35 (which every later switch would pay)."""
    auto = auto_tree(synthetic(lambda n: 0.010))
    tree = auto.choose(1)
    predicted = float(auto.calibrated(1, 0)[auto._index[tree]])
    runs, none = np.full((1, tree.num_branches), 1), np.zeros((1, 0), dtype=int)
    for _ in range(30):
        for _ in range(300):
            auto.record(StepRecord(PLAIN_DECODING, 1, 0.010, none, 0))
        for k in range(20):
            auto.record(
                StepRecord(tree, 1, predicted + 0.020 + (0.015 if k == 0 else 0.0), runs, 0)
            )
    assert auto.entry == pytest.approx(0.015, rel=0.05)


def test_trees_priced_in_a_slow_spell_are_tried_again_once_plain_steps_have_run():
    """Tree steps four times as slow as calibrated turn the session plain; as plain
    steps run at their calibrated cost, what the slow steps taught fades until a
    tree is tried again (and found slow again). Nothing else could lower their
    price, since no tree step runs."""
    auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.05 * (n - 1))))

    def decode(steps: int) -> list[TreeConfig]:
        chosen = []
        for _ in range(steps):
            tree = auto.choose(1)
            index = auto._index[tree]
            seconds = float(auto.calibrated(1, 0)[index])
            if tree == PLAIN_DECODING:
                auto.record(StepRecord(tree, 1, seconds, np.zeros((1, 0), dtype=int), 0))
            else:  # one drafted token accepted
                auto.record(
                    StepRecord(tree, 1, 4.0 * seconds, np.full((1, tree.num_branches), 1), 0)
                )
            chosen.append(tree)
        return chosen

    spell = decode(40)
    assert spell[0] != PLAIN_DECODING and spell[-1] == PLAIN_DECODING
    after = decode(600)
    assert after[0] == PLAIN_DECODING and any(t != PLAIN_DECODING for t in after)


# -- sessions ----------------------------------------------------------------------------


@pytest.fixture
def calibration_folder(tmp_path, monkeypatch):
    folder = tmp_path / "calibration"
    monkeypatch.setattr(calibrate_module, "calibration_folder", lambda: folder)
    return folder


def test_the_default_session_without_a_drafter_speculates_with_lookup(
    trained_llama, calibration_folder
):
    model, _, prompts = trained_llama
    session = DecodingSession(model, None)
    assert session.speculates and "lookup" in session.describe()
    # A prompt that repeats itself: the lookup branches copy it, losslessly.
    prompt = (prompts[0] * 6)[:40]
    updates = list(session.run([Request(prompt, stop=StopConfig(40))]))
    assert [t for u in updates for t in u.tokens] == mlx_lm_greedy(model, prompt, 40)
    assert any(u.tree.lookup_branches for u in updates)


class OnTheCurve(AutoTree):
    """An auto tree that takes every step to cost what its calibration predicts (so
    that a synthetic curve holds whatever this machine's real step times are)."""

    def record(self, step):
        index = self._index[step.tree]
        predicted = float(self.calibrated(step.batch_size, step.context)[index])
        super().record(replace(step, seconds=predicted))


def test_a_session_turns_lookup_on_from_what_it_sees_in_hindsight(trained_llama):
    model, _, prompts = trained_llama
    # A curve on which the prior alone keeps plain decoding.
    curve = synthetic(lambda n: 0.010 * (1 + 0.2 * (n - 1)))
    auto = OnTheCurve(curve, candidate_trees(False), LOOKUP_PRIOR)
    session = DecodingSession(model, None, tree=auto)
    prompt = (prompts[0] * 6)[:40]
    updates = list(session.run([Request(prompt, stop=StopConfig(60))]))
    assert [t for u in updates for t in u.tokens] == mlx_lm_greedy(model, prompt, 60)
    assert updates[0].tree == PLAIN_DECODING
    assert any(u.tree.lookup_branches for u in updates)


class Checked(OnTheCurve):
    """`OnTheCurve` that keeps the runs its hindsight checks report."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checked = []

    def record_hindsight(self, runs, lookup_tree):
        self.checked.append(runs)
        super().record_hindsight(runs, lookup_tree)


def test_a_hindsight_check_covers_every_step_since_the_last(trained_llama):
    """Decoding plainly, each check reports the branches of every step since the
    last check, as drafted at that step's start: together, one row per plain step
    whose Ll - 1 following tokens have come, equal to `hindsight_runs` there."""
    model, _, prompts = trained_llama
    curve = synthetic(lambda n: 0.010 * (1 + 3.0 * (n - 1)))  # lookup never pays
    auto = Checked(curve, candidate_trees(False), LOOKUP_PRIOR)
    prompt = (prompts[0] * 6)[:40]
    updates = list(
        DecodingSession(model, None, tree=auto).run([Request(prompt, stop=StopConfig(60))])
    )
    assert all(u.tree == PLAIN_DECODING for u in updates)
    runs = np.concatenate(auto.checked)  # (M, G) in step order
    text = prompt + [t for u in updates for t in u.tokens]
    span = auto._hindsight.lookup_branch_length - 1
    assert len(auto.checked) >= 10 and 60 - span - 4 <= len(runs) <= 60 - span + 1
    starts = len(prompt) + np.arange(len(runs))  # history lengths at each step's start
    expected = hindsight_runs(
        mx.array([text] * len(runs)), mx.array(starts + span), 4, span + 1, 3
    )  # (M, G)
    assert runs.tolist() == np.array(expected).tolist()
    assert runs.max() > 0


class Probed(OnTheCurve):
    """`OnTheCurve` that keeps the runs its drafter probes report."""

    def __init__(self, *args, probing: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.probing, self.probe_runs = probing, []

    def probe(self, tree):
        return super().probe(tree) if self.probing else None

    def record_probe(self, runs, probe_tree):
        self.probe_runs.append(runs)
        super().record_probe(runs, probe_tree)


def test_a_session_turns_the_drafter_back_on_from_what_its_probes_guess(trained_llama):
    """A session whose estimate was driven down decodes plainly; its probes draft
    beams without verifying them, find that they guess the text, and a drafter tree
    comes back sooner than without probes; output identical to mlx-lm's."""
    model, drafter, prompts = trained_llama
    curve = synthetic(lambda n: 0.010 * (1 + 0.1 * (n - 1)))
    first_drafted = {}
    for probing in (True, False):
        auto = Probed(curve, candidate_trees(True), GOOD_DRAFTER, probing=probing)
        steps_where_nothing_is_accepted(auto, in_hindsight=True)
        session = DecodingSession(model, drafter, tree=auto)
        updates = list(session.run([Request(prompts[0], stop=StopConfig(40))]))
        assert [t for u in updates for t in u.tokens] == mlx_lm_greedy(model, prompts[0], 40)
        assert updates[0].tree == PLAIN_DECODING
        drafted = [i for i, u in enumerate(updates) if u.tree.beam_width and u.tree.beam_length > 1]
        first_drafted[probing] = drafted[0] if drafted else len(updates)
        if probing:
            assert auto.probe_runs and max(int(r.max()) for r in auto.probe_runs) >= 2
    assert first_drafted[True] < first_drafted[False]


def test_the_auto_tree_is_lossless_with_a_drafter(trained_llama, calibration_folder):
    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter, tree="auto")
    for prompt in prompts[:4]:
        tokens = [t for u in session.run([Request(prompt, stop=StopConfig(30))]) for t in u.tokens]
        assert tokens == mlx_lm_greedy(model, prompt, 30)


# -- calibration -------------------------------------------------------------------------


def test_calibration_is_cached_and_measured_again_when_a_key_changes(
    trained_llama, calibration_folder, monkeypatch
):
    model, drafter, _ = trained_llama
    first, measured = cached_calibration(model, drafter)
    assert measured and 2 <= len(first.verify[0]) <= len(SIZES)  # the sweep may stop early
    assert all(seconds > 0 for row in first.verify for seconds in row)
    assert "drafter W=1" in format_calibration(first)
    again, measured = cached_calibration(model, drafter)
    assert not measured and again == first
    # Another device, another MLX version, other engine code, no drafter: each
    # measures again.
    monkeypatch.setattr(calibrate_module, "device_name", lambda: "gpu:Apple M9")
    _, measured = cached_calibration(model, drafter)
    assert measured
    monkeypatch.setattr(calibrate_module.mx, "__version__", "99.0", raising=False)
    _, measured = cached_calibration(model, drafter)
    assert measured
    monkeypatch.setattr(calibrate_module, "engine_digest", lambda: "0123456789abcdef")
    _, measured = cached_calibration(model, drafter)
    assert measured
    _, measured = cached_calibration(model, None)
    assert measured
    assert len(list(calibration_folder.glob("*.json"))) == 5


def test_the_engine_digest_changes_with_the_engine_code(tmp_path, monkeypatch):
    """The calibration key's engine digest covers the package's modules: an edited
    module gives another digest."""
    package = tmp_path / "pkg"
    (package / "kernels").mkdir(parents=True)
    (package / "target.py").write_text("x = 1\n")
    (package / "kernels" / "metal.py").write_text("y = 1\n")
    monkeypatch.setattr(calibrate_module, "__file__", str(package / "calibrate.py"))
    calibrate_module.engine_digest.cache_clear()
    try:
        before = calibrate_module.engine_digest()
        calibrate_module.engine_digest.cache_clear()
        (package / "kernels" / "metal.py").write_text("y = 2\n")
        assert calibrate_module.engine_digest() != before
    finally:
        calibrate_module.engine_digest.cache_clear()


def test_new_weights_or_a_broken_file_measure_again(calibration_folder):
    from tiny_models import tiny_model

    model = tiny_model("llama")
    first, _ = cached_calibration(model)
    model.update({"model": {"embed_tokens": {"weight": model.model.embed_tokens.weight + 1}}})
    second, measured = cached_calibration(model)
    assert measured and second.key.model != first.key.model
    path = calibration_folder / f"{second.key.digest}.json"
    path.write_text("{ not json")
    _, measured = cached_calibration(model)
    assert measured and json.loads(path.read_text())["key"] == second.to_dict()["key"]


def test_interpolation_and_extrapolation_of_the_curve():
    calibration = Calibration(KEY, (1, 2, 4), (100, 300), ((1.0, 2.0, 4.0), (3.0, 4.0, 6.0)))
    assert calibration.verify_seconds(np.array([3]), 100).tolist() == [3.0]
    assert calibration.verify_seconds(np.array([8]), 100).tolist() == [8.0]  # past N=4
    assert calibration.verify_seconds(np.array([1]), 200).tolist() == [2.0]  # between bands
    falling = Calibration(KEY, (1, 2, 4), (100,), ((1.0, 3.0, 2.0),))  # noise at N = 4
    assert falling.verify_seconds(np.array([8]), 100).tolist() == [4.0]  # proportional: 2 x 8/4


def test_the_sweep_stops_where_no_larger_tree_can_pay():
    """Linear verification (quantized weights on a CPU) stops the sweep once N costs more
    than a step can emit tokens; the largest trees of that linear curve still lose to
    plain decoding when extrapolated, and a flat curve is measured to the end."""
    asked: list[int] = []

    def linear(size: int) -> float:
        asked.append(size)
        return 0.01 * size

    measured = sweep(SIZES, linear, ceiling=DEPTH + 1)
    assert asked == [1, 2, 3, 4, 6, 8, 12]  # 12 > 10: nothing larger is timed
    assert len(measured) == len(asked)
    sizes = SIZES[: len(measured)]
    truncated = Calibration(KEY, sizes, (256,), (measured,), lookup=0.0)
    assert truncated.verify_seconds(np.array([64]), 256).tolist() == pytest.approx([0.64])
    tree = AutoTree(truncated, candidate_trees(True), GOOD_DRAFTER).choose(1)
    assert tree == PLAIN_DECODING
    assert len(sweep(SIZES, lambda size: 0.01 + 0.0001 * size, ceiling=DEPTH + 1)) == len(SIZES)


def _is_convex_and_rising(sizes, curve) -> bool:
    slopes = np.diff(curve) / np.diff(np.asarray(sizes, dtype=float))
    return bool(np.all(slopes >= -1e-9) and np.all(np.diff(slopes) >= -1e-9))


def _exact_convex_fit(sizes, values) -> np.ndarray:
    """The same weighted least-squares problem (relative errors) solved by trying
    every set of nonzero hinges."""
    x, y = np.asarray(sizes, dtype=float), np.asarray(values, dtype=float)
    hinges = np.maximum(x[:, None] - x[None, :-1], 0.0)
    best, best_error = None, np.inf
    for subset in range(1 << hinges.shape[1]):
        chosen = [j for j in range(hinges.shape[1]) if subset >> j & 1]
        design = np.concatenate([np.ones((len(x), 1)), hinges[:, chosen]], axis=1)
        weights = np.linalg.lstsq(design / y[:, None], np.ones_like(y), rcond=None)[0]
        if np.any(weights[1:] < -1e-12):
            continue
        error = float(np.sum((design @ weights / y - 1.0) ** 2))
        if error < best_error:
            best, best_error = design @ weights, error
    return best


def test_the_calibrated_curve_is_the_nearest_rising_convex_one():
    """A verification cost never falls with N and its growth never slows: the fit
    keeps a curve of that shape, and otherwise finds the nearest one (checked against
    trying every set of hinges)."""
    flat_then_linear = [20.0 + 0.8 * max(0, n - 16) for n in SIZES]
    assert smooth_curves(SIZES, [flat_then_linear])[0] == pytest.approx(flat_then_linear)
    rng = np.random.default_rng(0)
    sizes = SIZES[:7]
    for _ in range(20):
        values = 40.0 + 4.0 * np.asarray(sizes) + rng.normal(0.0, 6.0, len(sizes))
        fitted = convex_fit(sizes, values)
        assert _is_convex_and_rising(sizes, fitted)
        assert fitted == pytest.approx(_exact_convex_fit(sizes, values), abs=1e-6)
    falling = smooth_curves((1, 2, 3), [(3.0, 2.0, 1.0)])[0]
    assert np.ptp(falling) == pytest.approx(0.0, abs=1e-12)
    assert 1.0 <= falling[0] <= 3.0


def test_a_timing_spike_no_longer_prices_one_tree_size_out():
    """One slow timing (N = 8 here, +25 %) is pulled back to its neighbours; over many
    noisy measurements the cost of one tree size relative to another (what the
    choice compares) varies far less than in the raw timings."""
    truth = np.array([50.0 + 4.0 * (n - 1) for n in SIZES])
    spiked = truth.copy()
    spiked[SIZES.index(8)] *= 1.25
    fitted = np.array(smooth_curves(SIZES, [spiked])[0])
    assert abs(fitted[SIZES.index(8)] - truth[SIZES.index(8)]) < 0.3 * 0.25 * truth[SIZES.index(8)]
    rng = np.random.default_rng(1)
    eight, six, two = SIZES.index(8), SIZES.index(6), SIZES.index(2)
    raw, fit = [], []  # (cost(8) / cost(6), cost(8) / cost(2)) per measurement
    for _ in range(50):
        timed = truth * (1.0 + np.abs(rng.normal(0.0, 0.08, len(SIZES))))  # slow spells only
        fitted = np.array(smooth_curves(SIZES, [timed])[0])
        raw.append((timed[eight] / timed[six], timed[eight] / timed[two]))
        fit.append((fitted[eight] / fitted[six], fitted[eight] / fitted[two]))
    neighbours, smallest = np.std(fit, axis=0) / np.std(raw, axis=0)
    assert neighbours < 0.2 and smallest < 0.6


def test_the_one_token_forward_keeps_its_own_time():
    """N = 1 is what plain decoding runs (and may take a faster path than any tree):
    it keeps its timing in every band, at most the fitted N = 2's, and the larger N
    are fitted without it. The first curve is the default model's as this 2-core CPU
    once timed it (ms), with N = 1 well below the rest."""
    timed = [41.9, 57.6, 57.6, 57.6, 62.6, 83.1, 95.4, 108.5, 158.3, 189.4, 256.9, 320.4]
    longer = [53.3, 58.6, 71.7, 71.7, 81.5, 99.1, 127.4, 158.8, 222.3, 295.6, 410.5, 500.8]
    first, second = smooth_curves(SIZES, [timed, longer])
    assert first[0] == 41.9 and second[0] == 53.3
    assert first[1:3] == pytest.approx((57.6, 57.6), abs=0.5)
    assert _is_convex_and_rising(SIZES[1:], first[1:])
    assert _is_convex_and_rising(SIZES[1:], second[1:])
    slow_one = [70.0] + [50.0 + 4.0 * n for n in SIZES[1:]]
    fitted = smooth_curves(SIZES, [slow_one])[0]
    assert fitted[0] == pytest.approx(fitted[1]) and fitted[1] == pytest.approx(58.0)


def test_a_calibration_keeps_its_timings_beside_the_fitted_curve(tmp_path):
    """The fitted curve and the timings it was fitted to both survive the JSON round
    trip, and the table prints both."""
    calibration = replace(synthetic(lambda n: 0.01 + 0.001 * n), timed=((0.02,) * len(SIZES),))
    again = Calibration.from_dict(json.loads(json.dumps(calibration.to_dict())))
    assert again == calibration
    table = format_calibration(calibration)
    assert "timed" in table and "20.00" in table


def test_the_prefill_chunk_fits_the_latency_from_the_calibrated_cost():
    """1 ms per token (extrapolated past the largest N measured): 0.5 s takes 448
    tokens, a cheaper device takes more, and a tiny budget still takes 64."""
    per_token = synthetic(lambda n: 0.001 * n)
    assert prefill_chunk(per_token, 0.5) == 448  # 500 tokens fit: 7 x 64
    assert prefill_chunk(synthetic(lambda n: 0.0001 * n), 0.5) == 4992
    assert prefill_chunk(per_token, 0.001) == 64
    # A curve whose last points fall (noise) still grows with N beyond them, at least
    # proportionally: wide trees and large batches do not look free.
    noisy = synthetic(lambda n: 0.1 if n < 64 else 0.09)
    assert prefill_chunk(noisy, 0.5) == 320  # 0.09 s x N / 64 <= 0.5 s


def test_a_longer_context_never_costs_less_than_a_shorter_one():
    """Bands capped by a small model's positions (256, 448 here), the longer one timed
    cheaper by noise: a context past both costs what the shorter band does, not a
    cost extrapolated towards zero (which made any prefill chunk look free)."""
    cheaper = tuple(0.0008 * n for n in SIZES)  # the 448 band, below the 256 band's
    bands = replace(synthetic(lambda n: 0.001 * n), contexts=(256, 448))
    bands = replace(bands, verify=(bands.verify[0], cheaper))
    sizes = np.array([1, 16, 64, 512])
    assert bands.verify_seconds(sizes, 1024) == pytest.approx(0.001 * sizes)
    assert bands.verify_seconds(sizes, 256) == pytest.approx(0.001 * sizes)
    assert prefill_chunk(bands, 1e-6) == 64


# -- acceptance tables ---------------------------------------------------------------------


def test_survival_of_runs():
    runs = [[0, 2], [1, 0], [3, 3]]
    assert survival(runs, 3) == (
        (2 / 3, 1 / 3, 1 / 3),  # the first candidate alone
        (1.0, 2 / 3, 1 / 3),  # the best of both
    )


def test_a_drafter_keeps_its_acceptance_table(trained_llama, tmp_path, calibration_folder):
    _, drafter, _ = trained_llama
    table = AcceptanceTable(beams=((0.5, 0.2),), lookup=((0.3,),), steps=10, source="test")
    sampled = replace(table, beams=((0.3, 0.1),), temperature=1.0)
    drafter.acceptance, drafter.sampled_acceptance = table, sampled
    try:
        drafter.save(tmp_path / "d")
    finally:
        drafter.acceptance = drafter.sampled_acceptance = None
    loaded = Drafter.load(tmp_path / "d")
    assert (loaded.acceptance, loaded.sampled_acceptance) == (table, sampled)
    auto = AutoTree.for_model(trained_llama[0], loaded)
    rate, _ = auto.prior(1.0)  # the sampled steps' prior: the sampled table
    assert auto.estimates[1].survival(rate)[0, 1, 0, 0] == pytest.approx(0.3)
    assert auto.estimates[0].survival()[0, 1, 0, 0] == pytest.approx(0.5)
    # A folder whose only table was measured sampling, kept as acceptance.json (as
    # measure-acceptance --write once wrote it), still loads: as the sampled table.
    folder = tmp_path / "d"
    sampled_text = (folder / "acceptance-sampled.json").read_text()
    (folder / "acceptance-sampled.json").unlink()
    (folder / "acceptance.json").write_text(sampled_text)
    loaded = Drafter.load(folder)
    assert (loaded.acceptance, loaded.sampled_acceptance) == (None, sampled)
    (folder / "acceptance.json").write_text('{"beams": [[1.5]]}')
    with pytest.raises(DrafterError, match="acceptance.json is not a valid acceptance table"):
        Drafter.load(folder)
    loaded.acceptance = sampled  # measured sampling: not the greedy table
    with pytest.raises(ValueError, match="measured greedily"):
        loaded.save(tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_measured_acceptance_decays_with_depth_and_grows_with_width(trained_llama):
    model, drafter, prompts = trained_llama
    table = measure_acceptance(
        model, drafter, prompts[:6], tree=TreeConfig(3, 4, lookup_branches=2), max_tokens=24
    )
    assert table.steps > 0 and len(table.beams) == 3 and len(table.lookup) == 2
    assert len(table.joint) == 4 and len(table.joint[0]) == 3  # k = 0..3, g = 0..2
    assert table.joint[1][0] == table.beams[0][:3] and table.joint[0][2] == table.lookup[1][:3]
    assert all(u >= b for u, b in zip(table.joint[3][2], table.beams[2]))
    for rows in (table.beams, table.lookup):
        for row in rows:
            assert list(row) == sorted(row, reverse=True)
        for narrow, wide in zip(rows, rows[1:]):
            assert all(w >= n for n, w in zip(narrow, wide))
    assert table.beams[0][0] > 0.3  # the trained drafter is often right
    # The same replies with beams of 2 and 3 tokens: a table of each, beams and joint.
    assert [t.beam_length for t in table.by_length] == [2, 3]
    for shorter in table.by_length:
        assert shorter.steps > 0 and not shorter.lookup and len(shorter.beams) == 3
        assert len(shorter.joint) == 4 and len(shorter.joint[1][0]) == shorter.beam_length - 1
    # The branches once more without beams: what the tree's lookup-only self accepts.
    alone = measure_acceptance(
        model,
        drafter,
        prompts[:6],
        tree=TreeConfig(0, 1, lookup_branches=2, lookup_length=4),
        max_tokens=24,
    )
    assert not alone.alone and table.alone == alone.lookup and len(table.alone) == 2
    assert AcceptanceTable.from_dict(table.to_dict()) == table
    # A dynamic tree's cut beams would undercount: refused before decoding anything.
    for cut in (TreeConfig.parse("8x7@20"), TreeConfig(8, 7, tree_budget=20)):
        with pytest.raises(ValueError, match="full tree, not 8x7.* with a node budget"):
            measure_acceptance(model, drafter, prompts[:1], tree=cut)
    with pytest.raises(ValueError, match="without a drafter only lookup branches"):
        measure_acceptance(model, None, prompts[:1], tree=TreeConfig(8, 7))


def test_the_shipped_priors_are_valid_tables():
    from mlx_redrafter.loading import DEFAULT_DRAFTER

    shipped = Drafter.load(DEFAULT_DRAFTER)
    tables = (LOOKUP_PRIOR, LOOKUP_SAMPLED, DRAFTER_PRIOR)
    for prior in (*tables, shipped.acceptance, shipped.sampled_acceptance):
        assert prior is not None
        assert AcceptanceTable.from_dict(prior.to_dict()) == prior
        for row in prior.beams + prior.lookup:
            assert list(row) == sorted(row, reverse=True)
    # Sampling accepts less than greedy decoding, at every depth.
    pairs = ((LOOKUP_PRIOR, LOOKUP_SAMPLED), (shipped.acceptance, shipped.sampled_acceptance))
    for greedy, sampled in pairs:
        assert greedy is not None and sampled is not None and sampled.temperature == 1.0
        for kind in ("beams", "lookup"):
            for low, high in zip(getattr(sampled, kind), getattr(greedy, kind)):
                assert all(a < b for a, b in zip(low, high))


def test_runs_of_the_acceptance_walk():
    from mlx_redrafter.accept import accept
    from mlx_redrafter.tree import pack_tree

    beams = mx.array([[[5, 1, 2, 3], [5, 1, 4, 0], [5, 7, 7, 7]]])  # (1, 3, 4)
    tree = pack_tree(beams, 1 + 3 * 3)
    # The target continues 5 -> 1 -> 2 -> 9: beam 0 runs 2, beam 1 runs 1, beam 2 none.
    next_token = {(5,): 1, (5, 1): 2, (5, 1, 2): 9}
    choices = []
    for n in range(tree.tokens.shape[1]):
        depth = int(tree.depths[0, n])
        path = _prefix(beams, tree, n, depth)
        choices.append(next_token.get(path, 0))
    result = accept(beams, tree.unpack, tree.canonical, mx.array([choices]))
    assert result.runs.tolist() == [[2, 1, 0]] and result.num_accepted.tolist() == [2]


def _prefix(beams, tree, node, depth):
    """The tokens from the root to packed node `node` (found through unpack)."""
    unpack = np.array(tree.unpack[0])
    for w in range(unpack.shape[0]):
        if unpack[w, depth] == node:
            return tuple(int(t) for t in np.array(beams[0, w, : depth + 1]))
    return None  # padding


def test_hindsight_follows_each_row_as_rows_leave_and_join(trained_llama, monkeypatch):
    """In a batch whose rows end at different steps and which a request joins while
    it decodes, every hindsight row is one request's text at one of its own step
    starts: each start is checked once, none before its row's prompt ends, and every
    start whose Ll - 1 following tokens came before the row left is checked."""
    from mlx_redrafter import session as session_module

    searched = []  # (history (M, T), lengths (M,)) of every hindsight search

    def recording(history, lengths, *args):
        searched.append((np.array(history), np.array(lengths)))
        return hindsight_runs(history, lengths, *args)

    monkeypatch.setattr(session_module, "hindsight_runs", recording)
    model, _, prompts = trained_llama
    auto = Checked(
        synthetic(lambda n: 0.010 * (1 + 3.0 * (n - 1))), candidate_trees(False), LOOKUP_PRIOR
    )
    session = DecodingSession(model, None, tree=auto)
    texts = {i: (prompts[i] * 6)[: 30 + 5 * i] for i in range(3)}
    limits = {0: 20, 1: 50, 2: 30}
    session.add([Request(texts[i], stop=StopConfig(limits[i])) for i in (0, 1)], ids=[0, 1])
    made = {i: 0 for i in texts}
    prompt_lengths = {i: len(t) for i, t in texts.items()}
    joined = False
    while session.active:
        if made[1] == 8 and not joined:
            joined = True
            session.add([Request(texts[2], stop=StopConfig(limits[2]))], ids=[2])
        for update in session.step():
            assert update.tree == PLAIN_DECODING  # every step is checked in hindsight
            texts[update.request] = texts[update.request] + update.tokens
            made[update.request] += len(update.tokens)
    assert made == limits
    span = auto._hindsight.lookup_branch_length - 1
    checked = []  # (request, start) of every hindsight row
    for history, lengths in searched:
        for row, length in zip(history, lengths):
            owners = [i for i, t in texts.items() if list(row[:length]) == t[:length]]
            assert len(owners) == 1
            start = int(length) - span
            assert start >= prompt_lengths[owners[0]]
            checked.append((owners[0], start))
    assert len(checked) == len(set(checked))  # no start twice
    for i, limit in limits.items():
        starts = sorted(s for owner, s in checked if owner == i)
        first = prompt_lengths[i]
        assert starts == list(range(first, first + len(starts)))  # none skipped
        assert limit - span - 4 <= len(starts) <= limit - span + 1  # all but the last few


def test_trees_tried_are_not_priced_above_untried_ones_by_a_common_slowdown():
    """Every tree step costs 30 % more than calibrated (a slower spell, host work):
    the tree being run learns it, and the trees not run yet are priced nearly alike,
    a little nearer the calibration (with own factors alone each tried tree would
    look dearer than the untried ones, and the choice would move from tree to
    untried tree). A tree whose own steps keep costing more than the others' still
    stands apart."""
    auto = auto_tree(synthetic(lambda n: 0.010 * (1 + 0.05 * (n - 1))))
    tree = auto.choose(1)
    slow = auto._index[TreeConfig(2, 3)]
    index = auto._index[tree]
    assert tree != PLAIN_DECODING and index != slow
    runs = np.full((1, tree.num_branches), 1)  # one drafted token accepted
    for _ in range(24):
        auto.record(StepRecord(tree, 1, 1.3 * float(auto.calibrated(1, 0)[index]), runs, 0))
    factors = auto.factor
    trees = ~auto.candidates.plain
    others = trees & (np.arange(len(factors)) != index)
    assert factors[index] > 1.01 and np.allclose(factors[others], factors[others][0])
    assert 1.0 + 0.75 * (factors[index] - 1.0) < factors[others][0] < factors[index]
    assert factors[0] == 1.0  # plain decoding learns its overhead alone
    for _ in range(4):
        auto.measured.learn(slow, 3.0, np.inf)
    factors = auto.factor
    untried = trees & (auto.measured.steps == 0)
    assert factors[slow] > 1.5 * factors[index]
    assert np.all((factors[untried] > factors[index]) & (factors[untried] < factors[slow]))
    with pytest.raises(ValueError, match="positive"):
        auto.measured.factors(pool=0)


def test_a_tree_not_run_for_a_while_counts_little_in_the_pooled_factor():
    """Steps fade as other steps are decoded: a tree that ran long ago, in a slow spell,
    neither prices the untried trees nor keeps its own old factor at full weight."""
    measured = MeasuredCosts(3)
    for _ in range(50):
        measured.fade()
        measured.learn(1, 2.0, np.inf)  # long ago, slow
    for _ in range(300):
        measured.fade()
        measured.learn(2, 1.0, np.inf)  # since then, as calibrated
    factors = measured.factors()
    assert factors[0] == pytest.approx(1.0, abs=0.02)
    assert factors[1] < 1.5
