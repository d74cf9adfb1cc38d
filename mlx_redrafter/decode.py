"""The speculative decoding loop, at the level of token ids.

prefill -> [draft (beam search) -> pack tree -> verify -> accept -> commit cache
-> yield] per step. Shapes: B batch, W beam width, L beam length, N packed
tokens, D hidden, V vocabulary.

Plain autoregressive decoding is the same loop with W = L = 1 and no drafter:
the tree is the single root token, and every step emits the target's choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from .accept import Acceptance
from .beam_search import beam_search
from .config import PLAIN_DECODING, BeamConfig, CacheConfig, SamplingConfig, StopConfig
from .drafter import Drafter
from .kernels import Kernels, select_kernels
from .lookup import lookup_beams
from .ngrams import table_beams
from .sampling import choose_tokens, choose_tokens_quickly, position_keys
from .target import TargetCache, context_length, target_forward, target_hidden
from .tree import PackedTree, chain_tree, pad_beams

GREEDY = SamplingConfig()


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
        ones at [0, lengths[b]), the root at lengths[b] (what lookup beams search).
    """

    cache: TargetCache
    root_tokens: mx.array
    hidden: mx.array
    row_ids: list[int]
    sampling: list[SamplingConfig]
    keys: mx.array
    history: mx.array

    def select_rows(self, rows: list[int]) -> None:
        """Keep only the batch rows at the given positions."""
        index = mx.array(rows, dtype=mx.int32)
        self.cache.select_rows(rows)
        self.root_tokens = self.root_tokens[index]
        self.hidden = self.hidden[index]
        self.row_ids = [self.row_ids[r] for r in rows]
        self.sampling = [self.sampling[r] for r in rows]
        self.keys = self.keys[index]
        self.history = self.history[index]

    def extend(self, other: DecodeState) -> None:
        """Append the rows of `other` (freshly prefilled requests joining the batch)."""
        self.cache.extend(other.cache)
        self.root_tokens = mx.concatenate([self.root_tokens, other.root_tokens])
        self.hidden = mx.concatenate([self.hidden, other.hidden.astype(self.hidden.dtype)])
        self.row_ids = self.row_ids + other.row_ids
        self.sampling = self.sampling + other.sampling
        self.keys = mx.concatenate([self.keys, other.keys])
        capacity = max(self.history.shape[1], other.history.shape[1])
        self.history = mx.concatenate(
            [_widen(self.history, capacity), _widen(other.history, capacity)]
        )

    def record(self, tokens: mx.array) -> None:
        """Append a step's emitted tokens (B, L) to the history, after each row's root
        (call before the cache commits; entries past a row's emitted count are stale)."""
        needed = self.cache.frontier + 1 + tokens.shape[1]
        if needed > self.history.shape[1]:
            self.history = _widen(self.history, _round_up(needed))
        steps = mx.arange(tokens.shape[1], dtype=mx.int32)
        slots = self.cache.lengths[:, None] + 1 + steps[None, :]  # (B, L)
        self.history = mx.put_along_axis(self.history, slots, tokens, axis=1)

    def node_keys(self, positions: mx.array) -> mx.array | None:
        """(B, N, 2) PRNG keys of the nodes at `positions` (B, N); None if all greedy."""
        if all(rule.greedy for rule in self.sampling):
            return None
        return position_keys(self.keys, positions)


@dataclass(frozen=True)
class StepOutput:
    """One step's results read back to the host (index = batch row)."""

    tokens: list[list[int]]  # the num_accepted + 1 tokens each row emitted
    num_accepted: list[int]
    tree_sizes: list[int]  # distinct prefixes in each row's tree


