"""The trainer: the drafter learns against a frozen target (teacher-forced recurrence).

`train` computes the target's hidden states once per sequence, then runs AdamW
with warm-up + cosine decay, gradient clipping, a validation split, atomic
checkpoints with `resume`, optional distillation against the target's
distribution (KL), and data parallelism over `mx.distributed` ranks (see
`parallel`). Each of its optimizer steps is one `optimizer_step`; `fit`, a
minimal constant-rate run over token sequences (tests and quick experiments),
takes the same step on one micro-batch at a time.

Shapes: b micro-batch, T' usable positions, K draft steps, D hidden.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..drafter import Drafter
from .checkpoints import CheckpointError, latest_checkpoint, read_checkpoint, write_checkpoint
from .config import FitConfig, TrainConfig, config_record
from .data import (
    TrainingSequence,
    Window,
    draft_vocab_index,
    host_batch,
    progress_bar,
    split_rows,
    windows_with_hidden,
)
from .evaluate import TrainReport, evaluate
from .loss import (
    DraftBatch,
    SoftHead,
    SoftTargets,
    _device_batch,
    _loss_sums,
    _soft_targets,
    draft_batch,
    draft_loss,
    soft_head,
)
from .parallel import Sharding, deal, sum_over_ranks, world

# ---------------------------------------------------------------------------
# The optimizer step (shared by `train` and `fit`)


def clip_gradients(grads: Any, max_norm: float) -> Any:
    """Scale `grads` so their global L2 norm is at most `max_norm`.

    The norm is summed on the host in float64, in sorted parameter-name order:
    MLX's CPU reductions were seen to round differently for equal inputs held in
    differently allocated buffers, which would break bit-for-bit equality between
    a single process and data-parallel ranks (and between a run and its resumption).
    """
    mx.eval(grads)
    total = 0.0
    leaves = cast(list[tuple[str, mx.array]], tree_flatten(grads))
    for _, leaf in sorted(leaves, key=lambda item: item[0]):
        values = np.array(leaf.astype(mx.float32), dtype=np.float64)
        total += float(np.dot(values.ravel(), values.ravel()))
    norm = math.sqrt(total)
    if norm <= max_norm:
        return grads
    scale = mx.array(max_norm / (norm + 1e-6), dtype=mx.float32)
    return tree_map(lambda g: g * scale.astype(g.dtype), grads)


def optimizer_step(
    drafter: Drafter,
    optimizer: optim.Optimizer,
    loss_and_grad: Callable[..., Any],
    micro_batches: Iterable[tuple[Any, ...]],
    *,
    grad_clip: float = 0.0,
    group: Any | None = None,
) -> Any:
    """One optimizer step: the gradients of every micro-batch summed (then over the
    ranks of `group`), clipped to a global norm of `grad_clip` (0: not), applied.

    loss_and_grad: `nn.value_and_grad(drafter, f)` of an f(drafter, *inputs) that
    returns (loss, aux); micro_batches: the inputs of each micro-batch. Returns aux
    summed like the gradients, evaluated.
    """
    grads: Any = None
    aux: Any = None
    for inputs in micro_batches:
        (_, out), g = loss_and_grad(drafter, *inputs)
        grads = g if grads is None else tree_map(mx.add, grads, g)
        aux = out if aux is None else tree_map(mx.add, aux, out)
        mx.eval(grads, aux)
    grads = sum_over_ranks(grads, group)
    aux = sum_over_ranks(aux, group)
    if grad_clip > 0:
        grads = clip_gradients(grads, grad_clip)
    optimizer.update(drafter, grads)
    mx.eval(drafter.parameters(), optimizer.state, aux)
    return aux


def _fit_loss(drafter: Drafter, batch: DraftBatch) -> tuple[mx.array, tuple[mx.array]]:
    """`draft_loss` as `optimizer_step` wants it: (loss, (loss,))."""
    loss, _ = draft_loss(drafter, batch)
    return loss, (loss,)


def fit(
    model: nn.Module, drafter: Drafter, sequences: Sequence[Sequence[int]], config: FitConfig
) -> list[float]:
    """Train `drafter` on token sequences from the target; returns the loss per iteration.

    A constant learning rate, no clipping, validation or checkpoints: each iteration
    is one `optimizer_step` on the next `batch_size` sequences (cycling), its loss
    `draft_loss`.
    """
    model.freeze()
    optimizer = optim.AdamW(learning_rate=config.learning_rate, weight_decay=0.0)
    longest = max(len(s) for s in sequences)
    rows = [list(s) + [0] * (longest - len(s)) for s in sequences]
    padded = mx.array(rows, dtype=mx.int32)  # (N, T) right-padded
    lengths = mx.array([len(s) for s in sequences], dtype=mx.int32)  # (N,)
    loss_and_grad = nn.value_and_grad(drafter, _fit_loss)
    losses = []
    for iteration in range(config.iterations):
        start = (iteration * config.batch_size) % len(sequences)
        batch_rows = mx.arange(start, start + config.batch_size) % len(sequences)
        tokens = padded[batch_rows]  # (B, T)
        batch = draft_batch(model, drafter, tokens, lengths[batch_rows], config.num_steps)
        (loss,) = optimizer_step(drafter, optimizer, loss_and_grad, [(batch,)])
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------
# `train`: set-up and resume


@dataclass
class _Run:
    """One call of `train`: what the set-up derived, and where the run stands."""

    model: nn.Module
    drafter: Drafter
    config: TrainConfig
    group: Any | None
    say: Callable[[str], None]  # rank 0 logs, the other ranks stay silent
    windows: list[Window]
    sharding: Sharding
    valid_rows: list[int]  # this rank's share of the held-out windows
    vocab_index: np.ndarray | None  # (V,) target id -> draft index
    draft_ids: mx.array | None  # (Vd,)
    head: SoftHead | None
    optimizer: optim.Optimizer
    report: TrainReport
    step: int = 0

    @property
    def rank(self) -> int:
        return world(self.group)[0]


def new_drafter(
    model: nn.Module,
    seed: int,
    *,
    num_layers: int = 2,
    rnn: bool = True,
    exit_dim: int | None = None,
    draft_vocab_ids: Sequence[int] | None = None,
) -> Drafter:
    """An untrained drafter for `model`, its weights drawn with `seed` (`Drafter.create`)."""
    mx.random.seed(seed)
    return Drafter.create(
        model,
        num_draft_layers=num_layers,
        rnn=rnn,
        exit_dim=exit_dim,
        draft_vocab_ids=draft_vocab_ids,
    )


def _schedule(config: TrainConfig, total_steps: int) -> Callable[[mx.array], mx.array]:
    warmup = int(round(config.warmup * total_steps))
    end = config.learning_rate * config.final_lr_fraction
    cosine = optim.cosine_decay(config.learning_rate, max(total_steps - warmup, 1), end)
    if warmup == 0:
        return cosine
    linear = optim.linear_schedule(config.learning_rate / warmup, config.learning_rate, warmup)
    return optim.join_schedules([linear, cosine], [warmup])


def _check_tokens(sequences: Sequence[TrainingSequence], ids: Sequence[str], vocab: int) -> None:
    for index, sequence in enumerate(sequences):
        bad = [t for t in sequence.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"sequence {ids[index]} has token ids outside the target's vocabulary "
                f"[0, {vocab}): {bad[:5]}; was it distilled with another model?"
            )


def _set_up(
    model: nn.Module,
    drafter: Drafter,
    sequences: Sequence[TrainingSequence],
    ids: Sequence[str],
    config: TrainConfig,
    group: Any | None,
    log: Callable[[str], None],
    *,
    progress: bool,
    hidden_cache: str | os.PathLike[str] | None,
    hidden_cache_tag: str,
) -> _Run:
    """Check the inputs, deal the data, compute the target's hidden states this rank
    needs (`compute_hidden` with these options) and make the optimizer: a run at step 0."""
    rank, size = world(group)
    model.freeze()
    drafter.check_fits(model)
    _check_tokens(sequences, ids, drafter.config.vocab_size)
    train_rows, valid_rows = split_rows(sequences, ids, config.validation_fraction, config.seed)
    sharding = deal(train_rows, config.batch_size, config.micro_batch_size, group)
    total_steps = max(1, int(math.ceil(config.epochs * sharding.steps_per_epoch)))
    my_valid = valid_rows[rank::size]
    needed = sorted(sharding.rows() | set(my_valid))
    started = time.perf_counter()
    windows = windows_with_hidden(
        model,
        sequences,
        needed,
        progress=progress and rank == 0,
        cache_dir=hidden_cache,
        cache_tag=hidden_cache_tag,
    )
    hidden_seconds = time.perf_counter() - started
    vocab_index, draft_ids = draft_vocab_index(drafter)
    head = None
    if config.kl_weight > 0:
        dim = next(w.hidden.shape[-1] for w in windows if w.hidden is not None)
        head = soft_head(model, draft_ids, dim)
    optimizer = optim.AdamW(
        learning_rate=_schedule(config, total_steps), weight_decay=config.weight_decay
    )
    optimizer.init(drafter.trainable_parameters())
    return _Run(
        model=model,
        drafter=drafter,
        config=config,
        group=group,
        say=log if rank == 0 else (lambda message: None),
        windows=windows,
        sharding=sharding,
        valid_rows=my_valid,
        vocab_index=vocab_index,
        draft_ids=draft_ids,
        head=head,
        optimizer=optimizer,
        report=TrainReport(steps=0, total_steps=total_steps, hidden_seconds=hidden_seconds),
    )


def _resume(run: _Run, checkpoint_dir: str | os.PathLike[str] | None) -> None:
    """Continue from the newest checkpoint: weights, optimizer state, step, history."""
    if checkpoint_dir is None:
        raise ValueError("resume needs a checkpoint folder")
    path = latest_checkpoint(checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint to resume from in {checkpoint_dir}")
    loaded, optimizer_state, state = read_checkpoint(path)
    loaded.check_fits(run.model)
    if loaded.config != run.drafter.config:
        raise CheckpointError(
            f"checkpoint {path} holds a drafter {loaded.config}, not {run.drafter.config}"
        )
    if state.get("config") != config_record(run.config):
        raise CheckpointError(
            f"checkpoint {path} was written with other training settings; resume with "
            "the same options (or start a new --output)"
        )
    run.drafter.update(loaded.parameters())
    run.optimizer.state = tree_unflatten(list(optimizer_state.items()))
    run.step = int(state["step"])
    run.report.train_loss = list(state.get("train_loss", []))
    run.report.train_accuracy = list(state.get("train_accuracy", []))
    run.report.validation = list(state.get("validation", []))
    run.say(f"resumed from {path} at step {run.step}")


# ---------------------------------------------------------------------------
# `train`: one optimizer step, evaluation, checkpoints


def _loss_function(kl_weight: float) -> Callable[..., Any]:
    """The loss `train` differentiates: (loss sum x scale, (correct (K,), CE sum, counted (K,)))."""

    def loss_fn(
        d: Drafter, batch: DraftBatch, valid: mx.array, soft: SoftTargets | None, scale: mx.array
    ) -> tuple[mx.array, tuple[mx.array, mx.array, mx.array]]:
        loss_sum, correct, ce_sum = _loss_sums(d, batch, valid, soft, kl_weight)
        return loss_sum * scale, (correct, ce_sum, mx.sum(valid, axis=(0, 1)))

    return loss_fn


def _micro_batch(run: _Run, rows: list[int], scale: mx.array) -> tuple[Any, ...]:
    """The inputs of `_loss_function` for the windows `rows`."""
    config = run.config
    host = host_batch([run.windows[i] for i in rows], config.num_steps, run.vocab_index)
    batch = _device_batch(run.model, host, config.num_steps)
    valid = mx.array(host.valid.astype(np.float32))  # (b, T', K)
    soft = (
        _soft_targets(run.model, host, config.num_steps, run.draft_ids, run.head, config.soft_top_k)
        if config.kl_weight > 0
        else None
    )
    return batch, valid, soft, scale


class _StepStats(NamedTuple):
    positions: int  # in the global batch
    loss: float  # cross-entropy per position
    accuracy: list[float]  # (K,) top-1 per draft step


def _train_step(run: _Run, loss_and_grad: Callable[..., Any]) -> _StepStats:
    """One optimizer step on the next global batch, recorded in the report."""
    micro = run.sharding.global_batch(run.step, run.config.seed)
    # Every rank knows the global position count from token ids alone.
    positions = sum(max(len(run.windows[i].tokens) - 2, 0) for rows in micro for i in rows)
    scale = mx.array(1.0 / max(positions, 1), dtype=mx.float32)
    inputs = (_micro_batch(run, micro[j], scale) for j in run.sharding.mine)
    correct, ce_sum, counted = optimizer_step(
        run.drafter,
        run.optimizer,
        loss_and_grad,
        inputs,
        grad_clip=run.config.grad_clip,
        group=run.group,
    )
    run.step += 1
    loss = float(ce_sum.item()) / max(positions, 1)
    accuracy = (np.array(correct) / np.maximum(np.array(counted), 1)).tolist()
    run.report.train_loss.append(loss)
    run.report.train_accuracy.append([round(a, 4) for a in accuracy])
    return _StepStats(positions, loss, accuracy)


def _validate(run: _Run) -> None:
    """Evaluate on the held-out windows, record it at the current step and log it."""
    metrics = evaluate(
        run.model,
        run.drafter,
        run.windows,
        run.valid_rows,
        run.config,
        run.vocab_index,
        run.draft_ids,
        run.group,
    )
    run.report.validation.append({**metrics, "step": run.step})
    run.say(
        f"step {run.step}: validation loss {metrics['loss']:.3f}, accuracy "
        + " ".join(f"{a:.3f}" for a in metrics["accuracy"])
    )


def _checkpoint(run: _Run, folder: str | os.PathLike[str]) -> None:
    report = run.report
    state = {
        "step": run.step,
        "total_steps": report.total_steps,
        "config": config_record(run.config),
        "train_loss": report.train_loss,
        "train_accuracy": report.train_accuracy,
        "validation": report.validation,
    }
    write_checkpoint(folder, run.step, run.drafter, run.optimizer, state)


def _after_step(run: _Run, checkpoint_dir: str | os.PathLike[str] | None, last: int) -> None:
    """Validate every `eval_every` steps and at the end; checkpoint (rank 0) every
    `checkpoint_every` steps, at the end and where the run stops (`last`)."""
    config = run.config
    final = run.step == run.report.total_steps
    if (config.eval_every and run.step % config.eval_every == 0) or final:
        _validate(run)
    due = (config.checkpoint_every and run.step % config.checkpoint_every == 0) or final
    if checkpoint_dir is not None and run.rank == 0 and (due or run.step == last):
        _checkpoint(run, checkpoint_dir)


def _show(bar: Any, stats: _StepStats, rate: float) -> None:
    accuracy = "/".join(f"{a:.2f}" for a in stats.accuracy)
    bar.set_postfix_str(f"loss {stats.loss:.3f} acc {accuracy} {rate:.0f} tok/s", refresh=False)
    bar.update(1)


# ---------------------------------------------------------------------------
# `train`


def train(
    model: nn.Module,
    drafter: Drafter,
    sequences: Sequence[TrainingSequence],
    ids: Sequence[str],
    config: TrainConfig,
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    resume: bool = False,
    group: Any | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    max_steps: int | None = None,
    hidden_cache: str | os.PathLike[str] | None = None,
    hidden_cache_tag: str = "",
) -> TrainReport:
    """Train `drafter` (in place) on distilled sequences; the target stays frozen.

    ids: one stable id per sequence (the validation split hashes them).
    resume: continue from the newest checkpoint in `checkpoint_dir` (weights,
        optimizer state, step and data position), giving the same result as an
        uninterrupted run.
    group: an `mx.distributed` group for data parallelism (None: one process).
    max_steps: stop after this many optimizer steps in total (the schedule still
        spans the whole run; used to simulate an interruption).
    hidden_cache: a folder that keeps the target's hidden states between runs.
    """
    log = log or (lambda message: print(message, file=sys.stderr))
    run = _set_up(
        model,
        drafter,
        sequences,
        ids,
        config,
        group,
        log,
        progress=progress,
        hidden_cache=hidden_cache,
        hidden_cache_tag=hidden_cache_tag,
    )
    if resume:
        _resume(run, checkpoint_dir)
    mx.eval(drafter.parameters(), run.optimizer.state)
    if run.step == 0 and config.eval_every:
        _validate(run)  # where the run starts (chance, or --init-drafter's own figure)
    total = run.report.total_steps
    last = total if max_steps is None else min(total, max_steps)
    loss_and_grad = nn.value_and_grad(drafter, _loss_function(config.kl_weight))
    bar = progress_bar(total, "train", progress and run.rank == 0)
    bar.update(run.step)
    positions_seen = 0
    started = time.perf_counter()
    while run.step < last:
        stats = _train_step(run, loss_and_grad)
        positions_seen += stats.positions
        _show(bar, stats, positions_seen / max(time.perf_counter() - started, 1e-9))
        _after_step(run, checkpoint_dir, last)
    bar.close()
    run.report.steps = run.step
    run.report.seconds = time.perf_counter() - started
    run.report.tokens_per_second = positions_seen / max(run.report.seconds, 1e-9)
    return run.report
