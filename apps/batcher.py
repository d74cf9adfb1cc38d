"""Continuous batching: one decode worker serves every request of the server.

A single worker thread owns the `DecodeState`. Requests wait in a queue; between two
steps the worker prefills the ones that arrived (`prefill(..., sampling=[...],
row_ids=[...])`) and appends them to the running batch (`DecodeState.extend`), so a
request joins at the next step instead of waiting for the batch to drain. Every step
is one `decode_step`; each row then goes through its own stop rules (`RowProgress`:
max_tokens, EOS, the context limit) and its own stop strings (detokenized text), and
finished or cancelled rows leave with `DecodeState.select_rows`.

The beam shape adapts to the number of rows (`BeamPolicy`): verification of a tree
costs more as the batch grows, so large batches use smaller trees or plain decoding.
The step functions of each beam shape are built once and cached.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_redrafter.config import PLAIN_DECODING, BeamConfig, CacheConfig, SamplingConfig
from mlx_redrafter.decode import (
    DecodeState,
    RowProgress,
    StepFunctions,
    decode_step,
    prefill,
    step_functions,
)
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.target import context_length, prepare_target


class StopText:
    """Streaming text of one row with its stop strings.

    Text that could be the start of a stop string is held back until the next tokens
    show it is not, so no part of a stop string ever reaches the client, streamed or
    not, even when it spans several steps.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self.detokenizer = tokenizer.detokenizer  # a fresh copy per access
        self.detokenizer.reset()
        self.stops = tuple(s for s in stops if s)
        self.pending = ""  # decoded, not yet released
        self.stopped = False

    def _held(self) -> int:
        """Length of the longest end of `pending` that begins some stop string."""
        for size in range(min(len(self.pending), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.pending[-size:]
            if any(stop.startswith(tail) for stop in self.stops):
                return size
        return 0

    def add(self, tokens: Sequence[int], final: bool) -> str:
        """The new text to release after these tokens (all of it when final)."""
        for token in tokens:
            self.detokenizer.add_token(token)
        if final:
            self.detokenizer.finalize()
        self.pending += self.detokenizer.last_segment
        if self.stops:
            hits = [i for stop in self.stops if (i := self.pending.find(stop)) >= 0]
            if hits:
                self.stopped = True
                released, self.pending = self.pending[: min(hits)], ""
                return released
            if not final:
                cut = len(self.pending) - self._held()
                released, self.pending = self.pending[:cut], self.pending[cut:]
                return released
        released, self.pending = self.pending, ""
        return released


@dataclass(frozen=True)
class BeamPolicy:
    """Which beam shape a step uses, by the number of rows in the batch.

    tiers: (largest batch size, beam) pairs in increasing batch size; a batch larger
    than every tier decodes plainly (W = L = 1).
    """

    tiers: tuple[tuple[int, BeamConfig], ...] = ()

    def beam_for(self, batch_size: int) -> BeamConfig:
        for largest, beam in self.tiers:
            if batch_size <= largest:
                return beam
        return PLAIN_DECODING

    @classmethod
    def parse(cls, text: str) -> BeamPolicy:
        """'2:4x4,4:2x3' -> up to 2 rows W=4 L=4, up to 4 rows W=2 L=3, plain beyond.

        'plain' (or '') never speculates; a single 'WxL' speculates at every batch size.
        """
        text = text.strip()
        if text in ("", "plain"):
            return cls(())
        tiers: list[tuple[int, BeamConfig]] = []
        for part in text.split(","):
            limit_text, _, shape = part.strip().rpartition(":")
            try:
                beam = BeamConfig.parse(shape)
                largest = int(limit_text) if limit_text else 1 << 30
            except ValueError:
                raise ValueError(
                    f"cannot read beam tier {part!r}: write MAXBATCH:WxL, MAXBATCH:WxL+G or "
                    "MAXBATCH:WxL+GxLl, e.g. '2:4x4,4:2x3'"
                ) from None
            tiers.append((largest, beam))
        tiers.sort(key=lambda tier: tier[0])
        return cls(tuple(tiers))

    def describe(self) -> str:
        if not self.tiers:
            return "plain decoding at every batch size"
        parts = [f"B<={n}: {b.label}" for n, b in self.tiers]
        return ", ".join(parts) + ", plain beyond"


# Measured on the development machine (docs/apps.md, "Speculation and batch size"): the
# break-even tau of each shape (its step time over a plain step at the same batch size)
# stays below ~1.75 with 3x3 for one row and 2x3 up to four rows; beyond, even 2x3 needs
# tau > 2 of at most 3, and plain decoding of a larger batch is cheap, so it decodes plainly.
DEFAULT_POLICY = BeamPolicy(((1, BeamConfig(3, 3)), (4, BeamConfig(2, 3))))


class SpeedGuard:
    """Falls back to plain decoding where the policy's tree measurably does not pay.

    It keeps running averages of tau per beam shape and of the step time per (shape,
    batch size), both measured on the steps the worker runs. Speculation at batch size
    B pays when tau x (plain step / speculative step) >= 1; where it does not (a weak
    drafter, text it drafts badly, a loaded machine), the guard decodes plainly and
    tries the tree again every `probe_every` steps to follow changes in tau.
    """

    def __init__(self, probe_every: int = 24, weight: float = 0.25):
        self.probe_every = probe_every
        self.weight = weight
        self.tau: dict[BeamConfig, float] = {}
        self.cost: dict[tuple[BeamConfig, int], float] = {}
        self._plain_steps: dict[int, int] = {}

    def _average(self, table: dict[Any, float], key: Any, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - self.weight) * old + self.weight * value

    def record(self, beam: BeamConfig, batch_size: int, seconds: float, tau: float) -> None:
        self._average(self.cost, (beam, batch_size), seconds)
        if beam != PLAIN_DECODING:
            self._average(self.tau, beam, tau)

    def gain(self, beam: BeamConfig, batch_size: int) -> float | None:
        """Measured speed-up of `beam` over plain decoding at this batch size, if known."""
        tau = self.tau.get(beam)
        speculative = self.cost.get((beam, batch_size))
        plain = self.cost.get((PLAIN_DECODING, batch_size))
        if tau is None or speculative is None or plain is None:
            return None
        return tau * plain / speculative

    def choose(self, beam: BeamConfig, batch_size: int) -> BeamConfig:
        if beam == PLAIN_DECODING:
            return beam
        if (beam, batch_size) not in self.cost or beam not in self.tau:
            return beam  # measure the tree first
        if (PLAIN_DECODING, batch_size) not in self.cost:
            return PLAIN_DECODING  # then the plain step it competes with
        gain = self.gain(beam, batch_size)
        if gain is not None and gain >= 1.0:
            return beam
        waited = self._plain_steps.get(batch_size, 0) + 1
        self._plain_steps[batch_size] = 0 if waited >= self.probe_every else waited
        return beam if waited >= self.probe_every else PLAIN_DECODING


@dataclass(frozen=True)
class RowUpdate:
    """What one step gave one request (delivered on the worker thread).

    text: new text (stop strings already cut); tokens: the new token ids, of which the
    first `num_accepted` were drafted and accepted and the last is the target's own.
    finish_reason: None while running; "stop", "length", "cancelled" or "error".
    tokens_per_step: tau so far (counting the bonus token and a final EOS).
    accepted_tokens: drafted tokens accepted so far.
    """

    text: str
    tokens: list[int]
    num_accepted: int
    finish_reason: str | None
    prompt_tokens: int
    generation_tokens: int
    steps: int
    tokens_per_step: float
    accepted_tokens: int
    generation_tps: float
    beam_width: int
    beam_length: int
    batch_size: int
    error: str | None = None


@dataclass(eq=False)
class Job:
    """One request: token ids, its sampling rules and stop rules, and where updates go."""

    prompt: list[int]
    on_update: Callable[[RowUpdate], None]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = -1

    def cancel(self) -> None:
        """Ask the worker to drop this request before its next step."""
        self.cancelled.set()


@dataclass
class _Row:
    job: Job
    progress: RowProgress
    text: StopText
    produced: int = 0  # tau's numerator
    accepted: int = 0
    steps: int = 0
    decode_seconds: float = 0.0


@dataclass
class BatcherStats:
    """Counters for the status endpoint and the tests."""

    steps: int = 0
    admitted: int = 0
    joined: int = 0  # admitted into a batch that was already decoding
    finished: int = 0
    cancelled: int = 0
    largest_batch: int = 0
    steps_by_beam: dict[str, int] = field(default_factory=dict)


class Batcher:
    """The decode worker. `submit` jobs from any thread; updates arrive via callbacks.

    model: a target prepared by `prepare_target` (done here if not);
    drafter: None decodes plainly; policy: beam shape per batch size;
    max_batch: rows decoded together (more requests wait their turn);
    guard: a `SpeedGuard` that decodes plainly where the policy's tree measurably does
    not pay (None: always the policy's shape);
    seed: the sampling stream of the worker (None: random). A request's `seed`
    restarts the stream when it arrives to an idle worker, so a seeded sampled
    request served alone is reproducible; sampled rows decoding together share the
    stream (greedy rows never depend on it).
    """

    def __init__(
        self,
        model: nn.Module,
        drafter: Drafter | None,
        tokenizer: Any,
        policy: BeamPolicy = DEFAULT_POLICY,
        cache_config: CacheConfig | None = None,
        max_batch: int = 16,
        seed: int | None = None,
        guard: SpeedGuard | None = None,
    ):
        prepare_target(model)
        if drafter is not None:
            drafter.check_fits(model)
        # MLX streams belong to threads: weights still lazy here could not be evaluated
        # on the worker thread, so evaluate them on this one.
        mx.eval(model.parameters(), drafter.parameters() if drafter is not None else [])
        self.model = model
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.policy = policy if drafter is not None else BeamPolicy(())
        if drafter is not None:
            for _, beam in self.policy.tiers:
                if beam.beam_width > drafter.config.output_size:
                    raise ValueError(
                        f"beam width {beam.beam_width} exceeds the drafter's vocabulary of "
                        f"{drafter.config.output_size} tokens: use a smaller width"
                    )
        self.guard = guard
        self.cache_config = cache_config or CacheConfig()
        self.max_batch = max_batch
        self.context_limit = context_length(model)
        # The context check looks one step ahead with the longest beam any tier may use.
        self.longest_beam = max((beam.longest_beam for _, beam in self.policy.tiers), default=1)
        self.eos_ids = frozenset(int(t) for t in (getattr(tokenizer, "eos_token_ids", None) or ()))
        self.vocab_size = int(model.model.embed_tokens.weight.shape[0])
        self.stats = BatcherStats()
        self._key = mx.random.key(seed if seed is not None else secrets.randbits(32))
        mx.eval(self._key)
        self._steps: dict[BeamConfig, StepFunctions] = {}
        self._pending: list[Job] = []
        self._rows: dict[int, _Row] = {}
        self._ids = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="redrafter-decode", daemon=True)
        self._thread.start()

    # -- the public side ------------------------------------------------------------

    def check_prompt(self, prompt: Sequence[int]) -> str | None:
        """Why this prompt cannot be served, or None."""
        if not prompt:
            return "the prompt is empty"
        if self.context_limit is not None and len(prompt) >= self.context_limit:
            return (
                f"the prompt has {len(prompt)} tokens but the model's context is "
                f"{self.context_limit} positions: shorten it"
            )
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            return f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
        return None

    def submit(self, job: Job) -> Job:
        problem = self.check_prompt(job.prompt)
        if problem is not None:
            raise ValueError(problem)
        with self._wake:
            if self._closed:
                raise RuntimeError("the decode worker has stopped")
            job.id = next(self._ids)
            if job.max_tokens == 0:
                self._emit_unstarted(job, "length")
                return job
            self._pending.append(job)
            self._wake.notify()
        return job

    @property
    def active(self) -> int:
        """Rows in the running batch."""
        return len(self._rows)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    def warm_up(self) -> None:
        """Build the step functions of every tier (and plain) ahead of the first request."""
        for _, beam in self.policy.tiers:
            self._functions(beam)
        self._functions(PLAIN_DECODING)

    # -- the worker -----------------------------------------------------------------

    def _functions(self, beam: BeamConfig) -> StepFunctions:
        if beam not in self._steps:
            self._steps[beam] = step_functions(self.model, self.drafter, beam)
        return self._steps[beam]

    def _take_pending(self, block: bool) -> list[Job]:
        with self._wake:
            while block and not self._pending and not self._closed:
                self._wake.wait()
            room = self.max_batch - len(self._rows)
            taken, self._pending = self._pending[:room], self._pending[room:]
        return taken

    def _run(self) -> None:
        state: DecodeState | None = None
        while True:
            jobs = self._take_pending(block=not self._rows)
            if self._closed:
                for row in self._rows.values():
                    self._finish(row, "cancelled")
                return
            jobs = [job for job in jobs if not self._drop_if_cancelled(job)]
            try:
                if jobs:
                    state = self._admit(state, jobs)
                if state is not None and self._rows:
                    state = self._step(state)
            except Exception as error:  # a failed step must not take the server down
                traceback.print_exc()
                message = f"{type(error).__name__}: {error}"
                for row in list(self._rows.values()):
                    self._emit(row, "", [], 0, "error", error=message)
                for job in jobs:
                    if job.id not in self._rows:
                        self._emit_unstarted(job, "error", message)
                self._rows.clear()
                state = None

    def _drop_if_cancelled(self, job: Job) -> bool:
        if job.cancelled.is_set():
            self.stats.cancelled += 1
            self._emit_unstarted(job, "cancelled")
            return True
        return False

    def _job_key(self, job: Job) -> mx.array:
        """A request's own PRNG key: from its seed (reproducible whatever shares the
        batch), else the next key of the batcher's stream."""
        if job.seed is not None:
            return mx.random.key(job.seed)
        self._key, key = mx.random.split(self._key)
        return key

    def _admit(self, state: DecodeState | None, jobs: list[Job]) -> DecodeState:
        fresh = prefill(
            self.model,
            [job.prompt for job in jobs],
            self.cache_config,
            sampling=[job.sampling for job in jobs],
            row_ids=[job.id for job in jobs],
            keys=mx.stack([self._job_key(job) for job in jobs]),
        )
        for job in jobs:
            self._rows[job.id] = _Row(
                job, RowProgress(job.max_tokens, self.eos_ids), StopText(self.tokenizer, job.stop)
            )
        self.stats.admitted += len(jobs)
        if state is None or not state.row_ids:
            return fresh
        self.stats.joined += len(jobs)
        state.extend(fresh)
        return state

    def _step(self, state: DecodeState) -> DecodeState | None:
        batch_size = len(state.row_ids)
        beam = self.policy.beam_for(batch_size)
        if self.guard is not None:
            beam = self.guard.choose(beam, batch_size)
        functions = self._functions(beam)
        started = time.perf_counter()
        output = decode_step(self.model, functions, state)
        seconds = time.perf_counter() - started
        if self.guard is not None:
            tau = 1 + sum(output.num_accepted) / batch_size
            self.guard.record(beam, batch_size, seconds, tau)
        self.stats.steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, batch_size)
        name = beam.label
        self.stats.steps_by_beam[name] = self.stats.steps_by_beam.get(name, 0) + 1
        keep = []
        for position, (row_id, tokens, accepted, length) in enumerate(
            zip(state.row_ids, output.tokens, output.num_accepted, state.cache.host_lengths)
        ):
            row = self._rows[row_id]
            kept, counted, reason = row.progress.take(
                tokens, length, self.longest_beam, self.context_limit
            )
            text = row.text.add(kept, final=reason is not None)
            if row.text.stopped:
                reason = "stop"
            row.produced += counted
            row.accepted += accepted
            row.steps += 1
            row.decode_seconds += seconds
            if reason is None and row.job.cancelled.is_set():
                reason = "cancelled"
            self._emit(row, text, kept, accepted, reason, batch_size=batch_size, beam=beam)
            if reason is None:
                keep.append(position)
            else:
                del self._rows[row_id]
                self.stats.finished += 1
                self.stats.cancelled += reason == "cancelled"
        if not keep:
            return None
        if len(keep) != batch_size:
            state.select_rows(keep)
        return state

    def _finish(self, row: _Row, reason: str) -> None:
        self._emit(row, "", [], 0, reason)

    def _emit(
        self,
        row: _Row,
        text: str,
        tokens: list[int],
        accepted: int,
        reason: str | None,
        batch_size: int = 0,
        beam: BeamConfig = PLAIN_DECODING,
        error: str | None = None,
    ) -> None:
        update = RowUpdate(
            text=text,
            tokens=tokens,
            num_accepted=accepted,
            finish_reason=reason,
            prompt_tokens=len(row.job.prompt),
            generation_tokens=row.progress.generated,
            steps=row.steps,
            tokens_per_step=row.produced / row.steps if row.steps else 0.0,
            accepted_tokens=row.accepted,
            generation_tps=row.progress.generated / max(row.decode_seconds, 1e-9),
            beam_width=beam.beam_width,
            beam_length=beam.beam_length,
            batch_size=batch_size,
            error=error,
        )
        self._deliver(row.job, update)

    def _emit_unstarted(self, job: Job, reason: str, error: str | None = None) -> None:
        update = RowUpdate("", [], 0, reason, len(job.prompt), 0, 0, 0.0, 0, 0.0, 1, 1, 0, error)
        self._deliver(job, update)

    @staticmethod
    def _deliver(job: Job, update: RowUpdate) -> None:
        try:
            job.on_update(update)
        except Exception:  # a broken consumer must not stop the other rows
            traceback.print_exc()
            job.cancel()
