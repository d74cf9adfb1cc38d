"""The auto tree: each step's tree chosen to maximize expected tokens per second.

Shapes: C candidate trees, K candidates of one kind (drafter beams or lookup
branches) ranked best first, D depth (drafted tokens), B batch.

    expected tokens per step  E(tree) = 1 + sum_d P(some candidate accepts >= d tokens)
    step cost                 S(tree) = verify(B * N) + draft(W, L) + lookup + overhead
    choice                    argmax over trees of B * E / S, plain decoding included

The step cost comes from this machine's calibration (`calibrate.py`). Acceptance
starts from a prior (the drafter's own table, measured when it was made, or a
built-in table for lookup branches) and follows the current generation: every
step tells how many tokens each candidate had accepted, and a running estimate
with a short memory replaces the prior where it has seen enough. A tree that stops
paying (text the drafter cannot guess, nothing to copy) gives way to plain
decoding; as the estimate forgets, it is tried again now and then. While no lookup
branches are verified, the estimate still learns theirs in hindsight: every few
steps the session checks, for each step since the last check, what branches
drafted at its start would have had accepted (`lookup.hindsight_runs`, one batched
search), so copying text switches lookup trees on without spending a single
verification on them; and while no drafter beams are verified,
probes draft a few beams without verifying them and compare them with the tokens
decoded since (`probes.py`), so the drafter's estimate follows the text too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import mlx.nn as nn
import numpy as np

from .calibrate import DEPTH, Calibration, cached_calibration
from .config import PLAIN_DECODING, TreeConfig
from .distributed import is_main_process
from .drafter import Drafter
from .metrics import AcceptanceTable
from .per_model import PerModel
from .policy import StepRecord

MAX_PACKED = 64  # N of the largest candidate tree (the calibrated range)
PROBE_LONGEST = 16  # most steps between two drafter probes
# A drafter probe (`probes.py`) drafts 2 beams, of at most 5 tokens: it learns only
# once its rows have decoded L - 1 more tokens.
PROBE_WIDTH, PROBE_MAX_LENGTH = 2, 5
POOL_STEPS = 4.0  # steps' worth of the calibration in each measured cost (`MeasuredCosts`)
STEP_FADE = 0.99  # what a step counts in those costs after another step, plain or not
# Most that one step's time moves a measured cost, as a share of the step's predicted
# cost: its residual against the current estimate is clipped to this (Huber-style).
STEP_SPAN = 0.5

# Lookup branches searched in the row's own text (no drafter): the fraction of steps
# whose best of the first k + 1 branches had d tokens accepted. Measured (greedy,
# 1606 steps) with SmolLM2-135M-Instruct on 24 prompts held out from its drafter's
# training (`mlx-redrafter measure-acceptance --no-drafter`, docs/auto-tree.md).
LOOKUP_PRIOR = AcceptanceTable(
    lookup=(
        (0.177, 0.112, 0.083, 0.062, 0.053, 0.047, 0.042, 0.039, 0.035),
        (0.230, 0.141, 0.102, 0.077, 0.065, 0.056, 0.049, 0.046, 0.040),
        (0.255, 0.166, 0.110, 0.085, 0.071, 0.061, 0.053, 0.050, 0.044),
        (0.265, 0.174, 0.124, 0.095, 0.076, 0.064, 0.055, 0.052, 0.045),
    ),
    steps=1606,
    source="built-in prior: SmolLM2-135M-Instruct, 24 held-out prompts x 128 tokens, 0x1+4x10",
)

# The same, sampling at temperature 1.0 (`--no-drafter --temperature 1.0`, 2495
# steps): the prior of sampled steps, mixed with the greedy one below that
# temperature.
LOOKUP_SAMPLED = AcceptanceTable(
    lookup=(
        (0.088, 0.029, 0.014, 0.008, 0.003, 0.003, 0.001, 0.001, 0.001),
        (0.111, 0.041, 0.021, 0.012, 0.007, 0.006, 0.002, 0.002, 0.002),
        (0.124, 0.048, 0.023, 0.014, 0.007, 0.006, 0.002, 0.002, 0.002),
        (0.130, 0.051, 0.025, 0.016, 0.008, 0.006, 0.002, 0.002, 0.002),
    ),
    temperature=1.0,
    steps=2495,
    source="built-in prior: SmolLM2-135M-Instruct, 24 held-out prompts x 128 tokens, "
    "temperature 1.0, 0x1+4x10",
)

# A drafter without a measured table: a modest guess that the running estimate
# replaces within a few steps.
DRAFTER_PRIOR = AcceptanceTable(
    beams=(
        (0.45, 0.25, 0.14, 0.08, 0.05, 0.03),
        (0.52, 0.30, 0.17, 0.10, 0.06, 0.04),
        (0.56, 0.33, 0.19, 0.11, 0.07, 0.04),
        (0.58, 0.35, 0.20, 0.12, 0.07, 0.05),
    ),
    source="generic prior",
)


# -- candidates --------------------------------------------------------------------


@dataclass(frozen=True)
class Candidates:
    """The trees the auto choice picks from, as arrays over candidates (C,).

    width W (0: no drafter beams), length L, branches G (0: none), branch_length Ll,
    packed N. Index 0 is plain decoding.
    """

    trees: tuple[TreeConfig, ...]
    width: np.ndarray
    length: np.ndarray
    branches: np.ndarray
    branch_length: np.ndarray
    packed: np.ndarray

    @property
    def plain(self) -> np.ndarray:
        """(C,) whether each candidate is plain decoding (the root alone)."""
        return self.packed == 1

    @cached_property
    def beam_lengths(self) -> tuple[int, ...]:
        """The beam lengths of its drafter trees, ascending ((1,) without any): the
        acceptance of drafter beams is kept per beam length, one plane each."""
        return tuple(sorted({int(n) for n in self.length[self.width > 0]})) or (1,)

    @cached_property
    def plane(self) -> np.ndarray:
        """(C,) each candidate's plane of acceptance (`beam_lengths`; trees without
        drafter beams read plane 0, whose lookup cells every plane shares)."""
        return plane_of(self.beam_lengths, self.length)

    @classmethod
    def of(cls, trees: Sequence[TreeConfig]) -> Candidates:
        def column(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64)

        drafted = [t.beam_width if t.beam_length > 1 else 0 for t in trees]
        return cls(
            tuple(trees),
            column(drafted),
            column([t.beam_length if w else 1 for t, w in zip(trees, drafted)]),
            column([t.lookup_branches for t in trees]),
            column([t.lookup_branch_length if t.lookup_branches else 1 for t in trees]),
            column([t.num_packed for t in trees]),
        )


def candidate_trees(
    has_drafter: bool, max_width: int = 8, max_packed: int = MAX_PACKED
) -> Candidates:
    """Plain decoding, lookup-only trees and (with a drafter) drafter trees with and
    without lookup branches, up to `max_packed` packed tokens."""
    trees = [PLAIN_DECODING]
    for count in (1, 2, 4):
        for length in (3, 4, 5, 7, 10):
            trees.append(TreeConfig(0, 1, lookup_branches=count, lookup_length=length))
    if has_drafter:
        for width in (w for w in (1, 2, 3, 4, 6, 8) if w <= max_width):
            for length in range(2, 8):
                trees.append(TreeConfig(width, length))
                for count in (1, 2):
                    for branch in (4, 7, 10):
                        trees.append(
                            TreeConfig(width, length, lookup_branches=count, lookup_length=branch)
                        )
    return Candidates.of([t for t in trees if t.num_packed <= max_packed])


# -- acceptance ----------------------------------------------------------------------


def plane_of(lengths: Sequence[int], length: np.ndarray) -> np.ndarray:
    """(C,) the plane of beams of `length` (C,) tokens among planes of ascending beam
    `lengths` (P,): its own, or the next longer one (the last for longer beams)."""
    index = np.searchsorted(np.asarray(lengths), length)
    return np.minimum(index, len(lengths) - 1)


def _prior_rows(rows: Sequence[Sequence[float]], count: int, depth: int) -> np.ndarray:
    """A prior survival table (count, depth): missing rows repeat the last one, missing
    depths continue the last measured rate of decay."""
    table = np.zeros((count, depth))
    if not rows:
        return table
    for k in range(count):
        row = list(rows[min(k, len(rows) - 1)])
        rate = row[-1] / row[-2] if len(row) >= 2 and row[-2] > 0 else 0.5
        while len(row) < depth:
            row.append(row[-1] * min(rate, 0.95))
        table[k] = row[:depth]
    return np.clip(table, 0.0, 1.0)


def prior_cube(
    table: AcceptanceTable,
    beams: int,
    branches: int,
    depth: int,
    alone: Sequence[Sequence[float]] = (),
) -> np.ndarray:
    """(beams + 1, branches + 1, D) survival of the best of the first k drafter beams
    and first g lookup branches: the table's joint measurement where it has one, else
    the two kinds taken as independent ([0, 0] is zero: no candidate).

    alone: survival rows of lookup branches in trees without drafter beams, where they
    cap the table's. A drafter's table measures its branches beside beams, where a
    branch that finds no match in the text nor in the n-gram table copies the best
    beam; without beams it repeats the root. The cap is the drafter's own
    measurement of branches alone (`AcceptanceTable.alone`), or for a table without
    one the built-in prior, measured on another model without an n-gram table,
    which undercounts what a model that copies more accepts until the running
    estimate finds it."""
    zero = np.zeros((1, depth))
    by_beam = np.concatenate([zero, _prior_rows(table.beams, beams, depth)])  # (Kw+1, D)
    by_branch = np.concatenate([zero, _prior_rows(table.lookup, branches, depth)])  # (Kg+1, D)
    cube = 1.0 - (1.0 - by_beam[:, None, :]) * (1.0 - by_branch[None, :, :])  # (Kw+1, Kg+1, D)
    for k, plane in enumerate(table.joint[: beams + 1]):
        for g, row in enumerate(plane[: branches + 1]):
            cube[k, g, : len(row)] = row[:depth]
    if alone:  # (Kg, D) lookup branches without beams
        cube[0, 1:] = np.minimum(cube[0, 1:], _prior_rows(alone, branches, depth))
    return cube


def prior_planes(
    table: AcceptanceTable,
    lengths: Sequence[int],
    kinds: tuple[int, int],
    depth: int,
    alone: Sequence[Sequence[float]] = (),
) -> np.ndarray:
    """(P, Kw + 1, Kg + 1, D) `prior_cube` of beams of each of `lengths` (P,) tokens
    for (Kw, Kg) = `kinds` candidates: from the table measured with that beam length
    (`AcceptanceTable.by_length`), interpolated linearly between the two measured
    lengths around it, or the nearest measured one beyond them. Lookup branches
    alone (k = 0) are the table's own in every plane: they have no beam length."""
    main = prior_cube(table, kinds[0], kinds[1], depth, alone)  # (Kw + 1, Kg + 1, D)
    measured = {
        n: main if t is table else prior_cube(replace(t, lookup=table.lookup), *kinds, depth, alone)
        for n, t in table.beams_by_length().items()
    }  # beam length -> (Kw + 1, Kg + 1, D)
    if not measured:
        return np.stack([main] * len(lengths))  # (P, Kw + 1, Kg + 1, D)
    planes = np.stack([_at_length(measured, n) for n in lengths])  # (P, Kw + 1, Kg + 1, D)
    planes[:, 0] = main[0]
    return planes


