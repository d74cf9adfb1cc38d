"""The benchmark: ReDrafter against plain mlx-lm decoding, in one process, interleaved.

For every prompt, every method runs once before the next prompt starts, so
machine noise hits all methods alike. Methods:

* `mlx-lm`: `mlx_lm.stream_generate`, plain decoding: the baseline users have today;
* `plain`: this project's loop without a drafter (W = L = 1);
* `redrafter WxL`: the speculative loop at each tree
  (`WxL+G`: with G lookup branches beside the drafter's W; `WxL+GxLl`: lookup branches of
  Ll tokens; `0xL+G`: lookup branches alone);
* `redrafter WxL unpacked`: the same, verifying all W*L tokens (no prefix sharing).

Every method is timed the same way, from the stream of responses it yields:
decode tokens/s counts the tokens after the first response over the time from the
first response to the last (so prefill and the first step are excluded alike);
prefill tokens/s is prompt tokens over the time to the first response.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import batch_generate as mlx_lm_batch_generate
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.generate import generation_stream as mlx_lm_generation_stream
from mlx_lm.sample_utils import make_sampler

from .calibrate import cached_calibration, device_name
from .config import (
    DEFAULT_TREE,
    GREEDY,
    PLAIN_DECODING,
    SamplingConfig,
    StopConfig,
    TreeConfig,
    tree_label,
)
from .decode import PhaseClock, plan_step
from .drafter import Drafter
from .generate import stream_batch, stream_generate
from .metrics import acceptance_by_depth, accepted_counts, throughput, tokens_per_step
from .session import DecodingSession, Request

SLOW_BLAS_GFLOPS = 30.0


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    trees: the ReDrafter trees to compare.
    unpacked: also run each configuration without prefix sharing.
    profile_prompts: prompts of a separate pass that splits step time into phases.
    batch_sizes: batch sweep sizes (empty: no sweep), with the first tree.
    without_drafter: also run each tree without the drafter (its lookup branches
        alone), to show what the drafter adds.
    ignore_eos: every method decodes exactly max_tokens tokens, EOS or not (as
        vLLM's benchmark's --ignore-eos). Sampled replies differ from mlx-lm's, and so
        do their lengths; at equal lengths the speed-up compares equal work.
    repeats: runs of every method on each prompt, in rounds over the methods; each
        method's fastest run on the prompt counts (a slow spell of a shared machine
        only adds time, as `timeit` takes the best of its runs).
    """

    max_tokens: int = 256
    trees: tuple[TreeConfig | str, ...] = (DEFAULT_TREE,)
    sampling: SamplingConfig = GREEDY
    unpacked: bool = True
    seed: int = 0
    warmup_tokens: int = 16
    profile_prompts: int = 4
    batch_sizes: tuple[int, ...] = ()
    without_drafter: bool = False
    ignore_eos: bool = False
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats (--repeats) must be >= 1; got {self.repeats}")


@dataclass(frozen=True)
class Method:
    name: str
    tree: TreeConfig | str | None  # None: mlx-lm's own stream_generate; "auto"
    uses_drafter: bool = False


BASELINE = Method("mlx-lm", None)


def benchmark_methods(config: BenchConfig, has_drafter: bool) -> list[Method]:
    methods = [BASELINE, Method("plain", PLAIN_DECODING)]
    for tree in config.trees:
        speculates = isinstance(tree, str) or not plan_step(tree, False).plain
        if has_drafter and config.without_drafter and speculates:
            label = tree if isinstance(tree, str) else tree.label
            alone = tree if isinstance(tree, str) else tree.lookup_only  # lookup branches
            methods.append(Method(f"redrafter {label} no drafter", alone, False))
        if isinstance(tree, str):
            methods.append(Method(f"redrafter {tree}", tree, True))
            continue
        if not has_drafter and tree.beam_width > 0:
            continue  # lookup branches alone (0xL+G) need no drafter
        name = f"redrafter {tree.label}"
        methods.append(Method(name, tree, True))
        if config.unpacked and tree.beam_length > 1 and tree.draft_nodes is None:
            unshared = replace(tree, share_prefixes=False, tree_budget=None)
            methods.append(Method(f"{name} unpacked", unshared, True))
    return methods


