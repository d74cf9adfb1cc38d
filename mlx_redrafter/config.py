"""Configuration: one frozen dataclass per concern."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class TreeConfig:
    """The tree of a step: the drafter's beams and the lookup branches that the target
    verifies together (notation `WxL+GxLl`, see `parse`).

    beam_width: W, the drafter's candidate continuations (beams) per step.
    beam_length: L, tokens per beam; the first is the target's own token, so each
        beam holds L - 1 drafted tokens and a step emits at most L tokens.
    share_prefixes: pack the beams into a prefix tree so every distinct prefix is
        verified once (False verifies every beam token, as the reference MLX port does).
    tree_budget: the number of packed tokens N the target verifies per step
        (a static shape). None means every distinct prefix fits: 1 + (W+G)*(L-1) with
        sharing, (W+G)*L without. A smaller budget drops the lowest-ranked beams' tails.
    lookup_branches: G continuations copied from each row's own text (prompt and
        output so far): what followed the most recent earlier occurrences of its newest
        n-gram (`lookup.lookup_branches`). They join the drafter's W beams in the tree;
        0 drafts with the drafter alone. W may be 0 when G >= 1.
    lookup_ngram: the longest n-gram the lookup matches (it falls back to shorter).
    lookup_length: Ll, tokens per lookup branch, the root included (None: L). A match
        tends to hold for many tokens while the drafter's acceptance decays with
        depth, so short drafter beams and long lookup branches make a small tree.
    lookup_table: a lookup branch with no match in the row's text takes the
        continuation the drafter's n-gram table knows (`ngrams.py`), when the drafter
        ships one; False keeps the drafter's best beam there (written ':text').
    draft_nodes: a dynamic tree (written 'WxL@n'): of the distinct prefixes the W
        beams draft, the n likeliest to be accepted, the root included, are
        verified (`tree.keep_best_nodes`), as EAGLE-2 chooses its nodes, each
        prefix's chance taken from the acceptance measured for its tokens' depths
        and draft probabilities (`confidence.py`); the rest are cut. None verifies
        every drafted prefix (a full tree).
    """

    beam_width: int = 4
    beam_length: int = 4
    share_prefixes: bool = True
    tree_budget: int | None = None
    lookup_branches: int = 0
    lookup_ngram: int = 3
    lookup_length: int | None = None
    lookup_table: bool = True
    draft_nodes: int | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "lookup_branches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.beam_width + self.lookup_branches < 1:
            raise ValueError("a tree needs beam_width >= 1 or lookup_branches >= 1")
        if not isinstance(self.lookup_ngram, int) or self.lookup_ngram < 1:
            raise ValueError(f"lookup_ngram must be an integer >= 1, got {self.lookup_ngram!r}")
        if not isinstance(self.beam_length, int) or self.beam_length < 1:
            raise ValueError(f"beam_length must be an integer >= 1, got {self.beam_length!r}")
        if self.lookup_length is not None and (
            not isinstance(self.lookup_length, int) or self.lookup_length < 1
        ):
            raise ValueError(
                f"lookup_length must be an integer >= 1 (or None: beam_length), "
                f"got {self.lookup_length!r}"
            )
        if self.lookup_length is not None and not self.lookup_branches:
            raise ValueError(
                "lookup_length is the length of lookup branches: set lookup_branches >= 1"
            )
        if self.lookup_length == self.beam_length:
            object.__setattr__(self, "lookup_length", None)  # one spelling of one config
        if not self.lookup_branches:
            object.__setattr__(self, "lookup_table", True)
        self._check_draft_nodes()
        if self.tree_budget is not None and not (
            self.beam_length <= self.tree_budget <= self.max_tree_size
        ):
            raise ValueError(
                f"tree_budget must be between beam_length={self.beam_length} and "
                f"{self.max_tree_size} for W={self.beam_width}, L={self.beam_length}; "
                f"got {self.tree_budget}"
            )

    def _check_draft_nodes(self) -> None:
        if self.draft_nodes is None:
            return
        most = 1 + self.beam_width * (self.beam_length - 1)
        if most < 2:
            raise ValueError(
                "a dynamic tree (WxL@n) chooses among drafted tokens: it needs W >= 1 "
                f"and L >= 2, got W={self.beam_width}, L={self.beam_length}"
            )
        if not isinstance(self.draft_nodes, int) or not 2 <= self.draft_nodes <= most:
            raise ValueError(
                f"a dynamic tree keeps between 2 and {most} drafted prefixes (the root "
                f"included) of W={self.beam_width} beams of L={self.beam_length}; got "
                f"draft_nodes={self.draft_nodes!r}"
            )
        if not self.share_prefixes:
            raise ValueError("a dynamic tree chooses distinct prefixes: share_prefixes=True")
        if self.tree_budget is not None:
            raise ValueError("a dynamic tree's draft_nodes is its budget: leave tree_budget None")

    @property
    def num_branches(self) -> int:
        """W + G: the beams of a step's tree, the drafter's first."""
        return self.beam_width + self.lookup_branches

    @property
    def lookup_branch_length(self) -> int:
        """Ll: tokens per lookup branch, the root included."""
        return self.beam_length if self.lookup_length is None else self.lookup_length

    @property
    def depth(self) -> int:
        """The most tokens a step can emit: the longest beam's length."""
        if self.lookup_branches:
            return max(self.beam_length, self.lookup_branch_length)
        return self.beam_length

    @property
    def max_tree_size(self) -> int:
        """Most packed tokens a tree of these beams can need."""
        drafted = self.beam_width * (self.beam_length - 1)
        if self.draft_nodes is not None:
            drafted = self.draft_nodes - 1
        looked_up = self.lookup_branches * (self.lookup_branch_length - 1)
        if self.share_prefixes:
            return 1 + drafted + looked_up
        return drafted + looked_up + self.num_branches

    @property
    def num_packed(self) -> int:
        """N: packed tokens verified per step (static for this config)."""
        return self.tree_budget if self.tree_budget is not None else self.max_tree_size

    @property
    def lookup_only(self) -> TreeConfig:
        """The tree without its drafter beams: its lookup branches alone (0x1+GxLl),
        or plain decoding when it has none. What a session without a drafter decodes
        with: lookup branches need no drafter."""
        if not self.beam_width:
            return self
        if not self.lookup_branches:
            return PLAIN_DECODING
        length = self.lookup_branch_length
        return replace(
            self,
            beam_width=0,
            beam_length=1,
            tree_budget=None,
            lookup_length=length,
            draft_nodes=None,
        )

    @property
    def label(self) -> str:
        """'WxL'; 'WxL@n' for a dynamic tree of n drafted prefixes; 'WxL+G' with G
        lookup branches of L tokens; 'WxL+GxLl' with G lookup branches of Ll tokens;
        ':text' when they do not use the n-gram table (what `parse` reads)."""
        shape = f"{self.beam_width}x{self.beam_length}"
        if self.draft_nodes is not None:
            shape = f"{shape}@{self.draft_nodes}"
        if not self.lookup_branches:
            return shape
        source = "" if self.lookup_table else ":text"
        if self.lookup_branch_length == self.beam_length:
            return f"{shape}+{self.lookup_branches}{source}"
        return f"{shape}+{self.lookup_branches}x{self.lookup_branch_length}{source}"

    @classmethod
    def parse(cls, text: str) -> TreeConfig:
        """'4x4' -> W=4, L=4; '1x3+1' -> W=1, L=3 and one lookup branch of 3 tokens;
        '1x3+1x6' -> the same with a lookup branch of 6 tokens; '1x3+1x6:text' -> the
        lookup branch without the n-gram table; '4x4@7' -> a dynamic tree: the 7 most
        probable of the prefixes 4 beams of 4 draft; 'plain' -> 1x1."""
        item = text.strip().lower()
        if item == "plain":
            return PLAIN_DECODING
        item, colon, source = item.partition(":")
        if colon and (source != "text" or "+" not in item):
            raise ValueError(
                f"{text!r}: ':text' (lookup branches from the text alone) follows a shape "
                "with lookup branches, e.g. 1x3+1x7:text"
            )
        shape, plus, lookup = item.partition("+")
        shape, at, nodes = shape.partition("@")
        width, sep, length = shape.partition("x")
        count, lookup_sep, lookup_length = lookup.partition("x")
        numbers = (
            [width, length]
            + ([count] if plus else [])
            + ([lookup_length] if lookup_sep else [])
            + ([nodes] if at else [])
        )
        if not sep or not all(number.isdigit() for number in numbers):
            raise ValueError(
                f"{text!r} is not a tree: write WxL (drafter beams x beam length, "
                "e.g. 2x2), WxL+G (G lookup branches from the text, e.g. 1x3+1) or "
                "WxL+GxLl (lookup branches of Ll tokens, e.g. 1x3+1x6; ':text' after it "
                "leaves the n-gram table out); WxL@n keeps the n likeliest drafted "
                "prefixes (a dynamic tree, e.g. 4x4@7)"
            )
        return cls(
            int(width),
            int(length),
            lookup_branches=int(count or 0),
            lookup_length=int(lookup_length) if lookup_sep else None,
            lookup_table=not colon,
            draft_nodes=int(nodes) if at else None,
        )


