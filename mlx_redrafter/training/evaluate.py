"""Measuring a drafter: validation loss and per-step top-1 accuracy on held-out
windows, the report of a training run, and tau (tokens per target step) by
decoding prompts greedily through the public generation API.

Shapes: b micro-batch, T' usable positions, K draft steps.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..config import PLAIN_DECODING, SamplingConfig, StopConfig, TreeConfig
from ..drafter import Drafter
from ..generate import stream_batch, stream_generate
from ..metrics import AcceptanceTable, joint_survival, survival
from ..policy import StepRecord
from ..prompts import encode_prompt, read_prompts
from .config import TrainConfig
from .data import (
    TrainingSequence,
    Window,
    draft_vocab_index,
    host_batch,
    split_rows,
    windows_with_hidden,
)
from .loss import _device_batch, _loss_sums
from .parallel import sum_over_ranks


@dataclass
class TrainReport:
    """What `train` measured."""

    steps: int
    total_steps: int = 0
    train_loss: list[float] = field(default_factory=list)
    train_accuracy: list[list[float]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)
    tokens_per_second: float = 0.0
    seconds: float = 0.0
    hidden_seconds: float = 0.0


def run_summary(
    report: TrainReport, drafter: Drafter, config: TrainConfig, sequences: int, wall: float
) -> dict[str, Any]:
    """The report.json of a run: its steps, drafter, settings, timings and validations."""
    return {
        "steps": report.steps,
        "total_steps": report.total_steps,
        "drafter": drafter.config.to_dict(),
        "train": {
            "config": asdict(config),
            "sequences": sequences,
            "hidden_seconds": round(report.hidden_seconds, 1),
            "train_seconds": round(report.seconds, 1),
            "wall_seconds": round(wall, 1),
            "positions_per_second": round(report.tokens_per_second, 1),
        },
        "validation": report.validation,  # every evaluation, step 0 first
    }


# ---------------------------------------------------------------------------
# Validation loss and accuracy


def evaluate(
    model: nn.Module,
    drafter: Drafter,
    windows: Sequence[Window],
    rows: Sequence[int],
    config: TrainConfig,
    vocab_index: np.ndarray | None,
    draft_ids: mx.array | None,
    group: Any | None = None,
) -> dict[str, Any]:
    """Validation loss (cross-entropy per position) and per-step top-1 accuracy.

    Accuracy counts every position whose target exists; tokens outside the draft
    vocabulary count as misses (the drafter can never propose them).
    """
    ce_total = mx.array(0.0)
    correct = mx.zeros((config.num_steps,))
    counted = np.zeros((config.num_steps,))
    positions = 0
    for start in range(0, len(rows), config.micro_batch_size):
        chunk = [windows[i] for i in rows[start : start + config.micro_batch_size]]
        host = host_batch(chunk, config.num_steps, vocab_index)
        batch = _device_batch(model, host, config.num_steps)
        valid = mx.array(host.valid.astype(np.float32))  # (b, T', K)
        _, hits, ce_sum = _loss_sums(drafter, batch, valid, None, 0.0)
        ce_total = ce_total + ce_sum
        correct = correct + hits
        counted += host.valid.sum(axis=(0, 1))
        positions += int(host.valid[..., 0].sum())
        mx.eval(ce_total, correct)
    total = sum_over_ranks(
        [ce_total, correct, mx.array(counted.astype(np.float32)), mx.array(float(positions))],
        group,
    )
    mx.eval(total)
    count = max(float(total[3].item()), 1.0)
    accuracy = (np.array(total[1]) / np.maximum(np.array(total[2]), 1)).tolist()
    return {
        "loss": float(total[0].item()) / count,
        "accuracy": [round(a, 4) for a in accuracy],
        "positions": int(count),
    }


def validate(
    model: nn.Module,
    drafter: Drafter,
    sequences: Sequence[TrainingSequence],
    ids: Sequence[str],
    config: TrainConfig,
    *,
    progress: bool = True,
    hidden_cache: str | os.PathLike[str] | None = None,
    hidden_cache_tag: str = "",
) -> dict[str, Any]:
    """`evaluate` on the sequences `train` holds out for these ids (same fraction and seed).

    Lets two drafters be compared on one validation split, e.g. a shipped drafter
    against a new run's, whatever data each was trained on.
    """
    drafter.check_fits(model)
    _, rows = split_rows(sequences, ids, config.validation_fraction, config.seed)
    if not rows:
        raise ValueError(
            f"no sequence is held out at validation fraction {config.validation_fraction}: "
            "pass more data or a larger --validation-fraction"
        )
    windows = windows_with_hidden(
        model,
        sequences,
        rows,
        progress=progress,
        cache_dir=hidden_cache,
        cache_tag=hidden_cache_tag,
    )
    vocab_index, draft_ids = draft_vocab_index(drafter)
    return evaluate(model, drafter, windows, rows, config, vocab_index, draft_ids)


# ---------------------------------------------------------------------------
# tau by decoding


@dataclass(frozen=True)
class TauResult:
    """Tokens per target step over a prompt set, counting the bonus token.

    tokens_per_second: generated tokens over the summed decoding time of each
    request (per request, not the aggregate of a batch).
    """

    tau: float
    tokens: int
    steps: int
    tokens_per_second: float
    prompts: int


def measure_tau(
    model: nn.Module,
    drafter: Drafter | None,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    tree: TreeConfig | str,
    max_tokens: int = 256,
    batch_size: int = 1,
) -> TauResult:
    """Decode the prompts greedily and count tokens per target step (bonus included).

    tree: the tree (drafter beams and lookup branches; `PLAIN_DECODING` with
    `drafter=None` for the baseline); lookup branches read the drafter's n-gram table
    when it has one and the config allows it.

    batch_size 1 decodes each prompt alone with `stream_generate`; larger batches
    use `stream_batch` (the same loop; greedy tau per row does not depend on the
    batch, the wall-clock figure does).
    """
    produced = steps = generated = 0
    seconds = 0.0
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start : start + batch_size]]
        options: dict[str, Any] = {"max_tokens": max_tokens, "tree": tree}
        last: dict[int, Any] = {}
        if batch_size == 1:
            for response in stream_generate(model, drafter, tokenizer, chunk[0], **options):
                last[0] = response
        else:
            for row, response in stream_batch(model, drafter, tokenizer, chunk, **options):
                last[row] = response
        for response in last.values():
            produced += round(response.tokens_per_step * response.steps)
            steps += response.steps
            generated += response.generation_tokens
            seconds += response.generation_tokens / max(response.generation_tps, 1e-9)
    return TauResult(
        tau=produced / max(steps, 1),
        tokens=generated,
        steps=steps,
        tokens_per_second=generated / max(seconds, 1e-9),
        prompts=len(prompts),
    )


def measure_trees(
    model: nn.Module,
    drafter: Drafter,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    trees: Sequence[TreeConfig | str],
    *,
    max_tokens: int = 256,
    batch_size: int = 1,
) -> Iterator[tuple[TreeConfig | str, TauResult]]:
    """`measure_tau` for each tree in turn (`PLAIN_DECODING` decodes without the drafter)."""
    for tree in trees:
        plain = tree == PLAIN_DECODING
        yield (
            tree,
            measure_tau(
                model,
                None if plain else drafter,
                tokenizer,
                prompts,
                tree=tree,
                max_tokens=max_tokens,
                batch_size=batch_size,
            ),
        )


def tau_prompts(
    tokenizer: Any,
    held_out: Sequence[list[int]],
    *,
    path: str | None = None,
    count: int = 8,
    strict: bool = False,
) -> tuple[list[list[int]], str]:
    """The prompts the tau report decodes, and a label for them.

    With `path`, the JSONL prompts of that file (chat template; count 0 takes them
    all, N takes N evenly spaced ones); otherwise the first `count` non-empty
    `held_out` prompts.
    """
    if path:
        records = read_prompts(path, strict=strict)
        prompts = [encode_prompt(tokenizer, r.messages, True) for r in records]
        if count and count < len(prompts):
            # Evenly spaced, so a subset spans every category of a sorted file.
            prompts = [prompts[i * len(prompts) // count] for i in range(count)]
        return prompts, path
    return [p for p in held_out if p][:count], "held-out prompts"


# ---------------------------------------------------------------------------
# acceptance per depth, for the auto tree


class _RecordRuns:
    """A `policy.TreeChoice` that always uses one tree and keeps every row's runs."""

    def __init__(self, tree: TreeConfig):
        self.tree = tree
        self.runs: list[list[int]] = []

    @property
    def trees(self) -> list[TreeConfig]:
        return [self.tree]

    def describe(self) -> str:
        return self.tree.label

    def choose(self, batch_size: int, context: int = 0, temperature: float = 0.0) -> TreeConfig:
        return self.tree

    def record(self, step: StepRecord) -> None:
        self.runs.extend(step.runs.tolist())