def _at_length(cubes: dict[int, np.ndarray], length: int) -> np.ndarray:
    """The cube (Kw + 1, Kg + 1, D) of beams of `length` tokens from `cubes` of that
    shape measured at beam lengths (their keys, ascending): its own, interpolated
    between the two around it, or the nearest beyond them."""
    if length in cubes:
        return cubes[length]
    below = [n for n in cubes if n < length]
    above = [n for n in cubes if n > length]
    if not below or not above:
        return cubes[above[0] if above else below[-1]]
    low, high = below[-1], above[0]
    share = (length - low) / (high - low)
    return (1 - share) * cubes[low] + share * cubes[high]


def _table_planes(
    table: AcceptanceTable,
    kinds: tuple[int, int],
    builtin: AcceptanceTable,
    lengths: Sequence[int],
) -> np.ndarray:
    """The prior planes (P, Kw + 1, Kg + 1, D) of a drafter's (or the built-in) table
    for (Kw, Kg) candidates and beams of `lengths`: lookup rows from `builtin`
    (measured at the same temperature) where the table has none; branches alone
    capped by the table's own measurement of them (`AcceptanceTable.alone`), else by
    `builtin`'s rows."""
    if not table.lookup:
        table = replace(table, lookup=builtin.lookup)
    alone = (table.alone or builtin.lookup) if table.beams else ()
    return prior_planes(table, lengths, kinds, DEPTH, alone)


