"""The teacher-forced batch and the loss: the inputs and targets of K draft steps
at every position, the target's soft labels over the draft vocabulary, and the
loss sums `train`, `fit` and `evaluate` all go through.

Every path reaches the drafter through `Drafter.teacher_forced_logits`, its one
definition of the recurrence.

Shapes: B batch (b a micro-batch), T sequence length, T' usable positions, K draft
steps, D hidden, V target vocabulary, Vd draft vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..drafter import Drafter
from ..target import output_logits
from .data import HostBatch, target_hidden_states


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


def _step_inputs(embeddings: mx.array, usable: int, num_steps: int) -> mx.array:
    """e(x_{t+1}), ..., e(x_{t+K}) for every usable t: (B, T, D) -> (B, T', K, D)"""
    return mx.stack([embeddings[:, 1 + k : 1 + k + usable] for k in range(num_steps)], axis=2)


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
    inputs = _step_inputs(embeddings, usable, num_steps)  # (B, T', K, D)
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


def _device_batch(model: nn.Module, batch: HostBatch, num_steps: int) -> DraftBatch:
    """A host micro-batch (hidden states precomputed) as the drafter's teacher-forced batch."""
    usable = batch.targets.shape[1]
    embeddings = mx.stop_gradient(model.model.embed_tokens(mx.array(batch.tokens)))  # (b, T, D)
    return DraftBatch(
        mx.array(batch.hidden[:, :usable]).astype(embeddings.dtype),  # (b, T', D)
        _step_inputs(embeddings, usable, num_steps),  # (b, T', K, D)
        mx.array(batch.targets),
        mx.array(batch.in_vocab.astype(np.float32)),
    )


# ---------------------------------------------------------------------------
# Soft targets: the target's distribution over the draft vocabulary


class SoftHead(NamedTuple):
    """The target's output head restricted to the draft vocabulary: logits = h @ weight + bias.

    weight: (D, Vd); bias: (Vd,).
    """

    weight: mx.array
    bias: mx.array


def soft_head(model: nn.Module, draft_ids: mx.array | None, dim: int) -> SoftHead | None:
    """The target's head over the draft vocabulary as one affine map, if it is one.

    Soft targets need the target's logits only for the Vd draft tokens; slicing the
    head once makes them ~V/Vd times cheaper than the full (.., V) logits. The head
    is read through `output_logits` (so quantized and tied heads work) and checked
    on a random vector: a head that is not affine (e.g. with logit soft-capping)
    returns None and soft targets use the full head. dim: D, the hidden size.
    """
    if draft_ids is None:
        return None
    bias = output_logits(model, mx.zeros((1, dim))).astype(mx.float32)[0]  # (V,)
    weight = output_logits(model, mx.eye(dim)).astype(mx.float32) - bias  # (D, V)
    weight, bias = weight[:, draft_ids], bias[draft_ids]  # (D, Vd), (Vd,)
    probe = mx.random.normal((2, dim), key=mx.random.key(0))
    expected = output_logits(model, probe).astype(mx.float32)[:, draft_ids]  # (2, Vd)
    if not mx.allclose(probe @ weight + bias, expected, rtol=1e-3, atol=1e-3).item():
        return None
    mx.eval(weight, bias)
    return SoftHead(weight, bias)


class SoftTargets(NamedTuple):
    """The target's distribution for every (t, k), over (part of) the draft vocabulary.

    probs: (b, T', K, k) probabilities (over the whole draft vocabulary) of k tokens.
    ids: (b, T', K, k) their draft-vocabulary indices; None when k = Vd (every token,
        in order).
    """

    probs: mx.array
    ids: mx.array | None


def _soft_targets(
    model: nn.Module,
    batch: HostBatch,
    num_steps: int,
    draft_ids: mx.array | None,
    head: SoftHead | None = None,
    top_k: int = 0,
) -> SoftTargets:
    """The target's next-token distribution for every (t, k), over the draft vocabulary.

    Step k at window position t predicts x_{t+k+2}; the target predicts it from its
    hidden state at t+k+1. Probabilities are renormalised over the draft vocabulary;
    top_k > 0 keeps only the target's top_k most likely tokens per position (their
    probabilities are not renormalised again), which makes the soft loss as cheap as
    the hard one. `head` (from `soft_head`) computes only the draft vocabulary's logits.
    """
    usable = batch.targets.shape[1]
    hidden = mx.array(batch.hidden).astype(mx.float32)  # (b, T'+2, D)
    # Hidden states at t+1 .. t+K reach past the windows: zeros there (never valid).
    pad = mx.zeros((hidden.shape[0], num_steps, hidden.shape[2]), dtype=hidden.dtype)
    extended = mx.concatenate([hidden, pad], axis=1)  # (b, T'+2+K, D)
    if head is not None:
        logits = extended @ head.weight + head.bias  # (b, T'+2+K, Vd)
    else:
        logits = output_logits(model, extended).astype(mx.float32)  # (b, T'+2+K, V)
        if draft_ids is not None:
            logits = logits[..., draft_ids]  # (b, T'+2+K, Vd)
    ids = None
    if 0 < top_k < logits.shape[-1]:
        ids = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[..., :top_k]  # (b, T'+2+K, k)
        lse = mx.logsumexp(logits, axis=-1, keepdims=True)  # (b, T'+2+K, 1)
        probs = mx.exp(mx.take_along_axis(logits, ids, axis=-1) - lse)  # (b, T'+2+K, k)
    else:
        probs = mx.softmax(logits, axis=-1)  # (b, T'+2+K, Vd)

    def by_step(x: mx.array) -> mx.array:  # (b, T'+2+K, k) -> (b, T', K, k)
        return mx.stack([x[:, 1 + k : 1 + k + usable] for k in range(num_steps)], axis=2)

    return SoftTargets(
        mx.stop_gradient(by_step(probs)), None if ids is None else mx.stop_gradient(by_step(ids))
    )


# ---------------------------------------------------------------------------
# The loss


def _loss_sums(
    drafter: Drafter,
    batch: DraftBatch,
    valid: mx.array,
    soft: SoftTargets | None,
    kl_weight: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """(loss summed over positions and steps, correct (K,), loss-only CE sum)."""
    logits = drafter.teacher_forced_logits(batch.hidden, batch.token_embeddings)  # (b,T',K,Vd)
    hard = nn.losses.cross_entropy(logits, batch.targets, reduction="none")  # (b, T', K)
    ce_sum = mx.sum(hard * batch.weights)
    if soft is not None and kl_weight > 0:
        # -sum_j c_j log q_j = (sum_j c_j) logsumexp(z) - sum_j c_j z_j: the hard label
        # (c = 1 - w, 0 where it is outside the draft vocabulary) and the kept soft
        # labels (c = w p_j) share one logsumexp.
        lse = mx.logsumexp(logits, axis=-1)  # (b, T', K)
        if soft.ids is None:  # every draft token: the dense distribution
            soft_ce = mx.sum(soft.probs, axis=-1) * lse - mx.sum(soft.probs * logits, axis=-1)
            per = (1.0 - kl_weight) * hard * batch.weights + kl_weight * soft_ce  # (b, T', K)
        else:
            hard_weight = (1.0 - kl_weight) * batch.weights[..., None]  # (b, T', K, 1)
            coefficients = mx.concatenate([hard_weight, kl_weight * soft.probs], axis=-1)
            columns = mx.concatenate([batch.targets[..., None], soft.ids], axis=-1)
            picked = mx.take_along_axis(logits, columns, axis=-1)  # (b, T', K, 1 + k)
            per = mx.sum(coefficients, axis=-1) * lse - mx.sum(coefficients * picked, axis=-1)
        loss_sum = mx.sum(per * valid)
    else:
        loss_sum = ce_sum
    correct = (mx.argmax(logits, axis=-1) == batch.targets) & (batch.weights > 0)
    return loss_sum, mx.sum(correct.astype(mx.float32), axis=(0, 1)), ce_sum


def draft_loss(drafter: Drafter, batch: DraftBatch) -> tuple[mx.array, mx.array]:
    """Cross-entropy summed over draft steps, averaged over positions.

    Returns (loss scalar, per-step top-1 accuracy (K,)).
    """
    _, correct, ce_sum = _loss_sums(drafter, batch, batch.weights, None, 0.0)
    positions = mx.maximum(mx.sum(batch.weights[..., 0]), 1.0)
    accuracy = correct / mx.maximum(mx.sum(batch.weights, axis=(0, 1)), 1.0)  # (K,)
    return ce_sum / positions, accuracy
