"""Data parallelism: how the training rows are dealt into micro-batches and ranks.

A global batch of `batch_size` sequences is cut into S = world x micro_batches
micro-batches of `micro_batch_size`; the training sequences are dealt into S
fixed shards and micro-batch j always draws from shard j (shuffled per epoch
with the seed). Rank r owns shards r*M .. r*M+M-1, computes hidden states only
for them, and sums its micro-batch gradients; the ranks then sum over `all_sum`.
Each micro-batch loss is divided by the number of positions in the whole global
batch (known on every rank from the token ids alone), so the sum is the
global-batch gradient. A single process with S micro-batches adds the same terms
in the same order, so on CPU it ends with the same bits as S ranks of one
micro-batch each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map


def world(group: Any | None) -> tuple[int, int]:
    """(rank, number of ranks) of an `mx.distributed` group (None: one process)."""
    if group is None:
        return 0, 1
    return int(group.rank()), int(group.size())


def sum_over_ranks(values: Any, group: Any | None) -> Any:
    """`values` (a tree of arrays) summed over the ranks of `group`."""
    if group is None or group.size() == 1:
        return values
    return tree_map(lambda x: mx.distributed.all_sum(x, group=group), values)


def _shards(count: int, num_shards: int) -> list[list[int]]:
    return [list(range(j, count, num_shards)) for j in range(num_shards)]


def _epoch_order(shard: list[int], epoch: int, seed: int, shard_index: int) -> list[int]:
    rng = np.random.default_rng([seed, epoch, shard_index])
    return [shard[i] for i in rng.permutation(len(shard))]


@dataclass(frozen=True)
class Sharding:
    """The training rows dealt into S shards, the shards this rank owns, and the
    optimizer steps one pass over the data takes."""

    shards: list[list[int]]  # S lists of rows
    mine: list[int]  # this rank's shard (= micro-batch) indices
    micro_batch_size: int
    steps_per_epoch: int

    def rows(self) -> set[int]:
        """Every row this rank trains on."""
        return {i for j in self.mine for i in self.shards[j]}

    def global_batch(self, step: int, seed: int) -> list[list[int]]:
        """The rows of each of the S micro-batches of optimizer step `step`."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.micro_batch_size
        # Micro-batch j takes the next rows of shard j.
        return [
            _epoch_order(shard, epoch, seed, j)[start : start + self.micro_batch_size]
            for j, shard in enumerate(self.shards)
        ]


def deal(
    train_rows: Sequence[int], batch_size: int, micro_batch_size: int, group: Any | None
) -> Sharding:
    """Deal the training rows into batch_size / micro_batch_size shards over the ranks."""
    rank, size = world(group)
    if batch_size % (size * micro_batch_size):
        raise ValueError(
            f"batch_size {batch_size} must be a multiple of ranks ({size}) x "
            f"micro_batch_size ({micro_batch_size})"
        )
    num_shards = batch_size // micro_batch_size
    per_rank = num_shards // size
    shards = [[train_rows[i] for i in s] for s in _shards(len(train_rows), num_shards)]
    steps_per_epoch = min(len(s) for s in shards) // micro_batch_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"{len(train_rows)} training sequences are too few for batches of "
            f"{batch_size}: distill more data or lower --batch-size"
        )
    mine = list(range(rank * per_rank, (rank + 1) * per_rank))
    return Sharding(shards, mine, micro_batch_size, steps_per_epoch)