def rates(survival: np.ndarray) -> np.ndarray:
    """(..., D) survival -> (..., D) the rate of accepting token d given d - 1."""
    before = np.concatenate([np.ones_like(survival[..., :1]), survival[..., :-1]], axis=-1)
    return np.where(before > 0, survival / np.maximum(before, 1e-9), 0.0)


@dataclass(frozen=True)
class Counts:
    """Of some cells of the running estimate (any shape, ..., D), the steps that
    reached depth d - 1 and those that went on to accept token d."""

    reached: np.ndarray
    passed: np.ndarray

    @classmethod
    def zeros(cls, shape: tuple[int, ...]) -> Counts:
        return cls(np.zeros(shape), np.zeros(shape))

    def fade(self, decay: float) -> None:
        self.reached[...] *= decay  # in place: the arrays are the state
        self.passed[...] *= decay

    def add(self, cells: tuple[slice | int, ...], reached: np.ndarray, passed: np.ndarray) -> None:
        self.reached[cells] += reached
        self.passed[cells] += passed


class AcceptanceEstimate:
    """Running acceptance of a step's candidates: for the best of the first k drafter
    beams (of each of `lengths` tokens) and first g lookup branches, and depth d, the
    steps that reached depth d - 1 and those that went on to accept token d. Counts
    fade by `decay` each step, and `strength` steps' worth of the prior's rates are
    mixed in. Lookup branches alone (k = 0) have no beam length: their counts are
    kept once (`alone`, (Kg + 1, D)), those of beams once per length (`beams`,
    (P, Kw, Kg + 1, D)).

    prior: (P, Kw + 1, Kg + 1, D) survival (`prior_planes`), one plane per length,
    whose planes hold the same lookup-only cells.
    """

    def __init__(
        self,
        prior: np.ndarray,
        lengths: Sequence[int],
        strength: float = 8.0,
        decay: float = 0.995,
    ):
        if prior.ndim != 4 or prior.shape[0] != len(lengths):
            raise ValueError(f"prior: (P, Kw + 1, Kg + 1, D) for P={len(lengths)} beam lengths")
        planes, beams, branches, depth = prior.shape  # (P, Kw + 1, Kg + 1, D)
        self.lengths = tuple(lengths)
        self.prior_rate = rates(prior)
        self.strength, self.decay = strength, decay
        self.alone = Counts.zeros((branches, depth))  # lookup branches alone
        self.beams = Counts.zeros((planes, beams - 1, branches, depth))  # k = 1 .. Kw beams

    def fade(self) -> None:
        self.alone.fade(self.decay)
        self.beams.fade(self.decay)

    def observe(
        self, beam_runs: np.ndarray, branch_runs: np.ndarray, length: int, branch_length: int
    ) -> None:
        """One step: beam_runs (B, W) and branch_runs (B, G), the drafted tokens each
        candidate had accepted, ranked best first within each kind; length and
        branch_length: tokens per beam and per branch (the depths verified; length
        also picks the plane the beams' cells are counted in)."""
        _, kw, branches, depth = self.beams.reached.shape  # (P, Kw, Kg + 1, D)
        w, g = min(beam_runs.shape[1], kw), min(branch_runs.shape[1], branches - 1)
        if w + g == 0:
            return
        none = np.full((beam_runs.shape[0], 1), -1)  # (B, 1): no candidate
        by_beam = np.maximum.accumulate(np.hstack([none, beam_runs[:, :w]]), axis=1)
        by_branch = np.maximum.accumulate(np.hstack([none, branch_runs[:, :g]]), axis=1)
        best = np.maximum(by_beam[:, :, None], by_branch[:, None, :])  # (B, w+1, g+1)
        # A cell is seen at depth d when each of its kinds is long enough to reach d.
        reach = np.full((w + 1, g + 1), depth)
        reach[1:, :] = np.minimum(reach[1:, :], length - 1)
        reach[:, 1:] = np.minimum(reach[:, 1:], branch_length - 1)
        reach[0, 0] = 0
        depths = np.arange(1, depth + 1)  # (D,)
        seen = depths[None, None, :] <= reach[:, :, None]  # (w+1, g+1, D)
        reached = np.sum(best[..., None] >= depths - 1, axis=0) * seen  # (w+1, g+1, D)
        passed = np.sum(best[..., None] >= depths, axis=0) * seen
        plane = int(plane_of(self.lengths, np.array([length]))[0])
        self.alone.add((slice(0, g + 1),), reached[0], passed[0])
        self.beams.add((plane, slice(0, w), slice(0, g + 1)), reached[1:], passed[1:])

    def survival(self, prior_rate: np.ndarray | None = None) -> np.ndarray:
        """(P, Kw + 1, Kg + 1, D): P(the best of those candidates accepts >= d tokens),
        from the counts and the prior's rates (`prior_rate`: others of that shape),
        each kind by `_rates`: lookup branches alone (k = 0, the same in every
        plane) by their own counts, and beams of every length by theirs, so that
        lookup branches checked in hindsight neither hold back nor raise the
        drafter's estimate."""
        prior_rate = self.prior_rate if prior_rate is None else prior_rate
        alone = self._rates(self.alone, prior_rate[0, 0])  # (Kg + 1, D)
        beams = self._rates(self.beams, prior_rate[:, 1:])  # (P, Kw, Kg + 1, D)
        every_plane = (prior_rate.shape[0], 1, *alone.shape)
        alone = np.broadcast_to(alone, every_plane)  # (P, 1, Kg + 1, D)
        rate = np.concatenate([alone, beams], axis=1)  # (P, Kw + 1, Kg + 1, D)
        planes = np.cumprod(np.clip(rate, 0.0, 1.0), axis=-1)  # (P, Kw + 1, Kg + 1, D)
        planes[:, 0, 0] = 0.0
        return planes

    def _rates(self, counts: Counts, prior_rate: np.ndarray) -> np.ndarray:
        """The rates of one kind's cells (any shape, ..., D): its counts mixed with the
        prior's rates, first scaled down by how its observed steps fall short of
        what the prior predicted for them, so that text where nothing is accepted
        lowers the cells not yet observed too (wider trees, deeper tokens; beams of
        every length share the scale: what one length shows of the text holds the
        others back too). They are never scaled up: a rate raised at every depth
        compounds along the depths, so a few lucky steps would promise the deepest
        trees several tokens they have not shown (and the choice, taking the best
        of many such promises, would follow them); text easier than the prior raises
        the cells it observes, from their own counts."""
        weight = self.strength
        predicted = float(np.sum(counts.reached * prior_rate))
        scale = min((float(np.sum(counts.passed)) + weight) / (predicted + weight), 1.0)
        prior = np.clip(prior_rate * scale, 0.0, 1.0)
        return (counts.passed + weight * prior) / (counts.reached + weight)


