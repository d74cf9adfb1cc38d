"""Which tree a step uses: a tree per batch size, and a guard that decodes plainly
where the tree measurably does not pay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .config import PLAIN_DECODING, TreeConfig


@dataclass(frozen=True)
class StepRecord:
    """What a decoding step tells its tree choice (`TreeChoice.record`).

    tree: the tree the step verified (plain decoding for a plain step); batch_size: B;
    seconds: from its launch to its tokens on the host and the host's work after it;
    runs: (B, W + G) drafted tokens each candidate had accepted, the drafter's beams
    first; context: the rows' longest committed length after it; built: the step ran
    some compiled function at shapes it had not run at in its session (it traced it
    and built its kernels then), so its time is not a cost
    (`DecodingSession._first_run`).
    """

    tree: TreeConfig
    batch_size: int
    seconds: float
    runs: np.ndarray
    context: int
    built: bool = False


@dataclass(frozen=True)
class TreePolicy:
    """The tree of a step, by the number of rows in the batch.

    tiers: (largest batch size, tree) pairs in increasing batch size; a batch larger
    than every tier decodes plainly (W = L = 1).
    """

    tiers: tuple[tuple[int, TreeConfig], ...] = ()

    @classmethod
    def fixed(cls, tree: TreeConfig) -> TreePolicy:
        """The same tree at every batch size."""
        return cls(((1 << 30, tree),))

    def tree_for(self, batch_size: int) -> TreeConfig:
        for largest, tree in self.tiers:
            if batch_size <= largest:
                return tree
        return PLAIN_DECODING

    @property
    def trees(self) -> list[TreeConfig]:
        """Every tree a step may use, plain decoding included."""
        return [tree for _, tree in self.tiers] + [PLAIN_DECODING]

    @classmethod
    def parse(cls, text: str) -> TreePolicy:
        """'2:4x4,4:2x3' -> up to 2 rows 4x4, up to 4 rows 2x3, plain beyond.

        'plain' (or '') never speculates; a single tree ('1x2+1x7') is used at every
        batch size.
        """
        text = text.strip()
        if text in ("", "plain"):
            return cls(())
        tiers: list[tuple[int, TreeConfig]] = []
        for part in text.split(","):
            head, colon, rest = part.strip().partition(":")
            limit_text, shape = (head, rest) if colon and head.isdigit() else ("", part)
            try:
                tree = TreeConfig.parse(shape)
                largest = int(limit_text) if limit_text else 1 << 30
            except ValueError:
                raise ValueError(
                    f"cannot read tree tier {part!r}: write TREE (e.g. 1x2+1x7) for every "
                    "batch size, or MAXBATCH:TREE tiers, e.g. '2:4x4,4:2x3'"
                ) from None
            tiers.append((largest, tree))
        tiers.sort(key=lambda tier: tier[0])
        return cls(tuple(tiers))

    def describe(self) -> str:
        if not self.tiers:
            return "plain decoding at every batch size"
        if len(self.tiers) == 1 and self.tiers[0][0] >= 1 << 30:
            return f"{self.tiers[0][1].label} at every batch size"
        parts = [f"B<={n}: {tree.label}" for n, tree in self.tiers]
        return ", ".join(parts) + ", plain beyond"


class SpeedGuard:
    """Falls back to plain decoding where the policy's tree measurably does not pay.

    It keeps running averages of tau per tree and of the step time per (tree, batch
    size), both measured on the steps the session runs. Speculation at batch size B
    pays when tau x (plain step / speculative step) >= 1; where it does not (a weak
    drafter, text it drafts badly, a loaded machine), the guard decodes plainly and
    tries the tree again every `probe_every` steps to follow changes in tau.
    """

    def __init__(self, probe_every: int = 24, weight: float = 0.25):
        self.probe_every = probe_every
        self.weight = weight
        self.tau: dict[TreeConfig, float] = {}
        self.cost: dict[tuple[TreeConfig, int], float] = {}
        self._plain_steps: dict[int, int] = {}

    def _average(self, table: dict[Any, float], key: Any, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - self.weight) * old + self.weight * value

    def record(self, tree: TreeConfig, batch_size: int, seconds: float | None, tau: float) -> None:
        """A step's tau and time (None: its time is no cost, as it built functions)."""
        if seconds is not None:
            self._average(self.cost, (tree, batch_size), seconds)
        if tree != PLAIN_DECODING:
            self._average(self.tau, tree, tau)

    def gain(self, tree: TreeConfig, batch_size: int) -> float | None:
        """Measured speed-up of `tree` over plain decoding at this batch size, if known."""
        tau = self.tau.get(tree)
        speculative = self.cost.get((tree, batch_size))
        plain = self.cost.get((PLAIN_DECODING, batch_size))
        if tau is None or speculative is None or plain is None:
            return None
        return tau * plain / speculative

    def choose(self, tree: TreeConfig, batch_size: int) -> TreeConfig:
        if tree == PLAIN_DECODING:
            return tree
        if (tree, batch_size) not in self.cost or tree not in self.tau:
            return tree  # measure the tree first
        if (PLAIN_DECODING, batch_size) not in self.cost:
            return PLAIN_DECODING  # then the plain step it competes with
        gain = self.gain(tree, batch_size)
        if gain is not None and gain >= 1.0:
            return tree
        waited = self._plain_steps.get(batch_size, 0) + 1
        self._plain_steps[batch_size] = 0 if waited >= self.probe_every else waited
        return tree if waited >= self.probe_every else PLAIN_DECODING


