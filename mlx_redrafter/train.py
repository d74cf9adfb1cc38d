"""Training the drafter against a frozen target (teacher-forced recurrence).

Shapes: B batch, T sequence length, K = L - 1 draft steps, D hidden, Vd draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from .drafter import Drafter


class DraftBatch(NamedTuple):
    """Teacher-forcing inputs for K draft steps at every usable position t.

    hidden: (B, T', D) target hidden state at position t.
    token_embeddings: (B, T', K, D) e(x_{t+1}), ..., e(x_{t+K}).
    targets: (B, T', K) draft-vocabulary index of x_{t+2}, ..., x_{t+K+1}.
    weights: (B, T', K) 1 where the target token exists and is in the draft vocabulary.
    """

    hidden: mx.array
    token_embeddings: mx.array
    targets: mx.array
    weights: mx.array


def target_hidden_states(model: nn.Module, tokens: mx.array) -> mx.array:
    """The target's final hidden states over whole sequences. (B, T) -> (B, T, D)"""
    return mx.stop_gradient(model.model(tokens))


def draft_batch(
    model: nn.Module, drafter: Drafter, tokens: mx.array, lengths: mx.array, num_steps: int
) -> DraftBatch:
    """Build the teacher-forced inputs of `num_steps` draft steps from token sequences.

    tokens: (B, T) right-padded; lengths: (B,) real tokens per row.
    """
    batch_size, length = tokens.shape
    usable = length - num_steps - 1  # T': positions with K inputs and K targets after them
    if usable < 1:
        raise ValueError(f"sequences of {length} tokens are too short for {num_steps} draft steps")
    hidden = target_hidden_states(model, tokens)[:, :usable]  # (B, T', D)
    embeddings = mx.stop_gradient(model.model.embed_tokens(tokens))  # (B, T, D)
    inputs = mx.stack([embeddings[:, 1 + k : 1 + k + usable] for k in range(num_steps)], axis=2)
    target_ids = mx.stack([tokens[:, 2 + k : 2 + k + usable] for k in range(num_steps)], axis=2)
    position = mx.arange(usable)[None, :, None] + mx.arange(num_steps)[None, None, :] + 2
    weights = position < lengths[:, None, None]  # (B, T', K)
    if drafter.config.draft_vocab_size is None:
        targets = target_ids
    else:
        index = mx.full((drafter.config.vocab_size,), -1, dtype=mx.int32)
        index[drafter.draft_vocab_ids] = mx.arange(drafter.config.output_size, dtype=mx.int32)
        targets = index[target_ids]
        weights = weights & (targets >= 0)
        targets = mx.maximum(targets, 0)
    return DraftBatch(hidden, inputs, targets.astype(mx.int32), weights.astype(mx.float32))


def draft_loss(drafter: Drafter, batch: DraftBatch) -> tuple[mx.array, mx.array]:
    """Cross-entropy summed over draft steps, averaged over positions.

    Returns (loss scalar, per-step top-1 accuracy (K,)).
    """
    logits = drafter.teacher_forced_logits(batch.hidden, batch.token_embeddings)  # (B, T', K, Vd)
    losses = nn.losses.cross_entropy(logits, batch.targets, reduction="none")  # (B, T', K)
    positions = mx.maximum(mx.sum(batch.weights[..., 0]), 1.0)
    loss = mx.sum(losses * batch.weights) / positions
    correct = (mx.argmax(logits, axis=-1) == batch.targets).astype(mx.float32) * batch.weights
    accuracy = mx.sum(correct, axis=(0, 1)) / mx.maximum(mx.sum(batch.weights, axis=(0, 1)), 1.0)
    return loss, accuracy


@dataclass(frozen=True)
class FitConfig:
    """A short training run (the full trainer adds schedules and checkpoints)."""

    num_steps: int = 3
    iterations: int = 200
    learning_rate: float = 3e-3
    batch_size: int = 8


def fit(
    model: nn.Module, drafter: Drafter, sequences: Sequence[Sequence[int]], config: FitConfig
) -> list[float]:
    """Train `drafter` on token sequences from the target; returns the loss per iteration."""
    model.freeze()
    optimizer = optim.AdamW(learning_rate=config.learning_rate, weight_decay=0.0)
    longest = max(len(s) for s in sequences)
    padded = mx.array([list(s) + [0] * (longest - len(s)) for s in sequences], dtype=mx.int32)
    lengths = mx.array([len(s) for s in sequences], dtype=mx.int32)
    loss_and_grad = nn.value_and_grad(drafter, lambda d, b: draft_loss(d, b)[0])
    losses = []
    for iteration in range(config.iterations):
        start = (iteration * config.batch_size) % len(sequences)
        rows = mx.arange(start, start + config.batch_size) % len(sequences)
        batch = draft_batch(model, drafter, padded[rows], lengths[rows], config.num_steps)
        loss, grads = loss_and_grad(drafter, batch)
        optimizer.update(drafter, grads)
        mx.eval(drafter.trainable_parameters(), optimizer.state, loss)
        losses.append(loss.item())
    return losses