@dataclass
class Run:
    """One method on one prompt."""

    method: str
    prompt: int
    prompt_tokens: int
    tokens: list[int]
    steps: int
    produced_tokens: float  # tokens the target produced, counting a final EOS
    time_to_first_response: float
    decode_seconds: float
    decode_tokens: int
    accepted: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    trees_used: dict[str, int] = field(default_factory=dict)  # steps by tree
    peak_memory_gb: float = 0.0
    matches_baseline: bool | None = None

    @property
    def decode_tps(self) -> float:
        return throughput(self.decode_tokens, self.decode_seconds)

    @property
    def prefill_tps(self) -> float:
        return throughput(self.prompt_tokens, self.time_to_first_response)


def without_eos(tokenizer: Any) -> Any:
    """A copy of mlx-lm's tokenizer wrapper with no EOS token: generation runs to
    max_tokens (the original is untouched)."""
    if not hasattr(tokenizer, "eos_token_ids"):
        raise ValueError("--ignore-eos needs mlx-lm's tokenizer wrapper (eos_token_ids)")
    stripped = copy.copy(tokenizer)
    stripped.eos_token_ids = []
    return stripped


def run_method(
    method: Method,
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompt: list[int],
    prompt_index: int,
    config: BenchConfig,
) -> Run:
    """Decode one prompt with one method, timing every response."""
    mx.synchronize()
    mx.reset_peak_memory()
    stamps: list[float] = []
    chunks: list[list[int]] = []
    accepted: list[int] = []
    trees: list[int] = []
    used: dict[str, int] = {}
    produced = 0.0
    if config.ignore_eos:
        tokenizer = without_eos(tokenizer)
    started = time.perf_counter()
    sampling = config.sampling
    if method.tree is None:
        mx.random.seed(config.seed)
        sampler = make_sampler(sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        eos = tokenizer.eos_token_ids
        for baseline_response in mlx_lm_stream_generate(
            model, tokenizer, prompt, max_tokens=config.max_tokens, sampler=sampler
        ):
            stamps.append(time.perf_counter())
            stop = baseline_response.finish_reason == "stop" and baseline_response.token in eos
            chunks.append([] if stop else [baseline_response.token])
            produced += 1
        # mlx-lm leaves a forward in flight on its stream; a sharded one must end
        # before this process's next collectives (on another stream) start.
        mx.synchronize(mlx_lm_generation_stream)
        steps = len(stamps)
    else:
        last = None
        for response in stream_generate(
            model,
            drafter if method.uses_drafter else None,
            tokenizer,
            prompt,
            max_tokens=config.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=config.seed,
            tree=method.tree,
        ):
            stamps.append(time.perf_counter())
            chunks.append(response.tokens)
            accepted.append(response.num_accepted)
            trees.append(response.tree_size)
            used[response.tree] = used.get(response.tree, 0) + 1
            last = response
        steps = len(stamps)
        produced = last.tokens_per_step * last.steps if last else 0.0
    tokens = [t for chunk in chunks for t in chunk]
    return Run(
        method=method.name,
        prompt=prompt_index,
        prompt_tokens=len(prompt),
        tokens=tokens,
        steps=steps,
        produced_tokens=produced,
        time_to_first_response=(stamps[0] - started) if stamps else 0.0,
        decode_seconds=(stamps[-1] - stamps[0]) if stamps else 0.0,
        decode_tokens=len(tokens) - (len(chunks[0]) if chunks else 0),
        accepted=accepted,
        tree_sizes=trees,
        trees_used=used,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
    )


def profile_phases(
    method: Method,
    model: nn.Module,
    drafter: Drafter | None,
    prompts: Sequence[list[int]],
    config: BenchConfig,
) -> dict[str, float]:
    """Fractions of step time spent drafting, verifying, and on everything else.

    A separate pass with a host sync after each phase (so it is not timed for speed).
    """
    if method.tree is None or not prompts:
        return {}
    clock = PhaseClock()
    session = DecodingSession(
        model, drafter if method.uses_drafter else None, tree=method.tree, clock=clock
    )
    total = 0.0
    stop = StopConfig(max_tokens=config.max_tokens)
    for prompt in prompts:
        key = mx.random.key(config.seed)
        for update in session.run([Request(prompt, config.sampling, stop, key)]):
            if update.finish_reason is not None:
                total += update.metrics.decode_seconds
    draft = clock.seconds.get("draft", 0.0)
    verify = clock.seconds.get("verify", 0.0)
    total = max(total, 1e-9)
    return {"draft": draft / total, "verify": verify / total, "other": 1 - (draft + verify) / total}


def tau_by_category(runs: Sequence[Run], categories: Sequence[str]) -> dict[str, float]:
    """tau over each category's prompts (produced tokens over target steps), in first-seen
    order; categories[i] names prompt i."""
    produced: dict[str, float] = {}
    steps: dict[str, int] = {}
    for run in runs:
        category = categories[run.prompt]
        produced[category] = produced.get(category, 0.0) + run.produced_tokens
        steps[category] = steps.get(category, 0) + run.steps
    return {c: tokens_per_step(produced[c], steps[c]) for c in produced}


def summarize(method: Method, runs: list[Run], baseline: list[Run]) -> dict[str, Any]:
    """Per-method figures over the same prompts."""
    mean_tps = statistics.fmean(r.decode_tps for r in runs)
    base_tps = statistics.fmean(r.decode_tps for r in baseline)
    ratios = [r.decode_tps / b.decode_tps for r, b in zip(runs, baseline) if b.decode_tps > 0]
    steps = sum(r.steps for r in runs)
    accepted = [a for r in runs for a in r.accepted]
    summary: dict[str, Any] = {
        "method": method.name,
        "tree": tree_label(method.tree) if method.tree is not None else "mlx-lm",
        "trees_used": trees_used(runs),
        **tree_shape(method.tree),
        "prompts": len(runs),
        "generated_tokens": sum(len(r.tokens) for r in runs),
        "decode_tps": mean_tps,
        "prefill_tps": statistics.fmean(r.prefill_tps for r in runs),
        "speedup": mean_tps / base_tps if base_tps > 0 else 0.0,
        "speedup_per_prompt": {
            "min": min(ratios, default=0.0),
            "median": statistics.median(ratios) if ratios else 0.0,
            "max": max(ratios, default=0.0),
            "stdev": statistics.pstdev(ratios) if len(ratios) > 1 else 0.0,
        },
        "tau": tokens_per_step(sum(r.produced_tokens for r in runs), steps),
        "peak_memory_gb": max(r.peak_memory_gb for r in runs),
        "match_rate": (
            statistics.fmean(1.0 if r.matches_baseline else 0.0 for r in runs)
            if runs and runs[0].matches_baseline is not None
            else None
        ),
    }
    if method.tree is not None and accepted:
        depth = method.tree.depth if isinstance(method.tree, TreeConfig) else max(accepted) + 1
        counts = accepted_counts(accepted, depth)
        summary["acceptance_by_depth"] = acceptance_by_depth(counts)
        summary["accepted_histogram"] = counts
    if isinstance(method.tree, TreeConfig) and accepted:
        trees = [t for r in runs for t in r.tree_sizes]
        unpacked = replace(method.tree, share_prefixes=False, tree_budget=None, draft_nodes=None)
        unpacked_size = unpacked.num_packed
        summary["tree_compression"] = statistics.fmean(trees) / unpacked_size
    return summary


def tree_shape(tree: TreeConfig | str | None) -> dict[str, Any]:
    """A fixed tree's W, L, G, Ll, lookup source, prefix sharing, dynamic tree's n (None
    for a full tree) and packed tokens N (all None for the auto tree)."""
    fixed = tree if isinstance(tree, TreeConfig) else PLAIN_DECODING
    shape = {
        "beam_width": fixed.beam_width,
        "beam_length": fixed.beam_length,
        "lookup_branches": fixed.lookup_branches,
        "lookup_length": fixed.lookup_branch_length,
        "lookup_table": fixed.lookup_table,
        "share_prefixes": fixed.share_prefixes,
        "draft_nodes": fixed.draft_nodes,
        "num_packed": fixed.num_packed,
    }
    return dict.fromkeys(shape) if isinstance(tree, str) else shape


def dynamic_gains(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each dynamic tree (WxL@n) against each full tree of the run with the same
    packed tokens N and the same lookup branches: their tau and the dynamic tree's
    gain in tau and in speed-up (0 where the full tree's is 0)."""

    def size_key(s: dict[str, Any]) -> tuple[Any, ...]:
        branches = s["lookup_branches"]
        source = (s["lookup_length"], s["lookup_table"]) if branches else None
        return (s["num_packed"], branches, source)

    trees = [s for s in summaries if s.get("num_packed") and s.get("share_prefixes")]
    full = [s for s in trees if s["draft_nodes"] is None and s["beam_length"] > 1]
    gains = []
    for dynamic in (s for s in trees if s["draft_nodes"] is not None):
        for other in (s for s in full if size_key(s) == size_key(dynamic)):
            gains.append(
                {
                    "dynamic": dynamic["tree"],
                    "fixed": other["tree"],
                    "num_packed": dynamic["num_packed"],
                    "tau": [dynamic["tau"], other["tau"]],
                    "tau_gain": dynamic["tau"] / other["tau"] if other["tau"] else 0.0,
                    "speedup_gain": (
                        dynamic["speedup"] / other["speedup"] if other["speedup"] else 0.0
                    ),
                }
            )
    return gains


def trees_used(runs: Sequence[Run]) -> dict[str, int]:
    """Steps by tree over the runs, most used first."""
    counts: dict[str, int] = {}
    for run in runs:
        for label, steps in run.trees_used.items():
            counts[label] = counts.get(label, 0) + steps
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def by_category(
    runs: Sequence[Run], baseline: Sequence[Run], categories: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Per category (first-seen order; categories[i] names prompt i): tau, the speed-up
    (mean tokens/s over mean mlx-lm tokens/s on the same prompts) and the most used tree."""
    taus = tau_by_category(runs, categories)
    result: dict[str, dict[str, Any]] = {}
    for category in taus:
        mine = [r for r in runs if categories[r.prompt] == category]
        theirs = [b for b in baseline if categories[b.prompt] == category]
        base = statistics.fmean(b.decode_tps for b in theirs)
        used = trees_used(mine)
        result[category] = {
            "tau": taus[category],
            "speedup": statistics.fmean(r.decode_tps for r in mine) / base if base > 0 else 0.0,
            "tree": next(iter(used), "-"),
        }
    return result


def measure_matmul_gflops() -> float:
    """fp32 matmul speed of the default device (the CPU backend's BLAS on Linux)."""
    a = mx.random.normal((512, 1024))
    b = mx.random.normal((1024, 1024))
    mx.eval(a, b, a @ b)
    started = time.perf_counter()
    for _ in range(5):
        mx.eval(a @ b)
    return 5 * 2 * 512 * 1024 * 1024 / (time.perf_counter() - started) / 1e9


def loaded_blas_libraries() -> list[str]:
    """Shared libraries with BLAS in their name mapped into this process (Linux), after
    a matmul has run (the sgemm router loads its libraries on first use)."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return []
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "/" in line}
    return sorted(path for path in paths if "blas" in Path(path).name.lower())


def environment() -> dict[str, Any]:
    gflops = measure_matmul_gflops()
    device = mx.default_device()
    return {
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "mlx_redrafter": version("mlx-redrafter"),
        "device": str(device),
        "backend": "metal" if device == mx.gpu and mx.metal.is_available() else "cpu",
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device_name": device_name(),
        "cpu_count": os.cpu_count(),
        "matmul_gflops_fp32": round(gflops, 1),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "blas_libraries": loaded_blas_libraries(),
        "blas_settings": {
            name: value
            for name, value in sorted(os.environ.items())
            if name.startswith(("OPENBLAS_", "MLX_REDRAFTER_"))
        },
        "slow_blas": device == mx.cpu and gflops < SLOW_BLAS_GFLOPS,
    }


def slow_blas_warning(env: dict[str, Any]) -> str | None:
    if not env["slow_blas"]:
        return None
    return (
        f"WARNING: MLX's CPU backend runs fp32 matmul at {env['matmul_gflops_fp32']} GFLOP/s: "
        "it is using the slow reference BLAS, so these timings are meaningless. Preload "
        "OpenBLAS (Debian: apt-get install libopenblas0-pthread; then "
        "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0)."
    )


def batch_sweep(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    config: BenchConfig,
) -> list[dict[str, Any]]:
    """Throughput (generated tokens / wall-clock, prefill included) at each batch size."""
    rows = []
    tree = config.trees[0]
    for batch_size in config.batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(batch_size)]
        started = time.perf_counter()
        response = mlx_lm_batch_generate(
            model, tokenizer, batch, max_tokens=config.max_tokens, return_token_ids=True
        )
        mx.synchronize(mlx_lm_generation_stream)
        baseline_seconds = time.perf_counter() - started
        baseline_tokens = sum(len(ids) for ids in response.token_ids or [])
        row: dict[str, Any] = {
            "batch_size": batch_size,
            "mlx_lm_tps": baseline_tokens / baseline_seconds,
        }
        for name, use_drafter in (("plain", False), ("redrafter", True)):
            if use_drafter and drafter is None:
                continue
            method_tree = tree if use_drafter else PLAIN_DECODING
            started = time.perf_counter()
            count = 0
            for _, piece in stream_batch(
                model,
                drafter if use_drafter else None,
                tokenizer,
                batch,
                max_tokens=config.max_tokens,
                tree=method_tree,
            ):
                count += len(piece.tokens)
            row[f"{name}_tps"] = count / (time.perf_counter() - started)
        if "redrafter_tps" in row:
            row["redrafter_speedup"] = row["redrafter_tps"] / row["mlx_lm_tps"]
        rows.append(row)
    return rows


def fastest_runs(
    methods: Sequence[Method],
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompt: list[int],
    index: int,
    config: BenchConfig,
) -> dict[str, tuple[Run, bool]]:
    """Each method's fastest of `config.repeats` runs on one prompt (least decode
    time per token), the runs taken in rounds over the methods (a slow spell then
    slows one run of each method, not every run of one), and whether all its runs
    decoded the same tokens."""
    fastest: dict[str, tuple[Run, bool]] = {}
    for _ in range(config.repeats):
        for method in methods:
            run = run_method(method, model, drafter, tokenizer, prompt, index, config)
            if method.name not in fastest:
                fastest[method.name] = (run, True)
                continue
            best, same = fastest[method.name]
            same = same and run.tokens == best.tokens
            faster = _seconds_per_token(run) < _seconds_per_token(best)
            fastest[method.name] = (run if faster else best, same)
    return fastest


def _seconds_per_token(run: Run) -> float:
    return run.decode_seconds / max(run.decode_tokens, 1)


def interleaved_runs(
    methods: Sequence[Method],
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    config: BenchConfig,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[Run]]:
    """Every method's (fastest) run on each prompt, prompt by prompt; greedy runs
    are checked against mlx-lm's tokens, every repeat of them."""
    runs: dict[str, list[Run]] = {m.name: [] for m in methods}
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        fastest = fastest_runs(methods, model, drafter, tokenizer, prompt, index, config)
        for method in methods:
            run, repeated = fastest[method.name]  # repeated: every repeat decoded alike
            runs[method.name].append(run)  # mlx-lm's first: `benchmark_methods`
            if config.sampling.greedy:
                same = run.tokens == runs[BASELINE.name][index].tokens
                run.matches_baseline = same and repeated
        if progress:
            done = index + 1
            eta = (time.perf_counter() - started) / done * (len(prompts) - done)
            progress(f"prompt {done}/{len(prompts)}, ETA {eta:.0f} s")
    return runs


def run_benchmark(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    config: BenchConfig,
    progress: Callable[[str], None] | None = None,
    categories: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run every method on every prompt, interleaved; returns the full result record.

    categories: one label per prompt (e.g. MT-Bench's); tau is also reported per label.
    """
    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts")
    env = environment()
    methods = benchmark_methods(config, drafter is not None)
    warm = replace(config, max_tokens=config.warmup_tokens)
    for method in methods:  # warm-up: first-call costs stay out of the figures
        run_method(method, model, drafter, tokenizer, prompts[0], -1, warm)
    runs = interleaved_runs(methods, model, drafter, tokenizer, prompts, config, progress)
    profiles = {
        m.name: profile_phases(m, model, drafter, prompts[: config.profile_prompts], config)
        for m in methods
    }
    summaries = []
    for method in methods:
        summary = summarize(method, runs[method.name], runs[BASELINE.name])
        if profiles.get(method.name):
            summary["time_split"] = profiles[method.name]
        if categories is not None and any(categories):
            baseline = runs[BASELINE.name]
            summary["by_category"] = by_category(runs[method.name], baseline, categories)
        summaries.append(summary)
    sweep = batch_sweep(model, drafter, tokenizer, prompts, config) if config.batch_sizes else []
    calibration = None
    if any(isinstance(tree, str) for tree in config.trees):
        calibration = cached_calibration(model, drafter)[0].to_dict()
    return {
        "environment": env,
        "calibration": calibration,
        "config": {
            "max_tokens": config.max_tokens,
            "trees": [tree_label(tree) for tree in config.trees],
            "sampling": asdict(config.sampling),
            "seed": config.seed,
            "ignore_eos": config.ignore_eos,
            "repeats": config.repeats,
            "prompts": len(prompts),
            "categories": list(categories) if categories is not None else None,
        },
        "summary": summaries,
        "dynamic_trees": dynamic_gains(summaries),
        "batch_sweep": sweep,
        "runs": [asdict(r) for name in runs for r in runs[name]],
    }


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table of the per-method summaries."""
    header = (
        f"{'method':<26} {'tok/s':>7} {'speed-up':>8} {'(min-max)':>12} {'tau':>5} "
        f"{'compr.':>6} {'draft/verify/other':>19} {'peak GB':>7} {'match':>6}"
    )
    lines = [header, "-" * len(header)]
    for s in result["summary"]:
        split = s.get("time_split")
        split_text = (
            f"{split['draft']:.0%}/{split['verify']:.0%}/{split['other']:.0%}" if split else "-"
        )
        spread = s["speedup_per_prompt"]
        match = "-" if s["match_rate"] is None else f"{s['match_rate']:.0%}"
        compression = s.get("tree_compression")
        compression_text = "-" if compression is None else f"{compression:.2f}"
        lines.append(
            f"{s['method']:<26} {s['decode_tps']:>7.1f} {s['speedup']:>7.2f}x "
            f"{spread['min']:>5.2f}-{spread['max']:<5.2f} {s['tau']:>5.2f} "
            f"{compression_text:>6} "
            f"{split_text:>19} {s['peak_memory_gb']:>7.2f} {match:>6}"
        )
    lines += category_lines(result["summary"])
    lines += dynamic_lines(result.get("dynamic_trees") or [])
    if result["batch_sweep"]:
        lines.append("")
        lines.append(f"{'batch':>5} {'mlx-lm tok/s':>13} {'plain tok/s':>12} {'redrafter':>10}")
        for row in result["batch_sweep"]:
            lines.append(
                f"{row['batch_size']:>5} {row['mlx_lm_tps']:>13.1f} "
                f"{row.get('plain_tps', 0):>12.1f} {row.get('redrafter_tps', 0):>10.1f}"
            )
    return "\n".join(lines)


def category_lines(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Per category: each method's speed-up and tau, and the tree it used most."""
    rows = [s for s in summaries if s.get("by_category") and s["method"] != BASELINE.name]
    if not rows:
        return []
    names = list(rows[0]["by_category"])
    lines = ["", f"{'speed-up / tau by category':<26} " + " ".join(f"{n[:12]:>12}" for n in names)]
    for s in rows:
        cells = s["by_category"]
        lines.append(
            f"{s['method']:<26} "
            + " ".join(f"{cells[n]['speedup']:>5.2f}x/{cells[n]['tau']:<5.2f}" for n in names)
        )
        if len(s["trees_used"]) > 1:
            lines.append(
                f"{'  most used tree':<26} "
                + " ".join(f"{cells[n]['tree'][:12]:>12}" for n in names)
            )
    return lines


def dynamic_lines(gains: Sequence[dict[str, Any]]) -> list[str]:
    """Dynamic trees against full trees of equal N: tau of each and the gains."""
    if not gains:
        return []
    lines = ["", "dynamic tree against fixed trees of equal N (tau, tau gain, speed-up gain)"]
    for gain in gains:
        tau_dynamic, tau_fixed = gain["tau"]
        lines.append(
            f"  {gain['dynamic']:<14} vs {gain['fixed']:<14} N={gain['num_packed']:<3} "
            f"tau {tau_dynamic:.2f} vs {tau_fixed:.2f}: {gain['tau_gain'] - 1:+.1%} tau, "
            f"{gain['speedup_gain'] - 1:+.1%} speed"
        )
    return lines


def write_result(result: dict[str, Any], out_dir: Path) -> Path:
    """Write bench.json (atomically) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "bench.json"
    staging = out_dir / ".bench.json.tmp"
    staging.write_text(json.dumps(result, indent=2) + "\n")
    staging.replace(target)
    return target


def progress_printer(stream: Any = sys.stderr) -> Callable[[str], None]:
    def show(message: str) -> None:
        print(f"\r[bench] {message}   ", end="", file=stream, flush=True)

    return show