class TreeChoice(Protocol):
    """What a session asks before each step and tells after it, once the host's work
    after it is known: at the next step, at an `add`, or when the batch ends
    (`FixedTrees`, `auto.AutoTree`). A choice may also learn lookup acceptance in hindsight, as the
    auto tree does: `hindsight(tree) -> TreeConfig | None` names lookup branches to
    check on a step of `tree`, and `record_hindsight(runs, lookup_tree)` gets the
    runs (M, G) they would have had accepted at each step since the last check,
    one row per such step and row (`lookup.hindsight_runs`); and
    drafter acceptance from probes: `probe(tree) -> TreeConfig | None` names a
    drafter tree to draft unverified on a step of `tree`, and
    `record_probe(runs, probe_tree)` gets the runs (B, W) its beams would have had
    accepted (`probes.py`)."""

    @property
    def trees(self) -> list[TreeConfig]:
        """Every tree a step may use (a bounded set of shapes)."""
        ...

    def describe(self) -> str: ...

    def choose(self, batch_size: int, context: int = 0, temperature: float = 0.0) -> TreeConfig:
        """The tree of the next step of `batch_size` rows at context length `context`,
        `temperature` the highest sampling temperature among them (0: greedy)."""
        ...

    def record(self, step: StepRecord) -> None:
        """Learn from a step: its time and each row's runs (`StepRecord`)."""
        ...


@dataclass(frozen=True)
class FixedTrees:
    """The policy's tree at each batch size, with an optional speed guard."""

    policy: TreePolicy
    guard: SpeedGuard | None = None

    @property
    def trees(self) -> list[TreeConfig]:
        return self.policy.trees

    def describe(self) -> str:
        return self.policy.describe()

    def choose(self, batch_size: int, context: int = 0, temperature: float = 0.0) -> TreeConfig:
        tree = self.policy.tree_for(batch_size)
        return self.guard.choose(tree, batch_size) if self.guard is not None else tree

    def record(self, step: StepRecord) -> None:
        if self.guard is not None:
            runs = step.runs
            tau = 1.0 + float(np.mean(np.max(runs, axis=1))) if runs.size else 1.0
            seconds = None if step.built else step.seconds
            self.guard.record(step.tree, step.batch_size, seconds, tau)