ACCEPTANCE_TREE = TreeConfig(8, 7, lookup_branches=4, lookup_length=10)
# The shorter beam lengths a drafter's acceptance is measured at too
# (`AcceptanceTable.by_length`): the auto tree's candidates have beams of 2 to 7 tokens.
ACCEPTANCE_LENGTHS = (2, 3, 4, 5)


def measure_acceptance(
    model: nn.Module,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    *,
    tree: TreeConfig = ACCEPTANCE_TREE,
    lengths: Sequence[int] = ACCEPTANCE_LENGTHS,
    max_tokens: int = 128,
    temperature: float = 0.0,
    batch_size: int = 8,
    source: str = "",
) -> AcceptanceTable:
    """Decode the prompts with a wide tree and tabulate, per depth, how often the best
    of the first k drafter beams (and, separately, of the first k lookup branches)
    had its first d drafted tokens accepted (`metrics.AcceptanceTable`). The prompts
    are decoded again with the tree's beams cut to each of `lengths` tokens shorter
    than its own (`AcceptanceTable.by_length`): the replies are the same (greedy, or
    sampled with the same seeds), the beams are not. With a drafter, the tree's
    lookup branches are measured once more in a tree without beams
    (`AcceptanceTable.alone`): what the auto tree's lookup trees accept.

    Without a drafter the tree's beams are dropped and only lookup branches count.
    """
    if tree.draft_nodes is not None or tree.tree_budget is not None:
        raise ValueError(
            f"measure acceptance with a full tree, not {tree.label} with a node budget: its "
            "cut beams would undercount what the auto tree's trees accept (e.g. 8x7+4x10)"
        )
    if drafter is None:
        if not tree.lookup_branches:
            raise ValueError(
                f"without a drafter only lookup branches are measured: {tree.label} has "
                "none; give a tree with lookup branches (e.g. 0x1+4x10) or a drafter"
            )
        tree, lengths = tree.lookup_only, ()

    def measured_with(measuring: TreeConfig) -> AcceptanceTable:
        sampling = SamplingConfig(temperature=temperature)
        runs = _record_runs(model, drafter, prompts, measuring, sampling, max_tokens, batch_size)
        return _tabulate(runs, measuring, temperature)

    label = source or f"{len(prompts)} prompts x {max_tokens} tokens"
    table = measured_with(tree)
    shorter = []
    for length in sorted({n for n in lengths if 2 <= n < tree.beam_length}):
        branch = tree.lookup_branch_length if tree.lookup_branches else None
        cut = replace(tree, beam_length=length, lookup_length=branch)
        shorter.append(replace(measured_with(cut), lookup=()))
    alone = measured_with(tree.lookup_only).lookup if table.beams and tree.lookup_branches else ()
    source = f"{label}, tree {tree.label}"
    return replace(table, source=source, by_length=tuple(shorter), alone=alone)


