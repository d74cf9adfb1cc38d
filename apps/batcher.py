"""Continuous batching: one decode worker serves every request of the server.

A single worker thread owns a `DecodingSession`. Requests wait in a queue; between
two steps the worker adds the ones that arrived to the session (`add` prefills them
and appends them to the running batch), so a request joins at the next step instead
of waiting for the batch to drain. Every `step` of the session gives each request an
`Update` (its stop rules, stop strings and text are the session's), which the worker
hands to the request's callback.

The tree adapts to the number of rows (`TreePolicy`), and a `SpeedGuard` decodes
plainly where the tree measurably does not pay.

A sharded model (`mlx_redrafter.distributed`) decodes on every rank in step. Rank 0
serves the requests; before each step it sends its `Agenda` (the requests it admits,
the ones it cancels, whether it closes) to the other ranks, whose workers follow it
and run the same step. Nothing else needs sending: the session's choices agree
across ranks by themselves.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_redrafter.config import DEFAULT_TREE, CacheConfig, SamplingConfig
from mlx_redrafter.distributed import leader_bytes, sharding_group
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.policy import SpeedGuard, TreePolicy
from mlx_redrafter.prompt_cache import PrefixStore, PromptCache
from mlx_redrafter.session import DecodingSession, Request, Update, stop_config, wired_limit


@dataclass(eq=False)
class Job:
    """One request: token ids, its sampling rules and stop rules, and where updates go."""

    prompt: list[int]
    on_update: Callable[[Update], None]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # top alternatives per token to report; None: none
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = -1

    def cancel(self) -> None:
        """Ask the worker to drop this request before its next step."""
        self.cancelled.set()

    def spec(self) -> dict[str, Any]:
        """What another rank needs to decode this request alike (JSON-ready)."""
        return {
            "prompt": self.prompt,
            "sampling": asdict(self.sampling),
            "max_tokens": self.max_tokens,
            "stop": list(self.stop),
            "seed": self.seed,
            "logprobs": self.logprobs,
            "id": self.id,
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Job:
        """A request another rank admitted, its updates discarded here."""
        return cls(
            spec["prompt"],
            lambda update: None,
            SamplingConfig(**spec["sampling"]),
            spec["max_tokens"],
            tuple(spec["stop"]),
            spec["seed"],
            spec["logprobs"],
            id=spec["id"],
        )


@dataclass(frozen=True)
class Agenda:
    """What the worker does before one step: admit `jobs`, cancel the running requests
    `cancelled` (ids), or, when `closed`, cancel everything and stop."""

    jobs: list[Job]
    cancelled: list[int]
    closed: bool

    def encode(self) -> bytes:
        """JSON; b"" when there is nothing to do (most steps), which `leader_bytes`
        sends with a single collective."""
        if not (self.jobs or self.cancelled or self.closed):
            return b""
        specs = [job.spec() for job in self.jobs]
        fields = {"jobs": specs, "cancelled": self.cancelled, "closed": self.closed}
        return json.dumps(fields).encode()

    @classmethod
    def decode(cls, payload: bytes) -> Agenda:
        if not payload:
            return cls([], [], closed=False)
        fields = json.loads(payload)
        jobs = [Job.from_spec(spec) for spec in fields["jobs"]]
        return cls(jobs, fields["cancelled"], fields["closed"])


class QueueFull(RuntimeError):
    """`max_queue` requests are already waiting for a row."""


@dataclass
class BatcherStats:
    """Counters for the status endpoint and the tests."""

    admitted: int = 0
    joined: int = 0  # admitted into a batch that was already decoding
    finished: int = 0
    cancelled: int = 0


class Batcher:
    """The decode worker. `submit` jobs from any thread; updates arrive via callbacks.

    model: an mlx-lm model; drafter: None decodes plainly or with lookup branches;
    policy: a tree per batch size, or "auto" (the default: the auto tree, which
    chooses per step and batch size); max_batch: rows decoded together
    (more requests wait their turn, at most max_queue of them: None is unbounded);
    guard: a `SpeedGuard` that decodes plainly where a fixed policy's tree measurably
    does not pay (None: always the policy's tree);
    prefill_chunk: a new prompt is prefilled this many tokens before each step,
    the shortest waiting prompt first (None: whole, so a long prompt stalls the
    running rows and every request that arrives meanwhile).
    prefixes: the prefix cache (None: every prompt is prefilled whole): a request
    reuses the K/V of the longest prefix it shares with a finished one.
    On a sharded model, rank 0's batcher serves and the other ranks' batchers follow
    it (`wait` for rank 0 to close); `submit` is for rank 0 only.
    seed: the sampling stream of the worker (None: random). A request's `seed` gives
    it its own key, so a seeded sampled request is reproducible whatever shares its
    batch; unseeded ones take the next key of the worker's stream.
    """

    def __init__(
        self,
        model: nn.Module,
        drafter: Drafter | None,
        tokenizer: Any,
        policy: TreePolicy | str | None = None,
        cache_config: CacheConfig | None = None,
        max_batch: int = 16,
        seed: int | None = None,
        guard: SpeedGuard | None = None,
        max_queue: int | None = None,
        prefixes: PrefixStore | None = None,
        prefill_chunk: int | None = None,
    ):
        self.session = DecodingSession(
            model,
            drafter,
            tokenizer,
            tree=policy if policy is not None else DEFAULT_TREE,
            cache=cache_config,
            guard=guard,
            prefill_chunk=prefill_chunk,
        )
        # MLX streams belong to threads: weights still lazy here could not be evaluated
        # on the worker thread, so evaluate them on this one.
        mx.eval(model.parameters(), drafter.parameters() if drafter is not None else [])
        self.model, self.drafter, self.tokenizer = model, drafter, tokenizer
        self.policy = self.session.policy
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefixes = prefixes
        self._prompt_caches: dict[int, PromptCache] = {}
        self._memory = FreedMemory()
        self.context_limit = self.session.limit
        self.stats = BatcherStats()
        self._key = mx.random.key(seed if seed is not None else secrets.randbits(32))
        mx.eval(self._key)
        self._pending: list[Job] = []
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        # Sharded: rank 0 serves and sends its agenda; the other ranks follow it.
        self.group = sharding_group(model)
        if self.group is not None and prefixes is not None:
            raise ValueError(
                "a sharded model cannot keep a prefix cache: each rank's cache holds other "
                "layers, so their choices of what to keep would differ; turn it off"
            )
        self.following = self.group is not None and self.group.rank() != 0
        self._thread = threading.Thread(target=self._run, name="redrafter-decode", daemon=True)
        self._thread.start()

    # -- the public side ------------------------------------------------------------

    def check_prompt(self, prompt: Sequence[int]) -> str | None:
        """Why this prompt cannot be served, or None."""
        return self.session.check_prompt(prompt)

    def submit(self, job: Job) -> Job:
        if self.following:
            raise RuntimeError("this rank follows rank 0's requests; submit them there")
        problem = self.check_prompt(job.prompt)
        if problem is not None:
            raise ValueError(problem)
        with self._wake:
            if self._closed:
                raise RuntimeError("the decode worker has stopped")
            if self.max_queue is not None and len(self._pending) >= self.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are already waiting")
            job.id = next(self._ids)
            self._pending.append(job)
            self._wake.notify()
        return job

    @property
    def active(self) -> int:
        """Requests in the running batch."""
        return len(self._jobs)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def wait(self) -> None:
        """Return when the worker stops: on a following rank, when rank 0 closes."""
        self._thread.join()

    def close(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    def warm_up(self) -> None:
        """Build the step functions of every tree the policy may use ahead of requests."""
        for tree in self.policy.trees:
            self.session.step_functions(tree)

    # -- the worker -----------------------------------------------------------------

    def _take_pending(self, block: bool) -> list[Job]:
        with self._wake:
            while block and not self._pending and not self._closed:
                self._wake.wait()
            room = self.max_batch - len(self._jobs)
            taken, self._pending = self._pending[:room], self._pending[room:]
        return taken

    def _run(self) -> None:
        with wired_limit(self.model):
            while self._serve_once():
                pass

    def _serve_once(self) -> bool:
        """Carry out the next agenda and run one step; False once the worker is closed."""
        agenda = self._next_agenda()
        if agenda.closed:
            self._shut_down(agenda.jobs)
            return False
        try:
            if agenda.jobs:
                self._admit(agenda.jobs)
            for request in agenda.cancelled:
                self.session.cancel(request)
            for update in self.session.step():
                self._finish_or_continue(update)
        except Exception as error:  # a failed step must not take the server down
            traceback.print_exc()
            message = f"{type(error).__name__}: {error}"
            self.session.close("error")
            pending = [job for job in agenda.jobs if job.id not in self._jobs]
            for job in list(self._jobs.values()) + pending:
                self._deliver(job, Update.unstarted(job.id, len(job.prompt), "error", message))
            self._jobs.clear()
            self._prompt_caches.clear()
        return True

    def _next_agenda(self) -> Agenda:
        """This worker's agenda: from its queue, or rank 0's when it follows; rank 0 of
        a sharded model sends its own to the others."""
        if self.following and self.group is not None:
            return Agenda.decode(leader_bytes(b"", self.group))
        jobs = self._take_pending(block=not self._jobs)
        if self._closed:
            agenda = Agenda(jobs, [], closed=True)
        else:
            jobs = [job for job in jobs if not self._drop_if_cancelled(job)]
            cancelled = [job.id for job in self._jobs.values() if job.cancelled.is_set()]
            agenda = Agenda(jobs, cancelled, closed=False)
        if self.group is not None:
            leader_bytes(agenda.encode(), self.group)
        return agenda

    def _shut_down(self, jobs: list[Job]) -> None:
        """Cancel the running requests and those never started."""
        for update in self.session.close("cancelled"):
            self._deliver(self._jobs.pop(update.request), update)
        with self._wake:
            waiting, self._pending = self._pending, []
        for job in jobs + waiting + list(self._jobs.values()):  # never decoded
            self._deliver(job, Update.unstarted(job.id, len(job.prompt), "cancelled"))
        self._jobs.clear()
        self._prompt_caches.clear()

    def _finish_or_continue(self, update: Update) -> None:
        job = self._jobs[update.request]
        if update.finish_reason is not None:
            del self._jobs[update.request]
            finished = self._prompt_caches.pop(update.request, None)
            ended_well = update.finish_reason in ("stop", "length")
            if self.prefixes is not None and finished is not None and ended_well:
                self.prefixes.add(finished)
            self.stats.finished += 1
            self.stats.cancelled += update.finish_reason == "cancelled"
            self._memory.release()  # its K/V is free now
        self._deliver(job, update)

    def _drop_if_cancelled(self, job: Job) -> bool:
        if job.cancelled.is_set():
            self.stats.cancelled += 1
            self._deliver(job, Update.unstarted(job.id, len(job.prompt), "cancelled"))
            return True
        return False

    def _job_key(self, job: Job) -> mx.array:
        """A request's own PRNG key: from its seed (reproducible whatever shares the
        batch), else the next key of the batcher's stream."""
        if job.seed is not None:
            return mx.random.key(job.seed)
        self._key, key = mx.random.split(self._key)
        return key

    def _admit(self, jobs: list[Job]) -> None:
        requests = [
            Request(
                job.prompt,
                job.sampling,
                stop_config(self.tokenizer, job.max_tokens, job.stop),
                self._job_key(job),
                self._prompt_cache(job),
                job.logprobs,
            )
            for job in jobs
        ]
        joining = bool(self._jobs)
        for job in jobs:
            self._jobs[job.id] = job
        self.session.add(requests, ids=[job.id for job in jobs])
        self.stats.admitted += len(jobs)
        self.stats.joined += len(jobs) if joining else 0

    def _prompt_cache(self, job: Job) -> PromptCache | None:
        """The job's own prompt cache, primed from the prefix cache (None without one)."""
        if self.prefixes is None:
            return None
        self._prompt_caches[job.id] = self.prefixes.lookup(job.prompt)
        return self._prompt_caches[job.id]

    @staticmethod
    def _deliver(job: Job, update: Update) -> None:
        try:
            job.on_update(update)
        except Exception:  # a broken consumer must not stop the other rows
            traceback.print_exc()
            job.cancel()


class FreedMemory:
    """On Linux with glibc, hands freed heap memory back to the system, at most once
    every `every` seconds (a no-op elsewhere, and on Apple GPUs, whose buffers MLX
    allocates itself).

    On MLX's CPU backend arrays live in malloc'd memory. glibc raises its mmap
    threshold each time a large mapped block is freed, after which blocks of that
    size come from the heap, which a server's ever-changing cache sizes fragment:
    resident memory then grows far past what is allocated. `malloc_trim` returns the
    free parts of the heap; fixing the threshold instead would cost every large
    allocation a fresh mapping (about 12 % of throughput at 8 clients here)."""

    def __init__(self, every: float = 1.0):
        self.every = every
        self._last = 0.0
        self._trim: Callable[[int], int] | None = None
        if sys.platform.startswith("linux"):
            try:
                self._trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc (musl): nothing to trim
                self._trim = None

    def release(self) -> None:
        now = time.monotonic()
        if self._trim is not None and now - self._last >= self.every:
            self._trim(0)
            self._last = now
