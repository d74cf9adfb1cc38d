"""Running an unmodified mlx-lm model on a packed tree.

Shapes: B batch, N packed tokens, T committed context (frontier), D hidden,
V vocabulary, H kv heads, Dh head dim.

mlx-lm attention layers do three things with their cache: build the mask with
`cache.make_mask(...)`, rotate queries and keys with `self.rope(x,
offset=cache.offset)`, and append with `cache.update_and_fetch(keys, values)`.
`TargetCache` answers all three for a tree: the mask is the tree's ancestor
mask over each row's committed context, `offset` is the (B, N) per-token
positions (committed length + depth), and new keys/values go right after each
row's committed ones. `TreeRope` lets a model's rotary module take those (B, N) positions.
After acceptance, `TargetCache.commit` moves the accepted path's entries next
to each row's committed context; nothing is recomputed.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from .config import CacheConfig
from .tree import PackedTree, attention_mask, sliding_window_mask, tree_positions

# Families whose tree verification is proven token-identical to mlx-lm by the tests.
TESTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
_SUPPORTED_CACHES = (KVCache, RotatingKVCache, QuantizedKVCache)
# Families whose attention scores are (B, H_kv, H / H_kv, N, T) when H > H_kv: a
# mask then needs a third singleton axis to broadcast over a batch of several rows.
GROUPED_SCORES = ("gemma2",)


class UnsupportedModelError(ValueError):
    """The target model cannot be verified as a tree."""


class TreeRope(nn.Module):
    """Wraps a model's rotary module so `offset` may also be per-token positions (B, N).

    Integer and (B,) offsets go to the wrapped module unchanged, so mlx-lm's own
    generation is unaffected. For (B, N) positions the tokens are folded into the
    batch axis and rotated with one position each.
    """

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if not isinstance(offset, mx.array) or offset.ndim < 2:
            return self.rope(x, offset=offset)
        batch_size, num_heads, num_tokens, head_dim = x.shape
        if num_tokens == 1:  # one token per row (plain decoding): a (B,) offset as is
            return self.rope(x, offset=offset[:, 0])
        folded = x.transpose(0, 2, 1, 3).reshape(batch_size * num_tokens, num_heads, 1, head_dim)
        rotated = self.rope(folded, offset=offset.reshape(-1))  # (B*N, H, 1, Dh)
        rotated = rotated.reshape(batch_size, num_tokens, num_heads, head_dim)  # (B, N, H, Dh)
        return rotated.transpose(0, 2, 1, 3)  # (B, H, N, Dh)


def model_family(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return str(getattr(model, "model_type", None) or getattr(args, "model_type", "unknown"))


def local_layers(model: nn.Module) -> list[nn.Module]:
    """The layers this process runs: all of them, or its stage's when mlx-lm's
    pipeline sharding split the model (`distributed.py`)."""
    stage = getattr(model.model, "pipeline_layers", None)
    return list(model.layers if stage is None else stage)


def _rope_parents(model: nn.Module) -> list[nn.Module]:
    return [
        module
        for _, module in model.named_modules()
        if "rope" in module and not isinstance(module, TreeRope)
    ]


def output_logits(model: nn.Module, hidden: mx.array) -> mx.array:
    """The model's own output head on final hidden states, with its logit soft-capping
    when it has one (Gemma 2). (..., D) -> (..., V)"""
    if "lm_head" in model:
        logits = model.lm_head(hidden)
    else:
        logits = model.model.embed_tokens.as_linear(hidden)
    cap = getattr(model, "final_logit_softcapping", None)
    if cap:
        logits = mx.tanh(logits / cap) * cap
    return logits


def output_size(model: nn.Module) -> int:
    """V: the number of logits `output_logits` gives per position (rows of the output
    head, or of the tied embedding; quantized weights pack columns, never rows)."""
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens
    return int(head.weight.shape[0])


def prepare_target(model: nn.Module) -> nn.Module:
    """Check that `model` can be verified as a tree and adapt its rotary modules.

    Idempotent; raises UnsupportedModelError naming the family when it cannot work
    (recurrent/SSM or chunked caches, no rotary positions, an output head that is
    not a function of the final hidden state).
    """
    family = model_family(model)
    parents = _rope_parents(model)
    if parents and all(isinstance(parent.rope, TreeRope) for parent in parents):
        return model
    inner = getattr(model, "model", None)
    if inner is None or "embed_tokens" not in inner or not hasattr(model, "layers"):
        raise UnsupportedModelError(
            f"model family {family!r} is not a decoder-only mlx-lm language model with "
            f"model.embed_tokens and layers; tested families: {', '.join(TESTED_FAMILIES)}"
        )
    if hasattr(model, "make_cache"):
        caches = model.make_cache()
        unsupported = sorted({type(c).__name__ for c in caches if type(c) not in _SUPPORTED_CACHES})
        if unsupported:
            raise UnsupportedModelError(
                f"model family {family!r} uses {', '.join(unsupported)} layers (recurrent, "
                "state-space or chunked attention), which tree verification cannot run; "
                f"tested families: {', '.join(TESTED_FAMILIES)}"
            )
    if not parents:
        raise UnsupportedModelError(
            f"model family {family!r} has no rotary position module (`rope`), so packed "
            f"tokens cannot be given tree positions; tested families: {', '.join(TESTED_FAMILIES)}"
        )
    probe = mx.array([[0, 1]])
    expected = model(probe)
    mx.eval(expected)  # one forward at a time (a sharded model's collectives pair up in order)
    recovered = output_logits(model, model.model(probe))
    if expected.shape != recovered.shape or not mx.allclose(expected, recovered).item():
        raise UnsupportedModelError(
            f"model family {family!r} transforms its output beyond the final norm and "
            "output head, so verification cannot read logits from hidden states"
        )
    for parent in parents:
        parent.rope = TreeRope(parent.rope)
    return model


def context_length(model: nn.Module) -> int | None:
    """The model's maximum number of positions, when its config states one."""
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None)
    return int(value) if value else None


