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
        return throughput(self.prompt_tokens, self.prompt_seconds)

    @property
    def acceptance_by_depth(self) -> list[float]:
        return acceptance_by_depth(self.accepted_counts)

    @property
    def step_seconds(self) -> float:
        """Mean wall-clock of one decoding step."""
        return self.decode_seconds / self.steps if self.steps else 0.0
