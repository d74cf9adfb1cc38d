"""The decoding session: the one engine behind the API, chat, server and benchmark.

A `DecodingSession` owns a batch of requests in flight: the target's cache, each
request's stop rules (max_tokens, EOS, the context limit, stop strings), its
incremental detokenization and its metrics. Every `step` is

    draft -> pack tree -> verify -> accept -> commit cache -> yield

for all rows at once (`decode.decode_step`), after which each row's new tokens go
through its stop rules and text, and finished rows leave the batch. Requests may
join between steps (`add` prefills them and appends them to the running batch).

The API decodes its prompts with `run`; the server's worker thread calls `add` and
`step` itself (continuous batching); the benchmark and distillation use token ids
alone (no tokenizer).
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .auto import AutoTree
from .confidence import DraftConfidence, shared_confidence
from .config import (
    DEFAULT_TREE,
    GREEDY,
    PLAIN_DECODING,
    CacheConfig,
    SamplingConfig,
    StopConfig,
    TreeConfig,
    as_tree,
)
from .decode import (
    DecodeState,
    PhaseClock,
    Prefill,
    StepFunctions,
    StepOutput,
    decode_step,
    draft,
    plan_step,
    shared_step_functions,
    step_functions,
)
from .distributed import agreed_key, agreed_seconds, agreed_values, sharding_group
from .drafter import Drafter
from .kernels import Kernels
from .logprobs import MAX_TOP, TokenLogprob
from .lookup import hindsight_runs
from .metrics import RequestMetrics
from .ngrams import table_branches
from .policy import FixedTrees, SpeedGuard, StepRecord, TreeChoice, TreePolicy
from .probes import DraftProbe
from .prompt_cache import PromptCache
from .streams import THREAD as _THREAD
from .streams import generation_stream
from .target import TargetCache, context_length, prepare_target


@dataclass(frozen=True)
class Request:
    """One generation request in token ids.

    key: the request's MLX PRNG key (2,); required when it samples. Its token at
    position p is drawn with noise keyed by (key, p), so a seeded request gives the
    same tokens whatever tree decodes it and whatever shares its batch.
    prefix: a `PromptCache`: the prompt's prefix it holds is not prefilled again, and
    when the request ends it holds this request's prompt and reply.
    logprobs: report each emitted token's log-probability under the target and this
    many most likely alternatives (0..20, `logprobs.py`); None: none.
    """

    prompt: Sequence[int]
    sampling: SamplingConfig = GREEDY
    stop: StopConfig = StopConfig()
    key: mx.array | None = None
    prefix: PromptCache | None = None  # reused K/V of earlier turns; takes this one's
    logprobs: int | None = None


@dataclass(frozen=True)
class Update:
    """What one step gave one request.

    text: the new text (stop strings and anything after them cut; text that may
    begin a stop string is held back until the next tokens show it does not).
    tokens: the token ids emitted in this step: `num_accepted` drafted tokens the
    target accepted, then its own token (fewer when the request stopped).
    finish_reason: None while running; "stop" (EOS or a stop string), "length" or
    "cancelled" (or "error" where a server reports a failed step, with `error`).
    metrics: the request's running figures after this step.
    tree: the tree this step used (PLAIN_DECODING when it decoded plainly);
    tree_size: distinct prefixes it verified for this request; batch_size: rows.
    logprobs: one per token in `tokens`, when the request asked for them.
    """

    request: int
    text: str
    tokens: list[int]
    num_accepted: int
    finish_reason: str | None
    metrics: RequestMetrics
    tree: TreeConfig = PLAIN_DECODING
    tree_size: int = 1
    batch_size: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def unstarted(
        cls, request: int, prompt_tokens: int, reason: str, error: str | None = None
    ) -> Update:
        """The last update of a request that ends without a step (cancelled, failed)."""
        return cls(request, "", [], 0, reason, RequestMetrics(prompt_tokens), error=error)


@dataclass(frozen=True)
class _TimedStep:
    """A step the policy has not been told of yet (its seconds from launch to its
    tokens on the host), and when it ended."""

    step: StepRecord
    ended: float


def stop_config(tokenizer: Any, max_tokens: int, stop: Sequence[str] | str | None) -> StopConfig:
    """The stop rules of a request: max_tokens, the tokenizer's EOS ids, stop strings."""
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    eos = frozenset(int(t) for t in (getattr(tokenizer, "eos_token_ids", None) or ()))
    return StopConfig(max_tokens, eos, strings)