def prefill(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    cache_config: CacheConfig,
    sampling: SamplingConfig | Sequence[SamplingConfig] = GREEDY,
    row_ids: Sequence[int] | None = None,
    keys: mx.array | None = None,
) -> DecodeState:
    """Commit every prompt but its last token; the last token roots the first tree.

    Rows of different lengths are right-padded per chunk; padding is never committed.
    sampling: the rules of all rows, or of each row; row_ids: the requests the rows
    serve (default 0..B-1); keys: one PRNG key (2,), split into a key per row, or the
    rows' own keys (B, 2) (required when a row samples).
    """
    batch_size = len(prompts)
    cache = TargetCache(model, batch_size, cache_config)
    embedding = model.model.embed_tokens(mx.array([0]))  # (1, D), for D and the dtype
    hidden = mx.zeros((batch_size, embedding.shape[-1]), dtype=embedding.dtype)  # (B, D)
    contexts = [list(prompt[:-1]) for prompt in prompts]
    longest = max((len(context) for context in contexts), default=0)
    for start in range(0, longest, cache_config.prefill_step_size):
        chunks = [context[start : start + cache_config.prefill_step_size] for context in contexts]
        counts = [len(chunk) for chunk in chunks]
        width = max(counts)
        tokens = mx.array([chunk + [0] * (width - len(chunk)) for chunk in chunks])  # (B, C)
        chunk_hidden = target_hidden(model, cache, chain_tree(tokens), causal=True)  # (B, C, D)
        count = mx.array(counts, dtype=mx.int32)
        last = mx.maximum(count - 1, 0)[:, None, None]  # (B, 1, 1)
        last_hidden = mx.take_along_axis(chunk_hidden, last, axis=1)[:, 0]  # (B, D)
        hidden = mx.where((count > 0)[:, None], last_hidden.astype(hidden.dtype), hidden)
        cache.commit([list(range(width))] * batch_size, counts)
        mx.eval(hidden, cache.arrays())
    root_tokens = mx.array([prompt[-1] for prompt in prompts], dtype=mx.int32)  # (B,)
    capacity = _round_up(longest + 2)
    history = mx.array(
        [list(prompt) + [0] * (capacity - len(prompt)) for prompt in prompts], dtype=mx.int32
    )  # (B, capacity)
    rules = [sampling] * batch_size if isinstance(sampling, SamplingConfig) else list(sampling)
    if len(rules) != batch_size:
        raise ValueError(f"{len(rules)} sampling configs for {batch_size} prompts")
    ids = list(range(batch_size)) if row_ids is None else list(row_ids)
    return DecodeState(cache, root_tokens, hidden, ids, rules, row_keys(keys, rules), history)


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
    """(B, 2) per-row PRNG keys from one key (split per row) or from per-row keys."""
    batch_size = len(rules)
    if keys is None:
        if not all(rule.greedy for rule in rules):
            raise ValueError("sampling needs an MLX PRNG key (mx.random.key(seed))")
        return mx.zeros((batch_size, 2), dtype=mx.uint32)
    if keys.ndim == 1:
        return mx.random.split(keys, batch_size)  # (B, 2)
    if keys.shape != (batch_size, 2):
        raise ValueError(f"keys must have shape (2,) or ({batch_size}, 2), got {keys.shape}")
    return keys


@dataclass(frozen=True)
class StepFunctions:
    """The per-step device functions for one (drafter, beam config), built once.

    draft: (hidden (B, D), root_tokens (B,)) -> the drafter's beams (B, W, L)
        (one beam of the root repeated when there are none)
    lookup: (beams, history (B, T), history lengths (B,)) -> (B, W + G, max(L, Ll)),
        the drafter's beams then G lookup beams, the shorter ones padded with ABSENT;
        None without lookup beams
    pack: beams (B, W + G, max(L, Ll)) -> PackedTree with N = beam.num_packed
    accept: (beams, unpack, canonical, choices (B, N)) -> Acceptance
    kernels: which implementation expands, packs and accepts ("mlx", "metal", ...)
    """

    draft: Callable[[mx.array, mx.array], mx.array]
    lookup: Callable[[mx.array, mx.array, mx.array], mx.array] | None
    pack: Callable[[mx.array], PackedTree]
    accept: Callable[[mx.array, mx.array, mx.array, mx.array], Acceptance]
    kernels: str = "mlx"


