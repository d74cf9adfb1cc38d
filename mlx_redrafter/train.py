"""Training the drafter against a frozen target (teacher-forced recurrence).

Shapes: B batch, T sequence length, K = L - 1 draft steps, D hidden, V target
vocabulary, Vd draft vocabulary.

Two entry points:

* `fit`: a minimal loop over token sequences (tests and quick experiments);
* `train`: the full trainer behind `mlx-redrafter train`. It computes the
  target's hidden states once per sequence, then runs AdamW with warm-up +
  cosine decay, gradient clipping, a validation split, atomic checkpoints with
  `resume`, optional distillation against the target's distribution (KL), and
  data parallelism over `mx.distributed` ranks.

Both go through `Drafter.teacher_forced_logits`, the drafter's one definition
of the recurrence.

Data parallelism and determinism. A global batch of `batch_size` sequences is
cut into S = world x micro_batches micro-batches of `micro_batch_size`; the
training sequences are dealt into S fixed shards and micro-batch j always
draws from shard j (shuffled per epoch with the seed). Rank r owns shards
r*M .. r*M+M-1, computes hidden states only for them, and sums its
micro-batch gradients; the ranks then sum over `all_sum`. Each micro-batch loss
is divided by the number of positions in the whole global batch (known on every
rank from the token ids alone), so the sum is the global-batch gradient. A
single process with S micro-batches adds the same terms in the same order, so
on CPU it ends with the same bits as S ranks of one micro-batch each.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .config import BeamConfig
from .drafter import Drafter
from .files import fsync_path, match_umask
from .target import output_logits

# ---------------------------------------------------------------------------
# The teacher-forced batch and loss (shared by `fit` and `train`)


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
    """A short constant-rate training run (see `TrainConfig` for the full trainer)."""

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


# ---------------------------------------------------------------------------
# Training data: completion windows with cached target hidden states


class TrainingSequence(NamedTuple):
    """One distilled sequence: prompt + completion token ids, and the prompt's length."""

    tokens: list[int]
    prompt_length: int = 0


@dataclass
class Window:
    """The part of a sequence the drafter learns from, with the target's hidden states.

    Drafting at inference starts from the hidden state that predicted the last
    prompt token (position P-2), so the window starts there: tokens x[P-2:] and
    hidden (n, D) at those positions. Position t of the window drafts tokens t+2, ...
    """

    tokens: np.ndarray  # (n,) int32
    hidden: np.ndarray | None = None  # (n, D) float16, filled by `compute_hidden`


def make_window(sequence: TrainingSequence) -> Window:
    start = max(sequence.prompt_length - 2, 0)
    return Window(np.asarray(sequence.tokens[start:], dtype=np.int32))


def _hidden_key(sequence: TrainingSequence, tag: str) -> str:
    digest = hashlib.sha256(tag.encode())
    digest.update(np.asarray(sequence.tokens, dtype=np.int64).tobytes())
    digest.update(str(sequence.prompt_length).encode())
    return digest.hexdigest()[:32]


def compute_hidden(
    model: nn.Module,
    sequences: Sequence[TrainingSequence],
    windows: Sequence[Window],
    progress: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_tag: str = "",
) -> None:
    """Fill each window's hidden states with one target forward over its whole sequence.

    Each sequence runs alone (no padding), so its hidden states do not depend on
    which other sequences a process holds: every rank, and a resumed run, gets
    the same bits. With `cache_dir`, results are stored there (float16 .npy,
    keyed by the tokens, the prompt length and `cache_tag`, which should name
    the target) and reused by later runs.
    """
    cache = Path(cache_dir) if cache_dir is not None else None
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
    bar = _bar(len(sequences), "target hidden states", progress)
    for sequence, window in zip(sequences, windows):
        path = cache / f"{_hidden_key(sequence, cache_tag)}.npy" if cache is not None else None
        if path is not None and path.is_file():
            try:
                window.hidden = np.load(path, allow_pickle=False)
                bar.update(1)
                continue
            except (OSError, ValueError):
                pass  # unreadable: recompute and overwrite
        hidden = target_hidden_states(model, mx.array([sequence.tokens], dtype=mx.int32))
        hidden = hidden.astype(mx.float16)
        mx.eval(hidden)
        start = max(sequence.prompt_length - 2, 0)
        window.hidden = np.array(hidden[0, start:])
        if path is not None:
            fd, temp = tempfile.mkstemp(prefix=".hidden-", suffix=".npy", dir=path.parent)
            match_umask(temp)
            with os.fdopen(fd, "wb") as f:
                np.save(f, window.hidden)
            os.replace(temp, path)
        bar.update(1)
    bar.close()


