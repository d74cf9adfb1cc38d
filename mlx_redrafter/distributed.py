"""Sharded targets: speculative decoding of a model split across the ranks of an
`mx.distributed` group (started with `mlx.launch`), tensor- or pipeline-parallel
through mlx-lm's own sharding (`Model.shard`, `model.model.pipeline`), or, for the
llama family, which mlx-lm 0.32 does not pipeline, through `LlamaStage` here.

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
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

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
        if hasattr(model.model, "pipeline"):
            model.model.pipeline(group)
        else:
            model.model = LlamaStage(model.model, group)
        return model
    args = getattr(model, "args", None)
    heads = int(getattr(args, "num_attention_heads", size))
    kv_heads = int(getattr(args, "num_key_value_heads", None) or heads)
    if heads % size or kv_heads % size:
        fits = [str(n) for n in range(2, kv_heads + 1) if not heads % n and not kv_heads % n]
        pipelines = hasattr(model.model, "pipeline") or _is_plain_llama(model.model)
        other = " --shard pipeline, or" if pipelines else ""
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
    inner = getattr(model, "model", None)
    if mode == "pipeline" and not (hasattr(inner, "pipeline") or _is_plain_llama(inner)):
        why = "mlx-lm's model has no pipeline()"
        if _is_llama(inner):
            why = "this package pipelines llama models with full attention only, no sliding window"
        raise ShardingError(
            f"model family {family!r} cannot be pipeline-sharded: {why}; try --shard "
            "tensor, or run it on one machine"
        )


def _is_llama(inner: nn.Module | None) -> bool:
    """mlx-lm's llama inner model (llama and mistral checkpoints)."""
    from mlx_lm.models.llama import LlamaModel

    return isinstance(inner, LlamaModel)


def _is_plain_llama(inner: nn.Module | None) -> bool:
    """A llama inner model with full attention in every layer (what `LlamaStage` runs;
    sliding-window layers would need a second mask)."""
    return _is_llama(inner) and getattr(inner, "swa_idx", None) is None


class LlamaStage(nn.Module):
    """One pipeline stage of mlx-lm's llama inner model: rank r of S runs the r-th run
    of whole layers, in order (rank 0 the first layers). A stage receives the hidden
    states (B, N, D) from rank r - 1, runs its layers, sends them to rank r + 1; the
    last stage's states are then gathered on every rank, so all ranks hold the same
    output. Like mlx-lm's pipelined models it has `pipeline_layers` (this stage's
    layers, one cache each), `pipeline_rank` and `pipeline_size`; `layers` holds this
    stage's layers only (the weights are loaded before the split), so the model's own
    `make_cache` makes one cache per layer this rank runs."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.group = group
        self.pipeline_rank, self.pipeline_size = group.rank(), group.size()
        base, extra = divmod(len(inner.layers), self.pipeline_size)
        sizes = [base + (r < extra) for r in range(self.pipeline_size)]
        start = sum(sizes[: self.pipeline_rank])
        self.embed_tokens, self.norm, self.args = inner.embed_tokens, inner.norm, inner.args
        self.layers = list(inner.layers[start : start + sizes[self.pipeline_rank]])

    @property
    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def __call__(
        self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        batch_size = h.shape[0]
        cache = cache if cache is not None else [None] * len(self.pipeline_layers)
        mask = create_attention_mask(h, cache[0])
        rank, size = self.pipeline_rank, self.pipeline_size
        if rank > 0:  # the previous stage's output replaces this rank's embeddings
            h = mx.distributed.recv_like(h, rank - 1, group=self.group)
        for layer, layer_cache in zip(self.pipeline_layers, cache):
            h = layer(h, mask, cache=layer_cache)
        if rank < size - 1:
            h = mx.distributed.send(h, rank + 1, group=self.group)
            if cache[-1] is not None:  # evaluating the cache alone (a prefill) sends too
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        gathered = mx.distributed.all_gather(h, group=self.group)  # (S * B, N, D)
        return self.norm(gathered[-batch_size:])  # the last stage's (B, N, D)


def sharding_group(model: nn.Module) -> mx.distributed.Group | None:
    """The group `model` is sharded over; None when it runs whole in this process."""
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:
        return getattr(inner, "group", None) or mx.distributed.init()
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


def leader_bytes(payload: bytes, group: mx.distributed.Group) -> bytes:
    """Rank 0's `payload` on every rank of `group` (the others pass b""): two
    collectives, its length, then its bytes."""
    leader = group.rank() == 0
    length = int(cast(int, _all_sum(mx.array(len(payload) if leader else 0), group).item()))
    if length == 0:
        return b""
    mine = mx.array(list(payload) if leader else [0] * length, dtype=mx.int32)
    return bytes(cast(list[int], _all_sum(mine, group).tolist()))


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