def request_keys(seed: int | None, count: int) -> list[mx.array]:
    """One PRNG key per request, split from `seed` (None: a random seed)."""
    key = mx.random.key(seed if seed is not None else secrets.randbits(32))
    return list(mx.random.split(key, count)) if count else []


class StopText:
    """Incremental detokenization of one request, with its stop strings.

    Text that could be the start of a stop string is held back until the next tokens
    show it is not, so no part of a stop string ever reaches the caller, streamed or
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


@dataclass
class RowProgress:
    """Host-side stop rules of one row: max_tokens, EOS ids, the context limit."""

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    generated: int = 0

    def take(
        self, tokens: list[int], committed: int, depth: int, limit: int | None
    ) -> tuple[list[int], int, str | None]:
        """Apply the stop rules to a step's new tokens.

        committed: the row's committed length after the step; depth: the most tokens
        the next step may add; limit: the model's context.
        Returns (tokens kept, tokens counted for tau, finish reason or None).
        """
        tokens = tokens[: self.max_tokens - self.generated]
        reason = None
        for position, token in enumerate(tokens):
            if token in self.eos_token_ids:
                tokens, reason = tokens[:position], "stop"
                break
        self.generated += len(tokens)
        if reason is None and (
            self.generated >= self.max_tokens or (limit is not None and committed + depth > limit)
        ):
            reason = "length"
        return tokens, len(tokens) + (reason == "stop"), reason

    def may_end(self, count: int, committed: int, depth: int, limit: int | None) -> bool:
        """Whether `take` ends the row on `count` more tokens by max_tokens or the
        context (`committed`: its length after them), whatever the tokens are."""
        return self.generated + count >= self.max_tokens or (
            limit is not None and committed + depth > limit
        )


@dataclass
class _Row:
    """A request in flight."""

    id: int
    request: Request
    progress: RowProgress
    text: StopText | None
    metrics: RequestMetrics
    cancelled: bool = False

    def advance(
        self, tokens: list[int], committed: int, depth: int, limit: int | None
    ) -> tuple[list[int], int, str, str | None]:
        """A step's new tokens through the stop rules and the text.

        Returns (tokens kept, tokens counted for tau, new text, finish reason or None).
        """
        kept, counted, ended = self.progress.take(tokens, committed, depth, limit)
        text = "" if self.text is None else self.text.add(kept, final=ended is not None)
        if self.text is not None and self.text.stopped:
            ended = "stop"
        return kept, counted, text, ended


@dataclass
class SessionStats:
    """Counters of a session's steps."""

    steps: int = 0
    largest_batch: int = 0
    steps_by_tree: dict[str, int] = field(default_factory=dict)


_WIRED = threading.Lock()
_wired_users = 0


@contextlib.contextmanager
def wired_limit(model: nn.Module) -> Iterator[None]:
    """On Metal, wire memory up to the GPU's recommended working set while decoding (as
    mlx-lm does for large models); a no-op on other backends. Nested and concurrent
    uses share one setting: the first sets it and the last restores it, after the
    generation streams have finished their work (a step drafted ahead included)."""
    global _wired_users
    if not mx.metal.is_available():
        yield
        return
    with _WIRED:
        _wired_users += 1
        if _wired_users == 1:
            _THREAD.wired_before = mx.set_wired_limit(
                int(mx.device_info()["max_recommended_working_set_size"])
            )
    try:
        yield
    finally:
        mx.synchronize(generation_stream())
        mx.synchronize()
        with _WIRED:
            _wired_users -= 1
            if _wired_users == 0:
                mx.set_wired_limit(getattr(_THREAD, "wired_before", 0))


