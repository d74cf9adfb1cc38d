"""Replay greedy decoding over recorded runs: any tree, or the auto tree's choice,
compared without the machine's timing noise.

Shapes: M positions of a reply (each a possible step root), W beam width, L beam
length, G lookup branches, S prompt and reply tokens.

Greedy decoding is lossless, so a prompt's reply is the same tokens whatever tree
decodes it. What each drafter beam and lookup branch would have had accepted can
so be recorded once at every position of the reply (`record`), and any tree
replayed over the recording (`replay`): a step at position p accepts the longest
run among its tree's candidates there and moves on to p + run + 1. Step times come
from a cost model (`StepCost`: a calibration and a per-step overhead) instead of a
clock, so two trees compare on the same costs and the same text; the auto tree
learns from these times as it learns from measured ones. Drafter beams are taken
from a search of their own width (the first W beams of one W-beam search), lookup
branches from one search of the widest and longest (a shorter branch is a prefix of
its longer self).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .auto import (
    AutoTree,
    Candidates,
    MeasuredCosts,
    candidates_and_priors,
    context_band,
    step_seconds,
)
from .calibrate import Calibration
from .confidence import neutral_rates
from .config import PLAIN_DECODING, CacheConfig, TreeConfig
from .decode import step_functions
from .drafter import Drafter
from .lookup import lookup_branches
from .ngrams import table_branches
from .policy import StepRecord
from .probes import beam_runs
from .target import TargetCache, prepare_target, target_hidden
from .tree import ABSENT, chain_tree

NO_TOKEN = -2  # past the reply: equal to no drafted token, ABSENT included


@dataclass(frozen=True)
class RecordShape:
    """The candidates recorded at each position: a W-beam search of L tokens for each
    W in `widths` and L in `lengths` (a beam of a shorter search is not a prefix of
    a longer one's: beam search keeps the best W at every depth), and G lookup
    branches of Ll tokens with the drafter's n-gram table (the auto tree's largest;
    a shorter branch is a prefix of its longer self)."""

    widths: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    lengths: tuple[int, ...] = (2, 3, 4, 5, 6, 7)
    branches: int = 4
    branch_length: int = 10
    ngram: int = 3  # the n-gram the lookup matches (`TreeConfig.lookup_ngram`)

    def check(self, tree: TreeConfig) -> None:
        """A ValueError naming what a tree needs beyond what was recorded."""
        width = tree.beam_width if tree.beam_length > 1 else 0
        if width and (width not in self.widths or tree.beam_length not in self.lengths):
            raise ValueError(
                f"{tree.label}: recorded beams are {','.join(map(str, self.widths))} wide "
                f"and {','.join(map(str, self.lengths))} long; record with a shape that "
                "covers it"
            )
        branches, length = tree.lookup_branches, tree.lookup_branch_length
        if branches and (branches > self.branches or length > self.branch_length):
            raise ValueError(
                f"{tree.label}: recorded lookup branches are {self.branches} of "
                f"{self.branch_length} tokens; record with a shape that covers it"
            )
        if branches and not tree.lookup_table:
            raise ValueError(f"{tree.label}: lookup is recorded with the n-gram table, not :text")
        if tree.draft_nodes is not None or tree.lookup_ngram != self.ngram:
            raise ValueError(
                f"{tree.label}: replay takes fixed W x L trees of the "
                f"recorded n-gram ({self.ngram})"
            )


@dataclass(frozen=True)
class Recording:
    """One reply's runs at each of its M positions (position i roots the step that
    emits reply token i onwards), for the candidates of `shape`: beam_runs[W, L]
    (M, W), the drafted tokens each beam of a W-beam search of L tokens would have
    had accepted (none without a drafter); branch_runs (M, G), the same for
    the lookup branches that found a match in the text or the n-gram table, and
    fell (M, G) where a branch found neither (a step then drafts its fallback: the
    best beam, or without beams the root repeated, whose runs are root_runs (M,))."""

    shape: RecordShape
    prompt_tokens: int
    reply_tokens: int
    beam_runs: dict[tuple[int, int], np.ndarray]
    branch_runs: np.ndarray
    fell: np.ndarray
    root_runs: np.ndarray


def _searched_runs(
    model: nn.Module,
    drafter: Drafter,
    states: mx.array,
    root_tokens: mx.array,
    following: np.ndarray,
    shape: RecordShape,
) -> dict[tuple[int, int], np.ndarray]:
    """(W, L) -> (M, W) the runs of a W-beam search of L tokens at each root, for the
    shape's widths (up to the drafter's output size) and lengths: states (M, D) each
    root's hidden state, root_tokens (M,), following (M, Ll - 1) the tokens after
    each root."""
    runs = {}
    for width in (w for w in shape.widths if w <= drafter.config.output_size):
        for length in shape.lengths:
            tree = TreeConfig(width, length)
            draft = step_functions(model, drafter, tree, compiled=False).draft
            rates = neutral_rates(root_tokens.shape[0])  # (M, DEPTHS, BINS)
            beams = np.array(draft(states, root_tokens, None, rates).beams)  # (M, W, L)
            runs[width, length] = beam_runs(beams, following[:, : length - 1])
    return runs


def _branches(
    drafter: Drafter | None, padded: np.ndarray, roots: np.ndarray, shape: RecordShape
) -> np.ndarray:
    """(M, G, Ll) the lookup branches at each root (padded: the text (S + Ll,)), as a
    step drafts them from the text before it and the n-gram table; a branch that
    finds neither is the root followed by ABSENT."""
    count = len(roots)
    history = mx.array(np.tile(padded.clip(0), (count, 1)).astype(np.int32))  # (M, S + Ll)
    known = mx.array((roots + 1).astype(np.int32))  # (M,) tokens up to each root, included
    nothing = np.full((count, shape.branch_length - 1), ABSENT)  # (M, Ll-1)
    sentinel = np.concatenate([padded[roots][:, None], nothing], axis=1)  # (M, Ll)
    missing = mx.array(sentinel.astype(np.int32))
    table = drafter.ngrams if drafter is not None else None
    if table is not None:
        missing = table_branches(table, history, known, missing)  # (M, Ll)
    found = lookup_branches(
        history, known, shape.branches, shape.branch_length, shape.ngram, missing
    )
    return np.array(found)  # (M, G, Ll)


def record(
    model: nn.Module,
    drafter: Drafter | None,
    prompt: Sequence[int],
    reply: Sequence[int],
    shape: RecordShape = RecordShape(),
) -> Recording:
    """The runs of every recorded candidate at every position of `reply`, the greedy
    continuation of `prompt` (one target forward over both, one batched beam
    search per width, one batched lookup search)."""
    if not prompt:
        raise ValueError("record needs a prompt of at least one token")
    prepare_target(model)
    sequence = list(prompt) + list(reply)
    roots = np.arange(len(prompt) - 1, len(sequence) - 1)  # (M,) the last prompt token on
    padded = np.array(sequence + [NO_TOKEN] * shape.branch_length)  # (S + Ll,)
    following = padded[roots[:, None] + 1 + np.arange(shape.branch_length - 1)]  # (M, Ll-1)
    by_search: dict[tuple[int, int], np.ndarray] = {}
    if drafter is not None and len(roots):
        cache = TargetCache(model, 1, CacheConfig())
        tokens = mx.array([sequence], dtype=mx.int32)  # (1, S)
        hidden = target_hidden(model, cache, chain_tree(tokens), causal=True)[0]  # (S, D)
        # Each root's state is the hidden state before it (none before the first token).
        before = mx.array(np.maximum(roots - 1, 0))  # (M,)
        states = mx.where(mx.array(roots >= 1)[:, None], hidden[before], 0.0)  # (M, D)
        root_tokens = mx.array(padded[roots].astype(np.int32))  # (M,)
        by_search = _searched_runs(model, drafter, states, root_tokens, following, shape)
    branches = (
        _branches(drafter, padded, roots, shape)
        if len(roots)
        else np.zeros((0, shape.branches, shape.branch_length), np.int64)
    )
    repeated = np.repeat(padded[roots][:, None, None], shape.branch_length, axis=2)  # (M, 1, Ll)
    return Recording(
        shape,
        len(prompt),
        len(roots),
        by_search,
        beam_runs(branches, following),
        branches[:, :, 1] == ABSENT,
        beam_runs(repeated, following)[:, 0],
    )


def branch_runs(
    recording: Recording, positions: np.ndarray | int, count: int, length: int, beam: np.ndarray
) -> np.ndarray:
    """(..., G) the runs of `count` lookup branches of `length` tokens at `positions`,
    a branch without a match taking its fallback's run `beam` (..., the best beam's,
    or the root repeated's)."""
    found = np.minimum(recording.branch_runs[positions, :count], length - 1)  # (..., G)
    fallback = np.minimum(np.asarray(beam), length - 1)[..., None]  # (..., 1)
    return np.where(recording.fell[positions, :count], fallback, found)


