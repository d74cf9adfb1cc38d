"""Settings of the two training entry points (frozen; `train`'s are stored in
every checkpoint, and a resumed run must use the same ones)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


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


def config_record(config: TrainConfig) -> dict[str, Any]:
    """The settings a checkpoint records and a resumed run must match."""
    record = asdict(config)
    # Bookkeeping that may change between a run and its resumption.
    for key in ("eval_every", "checkpoint_every"):
        record.pop(key)
    return record


@dataclass(frozen=True)
class FitConfig:
    """A short constant-rate training run (see `TrainConfig` for the full trainer)."""

    num_steps: int = 3
    iterations: int = 200
    learning_rate: float = 3e-3
    batch_size: int = 8