class DecodingSession:
    """Requests decoded together, one speculative step at a time.

    model: an mlx-lm model (prepared for tree verification here); drafter: None
    decodes with a tree's lookup branches alone (`TreeConfig.lookup_only`), or
    plainly for a tree without them; tokenizer:
    mlx-lm's tokenizer wrapper, or None for token ids alone (no text, no stop
    strings); tree: "auto" (None: `DEFAULT_TREE`, the auto tree: `auto.AutoTree`,
    calibrated for this machine on first use), a `TreeConfig` or its notation
    ("1x2+1x7"), a `TreePolicy` (a tree per batch size) or any `TreeChoice`; guard:
    a `SpeedGuard` for a fixed tree or policy, which decodes plainly where the tree
    measurably does not pay; clock: profile each step's phases; prefetch: draft (or,
    between plain steps, launch) the next step before the host handles this one's
    tokens; prefill_chunk: prompts are committed this many tokens per step, one
    waiting prompt's chunk before each step (the shortest first, the oldest at least
    every other chunk), so that neither running rows nor a short prompt wait for a
    long prompt's whole prefill (None: whole, when it is added).
    """

    def __init__(
        self,
        model: nn.Module,
        drafter: Drafter | None,
        tokenizer: Any = None,
        *,
        tree: TreeConfig | TreePolicy | TreeChoice | str | None = None,
        cache: CacheConfig | None = None,
        guard: SpeedGuard | None = None,
        compiled: bool | None = None,
        kernels: str | Kernels | None = None,
        clock: PhaseClock | None = None,
        prefetch: bool = True,
        prefill_chunk: int | None = None,
    ):
        prepare_target(model)
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        if drafter is not None:
            drafter.check_fits(model)
        self.policy = tree_choice(tree, model, drafter, guard)
        for candidate in self.policy.trees:
            check_tree(candidate, drafter)
        self.model, self.drafter, self.tokenizer = model, drafter, tokenizer
        self.group = sharding_group(model)  # sharded over ranks that decode in step
        self.cache_config = cache or CacheConfig()
        self.clock, self.prefetch = clock, prefetch
        self.prefill_chunk = prefill_chunk
        self.compiled, self.kernels = compiled, kernels
        plans = [plan_step(t, drafter is not None) for t in self.policy.trees]
        self.depth = max(plan.depth for plan in plans)  # the context check looks ahead
        self.limit = context_length(model)
        self.vocab_size = int(model.model.embed_tokens.weight.shape[0])
        self.stats = SessionStats()
        self.state: DecodeState | None = None
        self._rows: dict[int, _Row] = {}
        self._unstarted: list[Update] = []
        self._functions: dict[TreeConfig, StepFunctions] = {}
        self._ran: set[tuple[Any, ...]] = set()  # functions and shapes run (`_first_run`)
        self._planned: tuple[int, TreeConfig] | None = None  # (batch size, next tree)
        self._prefilling: list[tuple[Prefill, list[_Row]]] = []  # waiting to join, in order
        self._oldest_due = False  # the oldest prefill gets the next chunk
        self._probe: DraftProbe | None = None  # drafter beams waiting for their tokens
        # What the target accepts of the drafter's tokens, which ranks dynamic trees.
        self.confidence: DraftConfidence | None = None
        if drafter is not None:
            self.confidence = shared_confidence(model, drafter)
            if self.group is not None:  # sharded: every rank must keep the same nodes
                self.confidence.agree(partial(agreed_values, group=self.group))
        self._timed: _TimedStep | None = None  # the last step, until its host work is known
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------------

    def check_prompt(self, prompt: Sequence[int]) -> str | None:
        """Why this prompt cannot be decoded (what to change), or None."""
        if not prompt:
            return "the prompt is empty: give at least one token or a non-empty string"
        if self.limit is not None and len(prompt) >= self.limit:
            return (
                f"the prompt has {len(prompt)} tokens but the model's context is "
                f"{self.limit} positions: shorten the prompt"
            )
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            return f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
        return None

    def _check(self, request: Request) -> None:
        problem = self.check_prompt(request.prompt)
        if problem is not None:
            raise ValueError(problem)
        if request.key is None and not request.sampling.greedy:
            raise ValueError("a sampled request needs a PRNG key (mx.random.key(seed))")
        if request.stop.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: give the session one")
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP:
            raise ValueError(
                f"logprobs asks for {request.logprobs} alternatives: give 0 to {MAX_TOP}"
            )

    def add(self, requests: Sequence[Request], ids: Sequence[int] | None = None) -> list[int]:
        """Prefill the requests together and let them join the batch at the next step.

        Returns their ids (`ids` if given, else new ones). Every request is checked
        before any work starts; a bad one raises ValueError saying what to change.
        """
        for request in requests:
            self._check(request)
        self._settle_timing()  # before the prefill, which is not the last step's work
        if self.group is not None:  # sharded: every rank samples with rank 0's keys
            requests = [replace(r, key=agreed_key(r.key, self.group)) for r in requests]
        ids = [next(self._ids) for _ in requests] if ids is None else list(ids)
        if len(set(ids)) != len(ids) or self._in_flight() & set(ids):
            raise ValueError(
                f"request ids must be new and distinct: {ids} (in flight: {self._in_flight()})"
            )
        starting = []
        for request_id, request in zip(ids, requests):
            row = self._new_row(request_id, request)
            if request.stop.max_tokens == 0:
                self._unstarted.append(self._update(row, [], "", 0, "length"))
            else:
                starting.append(row)
        if starting:
            self._prefill(starting)
        return ids

    def _new_row(self, request_id: int, request: Request) -> _Row:
        text = None
        if self.tokenizer is not None:
            text = StopText(self.tokenizer, request.stop.stop_strings)
        progress = RowProgress(request.stop.max_tokens, request.stop.eos_token_ids)
        return _Row(request_id, request, progress, text, RequestMetrics(len(request.prompt)))

    def _prefill(self, rows: list[_Row]) -> None:
        """Start the rows' prefill. With `prefill_chunk`, each step commits one chunk
        of a waiting prefill (`_advance_prefill`), so that a long prompt delays the
        running rows and other prompts by one chunk per step; otherwise it runs to the
        end now."""
        # Greedy rows never draw, so a row without a key gets a zero key.
        zero = mx.zeros((2,), dtype=mx.uint32)
        keys = [zero if row.request.key is None else row.request.key for row in rows]
        reuse = [_reusable(row.request) for row in rows]
        config = self.cache_config
        if self.prefill_chunk is not None:
            config = replace(config, prefill_step_size=self.prefill_chunk)
        with mx.stream(generation_stream()):
            job = Prefill(
                self.model,
                [list(row.request.prompt) for row in rows],
                config,
                sampling=[row.request.sampling for row in rows],
                row_ids=[row.id for row in rows],
                keys=mx.stack(keys),  # (B, 2)
                reuse=reuse,
            )
        for row, entry in zip(rows, reuse):
            row.metrics.cached_tokens = 0 if entry is None else entry[1]
            self._rows[row.id] = row
        self._prefilling.append((job, rows))
        if self.prefill_chunk is None:
            self._advance_prefill(whole=True)

    def _advance_prefill(self, whole: bool = False) -> None:
        """Commit the next chunk of one prefill (`_next_prefill`), or with `whole`
        every prefill to its end; a prefill that is done joins the batch."""
        while self._prefilling:
            index = 0 if whole else self._next_prefill()
            job, rows = self._prefilling[index]
            started = time.perf_counter()
            with mx.stream(generation_stream()):
                if not job.done:
                    job.advance()
                seconds = time.perf_counter() - started
                for row in rows:
                    row.metrics.prompt_seconds += seconds
                if job.done:
                    self._prefilling.pop(index)
                    self._join(job.finish())
            if not whole:
                return

    def _next_prefill(self) -> int:
        """Which waiting prefill gets the next chunk: the one with the fewest positions
        left, so that a short prompt is not held behind a long one; but the oldest on
        at least every other chunk, so that a long one is never starved."""
        if self._oldest_due:
            index = 0
        else:
            remaining = [job.remaining for job, _ in self._prefilling]
            index = remaining.index(min(remaining))
        self._oldest_due = index != 0
        return index

    def _join(self, fresh: DecodeState) -> None:
        """Append freshly prefilled rows to the batch (those cancelled meanwhile leave)."""
        if self.state is None or not self.state.row_ids:
            self.state = fresh
        else:
            self.state.extend(fresh)
        keep = [i for i, request_id in enumerate(self.state.row_ids) if request_id in self._rows]
        if not keep:
            self.state = None
        elif len(keep) != len(self.state.row_ids):
            self.state.select_rows(keep)

    def cancel(self, request_id: int) -> None:
        """End a request: it leaves before the next step, whose updates give its last
        one (no new tokens, "cancelled")."""
        row = self._rows.get(request_id)
        if row is not None:
            row.cancelled = True

    def _leave(self, request_ids: set[int]) -> None:
        """Take these requests out of the session (no more updates for them)."""
        for request_id in request_ids:
            self._rows.pop(request_id, None)
        self._unstarted = [u for u in self._unstarted if u.request not in request_ids]
        self._prefilling = [
            (job, rows) for job, rows in self._prefilling if any(r.id in self._rows for r in rows)
        ]
        if self.state is None:
            return
        keep = [i for i, request_id in enumerate(self.state.row_ids) if request_id in self._rows]
        if not keep:
            self.state = None
        elif len(keep) != len(self.state.row_ids):
            self.state.select_rows(keep)

    def _cancelled(self) -> list[Update]:
        """The last updates of the cancelled requests, which leave the batch now."""
        rows = [row for row in self._rows.values() if row.cancelled]
        if rows:
            self._leave({row.id for row in rows})
        return [self._update(row, [], "", 0, "cancelled") for row in rows]

    @property
    def speculates(self) -> bool:
        """True when some step may verify more than the root (with this drafter)."""
        return any(not plan_step(t, self.drafter is not None).plain for t in self.policy.trees)

    def describe(self) -> str:
        """The trees this session decodes with, for the user."""
        return self.policy.describe() if self.speculates else "plain decoding"

    def _in_flight(self) -> set[int]:
        """The ids of the requests that still have updates to give."""
        return set(self._rows) | {update.request for update in self._unstarted}

    @property
    def active(self) -> int:
        """Requests that still have updates to give."""
        return len(self._rows) + len(self._unstarted)

    def close(self, reason: str = "cancelled") -> list[Update]:
        """End every request now; returns their last updates."""
        updates = self._unstarted + [
            self._update(r, [], "", 0, reason) for r in self._rows.values()
        ]
        self._rows, self._unstarted, self.state, self._planned = {}, [], None, None
        self._prefilling = []
        self._settle_timing(gap_counts=False)
        return updates

    # -- steps ----------------------------------------------------------------------

    def step_functions(self, tree: TreeConfig) -> StepFunctions:
        """The step functions of `tree`, built once per session, and once per process
        unless the session was given a `Kernels` value (`shared_step_functions`)."""
        if tree not in self._functions:
            model, drafter, kernels = self.model, self.drafter, self.kernels
            if isinstance(kernels, Kernels):
                functions = step_functions(model, drafter, tree, self.compiled, kernels)
            else:
                functions = shared_step_functions(model, drafter, tree, self.compiled, kernels)
            self._functions[tree] = functions
        return self._functions[tree]

    def _first_run(self, *runs: tuple[Any, ...]) -> bool:
        """Whether this step runs some compiled function at shapes it has not run at in
        this session: it then traces them (and builds their kernels), so its time is
        not their cost. `runs`: what each function's trace depends on (`_step_runs`)."""
        first = not self._ran.issuperset(runs)
        self._ran.update(runs)
        return first

    @staticmethod
    def _step_runs(tree: TreeConfig, state: DecodeState, lookup: bool) -> tuple[Any, ...]:
        """The keys of the traces a step of `tree` runs: its draft (greedy or coupled
        with the target's noise) and its lookup, pack and accept functions, at its
        batch size and, with lookup branches, the width of the text's buffer."""
        variant = (len(state.row_ids), state.all_greedy)
        width = state.history.shape[1] if lookup else 0
        return ("draft", tree, *variant), ("step", tree, *variant, width)

    def choose_tree(self, batch_size: int) -> TreeConfig:
        """The tree of the next step (the policy's choice, or the one planned when
        the previous step looked ahead)."""
        planned, self._planned = self._planned, None
        if planned is not None and planned[0] == batch_size:
            return planned[1]
        if self.state is None:
            return self.policy.choose(batch_size)
        temperature = max(rule.temperature for rule in self.state.sampling)
        return self.policy.choose(batch_size, self.state.cache.frontier, temperature)

    def step(self) -> list[Update]:
        """One step of every request in flight; one update per request."""
        self._settle_timing()
        updates, self._unstarted = self._unstarted, []
        updates += self._cancelled()
        if self._prefilling:
            self._advance_prefill()
        state = self.state
        if state is None or not state.row_ids:
            return updates
        batch_size = len(state.row_ids)
        tree = self.choose_tree(batch_size)
        steps = self.step_functions(tree)
        built = self._first_run(*self._step_runs(tree, state, steps.plan.lookup_branches > 0))
        started = time.perf_counter()
        if self.clock is not None:
            self.clock.start()
        look_ahead = self._look_ahead(state, tree)
        asked = [self._rows[i].request.logprobs for i in state.row_ids]
        top = max((k for k in asked if k is not None), default=None)
        row_ids = list(state.row_ids)
        with mx.stream(generation_stream()):
            hindsight = self._hindsight(state, tree, steps.plan.lookup_branches > 0)
            built = self._start_probe(state, tree) or built
            if self.confidence is not None and tree.draft_nodes is not None:
                state.confidence = self.confidence.log_rates()  # ranks the nodes kept
            else:
                state.confidence = None
            output = decode_step(
                self.model, steps, state, self.clock, self.prefetch, look_ahead, top
            )
        if self.confidence is not None and output.confidence is not None:
            self.confidence.observe(output.confidence)
        # Sharded: rank 0's time on every rank, so every rank chooses the same next tree.
        seconds = agreed_seconds(time.perf_counter() - started, self.group)
        used = PLAIN_DECODING if steps.plan.plain else tree
        stamp, frontier = time.perf_counter(), state.cache.frontier
        timed = StepRecord(used, batch_size, seconds, output.runs, frontier, built)
        self._timed = _TimedStep(timed, stamp)
        record = getattr(self.policy, "record_hindsight", None)
        if hindsight is not None and record is not None:
            record(np.array(hindsight[0]), hindsight[1])
        self._follow_probe(row_ids, output.tokens)
        decoded = PLAIN_DECODING if steps.plan.plain else steps.plan.tree  # lookup_only
        self._count(decoded, batch_size)
        keep = self._emit(state, output, decoded, seconds, asked, updates)
        if not keep:
            self.state = None
            self._settle_timing(gap_counts=False)  # nothing follows it to overlap
        elif len(keep) != batch_size:
            state.select_rows(keep)
        return updates

    def _emit(
        self,
        state: DecodeState,
        output: StepOutput,
        used: TreeConfig,
        seconds: float,
        asked: list[int | None],
        updates: list[Update],
    ) -> list[int]:
        """Append each row's update for a step to `updates` (its tokens and text, and
        the logprobs it asked for); rows that end leave. Returns the batch positions
        that stay."""
        keep, batch_size = [], len(state.row_ids)
        for position, request_id in enumerate(list(state.row_ids)):
            row = self._rows[request_id]
            accepted = output.num_accepted[position]
            kept, counted, text, ended = row.advance(
                output.tokens[position], state.cache.host_lengths[position], self.depth, self.limit
            )
            row.metrics.record(len(kept), counted, accepted, seconds)
            step = (used, output.tree_sizes[position], batch_size)
            update = self._update(row, kept, text, accepted, ended, *step)
            if output.logprobs is not None and asked[position] is not None:
                figures = output.logprobs[position][: len(kept)]
                trimmed = [replace(f, top=f.top[: asked[position]]) for f in figures]
                update = replace(update, logprobs=trimmed)
            updates.append(update)
            if ended is None:
                keep.append(position)
            else:
                _hand_over(row.request.prefix, state, position)
                del self._rows[request_id]
        return keep

    def _settle_timing(self, gap_counts: bool = True) -> None:
        """Tell the policy the last step's time: from its launch to the next step's
        call, so that the host work between steps (each row's tokens and text, the
        caller's own) counts, as it does in the loop's throughput. A plain step that
        looked ahead overlaps that work with its next forward, a tree step cannot.
        The gap does not count when it is longer than the step itself (a wait for
        requests or for a user, not work), when a prefill or the end of the batch
        follows (`gap_counts` False), or sharded (each rank would see another gap)."""
        timed, self._timed = self._timed, None
        if timed is None:
            return
        step = timed.step
        gap = time.perf_counter() - timed.ended
        if not gap_counts or self.group is not None or not 0.0 <= gap <= step.seconds:
            gap = 0.0
        self.policy.record(replace(step, seconds=step.seconds + gap))

    def _hindsight(
        self, state: DecodeState, tree: TreeConfig, verifies_lookup: bool
    ) -> tuple[mx.array, TreeConfig] | None:
        """The runs (M, G) of the lookup branches the policy asks to check in hindsight
        on this step (launched now, read after the step's sync), with the lookup tree
        they come from. A check covers every step since the last one that verified no
        lookup branches: M is one per such step and row, each the branches as they
        would have been drafted at that step's start (`DecodeState.unchecked`), once
        the Ll - 1 tokens they are compared with have come. Optional: a `TreeChoice`
        without `hindsight` gets none."""
        ask = getattr(self.policy, "hindsight", None)
        if ask is None:
            return None
        known = np.array(state.cache.host_lengths)[:, None] + 1  # (B, 1) the root included
        if not verifies_lookup:  # a step that verifies them is observed directly
            state.unchecked = np.concatenate([state.unchecked[:, 1:], known], axis=1)  # (B, K)
        lookup_tree = ask(tree)
        if lookup_tree is None or state.history.shape[1] < lookup_tree.lookup_branch_length:
            return None
        span = lookup_tree.lookup_branch_length - 1  # tokens a branch is compared with
        starts = state.unchecked  # (B, K) every start is past its row's prompt
        ready = (starts >= 0) & (starts + span <= known)  # (B, K)
        state.unchecked = np.where(ready, -1, starts)
        where, column = np.nonzero(ready)  # (M,) batch position and slot, row by row
        if not where.size:
            return None
        lengths = starts[where, column] + span  # (M,) history length then + span
        table = self.drafter.ngrams if self.drafter is not None else None
        fallback = partial(table_branches, table) if table and lookup_tree.lookup_table else None
        history = state.history[mx.array(where.astype(np.int32))]  # (M, T)
        count, ngram = lookup_tree.lookup_branches, lookup_tree.lookup_ngram
        past = mx.array(lengths.astype(np.int32))  # (M,)
        runs = hindsight_runs(history, past, count, span + 1, ngram, fallback)  # (M, G)
        state.ride(runs)
        return runs, lookup_tree

    def _start_probe(self, state: DecodeState, tree: TreeConfig) -> bool:
        """Draft the beams of the drafter tree the policy asks to probe on this step
        (`probes.py`), evaluated with the step's own work. Optional: a `TreeChoice`
        without `probe` gets none; one probe at a time. Returns whether its draft
        ran at these shapes for the first time in this session: the beams are then
        evaluated now, so that building them is this step's time, not the next's
        (a plain step that looks ahead has the next one's forward wait for them)."""
        ask = getattr(self.policy, "probe", None)
        if self._probe is not None or self.drafter is None or ask is None:
            return False
        probe_tree = ask(tree)
        if probe_tree is None:
            return False
        built = self._first_run(self._step_runs(probe_tree, state, False)[0])
        beams = draft(self.step_functions(probe_tree), state).beams  # (B, W, L)
        if built:
            mx.eval(beams)
        else:
            state.ride(beams)
        self._probe = DraftProbe.start(probe_tree, state.row_ids, beams)
        return built

    def _follow_probe(self, row_ids: list[int], tokens: list[list[int]]) -> None:
        """Give the probe a step's decoded tokens; once they cover its beams, tell the
        policy what they would have had accepted. A change of rows voids it."""
        probe = self._probe
        if probe is None:
            return
        if not probe.add(row_ids, tokens):
            self._probe = None
            return
        runs = probe.runs()
        if runs is None:
            return
        self._probe = None
        record = getattr(self.policy, "record_probe", None)
        if record is not None:
            record(runs, probe.tree)

    def _look_ahead(self, state: DecodeState, tree: TreeConfig) -> bool:
        """Whether a plain step of `tree` should launch the next step before its sync:
        the next tree (chosen now) is plain and no row reaches max_tokens or the
        context on this step. A row that ends on an EOS or a stop string drops the
        launched step, as mlx-lm's loop computes one token past its EOS. Never for a
        sharded model: a forward launched ahead would put its collectives before
        this step's on one pipeline stage and after them on the other."""
        if not self.prefetch or self.clock is not None or self.group is not None:
            return False
        if not self.step_functions(tree).plan.plain:
            return False
        rows = [self._rows[request_id] for request_id in state.row_ids]
        lengths = state.cache.host_lengths
        if any(
            row.progress.may_end(1, length + 1, self.depth, self.limit)
            for row, length in zip(rows, lengths)
        ):
            return False
        next_tree = self.choose_tree(len(rows))
        self._planned = (len(rows), next_tree)
        return self.step_functions(next_tree).plan.plain

    def _count(self, tree: TreeConfig, batch_size: int) -> None:
        self.stats.steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, batch_size)
        label = tree.label
        self.stats.steps_by_tree[label] = self.stats.steps_by_tree.get(label, 0) + 1

    @staticmethod
    def _update(
        row: _Row,
        tokens: list[int],
        text: str,
        accepted: int,
        reason: str | None,
        tree: TreeConfig = PLAIN_DECODING,
        size: int = 1,
        batch_size: int = 0,
    ) -> Update:
        metrics = row.metrics.snapshot()
        return Update(row.id, text, tokens, accepted, reason, metrics, tree, size, batch_size)

    def run(
        self, requests: Sequence[Request], ids: Sequence[int] | None = None
    ) -> Iterator[Update]:
        """Decode the requests together to the end; yields every update as it comes.

        ids: the requests' ids in the updates (default: new ids); a session may run
        one batch after another, so ids 0..B-1 may be used again once a run ends.
        """
        with wired_limit(self.model):
            mine = set(self.add(requests, ids))
            try:
                while mine & self._in_flight():
                    yield from self.step()
            finally:  # a consumer that stops early leaves nothing behind
                self._leave(mine)