def compile_by_default() -> bool:
    """Compile the hot path on the GPU (Metal), where fusing many small kernels pays;
    on the CPU backend it measured no gain (docs/performance.md)."""
    return mx.default_device() == mx.gpu


def decoding_beam(drafter: Drafter | None, beam: BeamConfig) -> BeamConfig:
    """The tree a session actually decodes with: without a drafter, drafter beams
    (W >= 1) mean plain decoding (`PLAIN_DECODING`); lookup beams alone (W = 0) need
    no drafter and stay as given."""
    if drafter is None and beam.beam_width > 0:
        return PLAIN_DECODING
    return beam


def step_functions(
    model: nn.Module,
    drafter: Drafter | None,
    beam: BeamConfig,
    compiled: bool | None = None,
    kernels: str | Kernels | None = None,
) -> StepFunctions:
    """Build the draft, pack and accept functions of a decoding session.

    Without a drafter and lookup beams (or with L = 1) the tree is the root token
    alone: plain decoding.
    compiled: wrap them in mx.compile (None: `compile_by_default()`).
    kernels: "metal", "mlx" or "auto" (None: $MLX_REDRAFTER_KERNELS, default "auto":
        the fused Metal kernels when Metal is available), or a `Kernels` value.
    """
    compiled = compile_by_default() if compiled is None else compiled
    ops = select_kernels(kernels)
    embed = model.model.embed_tokens
    beam_length = beam.beam_length
    with_drafter = drafter is not None and beam.beam_width > 0 and beam_length > 1
    # Lookup beams beside the drafter's, or alone (W = 0, or drafter beams of one
    # token); a beam with drafter beams but no drafter is plain decoding, as
    # `decoding_beam` decides.
    lookup_length = beam.lookup_beam_length
    may_look_up = drafter is not None or beam.beam_width == 0
    num_lookup = beam.lookup_beams if may_look_up and lookup_length > 1 else 0
    draft: Callable[[mx.array, mx.array], mx.array]
    if drafter is None or not with_drafter:
        # No drafter beams: the root alone (plain decoding), or with lookup beams the
        # root repeated, their fallback.
        draft = _repeat_root(lookup_length if num_lookup else 1)
    else:

        def search(hidden: mx.array, root_tokens: mx.array) -> mx.array:
            return beam_search(
                drafter,
                embed,
                hidden,
                root_tokens,
                beam.beam_width,
                beam.beam_length,
                expand=ops.expand,
            )

        draft = search
        if compiled:
            draft = mx.compile(search, inputs=[drafter.state, embed.state])
    speculates = with_drafter or num_lookup > 0
    num_packed = beam.num_packed if speculates else 1
    share_prefixes = beam.share_prefixes or not speculates

    def pack(beams: mx.array) -> PackedTree:
        return ops.pack(beams, num_packed, share_prefixes)

    lookup = None
    table = drafter.ngrams if drafter is not None and beam.lookup_table else None
    if num_lookup:

        def lookup(beams: mx.array, history: mx.array, lengths: mx.array) -> mx.array:
            # A row without a match gets the n-gram table's continuation, or the best
            # drafted beam, cut or padded to Ll.
            fallback = pad_beams(beams[:, :1], lookup_length)[:, 0]  # (B, Ll)
            if table is not None:
                fallback = table_beams(table, history, lengths, fallback)  # (B, Ll)
            found = lookup_beams(
                history, lengths, num_lookup, lookup_length, beam.lookup_ngram, fallback
            )  # (B, G, Ll)
            if not with_drafter:
                return found
            longest = max(beam_length, lookup_length)  # shorter beams end in ABSENT
            return mx.concatenate([pad_beams(beams, longest), pad_beams(found, longest)], axis=1)

    if compiled:
        pack, accept = mx.compile(pack), mx.compile(ops.accept)
        return StepFunctions(draft, lookup, pack, accept, ops.backend)
    return StepFunctions(draft, lookup, pack, ops.accept, ops.backend)