class TreeLayerCache:
    """One attention layer's keys and values, shared bookkeeping in `TargetCache`.

    The layer refers to its `TargetCache` weakly: a strong reference both ways would
    make every finished cache a reference cycle, whose K/V only Python's cyclic
    garbage collector frees, at a time that has nothing to do with memory."""

    step = 256

    def __init__(self, shared: TargetCache):
        self.shared = shared
        self.keys: Any = None
        self.values: Any = None

    @property
    def shared(self) -> TargetCache:
        cache = self._shared()
        if cache is None:
            raise RuntimeError("a layer cache outlived its TargetCache; keep the TargetCache")
        return cache

    @shared.setter
    def shared(self, cache: TargetCache) -> None:
        self._shared = weakref.ref(cache)

    @property
    def offset(self) -> mx.array:
        return self.shared.positions  # (B, N)

    def make_mask(
        self, num_tokens: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        mask = self.shared.mask(window_size, array=return_array)
        if self.shared.grouped_scores and isinstance(mask, mx.array):
            return mask[:, :, None]  # (B, 1, 1, N, T + N)
        return mask

    def _store(self, x: mx.array) -> Any:
        return x

    def _allocate(self, like: Any, capacity: int) -> Any:
        def grow(x: mx.array) -> mx.array:
            shape = (*x.shape[:2], capacity, x.shape[3])
            return mx.zeros(shape, dtype=x.dtype)

        return tree_map(grow, like)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        start = self.shared.frontier
        stop = start + keys.shape[2]
        keys, values = self._store(keys), self._store(values)
        if self.keys is None or _length(self.keys) < stop:
            capacity = (stop + self.step - 1) // self.step * self.step
            grown_keys, grown_values = (
                self._allocate(keys, capacity),
                self._allocate(values, capacity),
            )
            if self.keys is not None:
                grown_keys = tree_map(_copy_prefix(start), grown_keys, self.keys)
                grown_values = tree_map(_copy_prefix(start), grown_values, self.values)
            self.keys, self.values = grown_keys, grown_values
        write = self.shared.writer()
        self.keys = tree_map(write, self.keys, keys)
        self.values = tree_map(write, self.values, values)
        return tree_map(lambda x: x[..., :stop, :], (self.keys, self.values))

    def move(self, source: mx.array, destination: mx.array) -> None:
        """Copy slots source -> destination per row (both (B, K)), gathering first."""

        def relocate(x: mx.array) -> mx.array:
            shape = (x.shape[0], x.shape[1], source.shape[1], x.shape[3])
            src = mx.broadcast_to(source[:, None, :, None], shape)
            dst = mx.broadcast_to(destination[:, None, :, None], shape)
            return mx.put_along_axis(x, dst, mx.take_along_axis(x, src, axis=2), axis=2)

        self.keys = tree_map(relocate, self.keys)
        self.values = tree_map(relocate, self.values)

    def select_rows(self, rows: mx.array) -> None:
        self.keys = tree_map(lambda x: x[rows], self.keys)
        self.values = tree_map(lambda x: x[rows], self.values)

    def extend(self, other: TreeLayerCache, rows: int, other_rows: int) -> None:
        """Append other's rows along the batch axis (capacities padded to the larger).

        rows, other_rows: the batch sizes; a side that stored nothing yet (its prompts
        were one token long) joins as zero rows, which its lengths mask.
        """
        if other.keys is None and self.keys is None:
            return
        if self.keys is None:
            self.keys = _zero_rows(other.keys, rows)
            self.values = _zero_rows(other.values, rows)
        if other.keys is None:
            other_keys, other_values = (
                _zero_rows(self.keys, other_rows),
                _zero_rows(self.values, other_rows),
            )
        else:
            other_keys, other_values = other.keys, other.values
        capacity = max(_length(self.keys), _length(other_keys))

        def pad(x: mx.array) -> mx.array:
            missing = capacity - x.shape[2]
            if missing == 0:
                return x
            zeros = mx.zeros((x.shape[0], x.shape[1], missing, x.shape[3]), dtype=x.dtype)
            return mx.concatenate([x, zeros], axis=2)

        def join(mine: mx.array, theirs: mx.array) -> mx.array:
            return mx.concatenate([pad(mine), pad(theirs)], axis=0)

        self.keys = tree_map(join, self.keys, other_keys)
        self.values = tree_map(join, self.values, other_values)

    def state_arrays(self) -> list[mx.array]:
        return [x for x in tree_map(lambda x: x, [self.keys, self.values]) if x is not None]


class QuantizedTreeLayerCache(TreeLayerCache):
    """Keys and values stored quantized, as mlx-lm's QuantizedKVCache stores them.

    mlx-lm's attention sees `bits` and `group_size` and runs its quantized kernel.
    """

    def __init__(self, shared: TargetCache, bits: int, group_size: int):
        super().__init__(shared)
        self.bits = bits
        self.group_size = group_size

    def _store(self, x: mx.array) -> Any:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))