PLAIN_DECODING = TreeConfig(beam_width=1, beam_length=1)

# The default tree of the API, the CLI, the chat app, the server and the benchmark:
# "auto", each step's tree chosen for this model, drafter and machine from the
# calibrated step cost and the running acceptance (`auto.py`).
DEFAULT_TREE = "auto"


def tree_label(tree: TreeConfig | str) -> str:
    """The notation of a tree ('auto' stays 'auto')."""
    return tree if isinstance(tree, str) else tree.label


def as_tree(tree: TreeConfig | str) -> TreeConfig:
    """A fixed tree from a TreeConfig or its notation ('1x2+1x7', 'plain')."""
    if isinstance(tree, str):
        return TreeConfig.parse(tree)
    if not isinstance(tree, TreeConfig):
        raise ValueError(
            f"tree must be 'auto', a TreeConfig or a string like '1x2+1x7', got {tree!r}"
        )
    return tree


@dataclass(frozen=True)
class SamplingConfig:
    """How the target picks tokens; the same rules as mlx-lm's sampler.

    temperature 0 is greedy. top_p (nucleus) and top_k filter the untempered
    distribution (top-p first, then top-k), then the temperature applies.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig()  # argmax decoding, as mlx-lm's default sampler


@dataclass(frozen=True)
class StopConfig:
    """When a row stops: max_tokens, any of eos_token_ids, or a stop string."""

    max_tokens: int = 256
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty strings")


@dataclass(frozen=True)
class CacheConfig:
    """Target K/V storage: plain, or quantized like mlx-lm's QuantizedKVCache."""

    kv_bits: int | None = None
    kv_group_size: int = 64
    prefill_step_size: int = 2048

    def __post_init__(self) -> None:
        if self.kv_bits is not None and self.kv_bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8 or None, got {self.kv_bits}")
        if self.prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {self.prefill_step_size}")