def _repeat_root(beam_length: int) -> Callable[[mx.array, mx.array], mx.array]:
    """A draft without the drafter: the root repeated, (B, 1, L)."""

    def draft(hidden: mx.array, root_tokens: mx.array) -> mx.array:
        shape = (root_tokens.shape[0], 1, beam_length)
        return mx.broadcast_to(root_tokens[:, None, None], shape)

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


def decode_step(
    model: nn.Module,
    steps: StepFunctions,
    state: DecodeState,
    clock: PhaseClock | None = None,
) -> StepOutput:
    """One speculative step for every row, with one host sync at the end (a second
    only when greedy choices meet near-equal logits; one per phase when a profiling
    `clock` is given)."""
    # Draft: W beams of L tokens, each opened by the row's root token.
    beams = steps.draft(state.hidden, state.root_tokens)  # (B, W, L)
    if steps.lookup is not None:
        # Draft (context lookup): G more beams from each row's own text.
        beams = steps.lookup(beams, state.history, state.cache.lengths + 1)  # (B, W + G, L)
    if clock:
        clock.mark("draft", beams)
    # Pack tree: each distinct prefix once, N static for this beam config.
    tree = steps.pack(beams)
    # Verify: one target forward over the packed tokens.
    hidden, logits = target_forward(model, state.cache, tree)  # (B, N, D), (B, N, V)
    keys = state.node_keys(state.cache.positions)  # (B, N, 2): by absolute position
    choices, unsure = choose_tokens_quickly(logits, state.sampling, keys)  # (B, N), ()
    if clock:
        clock.mark("verify", hidden, choices)

    # Accept: walk the tree along the target's choices.
    def accept(choices: mx.array) -> Acceptance:
        result = steps.accept(beams, tree.unpack, tree.canonical, choices)
        state.hidden = mx.take_along_axis(hidden, result.last_node[:, None, None], axis=1)[:, 0]
        return result

    result = accept(choices)
    # The step's one host sync (it also materializes this forward's K/V writes).
    mx.eval(state.hidden, result, tree.num_tokens, unsure)
    if unsure.item():
        # Rare: near-equal logits at some node; choose exactly as mlx-lm does.
        result = accept(choose_tokens(logits, state.sampling, keys))
        mx.eval(state.hidden, result)
    state.root_tokens = result.bonus_tokens
    state.record(result.tokens)
    num_accepted = host_list(result.num_accepted)
    tokens = [row[: n + 1] for row, n in zip(host_rows(result.tokens), num_accepted)]
    # Commit cache: keep the root and the accepted nodes' K/V (moved, if they must
    # move at all, lazily with the next forward).
    state.cache.commit(host_rows(result.path), [n + 1 for n in num_accepted])
    if clock:
        clock.mark("accept and commit")
    return StepOutput(tokens, num_accepted, host_list(tree.num_tokens))


def host_list(values: mx.array) -> list[int]:
    """An evaluated (B,) integer array as a Python list."""
    return cast(list[int], values.tolist())


def host_rows(values: mx.array) -> list[list[int]]:
    """An evaluated (B, K) integer array as Python lists."""
    return cast(list[list[int]], values.tolist())