def choose_draft_vocab(
    sequences: Sequence[TrainingSequence], size: int, always: Sequence[int] = ()
) -> list[int]:
    """The `size` most frequent completion tokens (ties: lower id), plus `always` ids.

    Returned sorted by id.
    """
    counts: dict[int, int] = {}
    for sequence in sequences:
        for token in sequence.tokens[sequence.prompt_length :]:
            counts[token] = counts.get(token, 0) + 1
    chosen = list(dict.fromkeys(int(t) for t in always))[:size]
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    taken = set(chosen)
    for token in ranked:
        if len(chosen) >= size:
            break
        if token not in taken:
            chosen.append(token)
            taken.add(token)
    # Fill up with unseen ids so the vocabulary has exactly `size` entries.
    filler = 0
    while len(chosen) < size:
        if filler not in taken:
            chosen.append(filler)
            taken.add(filler)
        filler += 1
    return sorted(chosen)


def vocab_coverage(sequences: Sequence[TrainingSequence], ids: Sequence[int]) -> float:
    """The fraction of completion tokens inside the draft vocabulary `ids`."""
    chosen = set(ids)
    total = hit = 0
    for sequence in sequences:
        completion = sequence.tokens[sequence.prompt_length :]
        total += len(completion)
        hit += sum(1 for t in completion if t in chosen)
    return hit / max(total, 1)


# ---------------------------------------------------------------------------
# Batches from windows


class HostBatch(NamedTuple):
    """A micro-batch on the host (numpy), before it meets the drafter.

    tokens: (b, T'+K+1) window tokens, right-padded.
    hidden: (b, T'+2, D) float16, every window position (the drafter reads the first T').
    targets: (b, T', K) draft-vocabulary index (0 where invalid).
    valid: (b, T', K) the target token exists (accuracy counts these).
    in_vocab: (b, T', K) valid and inside the draft vocabulary (the loss counts these).
    """

    tokens: np.ndarray
    hidden: np.ndarray
    targets: np.ndarray
    valid: np.ndarray
    in_vocab: np.ndarray


def host_batch(
    windows: Sequence[Window], num_steps: int, vocab_index: np.ndarray | None
) -> HostBatch:
    """Pad windows into one teacher-forcing micro-batch (K = num_steps)."""
    longest = max(len(w.tokens) for w in windows)
    usable = max(longest - 2, 1)  # T': window positions t with at least x_{t+2}
    dim = next(w.hidden for w in windows if w.hidden is not None).shape[-1]
    tokens = np.zeros((len(windows), usable + num_steps + 1), dtype=np.int32)
    hidden = np.zeros((len(windows), usable + 2, dim), dtype=np.float16)
    lengths = np.zeros((len(windows),), dtype=np.int64)
    for r, window in enumerate(windows):
        if window.hidden is None:
            raise ValueError("window without hidden states: call compute_hidden first")
        n = len(window.tokens)
        tokens[r, :n] = window.tokens
        hidden[r, :n] = window.hidden[:n]
        lengths[r] = n
    steps = np.arange(num_steps)
    position = np.arange(usable)[:, None] + steps[None, :] + 2  # (T', K) index of the target
    target_ids = tokens[:, position]  # (b, T', K)
    valid = position[None] < lengths[:, None, None]
    if vocab_index is None:
        targets = target_ids
        in_vocab = valid
    else:
        targets = vocab_index[target_ids]
        in_vocab = valid & (targets >= 0)
        targets = np.maximum(targets, 0)
    return HostBatch(tokens, hidden, targets.astype(np.int32), valid, in_vocab)


def _device_batch(model: nn.Module, batch: HostBatch, num_steps: int) -> DraftBatch:
    usable = batch.targets.shape[1]
    embeddings = mx.stop_gradient(model.model.embed_tokens(mx.array(batch.tokens)))  # (b, T, D)
    inputs = mx.stack([embeddings[:, 1 + k : 1 + k + usable] for k in range(num_steps)], axis=2)
    return DraftBatch(
        mx.array(batch.hidden[:, :usable]).astype(embeddings.dtype),
        inputs,
        mx.array(batch.targets),
        mx.array(batch.in_vocab.astype(np.float32)),
    )


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


