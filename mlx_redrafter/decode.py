"""The decoding step at the level of token ids, for a batch of rows.

`prefill` commits the prompts; `plan_step` derives once what a step of a tree does;
`decode_step` runs one step: draft (beam search, lookup) -> pack tree -> verify ->
accept -> commit cache. The session (`session.py`) drives these and yields.
Shapes: B batch, W beam width, L beam length, G lookup branches, N packed tokens,
D hidden, V vocabulary.

Plain autoregressive decoding is the same step with W = L = 1 and no drafter:
the tree is the single root token, and every step emits the target's choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .accept import Acceptance
from .beam_search import Coupling, scored_beam_search
from .confidence import confident_scores, neutral_rates, observed_counts
from .config import GREEDY, CacheConfig, SamplingConfig, TreeConfig
from .drafter import Drafter
from .kernels import Kernels, select_kernels
from .logprobs import EmittedLogprobs, TokenLogprob, emitted_logprobs
from .lookup import lookup_branches
from .ngrams import table_branches
from .per_model import PerModel
from .sampling import (
    choose_tokens,
    choose_tokens_quickly,
    position_keys,
    position_noise,
    scramble_keys,
)
from .target import TargetCache, output_size, target_forward, target_hidden
from .tree import PackedTree, chain_tree, keep_best_nodes, pad_beams

HINDSIGHT_KEPT = 64  # most unchecked step starts a row keeps for a hindsight check


class Draft(NamedTuple):
    """A step's candidates and what the drafter thought of its own.

    beams: (B, W + G, L) the drafter's beams (ABSENT past a dynamic tree's cut), then
        the lookup branches; contest: (B, W, Lw) the drafter beams' prefixes' contest
        scores (`beam_search.ScoredBeams`; zeros without a drafter).
    """

    beams: mx.array
    contest: mx.array

    def rows(self, index: mx.array) -> Draft:
        """The draft of the batch rows at `index` (B',)."""
        return Draft(self.beams[index], self.contest[index])


@dataclass
class DecodeState:
    """Everything the loop carries from one step to the next.

    cache: the target's K/V cache with each row's committed length.
    root_tokens: (B,) each row's newest token; not yet in the cache, it roots the next tree.
    hidden: (B, D) target hidden state at each row's last committed position.
    row_ids: which request each batch row serves.
    sampling: each row's sampling rules.
    keys: (B, 2) each row's PRNG key; the token at position p is sampled with noise
        keyed by (key, p) (`sampling.position_keys`), so it never depends on the steps.
    history: (B, capacity) each row's tokens so far, prompt and output: the committed
        ones at [0, lengths[b]), the root at lengths[b] (what lookup branches search).
    drafted: the next step's candidates, drafted ahead (`prefetch`), with the step
        functions that drafted them.
    confidence: (2, DEPTHS, BINS) log acceptance rates of greedy and sampled rows'
        drafted tokens (`confidence.DraftConfidence`), which rank a dynamic tree's
        prefixes; None: the draft probabilities rank them.
    ahead: the next plain step's forward, launched ahead (`launch_plain`).
    riders: lazy arrays a check wants computed (hindsight runs, probe beams); the
        step evaluates them with its own work, at its look-ahead launch or its
        sync, so they never make the host wait for a forward in flight.
    unchecked: (B, HINDSIGHT_KEPT) host array, each row's history lengths at the
        starts of the latest steps that verified no lookup branches and are not
        checked in hindsight yet, oldest first; -1 where there is none
        (`DecodingSession._hindsight`).
    drawn: (B, K, V) the sampling noise of the K positions from each row's root on,
        kept by `noise_from_root` with the committed lengths it was drawn at
        (`drawn_at`), so that the drafter's draw (`Coupling`) is reused to verify the
        tree it drafted, and never once the roots have moved on; None after `record`
        and when rows join.
    all_greedy, sampled (B,) bool, inverse_temperature (B,): the rows' rules as the
        step needs them (1 for greedy rows), made again when the rows change.
    """

    cache: TargetCache
    root_tokens: mx.array
    hidden: mx.array
    row_ids: list[int]
    sampling: list[SamplingConfig]
    keys: mx.array
    history: mx.array
    drafted: tuple[StepFunctions, Draft] | None = None
    confidence: mx.array | None = None
    ahead: PlainForward | None = None
    riders: list[mx.array] = field(default_factory=list)
    drawn: mx.array | None = None
    drawn_at: list[int] = field(default_factory=list)
    unchecked: np.ndarray = field(init=False)
    all_greedy: bool = field(init=False)
    sampled: mx.array = field(init=False)
    inverse_temperature: mx.array = field(init=False)

    def __post_init__(self) -> None:
        self.unchecked = np.full((len(self.row_ids), HINDSIGHT_KEPT), -1, dtype=np.int64)
        self._read_rules()

    def _read_rules(self) -> None:
        self.all_greedy = all(rule.greedy for rule in self.sampling)
        self.sampled = mx.array([not rule.greedy for rule in self.sampling], dtype=mx.bool_)
        inverse = [1.0 if rule.greedy else 1.0 / rule.temperature for rule in self.sampling]
        self.inverse_temperature = mx.array(inverse, dtype=mx.float32)  # (B,)

    def ride(self, *arrays: mx.array) -> None:
        """Have the next step evaluate these arrays with its own work."""
        self.riders.extend(arrays)

    def take_riders(self) -> list[mx.array]:
        riders, self.riders = self.riders, []
        return riders

    def prefetch(self, steps: StepFunctions, drafted: Draft) -> None:
        """Keep the next step's candidates, drafted ahead and evaluated
        asynchronously while the host works."""
        mx.async_eval(*drafted)
        self.drafted = (steps, drafted)

    def take_draft(self, steps: StepFunctions) -> Draft | None:
        """The candidates drafted ahead for `steps`, once; None if there are none."""
        drafted, self.drafted = self.drafted, None
        if drafted is None or drafted[0] is not steps:
            return None
        return drafted[1]

    def select_rows(self, rows: list[int]) -> None:
        """Keep only the batch rows at the given positions."""
        index = mx.array(rows, dtype=mx.int32)
        self.ahead = None  # its K/V writes land past the lengths, where they are stale
        if self.drafted is not None:
            self.drafted = (self.drafted[0], self.drafted[1].rows(index))
        self.cache.select_rows(rows)
        self.root_tokens = self.root_tokens[index]
        self.hidden = self.hidden[index]
        self.row_ids = [self.row_ids[r] for r in rows]
        self.sampling = [self.sampling[r] for r in rows]
        self.keys = self.keys[index]
        self.history = self.history[index]
        self.unchecked = self.unchecked[rows]
        if self.drawn is not None:
            self.drawn, self.drawn_at = self.drawn[index], [self.drawn_at[r] for r in rows]
        self._read_rules()

    def extend(self, other: DecodeState) -> None:
        """Append the rows of `other` (freshly prefilled requests joining the batch)."""
        self.drafted, self.ahead, self.drawn = None, None, None
        self.cache.extend(other.cache)
        self.root_tokens = mx.concatenate([self.root_tokens, other.root_tokens])
        self.hidden = mx.concatenate([self.hidden, other.hidden.astype(self.hidden.dtype)])
        self.row_ids = self.row_ids + other.row_ids
        self.sampling = self.sampling + other.sampling
        self.keys = mx.concatenate([self.keys, other.keys])
        self.unchecked = np.concatenate([self.unchecked, other.unchecked])
        self._read_rules()
        capacity = max(self.history.shape[1], other.history.shape[1])
        self.history = mx.concatenate(
            [_widen(self.history, capacity), _widen(other.history, capacity)]
        )

    def record(self, tokens: mx.array) -> None:
        """Append a step's emitted tokens (B, L) to the history, after each row's root
        (call before the cache commits; entries past a row's emitted count are stale)."""
        self.drawn = None  # the roots move on (`drawn_at` would refuse it anyway): free it
        needed = self.cache.frontier + 1 + tokens.shape[1]
        if needed > self.history.shape[1]:
            self.history = _widen(self.history, _round_up(needed))
        steps = mx.arange(tokens.shape[1], dtype=mx.int32)
        slots = self.cache.lengths[:, None] + 1 + steps[None, :]  # (B, L)
        self.history = mx.put_along_axis(self.history, slots, tokens, axis=1)

    def replace_roots(self, roots: mx.array) -> None:
        """Put other roots (B,) at each row's committed length in the history."""
        slots = self.cache.lengths[:, None]  # (B, 1)
        self.history = mx.put_along_axis(self.history, slots, roots[:, None], axis=1)

    def noise_from_root(self, count: int, vocab_size: int) -> mx.array:
        """(B, count, V) the sampling noise of the `count` positions from each row's
        root on (its committed length): drawn once per position and step, and kept
        (`drawn`) with the lengths it was drawn at, to be reused while they hold."""
        current = self.drawn is not None and self.drawn_at == self.cache.host_lengths
        drawn = self.drawn[:, :count] if current and self.drawn is not None else None
        have = 0 if drawn is None else drawn.shape[1]  # K
        if drawn is not None and have == count:
            return drawn
        offsets = mx.arange(have, count, dtype=mx.int32)
        positions = self.cache.lengths[:, None] + offsets[None]  # (B, count - K)
        fresh = position_noise(position_keys(self.keys, positions), vocab_size)
        noise = fresh if drawn is None else mx.concatenate([drawn, fresh], axis=1)
        self.drawn, self.drawn_at = noise, list(self.cache.host_lengths)
        return noise

    def node_noise(self, depths: mx.array, count: int, vocab_size: int) -> mx.array | None:
        """(B, N, V) the sampling noise of each node at `depths` (B, N) past the root,
        all below `count` (one draw per position, shared by the nodes there); None if
        all greedy."""
        if self.all_greedy:
            return None
        batch_size, num_nodes = depths.shape
        per_position = self.noise_from_root(count, vocab_size)  # (B, count, V)
        if count == 1:
            return mx.broadcast_to(per_position, (batch_size, num_nodes, vocab_size))
        rows = mx.arange(batch_size, dtype=mx.int32)[:, None] * count  # (B, 1)
        flat = per_position.reshape(batch_size * count, vocab_size)  # (B*count, V)
        nodes = flat[(rows + depths).reshape(-1)]  # (B*N, V)
        return nodes.reshape(batch_size, num_nodes, vocab_size)  # (B, N, V)


@dataclass(frozen=True)
class StepOutput:
    """One step's results read back to the host (index = batch row)."""

    tokens: list[list[int]]  # the num_accepted + 1 tokens each row emitted
    num_accepted: list[int]
    tree_sizes: list[int]  # distinct prefixes in each row's tree
    runs: np.ndarray  # (B, W + G) drafted tokens each candidate had accepted
    logprobs: list[list[TokenLogprob]] | None = None  # per emitted token, when asked
    confidence: np.ndarray | None = None  # `confidence.observed_counts`, drafter steps


class Prefill:
    """Prompts being committed, chunk by chunk (`advance`), so that a session can run
    decoding steps of other rows between the chunks of a long prompt.

    Every prompt but its last token is committed; the last token roots the first
    tree. Rows of different lengths are right-padded per chunk; padding is never
    committed. Arguments as in `prefill`.
    """

    def __init__(
        self,
        model: nn.Module,
        prompts: Sequence[Sequence[int]],
        cache_config: CacheConfig,
        sampling: SamplingConfig | Sequence[SamplingConfig] = GREEDY,
        row_ids: Sequence[int] | None = None,
        keys: mx.array | None = None,
        reuse: Sequence[tuple[TargetCache, int] | None] | None = None,
    ):
        batch_size = len(prompts)
        rules = [sampling] * batch_size if isinstance(sampling, SamplingConfig) else list(sampling)
        if len(rules) != batch_size:
            raise ValueError(f"{len(rules)} sampling configs for {batch_size} prompts")
        self.model, self.prompts, self.rules = model, prompts, rules
        self.chunk = cache_config.prefill_step_size
        self.row_ids = list(range(batch_size)) if row_ids is None else list(row_ids)
        self.keys = row_keys(keys, rules)
        self.cache, starts = _starting_cache(model, batch_size, cache_config, reuse)
        embedding = model.model.embed_tokens(mx.array([0]))  # (1, D), for D and the dtype
        self.hidden = mx.zeros((batch_size, embedding.shape[-1]), dtype=embedding.dtype)  # (B, D)
        self.contexts = [list(prompt[start:-1]) for prompt, start in zip(prompts, starts)]
        self.position = 0  # of the contexts committed so far
        self.longest = max((len(context) for context in self.contexts), default=0)

    @property
    def done(self) -> bool:
        return self.position >= self.longest

    @property
    def remaining(self) -> int:
        """Positions still to commit (in the longest row)."""
        return max(self.longest - self.position, 0)

    def advance(self) -> None:
        """Commit the next chunk (`prefill_step_size` positions) of every row."""
        start, self.position = self.position, self.position + self.chunk
        chunks = [context[start : self.position] for context in self.contexts]
        counts = [len(chunk) for chunk in chunks]
        width = max(counts)
        tokens = mx.array([chunk + [0] * (width - len(chunk)) for chunk in chunks])  # (B, C)
        chunk_hidden = target_hidden(self.model, self.cache, chain_tree(tokens), causal=True)
        count = mx.array(counts, dtype=mx.int32)
        last = mx.maximum(count - 1, 0)[:, None, None]  # (B, 1, 1)
        last_hidden = mx.take_along_axis(chunk_hidden, last, axis=1)[:, 0]  # (B, D)
        keep = (count > 0)[:, None]  # (B, 1): rows whose context ended keep their state
        self.hidden = mx.where(keep, last_hidden.astype(self.hidden.dtype), self.hidden)
        self.cache.commit([list(range(width))] * len(chunks), counts)
        mx.eval(self.hidden, self.cache.arrays())

    def finish(self) -> DecodeState:
        """The committed rows as a decode state (every chunk must have been advanced)."""
        assert self.done, "Prefill.finish before its last chunk"
        prompts = self.prompts
        root_tokens = mx.array([prompt[-1] for prompt in prompts], dtype=mx.int32)  # (B,)
        capacity = _round_up(max(len(prompt) for prompt in prompts) + 1)
        history = mx.array(
            [list(prompt) + [0] * (capacity - len(prompt)) for prompt in prompts], dtype=mx.int32
        )  # (B, capacity)
        return DecodeState(
            self.cache, root_tokens, self.hidden, self.row_ids, self.rules, self.keys, history
        )


def prefill(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    cache_config: CacheConfig,
    sampling: SamplingConfig | Sequence[SamplingConfig] = GREEDY,
    row_ids: Sequence[int] | None = None,
    keys: mx.array | None = None,
    reuse: Sequence[tuple[TargetCache, int] | None] | None = None,
) -> DecodeState:
    """Commit every prompt but its last token; the last token roots the first tree.

    Rows of different lengths are right-padded per chunk; padding is never committed.
    sampling: the rules of all rows, or of each row; row_ids: the requests the rows
    serve (default 0..B-1); keys: the rows' own PRNG keys (B, 2)
    (required when a row samples); reuse: per row, a one-row cache whose first n
    slots hold the row's first n prompt tokens (n <= len(prompt) - 2), or None:
    only the rest is prefilled.
    """
    job = Prefill(model, prompts, cache_config, sampling, row_ids, keys, reuse)
    while not job.done:
        job.advance()
    return job.finish()


def _starting_cache(
    model: nn.Module,
    batch_size: int,
    config: CacheConfig,
    reuse: Sequence[tuple[TargetCache, int] | None] | None,
) -> tuple[TargetCache, list[int]]:
    """The cache prefill starts from (empty, or the reused prefixes) and each row's
    number of prompt tokens already in it."""
    if reuse is None or not any(reuse):
        return TargetCache(model, batch_size, config), [0] * batch_size
    if len(reuse) != batch_size:
        raise ValueError(f"{len(reuse)} reused caches for {batch_size} prompts")
    cache = TargetCache(model, 0, config)
    for entry in reuse:
        cache.extend(
            TargetCache(model, 1, config) if entry is None else entry[0].copy_row(0, entry[1])
        )
    return cache, [0 if entry is None else entry[1] for entry in reuse]


HISTORY_STEP = 256


def _round_up(size: int) -> int:
    return (size + HISTORY_STEP - 1) // HISTORY_STEP * HISTORY_STEP


def _widen(history: mx.array, capacity: int) -> mx.array:
    """history (B, T) zero-padded to (B, capacity)."""
    extra = capacity - history.shape[1]
    if extra <= 0:
        return history
    return mx.concatenate([history, mx.zeros((history.shape[0], extra), dtype=history.dtype)], 1)


def row_keys(keys: mx.array | None, rules: Sequence[SamplingConfig]) -> mx.array:
    """(B, 2) per-row PRNG keys: the rows' own keys, split once (`sampling.scramble_keys`),
    or zeros when every row is greedy."""
    batch_size = len(rules)
    if keys is None:
        if not all(rule.greedy for rule in rules):
            raise ValueError("sampling needs an MLX PRNG key (mx.random.key(seed))")
        return mx.zeros((batch_size, 2), dtype=mx.uint32)
    if keys.shape != (batch_size, 2):
        raise ValueError(f"keys must have shape ({batch_size}, 2), got {keys.shape}")
    return scramble_keys(keys)


@dataclass(frozen=True)
class StepPlan:
    """What a step of one (tree, drafter) does, derived once from the config.

    tree: the tree a step decodes with: the tree asked for, or without a drafter its
    lookup branches alone (`TreeConfig.lookup_only`; plain decoding when it has
    none); drafts: the drafter's W beams of L tokens take part (a drafter, W >= 1,
    L > 1); lookup_branches, lookup_length: the G lookup branches of Ll tokens that
    take part (0: none); num_packed: N, the packed tokens verified per step (1: plain
    decoding); share_prefixes: pack each distinct prefix once; lookup_table: lookup
    branches without a match use the drafter's n-gram table.
    """

    tree: TreeConfig
    drafts: bool
    lookup_branches: int
    lookup_length: int
    num_packed: int
    share_prefixes: bool
    lookup_table: bool

    @property
    def plain(self) -> bool:
        """True when every step verifies the root alone (one token per step)."""
        return self.num_packed == 1

    @property
    def depth(self) -> int:
        """The most tokens a step can emit."""
        if self.plain:
            return 1
        lengths = [self.tree.beam_length] if self.drafts else []
        return max(lengths + ([self.lookup_length] if self.lookup_branches else []))


def plan_step(tree: TreeConfig, has_drafter: bool) -> StepPlan:
    """The plan of every step of a session decoding with `tree` (see `StepPlan`)."""
    if not has_drafter:
        tree = tree.lookup_only  # drafter beams need a drafter, lookup branches do not
    drafts = has_drafter and tree.beam_width > 0 and tree.beam_length > 1
    lookup_length = tree.lookup_branch_length
    branches = tree.lookup_branches if lookup_length > 1 else 0
    speculates = drafts or branches > 0
    return StepPlan(
        tree=tree,
        drafts=drafts,
        lookup_branches=branches,
        lookup_length=lookup_length,
        num_packed=tree.num_packed if speculates else 1,
        share_prefixes=tree.share_prefixes or not speculates,
        lookup_table=has_drafter and tree.lookup_table,
    )


DraftFunction = Callable[[mx.array, mx.array, Coupling | None, mx.array], Draft]
Drafted = tuple[mx.array, mx.array]  # what a compiled draft returns: a `Draft`'s fields


@dataclass(frozen=True)
class StepFunctions:
    """The per-step device functions of one `StepPlan`, built once.

    draft: (hidden (B, D), root_tokens (B,), coupling, log_rates (B, DEPTHS, BINS))
        -> the drafter's beams (B, W, L) and their prefixes' contest scores
        (B, W, L) (one beam of the root repeated, scored 0, when there are none);
        log_rates rank a dynamic tree's prefixes (`confidence.confident_scores`)
    coupling: state -> the target's sampling noise where the beams draft (`Coupling`),
        None when no row samples or nothing is drafted
    lookup: (beams, history (B, T), history lengths (B,)) -> (B, W + G, max(L, Ll)),
        the drafter's beams then G lookup branches, the shorter ones padded with
        ABSENT; None without lookup branches
    pack: beams (B, W + G, max(L, Ll)) -> PackedTree with N = plan.num_packed
    accept: (beams, unpack, canonical, choices (B, N)) -> Acceptance
    kernels: which implementation expands, packs and accepts ("mlx", "metal", ...)
    """

    plan: StepPlan
    draft: DraftFunction
    coupling: Callable[[DecodeState], Coupling | None]
    lookup: Callable[[mx.array, mx.array, mx.array], mx.array] | None
    pack: Callable[[mx.array], PackedTree]
    accept: Callable[[mx.array, mx.array, mx.array, mx.array], Acceptance]
    kernels: str = "mlx"


def compile_by_default() -> bool:
    """Compile the draft, lookup, pack and accept functions on every backend: each
    small op costs a kernel launch on the GPU and a dispatch on the host of the CPU
    backend, and compiling fuses them (docs/performance.md)."""
    return True


_SHARED: PerModel[StepFunctions] = PerModel()


def shared_step_functions(
    model: nn.Module,
    drafter: Drafter | None,
    tree: TreeConfig,
    compiled: bool | None = None,
    kernels: str | None = None,
) -> StepFunctions:
    """`step_functions`, built once per process for each model (and its embedding
    module), drafter, tree, compilation and kernel backend: a session per request
    (as `generate` makes) then finds its functions compiled already, instead of
    tracing each again on its first call. They hold the drafter, so a model keeps
    those of decoding without a drafter and of its latest drafter only, and all go
    when the model is freed."""
    compiled = compile_by_default() if compiled is None else compiled
    ops = select_kernels(kernels)
    return _SHARED.get(
        model,
        drafter,
        (tree, compiled, ops.backend),
        lambda: step_functions(model, drafter, tree, compiled, ops),
    )


def step_functions(
    model: nn.Module,
    drafter: Drafter | None,
    tree: TreeConfig,
    compiled: bool | None = None,
    kernels: str | Kernels | None = None,
) -> StepFunctions:
    """Build the draft, lookup, pack and accept functions of `plan_step(tree, drafter)`.

    compiled: wrap them in mx.compile (None: `compile_by_default()`).
    kernels: "metal", "mlx" or "auto" (None: $MLX_REDRAFTER_KERNELS, default "auto":
        the fused Metal kernels when Metal is available), or a `Kernels` value.
    """
    plan = plan_step(tree, drafter is not None)
    compiled = compile_by_default() if compiled is None else compiled
    ops = select_kernels(kernels)
    draft = _drafter_beams(model, drafter, plan, ops, compiled)
    coupling = _coupling(model, drafter, plan)
    lookup = _lookup(drafter, plan)
    if compiled and lookup is not None:
        lookup = mx.compile(lookup)
    num_packed, share_prefixes = plan.num_packed, plan.share_prefixes

    def pack(beams: mx.array) -> PackedTree:
        return ops.pack(beams, num_packed, share_prefixes)

    if compiled:
        return StepFunctions(
            plan, draft, coupling, lookup, mx.compile(pack), mx.compile(ops.accept), ops.backend
        )
    return StepFunctions(plan, draft, coupling, lookup, pack, ops.accept, ops.backend)


def _drafter_beams(
    model: nn.Module, drafter: Drafter | None, plan: StepPlan, ops: Kernels, compiled: bool
) -> DraftFunction:
    """The draft function: beam search in the drafter (coupled with the target's noise
    for sampled rows), or the root repeated (the lookup's fallback, or plain
    decoding's one-token tree)."""
    if drafter is None or not plan.drafts:
        return _repeat_root(plan.lookup_length if plan.lookup_branches else 1)
    embed = model.model.embed_tokens
    width, length, nodes = plan.tree.beam_width, plan.tree.beam_length, plan.tree.draft_nodes

    def beams_of(
        hidden: mx.array, root_tokens: mx.array, coupling: Coupling | None, log_rates: mx.array
    ) -> Drafted:
        beams, scores, contest = scored_beam_search(
            drafter, embed, hidden, root_tokens, width, length, ops.expand, coupling
        )  # (B, W, L) each
        if nodes is None:  # a fixed tree: every drafted prefix
            return beams, contest
        # A dynamic tree: the `nodes` prefixes of the W beams likeliest to be accepted.
        likely = confident_scores(scores, contest, log_rates)  # (B, W, L)
        return keep_best_nodes(beams, likely, nodes), contest

    def search(hidden: mx.array, root_tokens: mx.array, log_rates: mx.array) -> Drafted:
        return beams_of(hidden, root_tokens, None, log_rates)

    def coupled(
        hidden: mx.array,
        root_tokens: mx.array,
        scale: mx.array,
        noise: mx.array,
        log_rates: mx.array,
    ) -> Drafted:
        return beams_of(hidden, root_tokens, Coupling(scale, noise), log_rates)

    if compiled:
        search = mx.compile(search, inputs=[drafter.state, embed.state])
        coupled = mx.compile(coupled, inputs=[drafter.state, embed.state])

    def draft(
        hidden: mx.array, root_tokens: mx.array, coupling: Coupling | None, log_rates: mx.array
    ) -> Draft:
        if coupling is None:
            return Draft(*search(hidden, root_tokens, log_rates))
        return Draft(*coupled(hidden, root_tokens, coupling.scale, coupling.noise, log_rates))

    return draft


def _coupling(
    model: nn.Module, drafter: Drafter | None, plan: StepPlan
) -> Callable[[DecodeState], Coupling | None]:
    """The function giving a step's `Coupling`: the noise of the target's samples at the
    positions the drafter's beams draft, on its draft vocabulary (beam_search.py)."""
    if drafter is None or not plan.drafts:
        return lambda state: None
    vocab_size, drafted = output_size(model), plan.tree.beam_length - 1
    draft_ids = drafter.draft_vocab_ids if drafter.config.draft_vocab_size is not None else None

    def coupling(state: DecodeState) -> Coupling | None:
        if state.all_greedy:
            return None
        # The drafted token at depth d is the target's choice at the node of depth
        # d - 1: sampled with the noise of that node's position, the root's + d - 1,
        # which the verification of this tree reuses.
        noise = state.noise_from_root(drafted, vocab_size)  # (B, L-1, V)
        if draft_ids is not None:
            noise = noise[:, :, draft_ids]  # (B, L-1, Vd)
        noise = mx.where(state.sampled[:, None, None], noise, 0.0)  # greedy rows: none
        return Coupling(state.inverse_temperature, noise)

    return coupling


def _lookup(
    drafter: Drafter | None, plan: StepPlan
) -> Callable[[mx.array, mx.array, mx.array], mx.array] | None:
    """The lookup function: G branches from each row's text joined to the beams."""
    if not plan.lookup_branches:
        return None
    table = drafter.ngrams if drafter is not None and plan.lookup_table else None
    count, length, ngram = plan.lookup_branches, plan.lookup_length, plan.tree.lookup_ngram
    longest = max(plan.tree.beam_length, length)  # shorter beams end in ABSENT

    def lookup(beams: mx.array, history: mx.array, lengths: mx.array) -> mx.array:
        # A row without a match gets the n-gram table's continuation, or the best
        # drafted beam, cut or padded to Ll.
        fallback = pad_beams(beams[:, :1], length)[:, 0]  # (B, Ll)
        if table is not None:
            fallback = table_branches(table, history, lengths, fallback)  # (B, Ll)
        found = lookup_branches(history, lengths, count, length, ngram, fallback)  # (B, G, Ll)
        if not plan.drafts:
            return found
        return mx.concatenate([pad_beams(beams, longest), pad_beams(found, longest)], axis=1)

    return lookup


def _repeat_root(beam_length: int) -> DraftFunction:
    """A draft without the drafter: the root repeated, (B, 1, L), scored 0."""

    def draft(
        hidden: mx.array, root_tokens: mx.array, coupling: Coupling | None, log_rates: mx.array
    ) -> Draft:
        shape = (root_tokens.shape[0], 1, beam_length)
        return Draft(mx.broadcast_to(root_tokens[:, None, None], shape), mx.zeros(shape))

    return draft


class PhaseClock:
    """Wall-clock per phase of a step, for profiling only.

    Each `mark` evaluates the phase's outputs first, so a profiled step has one host
    sync per phase instead of one in all: use it in a separate, profiled pass.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, phase: str, *outputs: Any) -> None:
        mx.eval(*outputs)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def draft(steps: StepFunctions, state: DecodeState) -> Draft:
    """The step's candidates: the drafter's beams, then the lookup branches,
    (B, W + G, L), and the beams' contest scores; lazy until evaluated."""
    if state.confidence is None:
        log_rates = neutral_rates(state.root_tokens.shape[0])  # (B, DEPTHS, BINS)
    else:  # the rates before the last step's counts, for a draft made ahead
        log_rates = state.confidence[state.sampled.astype(mx.int32)]  # (B, DEPTHS, BINS)
    coupling = steps.coupling(state)
    drafted = steps.draft(state.hidden, state.root_tokens, coupling, log_rates)  # (B, W, L)
    if steps.lookup is None:
        return drafted
    # Draft (context lookup): G more branches from each row's own text.
    beams = steps.lookup(drafted.beams, state.history, state.cache.lengths + 1)  # (B, W + G, L)
    return drafted._replace(beams=beams)


def decode_step(
    model: nn.Module,
    steps: StepFunctions,
    state: DecodeState,
    clock: PhaseClock | None = None,
    prefetch: bool = True,
    look_ahead: bool = False,
    logprobs: int | None = None,
) -> StepOutput:
    """One speculative step for every row, with one host sync at the end (a second
    only when greedy choices meet near-equal logits; one per phase when a profiling
    `clock` is given).

    prefetch: after the sync, start drafting the next step with `mx.async_eval`, so
    the device works while the host handles this step's tokens (text, stop rules).
    look_ahead: for a plain step whose next step is plain too, launch that one
    before this one's sync (`plain_step`).
    logprobs: also report each emitted token's log-probability under the target and
    this many top alternatives (`logprobs.py`); None: none.
    """
    if steps.plan.plain:
        return plain_step(model, state, clock, look_ahead, logprobs)
    state.ahead = None  # a plain forward launched ahead is not this step's
    # Draft: W beams of L tokens, each opened by the row's root token, and G branches.
    drafted = state.take_draft(steps) or draft(steps, state)
    beams = drafted.beams  # (B, W + G, L)
    if clock:
        clock.mark("draft", beams)
    # Pack tree: each distinct prefix once, N static for this tree.
    tree = steps.pack(beams)
    # Verify: one target forward over the packed tokens.
    hidden, logits = target_forward(model, state.cache, tree)  # (B, N, D), (B, N, V)
    noise = state.node_noise(tree.depths, beams.shape[-1], logits.shape[-1])  # (B, N, V)
    choices, unsure = choose_tokens_quickly(logits, state.sampling, noise)  # (B, N), ()
    if clock:
        clock.mark("verify", hidden, choices)

    # Accept: walk the tree along the target's choices.
    walk = (steps, state, beams, tree, hidden, logits, logprobs)
    result, figures = accept_choices(*walk, choices)
    counts = _confidence_counts(steps.plan, drafted, result.runs, state.sampled)
    # The step's one host sync (it also materializes this forward's K/V writes).
    riders = state.take_riders()
    mx.eval(state.hidden, result, tree.num_tokens, unsure, _arrays(figures), counts, riders)
    if unsure.item():
        # Rare: near-equal logits at some node; choose exactly as mlx-lm does.
        result, figures = accept_choices(*walk, choose_tokens(logits, state.sampling, noise))
        counts = _confidence_counts(steps.plan, drafted, result.runs, state.sampled)
        mx.eval(state.hidden, result, _arrays(figures), counts)
    state.root_tokens = result.bonus_tokens
    state.record(result.tokens)
    num_accepted = host_list(result.num_accepted)
    tokens = [row[: n + 1] for row, n in zip(host_rows(result.tokens), num_accepted)]
    # Commit cache: keep the root and the accepted nodes' K/V (moved, if they must
    # move at all, lazily with the next forward).
    state.cache.commit(host_rows(result.path), [n + 1 for n in num_accepted])
    if clock:
        clock.mark("accept and commit")
    elif prefetch:
        state.prefetch(steps, draft(steps, state))
    sizes, runs = host_list(tree.num_tokens), np.array(result.runs)
    report = None if figures is None else figures.to_host(tokens)
    confidence = None if counts is None else np.array(counts)
    return StepOutput(tokens, num_accepted, sizes, runs, report, confidence)


def _confidence_counts(
    plan: StepPlan, drafted: Draft, runs: mx.array, sampled: mx.array
) -> mx.array | None:
    """The step's `confidence.observed_counts` of its drafter beams (lazy), or None
    without drafter beams, or with a tree budget (whose cut tokens acceptance treats
    as drafted and missed)."""
    if not plan.drafts or plan.tree.tree_budget is not None:
        return None
    width, length = drafted.contest.shape[1:]
    beams = drafted.beams[:, :width, :length]  # (B, W, L) the drafter's own
    return _observed_counts(beams, drafted.contest, runs[:, :width], sampled)


_observed_counts = mx.compile(observed_counts)  # traced once per (B, W, L)


def accept_choices(
    steps: StepFunctions,
    state: DecodeState,
    beams: mx.array,
    tree: PackedTree,
    hidden: mx.array,
    logits: mx.array,
    logprobs: int | None,
    choices: mx.array,
) -> tuple[Acceptance, EmittedLogprobs | None]:
    """Walk the packed tree along the target's `choices` (B, N); move each row's
    hidden state to its last accepted node and, when `logprobs` is set, compute the
    emitted tokens' log-probabilities. Lazy: nothing is evaluated here.

    beams: (B, W + G, L); hidden: (B, N, D); logits: (B, N, V).
    """
    result = steps.accept(beams, tree.unpack, tree.canonical, choices)
    last = result.last_node[:, None, None]  # (B, 1, 1)
    state.hidden = mx.take_along_axis(hidden, last, axis=1)[:, 0]  # (B, D)
    if logprobs is None:
        return result, None
    return result, emitted_logprobs(logits, result.path, result.tokens, logprobs)


@dataclass(frozen=True)
class PlainForward:
    """The lazy forward and choice of a plain step (`plain_forward`)."""

    hidden: mx.array  # (B, 1, D)
    logits: mx.array  # (B, 1, V)
    noise: mx.array | None  # (B, 1, V), None when every row is greedy
    choices: mx.array  # (B, 1) int32
    unsure: mx.array  # () bool: see `choose_tokens_quickly`


def plain_forward(model: nn.Module, state: DecodeState) -> PlainForward:
    """The target's forward over each row's root and its choice after it (lazy); the
    K/V of the roots land after each row's committed tokens, uncommitted."""
    hidden, logits = target_forward(model, state.cache, chain_tree(state.root_tokens[:, None]))
    roots = mx.zeros((len(state.row_ids), 1), dtype=mx.int32)  # (B, 1) depth 0
    noise = state.node_noise(roots, 1, logits.shape[-1])  # (B, 1, V)
    choices, unsure = choose_tokens_quickly(logits, state.sampling, noise)  # (B, 1), ()
    return PlainForward(hidden, logits, noise, choices, unsure)


def launch_plain(model: nn.Module, state: DecodeState) -> None:
    """Start the next plain step's forward now, from this step's choices before they
    are read, as mlx-lm pipelines its steps: the host builds and the device queues
    step t+1 while step t computes and the host handles its tokens. `plain_step`
    takes it; a change of rows (`select_rows`, `extend`) or a tree step drops it."""
    forward = plain_forward(model, state)
    riders = state.take_riders()
    if riders:  # waits, as the launch below would, for the forward in flight
        mx.async_eval(*riders)
    mx.async_eval(forward.hidden, forward.choices, forward.unsure)
    state.ahead = forward


def plain_step(
    model: nn.Module,
    state: DecodeState,
    clock: PhaseClock | None = None,
    look_ahead: bool = False,
    logprobs: int | None = None,
) -> StepOutput:
    """A step of plain decoding: the tree is the root alone, so there is nothing to
    draft, pack or walk; the target's choice after the root is the step's token.
    The same forward and choice as a one-token tree, with fewer operations.

    look_ahead: the next step is plain too; launch it (`launch_plain`) before this
    step's sync. The cache commit of a plain step needs nothing from the device.
    logprobs: as in `decode_step`.
    """
    state.drafted = None
    forward, state.ahead = state.ahead or plain_forward(model, state), None
    state.hidden = forward.hidden[:, 0]  # (B, D)
    state.root_tokens = forward.choices[:, 0]  # (B,)
    state.record(forward.choices)
    batch_size = forward.choices.shape[0]
    state.cache.commit([[0]] * batch_size, [1] * batch_size)
    if look_ahead and clock is None:
        launch_plain(model, state)
    roots = mx.zeros((batch_size, 1), dtype=mx.int32)  # (B, 1): the one node
    figures = None
    if logprobs is not None:
        figures = emitted_logprobs(forward.logits, roots, forward.choices, logprobs)
    # The step's one host sync.
    mx.eval(forward.hidden, forward.choices, forward.unsure, _arrays(figures), state.take_riders())
    tokens = host_rows(forward.choices)
    if forward.unsure.item():
        # Rare: near-equal logits; choose exactly as mlx-lm does, and if that changes
        # a token, drop the step launched ahead from the quick choice.
        exact = choose_tokens(forward.logits, state.sampling, forward.noise)  # (B, 1)
        if host_rows(exact) != tokens:
            tokens, state.ahead = host_rows(exact), None
            state.root_tokens = exact[:, 0]
            state.replace_roots(state.root_tokens)
            if logprobs is not None:
                figures = emitted_logprobs(forward.logits, roots, exact, logprobs)
                mx.eval(figures.arrays())
    if clock:
        clock.mark("verify")
    zeros = np.zeros((batch_size, 1), dtype=np.int64)
    report = None if figures is None else figures.to_host(tokens)
    return StepOutput(tokens, [0] * batch_size, [1] * batch_size, zeros, report)


def _arrays(figures: EmittedLogprobs | None) -> tuple[mx.array, ...]:
    return () if figures is None else figures.arrays()


def host_list(values: mx.array) -> list[int]:
    """An evaluated (B,) integer array as a Python list."""
    return cast(list[int], values.tolist())


def host_rows(values: mx.array) -> list[list[int]]:
    """An evaluated (B, K) integer array as Python lists."""
    return cast(list[list[int]], values.tolist())
