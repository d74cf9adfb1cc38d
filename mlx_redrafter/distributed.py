"""Sharded targets: speculative decoding of a model split across the ranks of an
`mx.distributed` group (started with `mlx.launch`), tensor- or pipeline-parallel
through mlx-lm's own sharding (`Model.shard`, `model.model.pipeline`).

Every rank runs the same loop on the same tokens. A sharded forward ends in a
collective (an all-sum of the tensor shards' outputs, an all-gather of the last
pipeline stage's hidden states), so every rank holds the same logits and reaches
the same acceptance decision without further communication. What a rank measures
for itself, the time of a step, is replaced by rank 0's (`agreed_seconds`), so the
choices made from timings (the auto tree and its calibration) agree too. The
drafter is small: every rank holds all of it.

Collectives pair up by the order in which each rank runs them. Each collective
here waits for the work in flight on the generation stream (`streams.py`), then
runs at once, alone, on the CPU stream, as mlx-lm's own sharded loading does
(left lazy, it could be scheduled before a forward's collectives on one rank and
after them on another: a pipeline stage's graph is not its peer's). For the same
reason a sharded session never launches a forward ahead of its step's sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from .streams import generation_stream
from .target import model_family

SHARD_MODES = ("tensor", "pipeline")


class ShardingError(ValueError):
    """The model cannot be sharded as asked; the message names the family and why."""


def shard_model(model: nn.Module, mode: str, group: mx.distributed.Group) -> nn.Module:
    """Split `model` (loaded lazily, weights not yet evaluated) across `group` in place:
    "tensor" (each rank holds a slice of every layer) or "pipeline" (each rank holds a
    run of whole layers; mlx-lm's pipeline stages talk over the global group)."""
    _check_shardable(model, mode)
    size = group.size()
    if size == 1:
        raise ShardingError(
            "sharding needs several ranks, and this process is alone: start it with "
            "mlx.launch (e.g. mlx.launch -n 2 --backend ring ...), or leave out --shard"
        )
    if mode == "pipeline":
        if len(model.model.layers) < size:
            raise ShardingError(
                f"{len(model.model.layers)} layers cannot be split over {size} ranks"
            )
        model.model.pipeline(group)
        return model
    args = getattr(model, "args", None)
    heads = int(getattr(args, "num_attention_heads", size))
    kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
    if heads % size or kv_heads % size:
        fits = [str(n) for n in range(2, kv_heads + 1) if not heads % n and not kv_heads % n]
        other = " --shard pipeline, or" if hasattr(model.model, "pipeline") else ""
        raise ShardingError(
            f"model family {model_family(model)!r} has {heads} attention and {kv_heads} "
            f"key/value heads, which {size} ranks cannot split evenly; use{other} a number "
            f"of ranks that divides both ({', '.join(fits) or 'none does'})"
        )
    model.shard(group)
    return model


def _check_shardable(model: nn.Module, mode: str) -> None:
    """A ShardingError naming the family when mlx-lm cannot shard it in `mode`."""
    family = model_family(model)
    if mode not in SHARD_MODES:
        raise ShardingError(f"unknown shard mode {mode!r}: use one of {', '.join(SHARD_MODES)}")
    if mode == "tensor" and not hasattr(model, "shard"):
        raise ShardingError(
            f"model family {family!r} cannot be tensor-sharded: mlx-lm's model has no "
            "shard(); try --shard pipeline, or run it on one machine"
        )
    if mode == "pipeline" and not hasattr(getattr(model, "model", None), "pipeline"):
        raise ShardingError(
            f"model family {family!r} cannot be pipeline-sharded: mlx-lm's model has no "
            "pipeline(); try --shard tensor, or run it on one machine"
        )


def sharding_group(model: nn.Module) -> mx.distributed.Group | None:
    """The group `model` is sharded over; None when it runs whole in this process."""
    if getattr(getattr(model, "model", None), "pipeline_size", 1) > 1:
        return mx.distributed.init()
    for _, module in model.named_modules():
        group = getattr(module, "group", None)
        if isinstance(group, mx.distributed.Group) and group.size() > 1:
            return group
    return None


def sharding_label(model: nn.Module) -> str:
    """How the model is split, for calibration keys and reports ("" when whole)."""
    group = sharding_group(model)
    if group is None:
        return ""
    mode = "pipeline" if getattr(model.model, "pipeline_size", 1) > 1 else "tensor"
    return f"{mode}-sharded over {group.size()} ranks (rank {group.rank()})"


def _all_sum(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """The sum of `x` over the ranks, evaluated now, after the generation stream's
    work in flight (see the module's note on ordering)."""
    mx.synchronize(generation_stream())
    total = mx.distributed.all_sum(x, group=group, stream=mx.cpu)
    mx.eval(total)
    return total


def agreed_values(values: Sequence[float], group: mx.distributed.Group | None) -> list[float]:
    """Rank 0's `values` (measured times) on every rank of `group`: a collective, which
    every rank calls at the same point with as many values; the values themselves
    without a group."""
    if group is None or group.size() == 1 or not values:
        return list(values)
    mine = mx.array(list(values) if group.rank() == 0 else [0.0] * len(values), dtype=mx.float32)
    agreed = _all_sum(mine, group)
    return [float(x) for x in cast(list[float], agreed.tolist())]


def agreed_seconds(seconds: float, group: mx.distributed.Group | None) -> float:
    """Rank 0's `seconds` on every rank of `group` (`agreed_values`)."""
    return agreed_values([seconds], group)[0]


def agreed_key(key: mx.array | None, group: mx.distributed.Group | None) -> mx.array | None:
    """Rank 0's PRNG key (2,) on every rank of `group` (a collective), so that a
    request seeded at random samples the same tokens on every rank."""
    if key is None or group is None or group.size() == 1:
        return key
    return _all_sum(key if group.rank() == 0 else mx.zeros_like(key), group)


def all_ranks(flag: bool, group: mx.distributed.Group | None) -> bool:
    """Whether `flag` holds on every rank of `group` (a collective)."""
    if group is None or group.size() == 1:
        return flag
    count = _all_sum(mx.array(int(flag)), group)
    return int(cast(int, count.item())) == group.size()


def barrier(group: mx.distributed.Group | None) -> None:
    """Wait until every rank of `group` gets here."""
    if group is not None and group.size() > 1:
        _all_sum(mx.array(1.0), group)


def is_main_process() -> bool:
    """True on rank 0 of the global group (and when not distributed): the one rank
    that prints and streams text."""
    return not mx.distributed.is_available() or mx.distributed.init().rank() == 0