# ---------------------------------------------------------------------------
# The trainer


@dataclass(frozen=True)
class TrainConfig:
    """Settings of `train` (stored in every checkpoint).

    num_steps: K, the draft steps trained per position (beam length L = K + 1).
    batch_size: sequences per optimizer step, over all ranks.
    micro_batch_size: sequences per forward/backward; batch_size must be a multiple
        of world size x micro_batch_size.
    epochs: passes over the training split (fractions allowed).
    warmup: fraction of the steps with a linear warm-up; then cosine decay to
        learning_rate x final_lr_fraction.
    grad_clip: maximum global gradient norm (0 disables clipping).
    kl_weight: 0 trains on the target's tokens (cross-entropy); 1 on the target's
        distribution (KL); in between mixes the two.
    soft_top_k: with kl_weight > 0, the target's distribution is kept for its
        soft_top_k most likely draft tokens per position (0: all of them).
    validation_fraction: share of sequences held out (chosen by hashing their ids).
    eval_every, checkpoint_every: in optimizer steps (0: only at the end).
    """

    num_steps: int = 4
    batch_size: int = 32
    micro_batch_size: int = 8
    epochs: float = 1.0
    learning_rate: float = 1e-3
    warmup: float = 0.1
    final_lr_fraction: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    kl_weight: float = 0.0
    soft_top_k: int = 64
    validation_fraction: float = 0.05
    eval_every: int = 0
    checkpoint_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("batch_size and micro_batch_size must be >= 1")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} is not a multiple of "
                f"micro_batch_size {self.micro_batch_size}"
            )
        if not 0 <= self.kl_weight <= 1:
            raise ValueError(f"kl_weight must be in [0, 1], got {self.kl_weight}")
        if self.soft_top_k < 0:
            raise ValueError(f"soft_top_k must be >= 0 (0: all tokens), got {self.soft_top_k}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must be in [0, 1), got {self.validation_fraction}"
            )
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup must be a fraction in [0, 1), got {self.warmup}")
        if self.epochs <= 0 or self.learning_rate <= 0:
            raise ValueError("epochs and learning_rate must be > 0")


class CheckpointError(ValueError):
    """A checkpoint could not be written or read."""


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


def split_validation(ids: Sequence[str], fraction: float, seed: int = 0) -> list[bool]:
    """For each id, whether it is held out (a stable hash, independent of order)."""
    held = []
    for record_id in ids:
        digest = hashlib.sha256(f"validation:{seed}:{record_id}".encode()).digest()
        held.append(int.from_bytes(digest[:8], "little") / 2**64 < fraction)
    return held


def _split_rows(
    sequences: Sequence[TrainingSequence], ids: Sequence[str], config: TrainConfig
) -> tuple[list[int], list[int]]:
    """Indices of the training and of the held-out sequences that have a position to learn."""
    held = split_validation(ids, config.validation_fraction, config.seed)
    usable = [len(sequence.tokens) > 2 for sequence in sequences]
    train_rows = [i for i, h in enumerate(held) if not h and usable[i]]
    return train_rows, [i for i, h in enumerate(held) if h and usable[i]]


def _schedule(config: TrainConfig, total_steps: int) -> Callable[[mx.array], mx.array]:
    warmup = int(round(config.warmup * total_steps))
    end = config.learning_rate * config.final_lr_fraction
    cosine = optim.cosine_decay(config.learning_rate, max(total_steps - warmup, 1), end)
    if warmup == 0:
        return cosine
    linear = optim.linear_schedule(config.learning_rate / warmup, config.learning_rate, warmup)
    return optim.join_schedules([linear, cosine], [warmup])