def expected_tokens(candidates: Candidates, planes: np.ndarray) -> np.ndarray:
    """(C,) expected tokens per step of each candidate from the survival planes
    (P, Kw + 1, Kg + 1, D), one per beam length (`Candidates.beam_lengths`): each
    candidate reads its beam length's plane; at depth d its beams count while d < L,
    its branches while d < Ll."""
    count_planes, beams, branches, depth = planes.shape
    if count_planes != len(candidates.beam_lengths):
        raise ValueError(f"planes: {len(candidates.beam_lengths)}, one per beam length")
    d = np.arange(1, depth + 1)[None, :]  # (1, D)
    width = np.minimum(candidates.width, beams - 1)[:, None]  # (C, 1)
    count = np.minimum(candidates.branches, branches - 1)[:, None]
    k = np.where(d < candidates.length[:, None], width, 0)  # (C, D)
    g = np.where(d < candidates.branch_length[:, None], count, 0)  # (C, D)
    return 1.0 + np.sum(planes[candidates.plane[:, None], k, g, d - 1], axis=1)


def step_seconds(
    candidates: Candidates,
    calibration: Calibration,
    batch_size: int,
    context: int,
    sampled: bool = False,
) -> np.ndarray:
    """(C,) predicted seconds of a step of each candidate for `batch_size` rows
    (`sampled`: some row samples, so every packed token is sampled, not argmaxed).
    Plain decoding pays `plain_share` of its forward: its steps are pipelined."""
    packed = batch_size * candidates.packed
    verify = calibration.verify_seconds(packed, context)
    draft = calibration.draft_seconds(batch_size * candidates.width, candidates.length)
    lookup = np.where(candidates.branches > 0, calibration.lookup, 0.0)
    sample = calibration.sample * packed if sampled else 0.0
    verify = np.where(candidates.plain, calibration.plain_share * verify, verify)  # pipelined
    return verify + draft + lookup + sample


def context_band(context: int) -> int:
    """The context length a step at `context` tokens is priced at: the power of two
    at or above it, at least 64 (so that the costs of a band are computed once)."""
    return max(64, 1 << max(context - 1, 1).bit_length())


def greedy_and_sampled_planes(
    prior: AcceptanceTable,
    sampled_prior: AcceptanceTable | None,
    kinds: tuple[int, int],
    lengths: Sequence[int],
) -> tuple[tuple[np.ndarray, np.ndarray], float, bool]:
    """The prior survival planes (P, Kw + 1, Kg + 1, D) of greedy and of sampled steps
    for (Kw, Kg) = `kinds` candidates and beams of `lengths` (P,), the temperature
    the sampled one was measured at,
    and whether the drafter's beams have a table measured sampling (a drafter
    without one: its beams as measured greedily, not trusted, and the built-in
    lookup rows measured sampling)."""
    beams_measured = sampled_prior is not None or not prior.beams
    if sampled_prior is not None and sampled_prior.temperature <= 0:
        raise ValueError("sampled_prior: give a table measured sampling (temperature > 0)")
    if sampled_prior is None:
        beams_only = tuple(replace(t, joint=()) for t in prior.by_length)
        sampled_prior = replace(
            prior, lookup=(), joint=(), alone=(), temperature=1.0, by_length=beams_only
        )
    greedy = _table_planes(prior, kinds, LOOKUP_PRIOR, lengths)
    sampled = _table_planes(sampled_prior, kinds, LOOKUP_SAMPLED, lengths)
    return (greedy, sampled), sampled_prior.temperature, beams_measured


# -- the choice ------------------------------------------------------------------------