def _record_runs(
    model: nn.Module,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    tree: TreeConfig,
    sampling: SamplingConfig,
    max_tokens: int,
    batch_size: int,
) -> list[list[int]]:
    """Decode the prompts with `tree` on every step: each step's and row's runs
    (drafted tokens accepted per candidate, the drafter's beams first)."""
    from ..session import DecodingSession, Request, request_keys

    recorder = _RecordRuns(tree)
    session = DecodingSession(model, drafter, tree=recorder)
    stop = StopConfig(max_tokens=max_tokens)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        keys = request_keys(0, len(chunk))
        requests = [Request(list(p), sampling, stop, key) for p, key in zip(chunk, keys)]
        for _ in session.run(requests):
            pass
    return recorder.runs


def _tabulate(runs: list[list[int]], tree: TreeConfig, temperature: float) -> AcceptanceTable:
    """The acceptance table of `runs` recorded with `tree` (its beams first)."""
    width = tree.beam_width if tree.beam_length > 1 else 0
    beams = [row[:width] for row in runs]
    lookup = [row[width:] for row in runs]
    depth = min(tree.beam_length, tree.lookup_branch_length) - 1 if width else 0
    return AcceptanceTable(
        beams=survival(beams, tree.beam_length - 1) if width else (),
        lookup=survival(lookup, tree.lookup_branch_length - 1) if tree.lookup_branches else (),
        joint=joint_survival(runs, width, depth) if width else (),
        temperature=temperature,
        steps=len(runs),
    )
