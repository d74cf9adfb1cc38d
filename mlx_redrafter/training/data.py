"""Training data: the distilled sequences, the windows the drafter learns from with
the target's hidden states over them (optionally cached on disk), the draft
vocabulary, the validation split and host micro-batches.

Shapes: B batch, T sequence length, K draft steps, D hidden, V target vocabulary,
Vd draft vocabulary.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..drafter import Drafter
from ..files import match_umask

if TYPE_CHECKING:
    from ..distill import DistilledSequence


class TrainingSequence(NamedTuple):
    """One distilled sequence: prompt + completion token ids, and the prompt's length."""

    tokens: list[int]
    prompt_length: int = 0


def training_sequences(
    records: Sequence[DistilledSequence],
) -> tuple[list[TrainingSequence], list[str]]:
    """The sequences of distilled records and their ids (the validation split hashes them)."""
    return [TrainingSequence(r.tokens, r.prompt_length) for r in records], [r.id for r in records]


# ---------------------------------------------------------------------------
# The validation split


def split_validation(ids: Sequence[str], fraction: float, seed: int = 0) -> list[bool]:
    """For each id, whether it is held out (a stable hash, independent of order)."""
    held = []
    for record_id in ids:
        digest = hashlib.sha256(f"validation:{seed}:{record_id}".encode()).digest()
        held.append(int.from_bytes(digest[:8], "little") / 2**64 < fraction)
    return held


def split_rows(
    sequences: Sequence[TrainingSequence], ids: Sequence[str], fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """Indices of the training and of the held-out sequences that have a position to learn."""
    held = split_validation(ids, fraction, seed)
    usable = [len(sequence.tokens) > 2 for sequence in sequences]
    train_rows = [i for i, h in enumerate(held) if not h and usable[i]]
    return train_rows, [i for i, h in enumerate(held) if h and usable[i]]


def training_replies(
    records: Sequence[DistilledSequence], validation_fraction: float, seed: int
) -> list[list[int]]:
    """The replies of the records `train` learns from (its held-out ids left out)."""
    held = split_validation([r.id for r in records], validation_fraction, seed)
    return [r.tokens[r.prompt_length :] for r, h in zip(records, held) if not h]


def held_out_prompts(
    sequences: Sequence[TrainingSequence], ids: Sequence[str], fraction: float, seed: int
) -> list[list[int]]:
    """The prompts of the held-out sequences (what the tau report decodes by default)."""
    held = split_validation(ids, fraction, seed)
    return [s.tokens[: s.prompt_length] for s, h in zip(sequences, held) if h]


# ---------------------------------------------------------------------------
# Windows with the target's hidden states


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


def target_hidden_states(model: nn.Module, tokens: mx.array) -> mx.array:
    """The target's final hidden states over whole sequences. (B, T) -> (B, T, D)"""
    return mx.stop_gradient(model.model(tokens))


def progress_bar(total: int, description: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (a silent one when not `enabled`)."""
    from tqdm import tqdm

    return tqdm(
        total=total, desc=description, disable=not enabled, file=sys.stderr, dynamic_ncols=True
    )


def _hidden_key(sequence: TrainingSequence, tag: str) -> str:
    digest = hashlib.sha256(tag.encode())
    digest.update(np.asarray(sequence.tokens, dtype=np.int64).tobytes())
    digest.update(str(sequence.prompt_length).encode())
    return digest.hexdigest()[:32]


def _load_hidden(path: Path | None) -> np.ndarray | None:
    """A cached (n, D) array, or None when there is none or it cannot be read."""
    if path is None or not path.is_file():
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None  # unreadable: recompute and overwrite


def _store_hidden(path: Path, hidden: np.ndarray) -> None:
    fd, temp = tempfile.mkstemp(prefix=".hidden-", suffix=".npy", dir=path.parent)
    match_umask(temp)
    with os.fdopen(fd, "wb") as f:
        np.save(f, hidden)
    os.replace(temp, path)


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
    bar = progress_bar(len(sequences), "target hidden states", progress)
    for sequence, window in zip(sequences, windows):
        path = cache / f"{_hidden_key(sequence, cache_tag)}.npy" if cache is not None else None
        window.hidden = _load_hidden(path)
        if window.hidden is None:
            hidden = target_hidden_states(model, mx.array([sequence.tokens], dtype=mx.int32))
            hidden = hidden.astype(mx.float16)  # (1, T, D)
            mx.eval(hidden)
            start = max(sequence.prompt_length - 2, 0)
            window.hidden = np.array(hidden[0, start:])  # (n, D)
            if path is not None:
                _store_hidden(path, window.hidden)
        bar.update(1)
    bar.close()


def windows_with_hidden(
    model: nn.Module,
    sequences: Sequence[TrainingSequence],
    rows: Sequence[int],
    *,
    progress: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_tag: str = "",
) -> list[Window]:
    """A window per sequence, the target's hidden states filled in for `rows` only
    (`compute_hidden` with these options)."""
    windows = [make_window(s) for s in sequences]
    compute_hidden(
        model,
        [sequences[i] for i in rows],
        [windows[i] for i in rows],
        progress=progress,
        cache_dir=cache_dir,
        cache_tag=cache_tag,
    )
    return windows


# ---------------------------------------------------------------------------
# The draft vocabulary


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


class VocabChoice(NamedTuple):
    """A draft vocabulary and the share of completion tokens it covers in each split."""

    ids: list[int]
    training_coverage: float
    held_out_coverage: float


def draft_vocabulary(
    sequences: Sequence[TrainingSequence],
    ids: Sequence[str],
    size: int,
    fraction: float,
    seed: int,
    always: Sequence[int] = (),
) -> VocabChoice:
    """`choose_draft_vocab` on the training split (held-out ids as `train` holds them out)."""
    held = split_validation(ids, fraction, seed)
    training = [s for s, h in zip(sequences, held) if not h]
    held_out = [s for s, h in zip(sequences, held) if h]
    vocab = choose_draft_vocab(training, size, always)
    return VocabChoice(vocab, vocab_coverage(training, vocab), vocab_coverage(held_out, vocab))


def draft_vocab_index(drafter: Drafter) -> tuple[np.ndarray | None, mx.array | None]:
    """Target id -> draft index (-1 outside the draft vocabulary) and the draft ids.

    Returns (vocab_index (V,), draft_ids (Vd,)), or (None, None) for a full-vocabulary head.
    """
    if drafter.config.draft_vocab_size is None:
        return None, None
    draft_ids = drafter.draft_vocab_ids
    vocab_index = np.full((drafter.config.vocab_size,), -1, dtype=np.int32)
    vocab_index[np.array(draft_ids)] = np.arange(drafter.config.output_size, dtype=np.int32)
    return vocab_index, draft_ids


# ---------------------------------------------------------------------------
# Micro-batches on the host


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