def _zero_rows(like: Any, rows: int) -> Any:
    """Zeros shaped like stored keys or values, with `rows` batch rows."""
    return tree_map(lambda x: mx.zeros((rows, *x.shape[1:]), dtype=x.dtype), like)


def _length(stored: Any) -> int:
    # Quantized: a tuple, or a list after mlx-lm's pipeline wraps it in mx.depends.
    first = stored[0] if isinstance(stored, (tuple, list)) else stored
    return int(first.shape[2])


def _copy_prefix(length: int) -> Callable[[mx.array, mx.array], mx.array]:
    def copy(new: mx.array, old: mx.array) -> mx.array:
        new[..., :length, :] = old[..., :length, :]
        return new

    return copy


def _write(start: int, stop: int) -> Callable[[mx.array, mx.array], mx.array]:
    """Write (B, H, N, ...) entries at slots [start, stop) of every row."""

    def write(buffer: mx.array, update: mx.array) -> mx.array:
        buffer[..., start:stop, :] = update
        return buffer

    return write


def _scatter(slots: mx.array) -> Callable[[mx.array, mx.array], mx.array]:
    """Write (B, H, N, ...) entries at each row's own slots (B, N)."""

    def write(buffer: mx.array, update: mx.array) -> mx.array:
        index = mx.broadcast_to(slots[:, None, :, None], update.shape)  # (B, H, N, ...)
        return mx.put_along_axis(buffer, index, update, axis=2)

    return write