def candidates_and_priors(
    drafter: Drafter | None,
) -> tuple[Candidates, AcceptanceTable, AcceptanceTable | None]:
    """The auto tree's candidates with `drafter` (None: lookup trees and plain
    decoding), and the greedy and sampled priors of their acceptance: the drafter's
    own tables (a generic prior for one without), or the built-in lookup priors."""
    width = min(8, drafter.config.output_size) if drafter is not None else 0
    candidates = candidate_trees(drafter is not None, max_width=width)
    if drafter is None:
        return candidates, LOOKUP_PRIOR, LOOKUP_SAMPLED
    return candidates, drafter.acceptance or DRAFTER_PRIOR, drafter.sampled_acceptance


class CheckSchedule:
    """When to run a check that costs the device a little (a hindsight search, a
    drafter probe): after `first` steps that do not verify what it checks, then
    after twice as many steps each time, up to every `longest`; a step that
    verifies it starts over."""

    def __init__(self, first: int, longest: int):
        self.first, self.longest = first, max(longest, first)
        self.waited, self.interval = 0, first

    def due(self, verified: bool) -> bool:
        if verified:
            self.waited, self.interval = 0, self.first
            return False
        self.waited += 1
        if self.waited < self.interval:
            return False
        self.waited, self.interval = 0, min(2 * self.interval, self.longest)
        return True


class MeasuredCosts:
    """What auto trees measure of their steps' cost beyond the calibration, for one
    model and drafter on this machine: shared by the sessions of a process
    (`shared_measured_costs`), so that a session per request starts from what
    earlier requests measured. Acceptance is not shared: it follows each request's
    own text.

    own (C,): each tree's own measured step time over its predicted one, from
    `steps` (C,) of its steps; excess (plain, trees): the seconds their steps took
    beyond the calibrated cost, from `excess_steps` (2,) steps (`overhead` is what
    the choice uses). Each is the mean of its steps while they are few, then a
    running mean, of residuals clipped around the current estimate (to `STEP_SPAN`
    of a tree step's predicted cost, to a plain step's whole cost): a step the
    machine stalled (another process, a page fault) moves a price by a fraction of
    a step, not by the stall, while a lasting change is still learned within tens
    of steps. Every step decoded, plain ones included, fades these step counts by
    `STEP_FADE`, so that what was measured a while ago (a slow spell) counts little
    and the calibration's prices return. entry: the extra seconds of a stint's
    first step (clipped as a tree step's); stint: the steps a stint of trees
    between two plain steps lasts (running means, not faded; stint is None until
    one has ended; a stint that lasts to the end of its session is not counted).
    """

    def __init__(self, trees: int):
        self.own = np.ones(trees)
        self.steps = np.zeros(trees)
        self.excess = np.zeros(2)
        self.excess_steps = np.zeros(2)
        self.entry = 0.0
        self.stint: float | None = None

    def fade(self) -> None:
        """Another step was decoded: what every step so far taught counts a little
        less. Plain steps fade it too: while plain decoding runs, no tree step runs
        that could correct a tree price learned in a slow spell, so the fading is
        what brings it back to the calibration's and lets trees be tried again."""
        self.steps *= STEP_FADE
        self.excess_steps *= STEP_FADE

    def learn_excess(self, kind: int, seconds: float, span: float) -> None:
        """A step of `kind` (0 plain, 1 trees) took `seconds` beyond its calibrated
        cost: the mean of such excesses while they are few, then a running one (a
        tenth of the weight on the newest step), each counted at most `span`
        seconds from the current estimate."""
        _update_mean(self.excess, self.excess_steps, kind, seconds, 0.1, span)

    @property
    def overhead(self) -> np.ndarray:
        """(plain, trees) the seconds beyond the calibrated cost their steps are priced
        at: the measured excess, shrunk toward the calibration's 0 by `POOL_STEPS`
        steps' worth (one step's excess is a fifth of it, not all); read-only."""
        priced = _with_prior(self.excess, self.excess_steps, 0.0, POOL_STEPS)
        priced.setflags(write=False)
        return priced

    def learn(self, index: int, ratio: float, span: float) -> None:
        """One step of tree `index` took `ratio` times its prediction: its factor is
        the mean of its (faded) steps' ratios while they are few, then a running
        one (a fifth of the weight on the newest step), each counted at most `span`
        from the current factor."""
        _update_mean(self.own, self.steps, index, ratio, 0.2, span)

    def factors(self, pool: float = POOL_STEPS) -> np.ndarray:
        """(C,) the factor each tree's steps are priced at: its own, mixed with `pool`
        (> 0) steps' worth of the pooled factor. The pooled factor is the mean of every
        tree's (weighted by their fading steps) and of `pool` steps at factor 1, the
        calibration's: one slow step is a fifth of it, not all. A tree that has not
        run is priced as the trees that have: the overhead learns what every tree step
        costs beyond the calibration more slowly than a tree's factor does, so own
        factors alone would price the trees tried so far above the untried ones, and
        the choice would hop from tree to untried tree."""
        if pool <= 0:
            raise ValueError(f"pool: a positive number of steps; got {pool}")
        pooled = (float(self.steps @ self.own) + pool) / (float(self.steps.sum()) + pool)
        return _with_prior(self.own, self.steps, pooled, pool)


def _with_prior(means: np.ndarray, steps: np.ndarray, prior: float, pool: float) -> np.ndarray:
    """(K,) `means` over (K,) `steps` each, mixed with `pool` steps' worth of `prior`."""
    return (steps * means + pool * prior) / (steps + pool)


def _update_mean(
    means: np.ndarray, steps: np.ndarray, i: int, value: float, floor: float, span: float
) -> None:
    """Add a step of `value` to entry `i` of (K,) `means` over (K,) faded `steps`: the
    mean of its steps while they are few, then a running mean (`floor` of the weight
    on the newest step), of residuals clipped to `span` around the current mean."""
    steps[i] += 1
    means[i] += max(1.0 / steps[i], floor) * _clipped(value - means[i], span)