def _reusable(request: Request) -> tuple[TargetCache, int] | None:
    """What `prefill` may reuse for this request: its prompt cache and the length of
    the prefix it shares with the prompt."""
    prefix = request.prefix
    if prefix is None or prefix.cache is None:
        return None
    prefix.cached = prefix.reusable(request.prompt)
    return (prefix.cache, prefix.cached) if prefix.cached else None


def _hand_over(prefix: PromptCache | None, state: DecodeState, position: int) -> None:
    """Give a finished row's K/V (its committed tokens) to its prompt cache."""
    if prefix is None:
        return
    length = state.cache.host_lengths[position]
    tokens = state.history[position, :length].tolist()
    prefix.keep(state.cache.copy_row(position), cast(list[int], tokens))


def tree_choice(
    tree: TreeConfig | TreePolicy | TreeChoice | str | None,
    model: nn.Module,
    drafter: Drafter | None,
    guard: SpeedGuard | None = None,
) -> TreeChoice:
    """How a session chooses its trees: the auto tree for "auto" (and None), else the
    fixed tree or policy given (with `guard` if any)."""
    tree = DEFAULT_TREE if tree is None else tree
    if isinstance(tree, str) and tree.strip().lower() == "auto":
        if guard is not None:
            raise ValueError("the auto tree guards itself: give a guard with a fixed tree only")
        return AutoTree.for_model(model, drafter)
    if isinstance(tree, TreePolicy):
        return FixedTrees(tree, guard)
    if isinstance(tree, (TreeConfig, str)):
        return FixedTrees(TreePolicy.fixed(as_tree(tree)), guard)
    if not all(hasattr(tree, name) for name in ("trees", "choose", "record", "describe")):
        raise ValueError(
            f"tree must be 'auto', a TreeConfig or a string like '1x2+1x7', got {tree!r}"
        )
    if guard is not None:
        raise ValueError("a guard goes with a fixed tree or a TreePolicy")
    return tree


def check_tree(tree: TreeConfig, drafter: Drafter | None) -> None:
    """A tree the drafter can draft: W no larger than its vocabulary."""
    if drafter is not None and tree.beam_width > drafter.config.output_size:
        raise ValueError(
            f"beam_width {tree.beam_width} exceeds the drafter's vocabulary of "
            f"{drafter.config.output_size} tokens: use a smaller beam_width"
        )