class TargetCache:
    """The target's K/V cache for a batch of rows decoding a tree per step.

    Row b's committed tokens occupy slots [0, lengths[b]); a forward writes row b's
    N packed tokens right after them, at [lengths[b], lengths[b] + N), so that a
    path accepted along the first beam (as plain decoding's always is) is already
    in place. The buffers hold frontier + N slots, where frontier = max committed
    length (a host integer, known after each step's one host sync); slots past a
    row's packed tokens are stale and hidden by the mask.
    """

    def __init__(self, model: nn.Module, batch_size: int, config: CacheConfig | None = None):
        config = config or CacheConfig()
        self.layers: list[TreeLayerCache] = [
            QuantizedTreeLayerCache(self, config.kv_bits, config.kv_group_size)
            if config.kv_bits is not None
            else TreeLayerCache(self)
            for _ in local_layers(model)
        ]
        heads = getattr(getattr(model, "args", None), "num_attention_heads", 0)
        kv_heads = getattr(getattr(model, "args", None), "num_key_value_heads", heads)
        self.grouped_scores = model_family(model) in GROUPED_SCORES and heads != kv_heads
        self.lengths = mx.zeros((batch_size,), dtype=mx.int32)  # (B,) on device
        self.host_lengths: list[int] = [0] * batch_size  # the same, on the host
        self.positions = mx.zeros((batch_size, 1), dtype=mx.int32)
        self._tree: PackedTree | None = None
        self._masks: dict[int | str | None, mx.array | str | None] = {}
        self._write = _write(0, 0)

    @property
    def frontier(self) -> int:
        return max(self.host_lengths, default=0)

    @property
    def batch_size(self) -> int:
        return len(self.host_lengths)

    def begin(self, tree: PackedTree, causal: bool = False) -> None:
        """Set up the positions and masks of the next forward over `tree`.

        causal: the tree is a single chain (prefill), which allows mlx-lm's fast
        causal mask when no row has stale slots.
        """
        self._tree = tree
        self.positions = tree_positions(tree, self.lengths)  # (B, N)
        self._masks = {}
        num_tokens = tree.tokens.shape[1]
        aligned = all(length == self.frontier for length in self.host_lengths)
        if aligned:  # every row writes at the frontier: one slice for the batch
            self._write = _write(self.frontier, self.frontier + num_tokens)
        else:
            steps = mx.arange(num_tokens, dtype=mx.int32)[None, :]  # (1, N)
            self._write = _scatter(self.lengths[:, None] + steps)  # (B, N) slots
        if aligned and num_tokens == 1:
            self._masks[None] = None
        elif aligned and causal:
            self._masks[None] = "causal"

    def writer(self) -> Callable[[mx.array, mx.array], mx.array]:
        """How this forward writes a layer's new entries into its buffers."""
        assert self._tree is not None, "TargetCache.begin must be called before a forward"
        return self._write

    def mask(self, window_size: int | None = None, array: bool = False) -> mx.array | str | None:
        """The forward's attention mask (B, 1, N, T + N), or "causal" / None where
        mlx-lm's own masks do (array: a model that needs an array gets one for
        "causal" too)."""
        assert self._tree is not None, "TargetCache.begin must be called before a forward"
        num_tokens = self._tree.tokens.shape[1]
        if window_size is not None and self.frontier + num_tokens <= window_size:
            window_size = None
        key: int | str | None = window_size
        if array and isinstance(self._masks.get(key), str):
            key = "array"  # only the full causal mask is ever a string
        if key not in self._masks:
            full = attention_mask(self._tree, self.lengths, self.frontier)
            if window_size is not None:
                full = sliding_window_mask(
                    full, self.positions, self.lengths, self.frontier, window_size
                )
            self._masks[key] = full
        return self._masks[key]

    def commit(self, path: list[list[int]], num_kept: list[int]) -> None:
        """Keep the packed tokens on each row's path for its first num_kept[b] entries.

        path: (B, K) packed indices and num_kept: (B,), as host lists read back by the
        step's one sync. Entry j of row b moves from slot lengths[b] + path[b][j] to
        lengths[b] + j. Entries already in place (a path along the first beam, as
        plain decoding's always is) are not copied; when any entry must move, the
        whole (B, K) path is moved in one gather/scatter per layer, evaluated with the
        next forward. Entries past num_kept land beyond the new length, where they
        are stale.
        """
        misplaced = any(
            index != j for row, kept in zip(path, num_kept) for j, index in enumerate(row[:kept])
        )
        if misplaced:
            # Entries past num_kept may name nodes that were cut or absent (>= N).
            last = self._tree.tokens.shape[1] - 1 if self._tree is not None else 0
            packed = mx.minimum(mx.array(path, dtype=mx.int32), last)  # (B, K)
            source = self.lengths[:, None] + packed  # (B, K)
            steps = mx.arange(source.shape[1], dtype=mx.int32)
            destination = self.lengths[:, None] + steps  # (B, K)
            for layer in self.layers:
                layer.move(source, destination)
        self.host_lengths = [length + kept for length, kept in zip(self.host_lengths, num_kept)]
        self.lengths = mx.array(self.host_lengths, dtype=mx.int32)
        self._tree = None
        self._masks = {}

    def select_rows(self, rows: list[int]) -> None:
        """Keep only the given batch rows (rows that finished are dropped)."""
        index = mx.array(rows, dtype=mx.int32)
        for layer in self.layers:
            layer.select_rows(index)
        self.lengths = self.lengths[index]
        self.host_lengths = [self.host_lengths[r] for r in rows]

    def copy_row(self, row: int, length: int | None = None) -> TargetCache:
        """A one-row cache holding row `row`'s first `length` committed slots (default:
        all of them); this cache is unchanged (its arrays are indexed, not written)."""
        out = copy.copy(self)
        out.layers = [copy.copy(layer) for layer in self.layers]
        index = mx.array([row], dtype=mx.int32)
        for layer in out.layers:
            layer.shared = out
            if layer.keys is not None:
                layer.select_rows(index)
        out.host_lengths = [self.host_lengths[row]]
        kept = out.host_lengths[0] if length is None else min(length, out.host_lengths[0])
        out.host_lengths = [kept]
        out.lengths = mx.array(out.host_lengths, dtype=mx.int32)
        out._tree, out._masks = None, {}
        return out

    def extend(self, other: TargetCache) -> None:
        """Append the rows of another cache of the same model (requests joining)."""
        if len(other.layers) != len(self.layers):
            raise ValueError("cannot merge caches of different models")
        if other.batch_size == 0:
            return
        if self.batch_size == 0:
            for mine, theirs in zip(self.layers, other.layers):
                mine.keys, mine.values = theirs.keys, theirs.values
        else:
            for mine, theirs in zip(self.layers, other.layers):
                mine.extend(theirs, self.batch_size, other.batch_size)
        self.lengths = mx.concatenate([self.lengths, other.lengths])
        self.host_lengths = self.host_lengths + other.host_lengths

    def arrays(self) -> list[mx.array]:
        return [self.lengths, *(a for layer in self.layers for a in layer.state_arrays())]


def target_hidden(
    model: nn.Module, cache: TargetCache, tree: PackedTree, causal: bool = False
) -> mx.array:
    """Run the target's body on the packed tokens of `tree`: hidden (B, N, D) after its
    final norm. The keys and values land after each row's committed ones, uncommitted."""
    cache.begin(tree, causal=causal)
    return model.model(tree.tokens, cache=cache.layers)


def target_forward(
    model: nn.Module, cache: TargetCache, tree: PackedTree
) -> tuple[mx.array, mx.array]:
    """Hidden states (B, N, D) and logits (B, N, V) at every packed token."""
    hidden = target_hidden(model, cache, tree)
    return hidden, output_logits(model, hidden)
