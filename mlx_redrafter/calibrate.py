"""The cost of a step on this machine: how long the target takes to verify N packed
tokens, and the drafter to draft, measured once per model and device and cached.

Shapes: N packed tokens, T context, W beam width, L beam length.

On an Apple GPU decoding is memory-bound: verifying 16-64 tokens costs little more
than one, so wide trees pay. On a CPU, or with 4-bit weights that must be
dequantized per token, the cost grows with N and small trees (or none) win. The
auto tree (`auto.py`) reads this curve instead of assuming either.

A calibration is keyed by the model's fingerprint (its parameter names, shapes,
dtypes and a sample of its values), the drafter's, the device, the dtype and
quantization, the MLX version and this package's engine code (a digest of its
modules, `engine_digest`); a change to any of them measures again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from .confidence import neutral_rates
from .config import GREEDY, CacheConfig, SamplingConfig, TreeConfig
from .distributed import agreed_seconds, agreed_values, all_ranks, sharding_group, sharding_label
from .drafter import Drafter
from .files import write_json
from .sampling import choose_tokens_quickly
from .target import (
    TargetCache,
    context_length,
    output_logits,
    output_size,
    prepare_target,
    target_hidden,
)
from .tree import chain_tree

DEPTH = 9  # deepest drafted token of any tree: a step emits at most DEPTH + 1 tokens
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # N: packed tokens per step
CONTEXTS = (256, 1024)  # T: context bands; the cost between them is interpolated
DRAFT_WIDTHS = (1, 2, 4, 8)  # W: beam widths the drafter's cost is measured at
FORMAT = 3  # bump when the file's meaning changes: old files are measured again


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibration depends on; any change measures again."""

    model: str
    drafter: str
    device: str
    dtype: str
    quantization: str
    mlx: str
    engine: str = ""  # `engine_digest()`
    format: int = FORMAT

    @property
    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Calibration:
    """Measured step costs (seconds) on one machine.

    verify[t][i]: the target's forward over SIZES[i] packed tokens and the choice of
        its tokens, after a context of contexts[t] tokens (batch of one), as fitted
        (`smooth_curves`); timed[t][i]: the fastest timing it was fitted to.
    draft_first[w], draft_level[w]: the drafter's beam search at width
        draft_widths[w]: its first drafted token, and each one after it.
    lookup: the lookup branches' search of the row's text, per step.
    sample: the extra cost per packed token of sampling (temperature 1) over argmax.
    plain_share: the share of a one-token step's calibrated cost (N = 1 at the first
        context band) that plain decoding pays per step, where each plain step's forward
        is launched before the previous step's tokens are read (`decode.launch_plain`):
        the host's work on a step then overlaps the device's, which a tree step,
        waiting for its acceptance, cannot do.
    """

    key: CalibrationKey
    sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    verify: tuple[tuple[float, ...], ...]
    draft_widths: tuple[int, ...] = ()
    draft_first: tuple[float, ...] = ()
    draft_level: tuple[float, ...] = ()
    lookup: float = 0.0
    sample: float = 0.0  # sampling one node's token instead of its argmax
    plain_share: float = 1.0
    seconds: float = 0.0  # how long the measurement took
    timed: tuple[tuple[float, ...], ...] = ()  # verify as timed, before `smooth_curves`

    def verify_seconds(self, num_packed: np.ndarray, context: int) -> np.ndarray:
        """Verification cost of N packed tokens (any shape) at context length T,
        interpolated linearly in N and in T (extrapolated past the measured range).
        A longer context never costs less: where noise made the longest band cheaper
        than the shortest, the longest takes the shortest's cost (extrapolating past
        it in T would otherwise fall towards zero)."""
        curves = [np.interp(num_packed, self.sizes, row) for row in self.verify]
        curves += [_extrapolate(num_packed, self.sizes, row) for row in self.verify]
        beyond = np.asarray(num_packed) > self.sizes[-1]
        per_band = [
            np.where(beyond, curves[len(self.verify) + t], curves[t])
            for t in range(len(self.verify))
        ]
        if len(self.contexts) == 1:
            return per_band[0]
        low, high = self.contexts[0], self.contexts[-1]
        weight = (context - low) / (high - low)  # linear in T: attention reads T keys
        longest = np.maximum(per_band[-1], per_band[0])
        return np.maximum(per_band[0] + weight * (longest - per_band[0]), 1e-6)

    def draft_seconds(self, width: np.ndarray, length: np.ndarray) -> np.ndarray:
        """The drafter's beam search cost for W beams of L tokens (0 for W = 0 or L < 2)."""
        if not self.draft_widths:
            return np.zeros(np.shape(width))
        first = np.interp(width, self.draft_widths, self.draft_first)
        level = np.interp(width, self.draft_widths, self.draft_level)
        cost = first + np.maximum(np.asarray(length) - 2, 0) * level
        return np.where((np.asarray(width) > 0) & (np.asarray(length) > 1), cost, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        fields = dict(data)
        fields["key"] = CalibrationKey(**fields["key"])
        for name in ("verify", "timed"):
            fields[name] = tuple(tuple(row) for row in fields.get(name, ()))
        for name in ("sizes", "contexts", "draft_widths", "draft_first", "draft_level"):
            fields[name] = tuple(fields[name])
        return cls(**fields)


def _extrapolate(x: np.ndarray, xs: Sequence[int], ys: Sequence[float]) -> np.ndarray:
    """Past the largest N: linear through the last two points, but never growing
    slower than proportionally to N (a forward of many tokens is compute-bound; noise
    may make the last two points flat or falling, which would make wide trees and
    large batches look free)."""
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), ys[-1] / xs[-1])
    return ys[-1] + slope * (np.asarray(x) - xs[-1])