def _world(group: Any | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return int(group.rank()), int(group.size())


# -- checkpoints: <dir>/ckpt-<step>/ and a LATEST pointer, both replaced atomically --

LATEST = "LATEST"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


def write_checkpoint(
    folder: str | os.PathLike[str],
    step: int,
    drafter: Drafter,
    optimizer: optim.Optimizer,
    state: dict[str, Any],
    keep: int = 1,
) -> Path:
    """Write checkpoint `step` under `folder`; the previous one stays valid until
    the new one is complete (staging folder, fsync, rename, then the LATEST
    pointer is replaced by rename). Disk errors leave the previous one intact."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{step:07d}"
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=root))
    try:
        match_umask(staging)
        drafter.save(staging / "drafter", overwrite=True)
        mx.save_safetensors(
            str(staging / OPTIMIZER_FILE), dict(tree_flatten(optimizer.state)), {"format": "mlx"}
        )
        (staging / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        for path in [*staging.rglob("*")]:
            if path.is_file():
                fsync_path(path)
        fsync_path(staging / "drafter")
        fsync_path(staging)
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        pointer = root / f".{LATEST}.partial"
        with open(pointer, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, root / LATEST)
        fsync_path(root)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        (root / f".{LATEST}.partial").unlink(missing_ok=True)
        previous = latest_checkpoint(root)
        kept = f"; the previous checkpoint {previous} is intact" if previous else ""
        raise CheckpointError(f"cannot write checkpoint {name} in {root}: {error}{kept}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    checkpoints = sorted(p for p in root.glob("ckpt-*") if p.is_dir())
    for old in checkpoints[:-keep] if keep > 0 else []:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The checkpoint LATEST points to, or None."""
    root = Path(folder)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def read_checkpoint(path: Path) -> tuple[Drafter, dict[str, mx.array], dict[str, Any]]:
    """(drafter, flat optimizer state, trainer state) of one checkpoint folder."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        drafter = Drafter.load(path / "drafter")
        optimizer_state = cast(dict[str, mx.array], mx.load(str(path / OPTIMIZER_FILE)))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read checkpoint {path}: {error}") from None
    return drafter, optimizer_state, state


# -- the loop --


def _bar(total: int, description: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total, desc=description, disable=not enabled, file=sys.stderr, dynamic_ncols=True
    )


def _shards(count: int, num_shards: int) -> list[list[int]]:
    return [list(range(j, count, num_shards)) for j in range(num_shards)]


def _epoch_order(shard: list[int], epoch: int, seed: int, shard_index: int) -> list[int]:
    rng = np.random.default_rng([seed, epoch, shard_index])
    return [shard[i] for i in rng.permutation(len(shard))]


def _sum_over_ranks(values: Any, group: Any | None) -> Any:
    if group is None or group.size() == 1:
        return values
    return tree_map(lambda x: mx.distributed.all_sum(x, group=group), values)


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
    rank, world = _world(group)
    log = log or (lambda message: print(message, file=sys.stderr))
    say = log if rank == 0 else (lambda message: None)
    model.freeze()
    drafter.check_fits(model)
    vocab_size = drafter.config.vocab_size
    for index, sequence in enumerate(sequences):
        bad = [t for t in sequence.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"sequence {ids[index]} has token ids outside the target's vocabulary "
                f"[0, {vocab_size}): {bad[:5]}; was it distilled with another model?"
            )
    if config.batch_size % (world * config.micro_batch_size):
        raise ValueError(
            f"batch_size {config.batch_size} must be a multiple of ranks ({world}) x "
            f"micro_batch_size ({config.micro_batch_size})"
        )
    train_rows, valid_rows = _split_rows(sequences, ids, config)
    num_shards = config.batch_size // config.micro_batch_size
    per_rank = num_shards // world
    shards = [[train_rows[i] for i in s] for s in _shards(len(train_rows), num_shards)]
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    steps_per_epoch = min(len(s) for s in shards) // config.micro_batch_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"{len(train_rows)} training sequences are too few for batches of "
            f"{config.batch_size}: distill more data or lower --batch-size"
        )
    total_steps = max(1, int(math.ceil(config.epochs * steps_per_epoch)))

    windows = [make_window(s) for s in sequences]
    my_valid = valid_rows[rank::world]
    needed = sorted({i for j in mine for i in shards[j]} | set(my_valid))
    started = time.perf_counter()
    compute_hidden(
        model,
        [sequences[i] for i in needed],
        [windows[i] for i in needed],
        progress=progress and rank == 0,
        cache_dir=hidden_cache,
        cache_tag=hidden_cache_tag,
    )
    hidden_seconds = time.perf_counter() - started

    vocab_index, draft_ids = _draft_vocab_index(drafter)
    head = None
    if config.kl_weight > 0:
        dim = next(w.hidden.shape[-1] for w in windows if w.hidden is not None)
        head = soft_head(model, draft_ids, dim)

    optimizer = optim.AdamW(
        learning_rate=_schedule(config, total_steps), weight_decay=config.weight_decay
    )
    optimizer.init(drafter.trainable_parameters())
    step = 0
    report = TrainReport(steps=0, total_steps=total_steps, hidden_seconds=hidden_seconds)
    if resume:
        if checkpoint_dir is None:
            raise ValueError("resume needs a checkpoint folder")
        path = latest_checkpoint(checkpoint_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {checkpoint_dir}")
        loaded, optimizer_state, state = read_checkpoint(path)
        loaded.check_fits(model)
        if loaded.config != drafter.config:
            raise CheckpointError(
                f"checkpoint {path} holds a drafter {loaded.config}, not {drafter.config}"
            )
        if state.get("config") != _config_record(config):
            raise CheckpointError(
                f"checkpoint {path} was written with other training settings; resume with "
                "the same options (or start a new --output)"
            )
        drafter.update(loaded.parameters())
        optimizer.state = tree_unflatten(list(optimizer_state.items()))
        step = int(state["step"])
        report.train_loss = list(state.get("train_loss", []))
        report.train_accuracy = list(state.get("train_accuracy", []))
        report.validation = list(state.get("validation", []))
        say(f"resumed from {path} at step {step}")
    mx.eval(drafter.parameters(), optimizer.state)

    def validate_at(step: int) -> None:
        metrics = evaluate(model, drafter, windows, my_valid, config, vocab_index, draft_ids, group)
        report.validation.append({**metrics, "step": step})
        say(
            f"step {step}: validation loss {metrics['loss']:.3f}, accuracy "
            + " ".join(f"{a:.3f}" for a in metrics["accuracy"])
        )

    if step == 0 and config.eval_every:
        validate_at(0)  # where the run starts (chance, or --init-drafter's own figure)

    def loss_fn(
        d: Drafter, batch: DraftBatch, valid: mx.array, soft: SoftTargets | None, scale: mx.array
    ) -> tuple[mx.array, tuple[mx.array, mx.array]]:
        loss_sum, correct, ce_sum = _loss_sums(d, batch, valid, soft, config.kl_weight)
        return loss_sum * scale, (correct, ce_sum)

    loss_and_grad = nn.value_and_grad(drafter, loss_fn)
    last_step = total_steps if max_steps is None else min(total_steps, max_steps)
    bar = _bar(total_steps, "train", progress and rank == 0)
    bar.update(step)
    positions_seen = 0
    loop_started = time.perf_counter()
    while step < last_step:
        epoch, within = divmod(step, steps_per_epoch)
        # The global batch: micro-batch j takes the next rows of shard j.
        micro: list[list[int]] = []
        for j in range(num_shards):
            order = _epoch_order(shards[j], epoch, config.seed, j)
            start = within * config.micro_batch_size
            micro.append(order[start : start + config.micro_batch_size])
        host = {
            j: host_batch([windows[i] for i in micro[j]], config.num_steps, vocab_index)
            for j in mine
        }
        # Every rank knows the global position count from token ids alone.
        positions = 0
        for j in range(num_shards):
            lengths = [len(windows[i].tokens) for i in micro[j]]
            positions += sum(max(n - 2, 0) for n in lengths)
        scale = mx.array(1.0 / max(positions, 1), dtype=mx.float32)
        grads: Any = None
        correct_sum = mx.zeros((config.num_steps,))
        counted = np.zeros((config.num_steps,))
        ce_total = mx.array(0.0)
        for j in mine:
            batch = _device_batch(model, host[j], config.num_steps)
            valid = mx.array(host[j].valid.astype(np.float32))
            soft = (
                _soft_targets(model, host[j], config.num_steps, draft_ids, head, config.soft_top_k)
                if config.kl_weight > 0
                else None
            )
            (_, (correct, ce_sum)), g = loss_and_grad(drafter, batch, valid, soft, scale)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            correct_sum = correct_sum + correct
            ce_total = ce_total + ce_sum
            counted += host[j].valid.sum(axis=(0, 1))
            mx.eval(grads, correct_sum, ce_total)
        grads = _sum_over_ranks(grads, group)
        stats = _sum_over_ranks(
            [correct_sum, ce_total, mx.array(counted.astype(np.float32))], group
        )
        if config.grad_clip > 0:
            grads = clip_gradients(grads, config.grad_clip)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state, stats)
        step += 1
        positions_seen += positions
        loss_value = float(stats[1].item()) / max(positions, 1)
        accuracy = (np.array(stats[0]) / np.maximum(np.array(stats[2]), 1)).tolist()
        report.train_loss.append(loss_value)
        report.train_accuracy.append([round(a, 4) for a in accuracy])
        elapsed = time.perf_counter() - loop_started
        bar.set_postfix_str(
            f"loss {loss_value:.3f} acc "
            + "/".join(f"{a:.2f}" for a in accuracy)
            + f" {positions_seen / max(elapsed, 1e-9):.0f} tok/s",
            refresh=False,
        )
        bar.update(1)
        final = step == total_steps
        if (config.eval_every and step % config.eval_every == 0) or final:
            validate_at(step)
        if (
            checkpoint_dir is not None
            and rank == 0
            and (
                (config.checkpoint_every and step % config.checkpoint_every == 0)
                or final
                or step == last_step
            )
        ):
            write_checkpoint(
                checkpoint_dir,
                step,
                drafter,
                optimizer,
                {
                    "step": step,
                    "total_steps": total_steps,
                    "config": _config_record(config),
                    "train_loss": report.train_loss,
                    "train_accuracy": report.train_accuracy,
                    "validation": report.validation,
                },
            )
    bar.close()
    report.steps = step
    report.seconds = time.perf_counter() - loop_started
    report.tokens_per_second = positions_seen / max(report.seconds, 1e-9)
    return report


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


def _config_record(config: TrainConfig) -> dict[str, Any]:
    record = asdict(config)
    # Bookkeeping that may change between a run and its resumption.
    for key in ("eval_every", "checkpoint_every"):
        record.pop(key)
    return record


def _draft_vocab_index(drafter: Drafter) -> tuple[np.ndarray | None, mx.array | None]:
    """Target id -> draft index (-1 outside the draft vocabulary) and the draft ids.

    Returns (vocab_index (V,), draft_ids (Vd,)), or (None, None) for a full-vocabulary head.
    """
    if drafter.config.draft_vocab_size is None:
        return None, None
    draft_ids = drafter.draft_vocab_ids
    vocab_index = np.full((drafter.config.vocab_size,), -1, dtype=np.int32)
    vocab_index[np.array(draft_ids)] = np.arange(drafter.config.output_size, dtype=np.int32)
    return vocab_index, draft_ids


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
    _, rows = _split_rows(sequences, ids, config)
    if not rows:
        raise ValueError(
            f"no sequence is held out at validation fraction {config.validation_fraction}: "
            "pass more data or a larger --validation-fraction"
        )
    windows = [make_window(sequences[i]) for i in rows]
    compute_hidden(
        model,
        [sequences[i] for i in rows],
        windows,
        progress=progress,
        cache_dir=hidden_cache,
        cache_tag=hidden_cache_tag,
    )
    vocab_index, draft_ids = _draft_vocab_index(drafter)
    return evaluate(model, drafter, windows, range(len(rows)), config, vocab_index, draft_ids)


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
        valid = mx.array(host.valid.astype(np.float32))
        _, hits, ce_sum = _loss_sums(drafter, batch, valid, None, 0.0)
        ce_total = ce_total + ce_sum
        correct = correct + hits
        counted += host.valid.sum(axis=(0, 1))
        positions += int(host.valid[..., 0].sum())
        mx.eval(ce_total, correct)
    total = _sum_over_ranks(
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
    beam: BeamConfig,
    max_tokens: int = 256,
    batch_size: int = 1,
) -> TauResult:
    """Decode the prompts greedily and count tokens per target step (bonus included).

    beam is the tree (drafter beams and lookup beams; `PLAIN_DECODING` with
    `drafter=None` for the baseline); lookup beams read the drafter's n-gram table
    when it has one and the config allows it.

    batch_size 1 decodes each prompt alone with `stream_generate`; larger batches
    use `stream_batch` (the same loop; greedy tau per row does not depend on the
    batch, the wall-clock figure does).
    """
    from .generate import stream_batch, stream_generate

    produced = steps = generated = 0
    seconds = 0.0
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start : start + batch_size]]
        options: dict[str, Any] = {
            "max_tokens": max_tokens,
            "beam": beam,
        }
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
