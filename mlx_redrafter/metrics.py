"""Decoding figures, computed in one place for the API, the chat app, the server and
the benchmark.

tau (tokens per step): tokens the target produced per verification forward, counting
its bonus token and a final EOS token (which is not part of the text).
acceptance by depth: the fraction of steps whose first k drafted tokens were all
accepted, for k = 1, 2, ...: how deep into the tree the target agreed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace


def tokens_per_step(produced: float, steps: int) -> float:
    """tau: produced tokens over target steps (0 before the first step)."""
    return produced / steps if steps else 0.0


def throughput(tokens: float, seconds: float) -> float:
    """Tokens per second (0 for no time)."""
    return tokens / seconds if seconds > 0 else 0.0


def accepted_counts(accepted: Sequence[int], depth: int) -> list[int]:
    """counts[k] = steps that accepted exactly k drafted tokens, k in [0, depth)."""
    counts = [0] * max(depth, 1)
    for count in accepted:
        counts[min(count, len(counts) - 1)] += 1
    return counts


def acceptance_by_depth(counts: Sequence[int]) -> list[float]:
    """From `accepted_counts`: the fraction of steps that accepted at least k drafted
    tokens, for k = 1 .. len(counts) - 1."""
    steps = sum(counts)
    if not steps:
        return [0.0] * (len(counts) - 1)
    return [sum(counts[k:]) / steps for k in range(1, len(counts))]


@dataclass
class RequestMetrics:
    """Running figures of one request, updated once per step.

    generated: tokens emitted to the caller; produced: tau's numerator (generated,
    plus a final EOS); accepted: drafted tokens the target accepted; accepted_counts:
    steps by number of accepted drafted tokens (index k: exactly k).
    """

    prompt_tokens: int
    prompt_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens taken from a prompt cache, not prefilled
    generated: int = 0
    produced: int = 0
    steps: int = 0
    accepted: int = 0
    decode_seconds: float = 0.0
    accepted_counts: list[int] = field(default_factory=list)

    def record(self, emitted: int, counted: int, num_accepted: int, seconds: float) -> None:
        """Add one step: `emitted` tokens kept, `counted` for tau, `num_accepted` drafted."""
        self.generated += emitted
        self.produced += counted
        self.steps += 1
        self.accepted += num_accepted
        self.decode_seconds += seconds
        if len(self.accepted_counts) <= num_accepted:
            self.accepted_counts.extend([0] * (num_accepted + 1 - len(self.accepted_counts)))
        self.accepted_counts[num_accepted] += 1

    def snapshot(self) -> RequestMetrics:
        """A copy that later steps do not change."""
        return replace(self, accepted_counts=list(self.accepted_counts))

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.produced, self.steps)

    @property
    def generation_tps(self) -> float:
        return throughput(self.generated, self.decode_seconds)

    @property
    def prompt_tps(self) -> float:
        """Prefilled tokens (cached ones excluded) per second of prefill."""
        return throughput(self.prompt_tokens - self.cached_tokens, self.prompt_seconds)

    @property
    def acceptance_by_depth(self) -> list[float]:
        return acceptance_by_depth(self.accepted_counts)

    @property
    def step_seconds(self) -> float:
        """Mean wall-clock of one decoding step."""
        return self.decode_seconds / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class AcceptanceTable:
    """Expected acceptance per depth of a step's candidates, measured by decoding.

    beams[k][d - 1]: the fraction of steps where the best of the drafter's first
        k + 1 beams had its first d drafted tokens accepted (beams are ranked best first).
    lookup[k][d - 1]: the same for the first k + 1 lookup branches.
    joint[k][g][d - 1]: the same for the best of the first k drafter beams and the
        first g lookup branches together (k, g >= 0; [0][0] is empty), measured in the
        same steps: the two kinds often propose the same tokens, so their union
        accepts less than if they were independent.
    alone[k][d - 1]: the same for the first k + 1 lookup branches of trees without
        drafter beams (with the drafter's n-gram table), measured on the same prompts
        apart: beside beams a branch that finds no match copies the best beam, so
        `lookup` counts the beam's acceptance too ([] when not measured).
    temperature: the sampling temperature it was measured at (0: greedy); steps: the
    steps it was measured on; source: the prompts and tree it was measured with.
    by_length: the beams (and joint) of the same drafter measured on the same prompts
    with trees of other beam lengths L, one table each. A beam's length is what beam
    search ranks it by: longer beams keep fewer distinct first tokens (eight beams of
    7 tokens start with about two), so the first levels of short, wide trees accept
    more than the rows of a long tree say. A table's beam length is its rows' depth
    plus one (`beam_length`).
    """

    beams: tuple[tuple[float, ...], ...] = ()
    lookup: tuple[tuple[float, ...], ...] = ()
    joint: tuple[tuple[tuple[float, ...], ...], ...] = ()
    temperature: float = 0.0
    steps: int = 0
    source: str = ""
    by_length: tuple[AcceptanceTable, ...] = ()
    alone: tuple[tuple[float, ...], ...] = ()

    @property
    def beam_length(self) -> int:
        """L of the tree the beams were measured with (0: no beams)."""
        return len(self.beams[0]) + 1 if self.beams else 0

    def beams_by_length(self) -> dict[int, AcceptanceTable]:
        """Beam length L -> the table measured with beams of L tokens, this one included."""
        tables = {t.beam_length: t for t in self.by_length if t.beams}
        if self.beams:
            tables[self.beam_length] = self
        return dict(sorted(tables.items()))

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = {
            "beams": [list(row) for row in self.beams],
            "lookup": [list(row) for row in self.lookup],
            "joint": [[list(row) for row in rows] for rows in self.joint],
            "temperature": self.temperature,
            "steps": self.steps,
            "source": self.source,
        }
        if self.by_length:
            data["by_length"] = [t.to_dict() for t in self.by_length]
        if self.alone:
            data["alone"] = [list(row) for row in self.alone]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> AcceptanceTable:
        def rows(name: str) -> tuple[tuple[float, ...], ...]:
            return rows_of(data.get(name, []), name)

        def rows_of(value: object, name: str) -> tuple[tuple[float, ...], ...]:
            if not isinstance(value, list) or not all(isinstance(r, list) for r in value):
                raise ValueError(f"acceptance table: {name!r} must be a list of lists")
            table = tuple(tuple(float(p) for p in row) for row in value)
            if any(not 0 <= p <= 1 for row in table for p in row):
                raise ValueError(f"acceptance table: {name!r} holds a value outside [0, 1]")
            return table

        joint = data.get("joint", [])
        if not isinstance(joint, list) or not all(isinstance(rows, list) for rows in joint):
            raise ValueError("acceptance table: 'joint' must be a list of lists of lists")
        cube = tuple(rows_of(rows, "joint") for rows in joint)
        temperature, steps = data.get("temperature", 0.0), data.get("steps", 0)
        if not isinstance(temperature, (int, float)) or not isinstance(steps, int):
            raise ValueError("acceptance table: temperature must be a number, steps an integer")
        source = str(data.get("source", ""))
        others = data.get("by_length", [])
        if not isinstance(others, list) or not all(isinstance(t, dict) for t in others):
            raise ValueError("acceptance table: 'by_length' must be a list of tables")
        by_length = tuple(cls.from_dict(t) for t in others)
        lengths = [t.beam_length for t in by_length]
        if any(t.by_length or not t.beams for t in by_length) or len(set(lengths)) < len(lengths):
            raise ValueError(
                "acceptance table: 'by_length' holds tables of drafter beams, one per beam "
                "length, without tables of their own"
            )
        beams, lookup, alone = rows("beams"), rows("lookup"), rows("alone")
        for name, table in (("beams", beams), ("lookup", lookup), ("alone", alone)):
            if any(len(row) != len(table[0]) for row in table):
                raise ValueError(
                    f"acceptance table: every row of {name!r} must have the same depth"
                )
        if any(t.temperature != temperature for t in by_length):
            raise ValueError("acceptance table: 'by_length' tables are measured at its temperature")
        return cls(beams, lookup, cube, float(temperature), steps, source, by_length, alone)


def survival(runs: Sequence[Sequence[int]], depth: int) -> tuple[tuple[float, ...], ...]:
    """From each step's runs (accepted drafted tokens of each candidate, ranked best
    first): row k, depth d -> the fraction of steps whose best of the first k + 1
    candidates accepted at least d tokens, for d = 1 .. depth."""
    if not runs:
        return ()
    count = len(runs)
    width = min(len(row) for row in runs)
    table = []
    for k in range(width):
        best = [max(row[: k + 1]) for row in runs]
        table.append(tuple(sum(b >= d for b in best) / count for d in range(1, depth + 1)))
    return tuple(table)


def joint_survival(
    runs: Sequence[Sequence[int]], width: int, depth: int
) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """From each step's runs (the first `width` are drafter beams, the rest lookup
    branches, each kind ranked best first): [k][g][d - 1] -> the fraction of steps
    where the best of the first k beams and first g branches accepted at least d
    tokens (k = 0 .. width, g = 0 .. branches; [0][0] is all zeros)."""
    if not runs:
        return ()
    branches = min(len(row) for row in runs) - width
    cube = []
    for k in range(width + 1):
        plane = []
        for g in range(branches + 1):
            best = [max([-1, *row[:k], *row[width : width + g]]) for row in runs]
            plane.append(tuple(sum(b >= d for b in best) / len(runs) for d in range(1, depth + 1)))
        cube.append(tuple(plane))
    return tuple(cube)
