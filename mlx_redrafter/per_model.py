"""Values kept per model for a process's sessions, for as long as the model lives.

A session per request (as `generate` makes) finds what an earlier session of the
same model built or measured: the compiled step functions (`decode`), the step
costs the auto tree measured (`auto`). Keys start with the model, its embedding
module (one swapped in place, as `nn.quantize` does, is a new model) and the
drafter; each store adds its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

import mlx.nn as nn

Value = TypeVar("Value")


class PerModel(Generic[Value]):
    """Values per (model, embedding, drafter, *extra). A model keeps those of
    decoding without a drafter and of its latest drafter (held, so that its id
    names no other drafter); all go when the model is freed."""

    def __init__(self) -> None:
        self._items: dict[tuple[Hashable, ...], tuple[Any, Value]] = {}

    def __iter__(self) -> Iterator[tuple[Hashable, ...]]:
        return iter(list(self._items))

    def get(
        self,
        model: nn.Module,
        drafter: Any,
        extra: tuple[Hashable, ...],
        make: Callable[[], Value],
    ) -> Value:
        """The value of this key, made by `make` on first use."""
        embed = id(model.model.embed_tokens)
        key = (id(model), embed, id(drafter), *extra)
        if key not in self._items:
            if not any(k[0] == key[0] for k in self._items):
                weakref.finalize(model, self._forget, id(model))
            for other, (held, _) in list(self._items.items()):
                another_drafter = drafter is not None and held is not None and held is not drafter
                if other[0] == key[0] and (other[1] != embed or another_drafter):
                    del self._items[other]
            self._items[key] = (drafter, make())
        return self._items[key][1]

    def _forget(self, model_id: int) -> None:
        for key in [k for k in self._items if k[0] == model_id]:
            del self._items[key]