def _clipped(residual: float, span: float) -> float:
    """`residual` clipped to [-span, span]: what one step may move a running mean by."""
    return min(max(residual, -span), span)


_MEASURED: PerModel[MeasuredCosts] = PerModel()


def shared_measured_costs(model: nn.Module, drafter: Drafter | None, trees: int) -> MeasuredCosts:
    """The process's `MeasuredCosts` of (model, drafter) and its `trees` candidates,
    kept as `per_model.PerModel` keeps values."""
    return _MEASURED.get(model, drafter, (trees,), lambda: MeasuredCosts(trees))


class AutoTree:
    """Chooses each step's tree from the calibrated cost and the running acceptance.

    every: steps between choices (a chosen tree runs at least this long, so its shape
    is compiled once and used); margin: a new tree must promise this much more
    speed than the current one to replace it; measured: what earlier sessions of this
    model measured of their steps (`shared_measured_costs`; None: start from the
    calibration).
    """

    def __init__(
        self,
        calibration: Calibration,
        candidates: Candidates,
        prior: AcceptanceTable,
        sampled_prior: AcceptanceTable | None = None,
        *,
        every: int = 4,
        margin: float = 0.03,
        measured: MeasuredCosts | None = None,
    ):
        self.calibration, self.candidates = calibration, candidates
        kinds = (int(candidates.width.max()), int(candidates.branches.max()))
        lengths = candidates.beam_lengths
        self._planes, self._sampled_at, self._beams_measured = greedy_and_sampled_planes(
            prior, sampled_prior, kinds, lengths
        )
        self._priors: dict[float, tuple[np.ndarray, np.ndarray]] = {}  # share -> rates, tokens
        # Running acceptance of greedy steps and, apart, of steps where some row
        # samples: a sample accepts a drafted token less often than an argmax does.
        self.estimates = tuple(AcceptanceEstimate(planes, lengths) for planes in self._planes)
        self._beam_evidence = 0.0  # drafter beams seen by sampled steps (row-steps)
        self.measured = measured if measured is not None else MeasuredCosts(len(candidates.trees))
        if len(self.measured.own) != len(candidates.trees):
            raise ValueError("measured: the MeasuredCosts of these candidates' trees")
        self.every, self.margin = every, margin
        self._after_plain = True
        self._stint = 0  # tree steps since the last plain one
        self.current: dict[int, int] = {}  # batch size -> candidate index
        self._latest = 0  # the candidate chosen last, for any batch size (0: plain)
        self._age: dict[int, int] = {}
        self._costs: dict[tuple[int, int, bool], np.ndarray] = {}
        self._index = {tree: i for i, tree in enumerate(candidates.trees)}
        # A hindsight check covers every step since the last one, in one batched
        # search: checks every `every` steps see as many steps as checks every step.
        self._hindsight_due = CheckSchedule(every, every)
        self._probe_due = CheckSchedule(every, PROBE_LONGEST)
        longest = int(np.max(np.where(candidates.branches > 0, candidates.branch_length, 0)))
        self._hindsight = (
            TreeConfig(0, 1, lookup_branches=kinds[1], lookup_length=longest) if kinds[1] else None
        )
        self._probe_width = min(PROBE_WIDTH, kinds[0])  # 0: no drafter, no probes
        self._last = (1, 0, 0.0)  # (batch size, context, temperature) of the last choice

    @classmethod
    def for_model(cls, model: nn.Module, drafter: Drafter | None, **options: float) -> AutoTree:
        """The auto tree of (model, drafter) on this machine: its calibration is read from
        the cache folder, or measured now (seconds) and stored there; acceptance starts
        from the drafter's own table, or the built-in priors; the step costs measured
        beyond the calibration are those of earlier sessions of this model and
        drafter in this process (`shared_measured_costs`)."""
        calibration, _ = cached_calibration(model, drafter, announce=is_main_process())
        candidates, prior, sampled = candidates_and_priors(drafter)
        return cls(
            calibration,
            candidates,
            prior,
            sampled,
            measured=shared_measured_costs(model, drafter, len(candidates.trees)),
            **options,  # type: ignore[arg-type]
        )

    @property
    def trees(self) -> list[TreeConfig]:
        return list(self.candidates.trees)

    @property
    def factor(self) -> np.ndarray:
        """(C,) each tree's measured step time over its predicted one, as the choice
        prices it (`MeasuredCosts.factors`); 1 for plain decoding, whose steps learn
        only their overhead."""
        return np.where(self.candidates.plain, 1.0, self.measured.factors())

    @property
    def overhead(self) -> np.ndarray:
        """(plain, trees) the step time beyond the calibrated cost (seconds) that the
        choice prices, measured for plain steps and for tree steps apart
        (`MeasuredCosts.overhead`): a tree step's host work (packing, acceptance, the
        cache commit) is not a plain step's, which the calibration times whole."""
        return self.measured.overhead

    @property
    def entry(self) -> float:
        """Measured extra seconds of the first tree step after a plain one (its draft
        was not prefetched during the step before): a cost of the switch, learned
        apart from the trees' own."""
        return self.measured.entry

    def describe(self) -> str:
        kinds = "lookup and drafter trees" if self.candidates.width.max() else "lookup trees"
        return f"auto (plain, {kinds} up to N={int(self.candidates.packed.max())})"

    def calibrated(self, batch_size: int, context: int, temperature: float = 0.0) -> np.ndarray:
        """(C,) step seconds of every candidate as the calibration predicts them
        (`temperature` > 0: some row samples)."""
        band = context_band(context)
        sampled = temperature > 0
        key = (batch_size, band, sampled)
        if key not in self._costs:
            self._costs[key] = step_seconds(
                self.candidates, self.calibration, batch_size, band, sampled
            )
        return self._costs[key]

    def costs(self, batch_size: int, context: int, temperature: float = 0.0) -> np.ndarray:
        """(C,) expected step seconds: the calibrated cost plus the measured overhead
        of its kind (plain or tree steps), times each tree's measured factor
        (`MeasuredCosts.factors`: its own mixed with the trees' that ran)."""
        overhead = np.where(self.candidates.plain, self.overhead[0], self.overhead[1])  # (C,)
        return (self.calibrated(batch_size, context, temperature) + overhead) * self.factor

    def speeds(self, batch_size: int, context: int, temperature: float = 0.0) -> np.ndarray:
        """(C,) expected tokens per second of every candidate, for rows sampling at
        up to `temperature` (0: greedy)."""
        sampled = int(temperature > 0)
        rate, _ = self.prior(temperature)
        tokens = expected_tokens(self.candidates, self.estimates[sampled].survival(rate))
        speeds = batch_size * tokens / self.costs(batch_size, context, temperature)
        if self._beams_untrusted(temperature):
            speeds = np.where(self.candidates.width > 0, 0.0, speeds)
        return speeds

    def prior(self, temperature: float) -> tuple[np.ndarray, np.ndarray]:
        """The prior of steps at `temperature`: its rates (P, Kw + 1, Kg + 1, D) and the
        expected tokens (C,) of every candidate. Greedy steps take the greedy table,
        steps at or above the sampled table's temperature that table, and steps in
        between the two mixed, the sampled one's share growing with the square root
        of the temperature: acceptance falls fast from the argmax's as soon as the
        target samples (at 0.7 of the table's temperature: 16 % greedy, 84 % sampled;
        docs/auto-tree.md)."""
        share = round(min(max(temperature, 0.0) / self._sampled_at, 1.0) ** 0.5, 2)
        if share not in self._priors:
            greedy, sampled = self._planes
            mixed = (1 - share) * greedy + share * sampled  # (P, Kw + 1, Kg + 1, D)
            self._priors[share] = (rates(mixed), expected_tokens(self.candidates, mixed))
        return self._priors[share]

    def _beams_untrusted(self, temperature: float) -> bool:
        """Whether steps at `temperature` have no prior for the drafter's beams they
        can trust: sampled steps of a drafter without a table measured sampling,
        until they have seen its beams in `strength` row-steps (probes, verified
        steps); until then they decode without drafter beams."""
        if temperature <= 0 or self._beams_measured:
            return False
        return self._beam_evidence < self.estimates[1].strength

    @property
    def acceptance(self) -> AcceptanceEstimate:
        """The running estimate of the steps being decoded (greedy or sampled)."""
        return self.estimates[int(self._last[2] > 0)]

    def _observe(
        self, beam_runs: np.ndarray, branch_runs: np.ndarray, length: int, branch_length: int
    ) -> None:
        self.acceptance.observe(beam_runs, branch_runs, length, branch_length)
        if self._last[2] > 0 and beam_runs.size:
            self._beam_evidence += beam_runs.shape[0]

    def switch_seconds(self, batch_size: int, context: int, temperature: float = 0.0) -> float:
        """Seconds a stint of trees costs plain decoding beyond its steps: the plain
        step before it and the one after it run unpipelined, each paying the whole
        forward rather than `plain_share` of it (the forward's cost alone: the host's
        work is not pipelined away either way), and the stint's first step pays its
        measured extra (`entry`: it drafts what a tree step after a tree step finds
        drafted)."""
        plain = float(self.calibrated(batch_size, context, temperature)[0])  # pipelined
        share = self.calibration.plain_share
        unpipelined = 2.0 * plain * (1.0 / share - 1.0) if share > 0 else 0.0
        return unpipelined + max(self.entry, 0.0)

    def choose(self, batch_size: int, context: int = 0, temperature: float = 0.0) -> TreeConfig:
        """The tree of the next step for `batch_size` rows at `context` tokens, the
        highest sampling temperature among them `temperature` (0: greedy). The
        choice is made again every `every` steps, or at once for a batch size not seen
        yet; the tree last chosen for any batch size (at first plain decoding) is the
        incumbent. Leaving plain decoding pays for its switch (`switch_seconds`,
        spread over the steps a stint of trees lasts: as measured, and at least the
        `every` steps a tree runs), and any new tree must promise `margin` more speed
        than the incumbent."""
        self._last = (batch_size, context, temperature)
        current = self.current.get(batch_size)
        age = self._age.get(batch_size, self.every)
        if current is None or age >= self.every:
            incumbent = self._latest if current is None else current
            speeds = self.speeds(batch_size, context, temperature)
            plain = self.candidates.plain
            if plain[incumbent]:  # a tree pays for the switch too
                stint = max(self.every, self.measured.stint or 0.0)
                extra = self.switch_seconds(batch_size, context, temperature) / stint
                costs = self.costs(batch_size, context, temperature)
                speeds = np.where(plain, speeds, speeds * costs / (costs + extra))
            best = int(np.argmax(speeds))
            current = best if speeds[best] > speeds[incumbent] * (1 + self.margin) else incumbent
            self.current[batch_size], age = current, 0
        self._latest = current
        self._age[batch_size] = age + 1
        return self.candidates.trees[current]

    def _end_stint(self) -> None:
        """Learn how long stints of trees last (a running mean of their steps)."""
        last = self.measured.stint
        steps = float(self._stint)
        self.measured.stint = steps if last is None else last + 0.2 * (steps - last)

    def hindsight(self, tree: TreeConfig) -> TreeConfig | None:
        """The lookup branches (G, Ll) to check in hindsight on a step of `tree`: the
        widest and longest candidate ones, every `every` steps among those without
        lookup branches (a check costs the device a little; it covers the steps since
        the last one). None on the other steps."""
        if self._hindsight is None:
            return None
        return self._hindsight if self._hindsight_due.due(tree.lookup_branches > 0) else None

    def probe(self, tree: TreeConfig) -> TreeConfig | None:
        """The drafter tree (W, L) to probe on a step of `tree` (`probes.py`), on the
        steps `CheckSchedule` picks among those without drafter beams, and only where
        some drafter tree could beat plain decoding on this machine's cost curve (at
        the steps' temperature) with the greedy prior's acceptance (so never where
        verification cannot pay, as with 4-bit weights on a CPU). None on the other
        steps. The greedy prior is an optimistic bound for sampled steps in practice
        (the shipped drafter's `1x2` accepts its drafted token in 41 % of greedy
        steps, 24 % of sampled ones); gating sampled steps by their own prior
        instead would keep the estimate from ever learning that the drafter
        guesses more samples than that prior says.

        Sampled steps are probed too: the walk accepts a drafted token exactly when
        the target's sample at its parent is that token, and the tokens decoded since
        are those samples, so a probe's runs are distributed as a verified beam's.
        Sampled steps without a prior they trust for the beams are probed on every
        step they can be (one probe at a time) until they have seen enough.

        A probe drafts `PROBE_WIDTH` beams as long as those of the drafter tree that
        the prior at the steps' temperature ranks best, up to `PROBE_MAX_LENGTH`
        tokens (it learns once its rows have decoded L - 1 more tokens): it teaches
        the plane of acceptance that the choice moves to when the drafter guesses
        the text. (The running estimate would not do: after a stretch the drafter
        does not guess, it ranks the drafter trees by their cost alone.)"""
        if not self._probe_width:
            return None
        batch_size, context, temperature = self._last
        due = self._probe_due.due(tree.beam_width > 0 and tree.beam_length > 1)
        if not (due or self._beams_untrusted(temperature)):
            return None
        _, bound = self.prior(0.0)  # (C,) expected tokens by the greedy prior
        # On the cost curve alone: a tree overhead learned in a short stint must not
        # keep the drafter from ever being probed again.
        costs = self.calibrated(batch_size, context, temperature)
        speeds = bound / costs
        drafted = self.candidates.width > 0
        if speeds[drafted].max(initial=0.0) <= speeds[0]:
            return None
        _, tokens = self.prior(temperature)
        best = int(np.argmax(np.where(drafted, tokens / costs, -np.inf)))
        length = min(int(self.candidates.length[best]), PROBE_MAX_LENGTH)
        return TreeConfig(self._probe_width, length)

    def record_probe(self, runs: np.ndarray, probe_tree: TreeConfig) -> None:
        """Learn drafter acceptance from the runs (B, W) that a probe's beams would
        have had accepted."""
        none = np.zeros((runs.shape[0], 0), dtype=np.int64)  # (B, 0): no lookup branches
        self._observe(runs, none, probe_tree.beam_length, 1)

    def record_hindsight(self, runs: np.ndarray, lookup_tree: TreeConfig) -> None:
        """Learn lookup acceptance from the runs (M, G) that the branches of
        `lookup_tree` would have had accepted, one row per step and row checked."""
        none = np.zeros((runs.shape[0], 0), dtype=np.int64)  # (B, 0): no drafter beams
        self._observe(none, runs, 1, lookup_tree.lookup_branch_length)

    def record(self, step: StepRecord) -> None:
        """Learn from a step: each row's runs (B, W + G) of accepted tokens per
        candidate (the drafter's beams first), and its time unless it built
        functions (ran them at shapes new to its session, `StepRecord.built`)."""
        self.acceptance.fade()
        self.measured.fade()
        tree, runs = step.tree, step.runs
        width = tree.beam_width if tree.beam_length > 1 else 0
        branches = runs[:, width : width + tree.lookup_branches]
        self._observe(runs[:, :width], branches, tree.beam_length, tree.lookup_branch_length)
        index = self._index.get(tree)
        if index is None:
            return
        temperature = self._last[2]  # the last choice's rows: this step's
        predicted = float(self.calibrated(step.batch_size, step.context, temperature)[index])
        # The step's host work and anything else the calibration did not see ...
        if self.candidates.plain[index]:
            self._learn_plain_step(step.seconds - predicted, predicted, step.built)
            return
        self._learn_tree_step(index, step.seconds, predicted, step.built)

    def _learn_plain_step(self, excess: float, predicted: float, built: bool) -> None:
        """Learn from a plain step's `excess` (seconds beyond its calibrated cost). A
        plain step that looked ahead launched the next one's forward, so its time can
        hold part of its neighbour's (the first of a stint long, the last short): only
        their average means something, so its residual is clipped at a whole step's
        cost (what a look-ahead can move between neighbours; the clip is symmetric
        and keeps such an alternation's mean), not at `STEP_SPAN` of it, and no
        plain factor is kept."""
        if not self._after_plain:  # a stint of trees ended
            self._end_stint()
        self._after_plain = True
        if not built:
            self.measured.learn_excess(0, excess, predicted)

    def _learn_tree_step(self, index: int, seconds: float, predicted: float, built: bool) -> None:
        """Learn from a tree step's time: the first step of a stint teaches the
        switch's cost (`entry`), the others the tree steps' overhead and this tree's
        factor."""
        first_of_stint = self._after_plain
        self._after_plain, self._stint = False, 1 if first_of_stint else self._stint + 1
        if built:
            return
        span = STEP_SPAN * predicted
        if first_of_stint:  # against what tree steps measure, not faded toward 0
            extra = seconds - predicted - self.measured.excess[1]
            self.measured.entry += 0.2 * _clipped(extra - self.measured.entry, span)
            return
        self.measured.learn_excess(1, seconds - predicted, span)
        # ... and what this tree's steps cost beyond that.
        ratio = seconds / max(predicted + self.overhead[1], 0.5 * predicted)
        self.measured.learn(index, ratio, STEP_SPAN)