def tree_runs(recording: Recording, tree: TreeConfig, position: int) -> np.ndarray:
    """(1, W + G) the runs of `tree`'s candidates at `position`, the drafter's beams
    first, each within its candidate's length and the reply's end."""
    width = tree.beam_width if tree.beam_length > 1 else 0
    beams = recording.beam_runs[width, tree.beam_length][position] if width else np.zeros(0)
    beams = beams.astype(np.int64)  # (W,)
    fallback = beams[0] if width else recording.root_runs[position]
    branches = branch_runs(
        recording, position, tree.lookup_branches, tree.lookup_branch_length, fallback
    )  # (G,)
    left = recording.reply_tokens - position - 1  # drafted tokens the reply still has
    return np.minimum(np.concatenate([beams, branches]), max(left, 0))[None, :]


@dataclass(frozen=True)
class StepCost:
    """A step's seconds as the auto tree prices it before it has measured anything
    (`auto.step_seconds` on this calibration, one row, at the context's band),
    plus `tree_overhead` seconds for a step that verifies a tree (the host's work
    the calibration does not time)."""

    calibration: Calibration
    tree_overhead: float = 0.0
    _cache: dict[tuple[TreeConfig, int], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def seconds(self, tree: TreeConfig, context: int) -> float:
        context = context_band(context)
        key = (tree, context)
        if key not in self._cache:
            candidates = Candidates.of([tree])
            verify = float(step_seconds(candidates, self.calibration, 1, context)[0])
            self._cache[key] = verify + (0.0 if candidates.plain[0] else self.tree_overhead)
        return self._cache[key]


@dataclass
class Replayed:
    """What a replay decoded: tokens, steps (target forwards), seconds by the cost
    model, the steps of each tree, and each step's accepted drafted tokens."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    trees: Counter[str] = field(default_factory=Counter)
    accepted: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.tokens / max(self.steps, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _Checks:
    """The auto tree's hindsight checks and drafter probes over a recording, as a
    session runs them (`session.DecodingSession._hindsight`, `probes.py`): lookup
    branches checked at every step root since the last check once their tokens have
    come, one probe at a time, reported once its beams' tokens have come."""

    def __init__(self, auto: AutoTree, recording: Recording):
        self.auto, self.recording = auto, recording
        self.unchecked: list[int] = []
        self.probe: tuple[int, TreeConfig] | None = None

    def before(self, tree: TreeConfig, position: int) -> None:
        """Before a step of `tree` at `position`: the hindsight check and the probe
        the auto tree asks for."""
        if not tree.lookup_branches:
            self.unchecked.append(position)
        lookup = self.auto.hindsight(tree)
        if lookup is not None:
            span = lookup.lookup_branch_length - 1
            ready = [p for p in self.unchecked if p + span <= position]
            self.unchecked = [p for p in self.unchecked if p + span > position]
            if ready:
                at = np.array(ready)  # (K,) the step roots checked
                roots = self.recording.root_runs[at]  # (K,) no match: the root repeated
                runs = branch_runs(self.recording, at, lookup.lookup_branches, span + 1, roots)
                self.auto.record_hindsight(runs, lookup)  # (K, G)
        if self.probe is None:
            probe = self.auto.probe(tree)
            self.probe = None if probe is None else (position, probe)

    def after(self, position: int) -> None:
        """After a step, the reply decoded up to `position`: report the probe whose
        beams' tokens have all come."""
        if self.probe is None or position < self.probe[0] + self.probe[1].beam_length - 1:
            return
        start, probe = self.probe
        runs = self.recording.beam_runs[probe.beam_width, probe.beam_length][start]  # (W,)
        self.auto.record_probe(runs[None, :], probe)
        self.probe = None


def replay(
    recording: Recording,
    choice: TreeConfig | AutoTree,
    cost: StepCost,
    into: Replayed | None = None,
) -> Replayed:
    """Decode the recorded reply again with a fixed tree or the auto tree's choice:
    each step's tokens from the recorded runs, its seconds from `cost` (no cost for
    a switch between plain and tree steps, for probes or for hindsight checks), the
    auto tree told of each tree's first step as a session tells it (`built`).
    A recording without a drafter replays a tree's lookup branches alone, as a
    session without a drafter decodes it. Adds to `into` (a fresh `Replayed` when
    None) and returns it."""
    result = into if into is not None else Replayed()
    auto = choice if isinstance(choice, AutoTree) else None
    checks = _Checks(auto, recording) if auto is not None else None
    ran: set[TreeConfig] = set()  # a session's first step of a tree builds its functions
    position = 0
    while position < recording.reply_tokens:
        context = recording.prompt_tokens + position
        tree = auto.choose(1, context) if auto is not None else choice
        assert isinstance(tree, TreeConfig)
        if not recording.beam_runs:
            tree = tree.lookup_only
        recording.shape.check(tree)
        if checks is not None:
            checks.before(tree, position)
        runs = tree_runs(recording, tree, position)  # (1, W + G)
        accepted = int(runs.max(initial=0))
        seconds = cost.seconds(tree, context)
        position += accepted + 1
        result.tokens, result.steps = result.tokens + accepted + 1, result.steps + 1
        result.seconds += seconds
        result.trees[tree.label] += 1
        result.accepted.append(accepted)
        if auto is not None and checks is not None:
            auto.record(StepRecord(tree, 1, seconds, runs, context, built=tree not in ran))
            ran.add(tree)
            checks.after(position)
    return result


def auto_factory(calibration: Calibration, drafter: Drafter | None) -> Callable[[], AutoTree]:
    """New auto trees as `AutoTree.for_model` makes them, one per request, sharing
    what they measure of step costs, on `calibration` instead of the cached one."""
    candidates, prior, sampled = candidates_and_priors(drafter)
    measured = MeasuredCosts(len(candidates.trees))
    return lambda: AutoTree(calibration, candidates, prior, sampled, measured=measured)


def replay_trees(
    recordings: Sequence[Recording],
    trees: Sequence[TreeConfig | str],
    cost: StepCost,
    drafter: Drafter | None,
) -> dict[str, Replayed]:
    """Each tree ("auto": a new auto tree per recording, as per request) and plain
    decoding replayed over every recording, by tree label."""
    results: dict[str, Replayed] = {}
    for tree in (PLAIN_DECODING, *trees):
        new_auto = auto_factory(cost.calibration, drafter) if isinstance(tree, str) else None
        label = "auto" if isinstance(tree, str) else tree.label
        results[label] = Replayed()
        for recording in recordings:
            choice = new_auto() if new_auto is not None else tree
            assert isinstance(choice, (TreeConfig, AutoTree))
            replay(recording, choice, cost, into=results[label])
    return results


def record_replies(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    shape: RecordShape = RecordShape(),
    progress: Callable[[int, int], None] | None = None,
) -> list[Recording]:
    """Each prompt's greedy reply (plain decoding, up to `max_tokens` or the end of
    turn), recorded (`record`)."""
    from .generate import stream_generate

    recordings = []
    for index, prompt in enumerate(prompts):
        reply: list[int] = []
        for response in stream_generate(
            model, None, tokenizer, list(prompt), max_tokens=max_tokens, tree=PLAIN_DECODING
        ):
            reply.extend(response.tokens)
        recordings.append(record(model, drafter, prompt, reply, shape))
        if progress is not None:
            progress(index + 1, len(prompts))
    return recordings