# -- what the calibration depends on -----------------------------------------------


def fingerprint(module: nn.Module | None) -> str:
    """A short hash of a module's parameter names, shapes, dtypes and a sample of values
    ('none' for no module): the same weights give the same fingerprint."""
    if module is None:
        return "none"
    digest = hashlib.sha256()
    parameters = cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))
    for name, value in sorted(parameters, key=lambda item: item[0]):
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
        sample = value.reshape(-1)[:16]
        if sample.dtype in (mx.bfloat16, mx.float16):
            sample = sample.astype(mx.float32)
        digest.update(np.array(sample).tobytes())
    return digest.hexdigest()[:20]


def device_name() -> str:
    """The device the default stream runs on, with its model name."""
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        info = mx.metal.device_info()
        return f"gpu:{info.get('device_name', info.get('architecture', 'metal'))}"
    processor = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                processor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{processor}:{os.cpu_count()} cores"


def quantization(model: nn.Module) -> str:
    """'none', or the bits and group size of the model's quantized layers."""
    kinds = {
        f"{module.bits}-bit/{module.group_size}"
        for _, module in model.named_modules()
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    return ",".join(sorted(kinds)) or "none"


def calibration_key(model: nn.Module, drafter: Drafter | None) -> CalibrationKey:
    dtype = str(model.model.embed_tokens(mx.array([0])).dtype)
    return CalibrationKey(
        model=fingerprint(model),
        drafter=fingerprint(drafter),
        device=" ".join(filter(None, (device_name(), sharding_label(model)))),
        dtype=dtype,
        quantization=quantization(model),
        mlx=str(getattr(mx, "__version__", "unknown")),
        engine=engine_digest(),
    )


@functools.cache
def engine_digest() -> str:
    """A digest of this package's engine modules (the package's own .py files and its
    kernels): a change to the code a step runs may change what the step costs."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*package.glob("*.py"), *package.glob("kernels/*.py")]):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# -- measuring ---------------------------------------------------------------------


def _time(run: Callable[[], Any], repeats: int, warm: bool = True) -> float:
    """The fastest of `repeats` timed runs, after one warm-up run (seconds)."""
    if warm:
        mx.eval(run())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        best = min(best, time.perf_counter() - start)
    return best


def _verify_curve(
    model: nn.Module,
    context: int,
    sizes: Sequence[int],
    repeats: int,
    ceiling: float = float("inf"),
) -> tuple[float, ...]:
    """Seconds of a verification forward (logits and their greedy choice) over N tokens after
    a context of `context` random tokens, for N in `sizes` (`sweep`: up to the first N
    that costs more than `ceiling` times N = 1): the fastest of `repeats` timings,
    taken in rounds over every N, so that a slow spell of the machine slows every N
    of a round alike rather than a few N's every timing."""
    vocab = int(model.model.embed_tokens.weight.shape[0])
    prompt = mx.random.randint(0, vocab, (1, context), key=mx.random.key(0)).astype(mx.int32)
    cache = _random_context(model, prompt)
    group = sharding_group(model)

    def verify(size: int) -> Callable[[], tuple[mx.array, mx.array]]:
        tree = chain_tree(prompt[:, :size])  # (1, N): a tree's cost does not depend on its shape

        def run() -> tuple[mx.array, mx.array]:
            logits = output_logits(model, target_hidden(model, cache, tree))  # (1, N, V)
            return choose_tokens_quickly(logits, GREEDY, None)  # as a greedy step does

        return run

    # Sharded: every rank runs the same forwards together and stops at the same N.
    first = sweep(sizes, lambda size: agreed_seconds(_time(verify(size), 1), group), ceiling)
    rounds = [first]
    for _ in range(repeats - 1):
        timed = [_time(verify(size), 1, warm=False) for size in sizes[: len(first)]]
        rounds.append(tuple(agreed_values(timed, group)))
    return tuple(min(column) for column in zip(*rounds))


def _random_context(model: nn.Module, prompt: mx.array) -> TargetCache:
    """A one-row cache whose T committed slots hold random keys and values (T: the
    prompt's length): attention costs the same whatever they hold, and a real prefill
    would take minutes where the forward is linear in its tokens (quantized weights
    on a CPU). One token runs through the model to give each layer its K/V shapes."""
    cache = TargetCache(model, 1, CacheConfig())
    mx.eval(target_hidden(model, cache, chain_tree(prompt[:, :1]), causal=True))
    context = prompt.shape[1]

    def widen(x: mx.array) -> mx.array:  # (1, H, 1, Dh) -> (1, H, T, Dh)
        shape = (x.shape[0], x.shape[1], context, x.shape[3])
        return mx.random.normal(shape, key=mx.random.key(context)).astype(x.dtype)

    for layer in cache.layers:
        layer.keys, layer.values = tree_map(widen, layer.keys), tree_map(widen, layer.values)
    mx.eval(cache.arrays())
    cache.commit([list(range(context))], [context])
    return cache


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin ||design @ x - target|| over x >= 0 (Lawson and Hanson's active set).
    design: (K, P), target: (K,) -> (P,)"""
    size = design.shape[1]
    x, free = np.zeros(size), np.zeros(size, dtype=bool)
    tolerance = 1e-12 * max(1.0, float(np.abs(target).max(initial=0.0)))
    for _ in range(10 * size + 10):
        gradient = design.T @ (target - design @ x)  # (P,) how each bound x_j would help
        if free.all() or np.where(free, -np.inf, gradient).max() <= tolerance:
            break
        free[int(np.argmax(np.where(free, -np.inf, gradient)))] = True
        while True:  # solve on the free set; step back to the bound if a value goes <= 0
            trial = np.zeros(size)
            trial[free] = np.linalg.lstsq(design[:, free], target, rcond=None)[0]
            if np.all(trial[free] > tolerance):
                x = trial
                break
            crossing = free & (trial <= tolerance)
            room = x[crossing] - trial[crossing]  # >= 0; 0 for a variable just freed at 0
            steps = np.divide(x[crossing], room, out=np.zeros_like(room), where=room > 0)
            x = x + np.min(steps) * (trial - x)
            free &= x > tolerance
    return x


def convex_fit(sizes: Sequence[int], values: Sequence[float]) -> np.ndarray:
    """The non-decreasing convex curve nearest to `values` at `sizes`, in squared
    relative error (each timing weighted by 1 / its value, so that the large N,
    whose timings are the largest numbers, do not set the curve at the small N).

    A verification forward's cost is flat while reading the weights dominates (an
    Apple GPU, up to tens of tokens) and grows at a rate that never falls once
    compute or attention does (a CPU): non-decreasing and convex in N. A single
    timing that a busy spell slowed or a lucky one sped up breaks that shape, and
    would make every tree of that N look dear or cheap next to its neighbours; the
    fit pulls it back to them. The curve is a + s (N - N_1) + sum_j b_j (N - N_j)+
    with s, b_j >= 0: a hinge at each measured N but the last.
    (K,) sizes, (K,) values -> (K,)"""
    x, y = np.asarray(sizes, dtype=np.float64), np.asarray(values, dtype=np.float64)
    floor = 1e-9 * max(float(np.abs(y).max(initial=0.0)), 1e-30)
    weight = 1.0 / np.maximum(y, floor)  # (K,)
    share = weight**2 / np.sum(weight**2)  # (K,) each timing's share of the intercept
    hinges = np.maximum(x[:, None] - x[None, :-1], 0.0)  # (K, K-1)
    centered = hinges - share @ hinges  # the free intercept a, solved for apart
    level = float(share @ y)
    slopes = _nonnegative_least_squares(weight[:, None] * centered, weight * (y - level))
    return np.asarray(level + centered @ slopes)  # (K,)


def smooth_curves(
    sizes: Sequence[int], rows: Sequence[Sequence[float]]
) -> tuple[tuple[float, ...], ...]:
    """Measured verification curves, one per context band, with their timing noise
    taken out: the larger N fitted (`convex_fit`), N = 1 as timed (at most the
    fitted N = 2's). The one-token forward stays apart because it is what plain
    decoding runs, whose pipelined share (`plain_share`) and unpipelined cost
    (`AutoTree.switch_seconds`) are measured against it, and because it may take a
    faster path than any tree (a matrix-vector kernel, no mask)."""
    curves = []
    for row in rows:
        rest = convex_fit(sizes[1:], row[1:])  # (K-1,) `sweep` measures two N at least
        curves.append((min(float(row[0]), float(rest[0])), *(float(v) for v in rest)))
    return tuple(curves)


def sweep(
    sizes: Sequence[int], seconds: Callable[[int], float], ceiling: float
) -> tuple[float, ...]:
    """`seconds(N)` for N in `sizes` (ascending, from 1), stopping after the first N
    whose cost exceeds `ceiling` times N = 1's (and after two sizes at least): no step
    emits more than `ceiling` tokens, so no larger tree can beat plain decoding, and
    `Calibration.verify_seconds` extrapolates past the last N measured. Where
    verification is linear in N (quantized weights on a CPU) this measures 8 sizes,
    not 12, and the cheapest ones."""
    measured: list[float] = []
    for size in sizes:
        measured.append(seconds(size))
        if len(measured) >= 2 and measured[-1] > ceiling * measured[0]:
            break
    return tuple(measured)


def _draft_costs(
    model: nn.Module, drafter: Drafter, repeats: int
) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
    """Beam search seconds per width: the first drafted token and each further one."""
    from .decode import step_functions  # decode imports the kernels; keep this light

    widths = tuple(w for w in DRAFT_WIDTHS if w <= drafter.config.output_size)
    hidden = mx.zeros((1, drafter.config.hidden_size), dtype=mx.float32)  # (1, D)
    root = mx.zeros((1,), dtype=mx.int32)  # (1,)
    rates = neutral_rates(1)  # (1, DEPTHS, BINS)
    first, level = [], []
    for width in widths:
        costs = []
        for length in (2, 4):
            steps = step_functions(model, drafter, TreeConfig(width, length))
            draft = steps.draft
            costs.append(_time(lambda: tuple(draft(hidden, root, None, rates)), repeats))  # noqa: B023
        first.append(costs[0])
        level.append(max(costs[1] - costs[0], 0.0) / 2)
    return widths, tuple(first), tuple(level)


def _lookup_cost(model: nn.Module, drafter: Drafter | None, context: int, repeats: int) -> float:
    from .decode import step_functions

    steps = step_functions(model, drafter, TreeConfig(0, 1, lookup_branches=2, lookup_length=8))
    assert steps.lookup is not None
    history = mx.random.randint(0, 64, (1, context), key=mx.random.key(1)).astype(mx.int32)
    beams = mx.zeros((1, 1, 8), dtype=mx.int32)  # (B, W, L)
    lengths = mx.array([context], dtype=mx.int32)
    lookup = steps.lookup
    return _time(lambda: lookup(beams, history, lengths), repeats)


def _sample_cost(model: nn.Module, repeats: int, nodes: int = 16) -> float:
    """Seconds per node of sampling a token (temperature 1) rather than taking the argmax,
    its noise drawn for every node. Decoding draws it once per position, so wide trees
    are priced high; priced per position, the auto tree chose trees that measured slower
    (CHANGELOG.md)."""
    from .sampling import choose_tokens, position_keys, position_noise

    vocab = output_size(model)
    logits = mx.random.normal((1, nodes, vocab), key=mx.random.key(2))  # (1, N, V)
    keys = position_keys(mx.random.key(3)[None], mx.arange(nodes, dtype=mx.int32)[None])

    def sample() -> mx.array:  # the noise of N positions is drawn, then used
        return choose_tokens(logits, SamplingConfig(1.0), position_noise(keys, vocab))

    sampled = _time(sample, repeats)
    greedy = _time(lambda: choose_tokens_quickly(logits, GREEDY, None), repeats)
    return max(sampled - greedy, 0.0) / nodes


def _plain_step(model: nn.Module, context: int, repeats: int, steps: int = 8) -> float | None:
    """Seconds per plain step as the decoding loop runs them, each step's forward
    launched before the previous step's tokens are read (`decode.launch_plain`): the
    best of `repeats` + 1 runs of `steps` steps after a `context`-token prompt. None
    for a sharded model, which never launches ahead (`distributed.py`)."""
    from .decode import plain_step, prefill

    if sharding_group(model) is not None:
        return None
    vocab = int(model.model.embed_tokens.weight.shape[0])
    prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(4))
    state = prefill(model, [cast(list[int], prompt.tolist())], CacheConfig())
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for _ in range(steps):
            plain_step(model, state, look_ahead=True)
        assert state.ahead is not None
        mx.eval(state.ahead.choices)  # the forward the last step launched: count it
        state.ahead = None
        best = min(best, (time.perf_counter() - start) / (steps + 1))
    return best


def measure(
    model: nn.Module,
    drafter: Drafter | None = None,
    *,
    sizes: Sequence[int] = SIZES,
    contexts: Sequence[int] = CONTEXTS,
    repeats: int = 3,
) -> Calibration:
    """Measure the step costs of `model` (and `drafter`) on this device now."""
    prepare_target(model)
    started = time.perf_counter()
    limit = context_length(model)
    usable = max(sizes) + 8
    bands = sorted({c if limit is None else max(1, min(c, limit - usable)) for c in contexts})
    first = _verify_curve(model, bands[0], sizes, repeats, ceiling=DEPTH + 1)
    sizes = sizes[: len(first)]  # the larger trees cannot pay here: not measured
    verify = (first, *(_verify_curve(model, band, sizes, repeats) for band in bands[1:]))
    timed, verify = verify, smooth_curves(sizes, verify)
    widths, first, level = (
        ((), (), ()) if drafter is None else _draft_costs(model, drafter, repeats)
    )
    lookup = _lookup_cost(model, drafter, bands[-1], repeats)
    sample = _sample_cost(model, repeats)
    plain = _plain_step(model, bands[0], repeats)
    plain_share = 1.0 if plain is None else min(plain / verify[0][0], 1.0)
    # Sharded: rank 0's figures on every rank, so every rank chooses the same trees.
    local = [*first, *level, lookup, sample]
    agreed = agreed_values(local, sharding_group(model))
    first, level = tuple(agreed[: len(first)]), tuple(agreed[len(first) : len(local) - 2])
    lookup, sample = agreed[-2], agreed[-1]
    return Calibration(
        key=calibration_key(model, drafter),
        sizes=tuple(sizes),
        contexts=tuple(bands),
        verify=verify,
        timed=timed,
        draft_widths=widths,
        draft_first=first,
        draft_level=level,
        lookup=lookup,
        sample=sample,
        plain_share=plain_share,
        seconds=time.perf_counter() - started,
    )


def prefill_chunk(calibration: Calibration, seconds: float, context: int = 1024) -> int:
    """The most prompt tokens (a multiple of 64, at least 64, at most 8192) one prefill
    chunk may take so that it costs about `seconds` at context `context`, from the
    calibrated verification cost (extrapolated past its largest N)."""
    sizes = np.arange(64, 8192 + 1, 64)
    cost = calibration.verify_seconds(sizes, context)
    fits = sizes[cost <= seconds]
    return int(fits[-1]) if len(fits) else 64


# -- the cache ---------------------------------------------------------------------


def calibration_folder() -> Path:
    from .defaults import cache_dir

    return cache_dir() / "calibration"


def cached_calibration(
    model: nn.Module,
    drafter: Drafter | None = None,
    *,
    folder: Path | None = None,
    remeasure: bool = False,
    announce: bool = False,
) -> tuple[Calibration, bool]:
    """The calibration of (model, drafter) on this device: read from the cache folder,
    or measured now and stored there. Returns it and whether it was measured now.
    announce: say on stderr when it measures (a pause of seconds)."""
    folder = calibration_folder() if folder is None else Path(folder)
    key = calibration_key(model, drafter)
    path = folder / f"{key.digest}.json"
    stored = None if remeasure else _read_calibration(path, key)
    if _every_rank_has(stored, sharding_group(model)) and stored is not None:
        return stored, False
    if announce:
        print(
            f"mlx-redrafter: measuring the step cost of this model on {key.device} for the "
            f"auto tree (once; cached in {folder})",
            file=sys.stderr,
        )
    calibration = measure(model, drafter)
    write_json(path, calibration.to_dict())
    return calibration, True


def _every_rank_has(stored: Calibration | None, group: mx.distributed.Group | None) -> bool:
    """Whether every rank of `group` holds the same figures as rank 0 (a collective;
    sharded ranks measure together unless they do, so that they choose alike)."""
    if group is None:
        return stored is not None
    figures = {} if stored is None else stored.to_dict()
    figures = {k: v for k, v in figures.items() if k not in ("key", "seconds")}
    text = json.dumps(figures, sort_keys=True).encode()
    digest = float(int(hashlib.sha256(text).hexdigest()[:5], 16))  # exact in float32
    first = agreed_values([digest], group)[0]  # every rank takes part, whatever it holds
    return all_ranks(stored is not None and first == digest, group)


def _read_calibration(path: Path, key: CalibrationKey) -> Calibration | None:
    """The calibration stored at `path` when it is readable and has this key."""
    if not path.is_file():
        return None
    try:
        stored = Calibration.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError):
        return None  # unreadable or from another format: measure again
    return stored if stored.key == key else None


def format_calibration(calibration: Calibration) -> str:
    """A table of the cost curve: N, then per context band the step time as fitted,
    its ratio to one token, and the time as timed."""
    head = "     N" + "".join(f"   T={t:<5d} ms   x1    timed" for t in calibration.contexts)
    lines = [head]
    timed = calibration.timed or calibration.verify
    for i, size in enumerate(calibration.sizes):
        cells = "".join(
            f"  {row[i] * 1e3:9.2f} {row[i] / row[0]:5.2f} {raw[i] * 1e3:8.2f}"
            for row, raw in zip(calibration.verify, timed)
        )
        lines.append(f"{size:6d}{cells}")
    for width, first, level in zip(
        calibration.draft_widths, calibration.draft_first, calibration.draft_level
    ):
        lines.append(
            f"drafter W={width}: {first * 1e3:.2f} ms for its first token, "
            f"{level * 1e3:.2f} ms per further token"
        )
    lines.append(f"lookup branches: {calibration.lookup * 1e3:.2f} ms per step")
    lines.append(f"sampling: {calibration.sample * 1e3:.3f} ms per packed token")
    lines.append(
        f"plain decoding: {calibration.plain_share:.2f} of N=1's time per step "
        "(each forward launched before the previous step's tokens are read)"
    )
    return "\n".join(lines)
