"""Fused Metal kernels for beam expansion, tree packing and acceptance, and which to use.

A decoding session picks one `Kernels` value when its step functions are built
(`decode.step_functions(..., kernels=...)`) and keeps it: the choice is explicit,
frozen state, never a module global swapped at run time.

    requested  = the `kernels` argument, else $MLX_REDRAFTER_KERNELS, else "auto"
    "auto"     -> "metal" when mx.metal.is_available(), else "mlx"
    "metal"    -> the fused kernels (an error when Metal is unavailable)
    "mlx"      -> the pure-MLX functions `expand_beams`, `pack_tree` and `accept`

Both give identical integer outputs, and identical beam scores (docs/kernels.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import mlx.core as mx

from ..accept import Acceptance, accept
from ..beam_search import Expansion, expand_beams
from ..tree import PackedTree, pack_tree
from .fused import Launch, accept_fused, expand_beams_fused, metal_launch, pack_tree_fused
from .sources import ALL_KERNELS, KernelSpec

ENV_VAR = "MLX_REDRAFTER_KERNELS"
CHOICES = ("auto", "metal", "mlx")

ExpandFn = Callable[[mx.array, mx.array], Expansion]
AcceptFn = Callable[[mx.array, mx.array, mx.array, mx.array], Acceptance]
PackFn = Callable[[mx.array, int, bool], PackedTree]


@dataclass(frozen=True)
class Kernels:
    """The implementation of the expansion and acceptance steps a session uses.

    backend: "mlx", "metal", or another label (tests use an emulated launcher).
    expand: (scores (B, W), logits (B, W, Vd)) -> Expansion, as `expand_beams`.
    pack: (beams (B, W, L), num_packed, share_prefixes) -> PackedTree, as `tree.pack_tree`.
    accept: (beams, unpack, canonical, choices) -> Acceptance, as `accept.accept`.
    """

    backend: str
    expand: ExpandFn
    pack: PackFn
    accept: AcceptFn


def fused_kernels(launch: Launch, backend: str) -> Kernels:
    """The fused kernels run through `launch` (Metal, or an emulator)."""

    def expand(scores: mx.array, logits: mx.array) -> Expansion:
        return expand_beams_fused(scores, logits, launch=launch)

    def pack(beams: mx.array, num_packed: int, share_prefixes: bool = True) -> PackedTree:
        return pack_tree_fused(beams, num_packed, share_prefixes, launch=launch)

    def accept_step(
        beams: mx.array, unpack: mx.array, canonical: mx.array, choices: mx.array
    ) -> Acceptance:
        return accept_fused(beams, unpack, canonical, choices, launch=launch)

    return Kernels(backend, expand, pack, accept_step)


MLX_KERNELS = Kernels("mlx", expand_beams, pack_tree, accept)
METAL_KERNELS = fused_kernels(metal_launch, "metal")


def requested_backend(
    requested: str | None = None, environ: Mapping[str, str] | None = None
) -> str:
    """The requested choice: the argument, else $MLX_REDRAFTER_KERNELS, else "auto"."""
    environ = os.environ if environ is None else environ
    source = "argument `kernels`"
    if requested is None:
        requested, source = environ.get(ENV_VAR, "").strip() or "auto", f"${ENV_VAR}"
    choice = requested.strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"{source} must be one of {', '.join(CHOICES)}; got {requested!r}")
    return choice


def resolve_backend(
    requested: str | None = None,
    *,
    metal_available: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """ "metal" or "mlx" for a request (see the module docstring for the rules)."""
    choice = requested_backend(requested, environ)
    available = mx.metal.is_available() if metal_available is None else metal_available
    if choice == "auto":
        return "metal" if available else "mlx"
    if choice == "metal" and not available:
        raise ValueError(
            "Metal kernels were requested (kernels='metal' or "
            f"{ENV_VAR}=metal) but Metal is not available on this machine"
        )
    return choice


def select_kernels(
    requested: str | Kernels | None = None,
    *,
    metal_available: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> Kernels:
    """The `Kernels` for a request; a `Kernels` value is used as given."""
    if isinstance(requested, Kernels):
        return requested
    backend = resolve_backend(requested, metal_available=metal_available, environ=environ)
    return METAL_KERNELS if backend == "metal" else MLX_KERNELS


__all__ = [
    "ALL_KERNELS",
    "CHOICES",
    "ENV_VAR",
    "METAL_KERNELS",
    "MLX_KERNELS",
    "AcceptFn",
    "ExpandFn",
    "KernelSpec",
    "PackFn",
    "Kernels",
    "Launch",
    "accept_fused",
    "expand_beams_fused",
    "fused_kernels",
    "metal_launch",
    "pack_tree_fused",
    "requested_backend",
    "resolve_backend",
    "select_kernels",
]