@dataclass
class RowProgress:
    """Host-side stop rules of one row: max_tokens, EOS ids, the context limit."""

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    generated: int = 0

    def take(
        self, tokens: list[int], committed: int, beam_length: int, limit: int | None
    ) -> tuple[list[int], int, str | None]:
        """Apply the stop rules to a step's new tokens.

        committed: the row's committed length after the step; limit: the model's context.
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
            self.generated >= self.max_tokens
            or (limit is not None and committed + beam_length > limit)
        ):
            reason = "length"
        return tokens, len(tokens) + (reason == "stop"), reason


@dataclass(frozen=True)
class DecodeEvent:
    """What one step produced for the rows still running, after stop rules.

    row_ids: the requests that took part in this step.
    tokens: the new tokens of each of those rows (may be empty once a row stops).
    num_emitted: tokens the target produced for each row that count towards tau: the
        kept tokens, plus the EOS token when the row stopped on one.
    num_accepted: drafted tokens the target accepted for each row.
    tree_sizes: distinct prefixes in each row's tree (N before padding).
    finished: rows that ended this step, with "stop" (EOS) or "length".
    prefill_seconds, step_seconds: wall-clock of the prefill and of this step.
    """

    row_ids: list[int]
    tokens: list[list[int]]
    num_emitted: list[int]
    num_accepted: list[int]
    tree_sizes: list[int]
    finished: dict[int, str] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    step_seconds: float = 0.0


def speculative_decode(
    model: nn.Module,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    beam: BeamConfig,
    sampling: SamplingConfig | Sequence[SamplingConfig],
    stop: StopConfig,
    cache_config: CacheConfig | None = None,
    key: mx.array | None = None,
    stopped_rows: set[int] | None = None,
    compiled: bool | None = None,
    clock: PhaseClock | None = None,
    kernels: str | Kernels | None = None,
) -> Iterator[DecodeEvent]:
    """Decode a batch of token-id prompts together; yields one event per step.

    `sampling` is one config for every row or one per prompt.
    A consumer that decides a row must end (a stop string, a closed client) adds
    its index to `stopped_rows`; the row leaves the batch before the next step.
    `key` is the MLX PRNG key for sampling: one key (2,), split into a key per row, or
    each row's own key (B, 2). `compiled` forces
    mx.compile on or off for the draft/pack/accept functions (default: on the GPU only).
    `clock` profiles the phases of every step (adding a host sync per phase).
    `kernels` picks the expansion/acceptance implementation (see `step_functions`).
    """
    cache_config = cache_config or CacheConfig()
    stopped_rows = stopped_rows if stopped_rows is not None else set()
    if stop.max_tokens == 0 or not prompts:
        return
    beam = decoding_beam(drafter, beam)
    steps = step_functions(model, drafter, beam, compiled, kernels)
    limit = context_length(model)
    started = time.perf_counter()
    rules = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) else list(sampling)
    keys = row_keys(key, rules)  # checked before the prefill's work
    state = prefill(model, prompts, cache_config, rules, keys=keys)
    prefill_seconds = time.perf_counter() - started
    progress = [RowProgress(stop.max_tokens, stop.eos_token_ids) for _ in prompts]
    while state.row_ids:
        step_started = time.perf_counter()
        if clock:
            clock.start()
        output = decode_step(model, steps, state, clock)
        finished: dict[int, str] = {}
        emitted: list[list[int]] = []
        counted: list[int] = []
        for row, new_tokens, length in zip(state.row_ids, output.tokens, state.cache.host_lengths):
            kept, count, reason = progress[row].take(new_tokens, length, beam.longest_beam, limit)
            emitted.append(kept)
            counted.append(count)
            if reason is not None:
                finished[row] = reason
        yield DecodeEvent(
            row_ids=list(state.row_ids),
            tokens=emitted,
            num_emitted=counted,
            num_accepted=output.num_accepted,
            tree_sizes=output.tree_sizes,
            finished=finished,
            prefill_seconds=prefill_seconds,
            step_seconds=time.perf_counter() - step_started,
        )
        keep = [
            position
            for position, row in enumerate(state.row_ids)
            if row not in finished and row not in stopped_rows
        ]
        if len(keep) != len(state.row_ids):
            state.select_rows(keep)
