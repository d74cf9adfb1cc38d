"""The Metal kernels' own text, compiled as C++ and run on the CPU, against the fallback.

tests/kernel_harness wraps each kernel body from mlx_redrafter/kernels/sources.py in
the signature `mx.fast.metal_kernel` would generate, builds it with g++ (with
AddressSanitizer/UBSan when available) and runs every thread of the grid twice, in
opposite orders over differently poisoned outputs. The project's own wrappers
(`expand_beams_fused`, `accept_fused`) drive it, so grid sizes, chunking and output
shapes are tested too. Deliberately broken variants prove the comparison bites.
"""

from __future__ import annotations

import dataclasses
import zlib

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_tokens
from kernel_harness.cases import (
    CHUNKS,
    EXPAND_KINDS,
    EXPAND_SHAPES,
    accept_cases,
    expand_inputs,
    pack_cases,
    same,
)
from kernel_harness.emulate import Emulator, KernelRunError, NotEmulated, compiler, generate
from tiny_models import tiny_model

from mlx_redrafter.accept import accept
from mlx_redrafter.beam_search import expand_beams
from mlx_redrafter.config import SamplingConfig, TreeConfig
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.kernels import (
    accept_fused,
    expand_beams_fused,
    fused_kernels,
    pack_tree_fused,
)
from mlx_redrafter.kernels.sources import (
    ACCEPT,
    ALL_KERNELS,
    BEAM_CANDIDATES,
    BEAM_SELECT,
    PACK_TREE,
)
from mlx_redrafter.target import prepare_target
from mlx_redrafter.tree import pack_tree

pytestmark = pytest.mark.skipif(
    compiler() is None, reason="g++ not found: the Metal kernels cannot be emulated here"
)


@pytest.fixture(scope="module")
def emulator():
    return Emulator()


def expand_mismatches(emulator: Emulator, kinds=EXPAND_KINDS, chunks=CHUNKS) -> list[str]:
    failures = []
    for shape in EXPAND_SHAPES:
        for kind in kinds:
            rng = np.random.default_rng(zlib.crc32(repr((shape, kind)).encode()))
            scores, logits = expand_inputs(kind, shape, rng)
            want = expand_beams(scores, logits)
            for chunk in chunks:
                got = expand_beams_fused(scores, logits, launch=emulator.launch, chunk=chunk)
                if not same(got, want):
                    failures.append(f"{kind} B,W,Vd={shape} chunk={chunk}")
    return failures


def test_expansion_kernels_match_the_fallback(emulator):
    assert expand_mismatches(emulator) == []


def test_expansion_matches_on_half_precision_logits(emulator):
    rng = np.random.default_rng(3)
    scores = mx.array(rng.normal(size=(2, 3)), mx.float32)
    logits = mx.array(rng.integers(0, 5, size=(2, 3, 40)), mx.bfloat16)
    got = expand_beams_fused(scores, logits, launch=emulator.launch, chunk=6)
    assert same(got, expand_beams(scores, logits))


def accept_mismatches(emulator: Emulator) -> tuple[list[str], int]:
    failures, full = [], 0
    for shape, inputs in accept_cases():
        want = accept(*inputs)
        full += int(np.sum(np.array(want.num_accepted) == shape[2] - 1)) if shape[2] > 1 else 0
        if not same(accept_fused(*inputs, launch=emulator.launch), want):
            failures.append(f"B,W,L={shape}")
    return failures, full


def test_acceptance_kernel_matches_the_fallback(emulator):
    failures, full_length = accept_mismatches(emulator)
    assert failures == []
    assert full_length > 10  # the cases do reach the deepest acceptance


def pack_mismatches(emulator: Emulator) -> list[str]:
    failures = []
    for beams, budget, share_prefixes in pack_cases():
        want = pack_tree(beams, budget, share_prefixes)
        got = pack_tree_fused(beams, budget, share_prefixes, launch=emulator.launch)
        if not same(got, want):
            failures.append(f"B,W,L={beams.shape} N={budget} share={share_prefixes}")
    return failures


def test_pack_tree_kernel_matches_the_fallback(emulator):
    assert pack_mismatches(emulator) == []


# ---------------------------------------------------------------- the harness bites


def broken(spec, field: str, old: str, new: str):
    text = getattr(spec, field)
    assert old in text, f"{spec.name}: {old!r} not found; update the broken variant"
    return dataclasses.replace(spec, **{field: text.replace(old, new)})


@pytest.mark.parametrize(
    "stages", [(BEAM_CANDIDATES,), (BEAM_SELECT,)], ids=["in the chunks", "in the merge"]
)
def test_wrong_tie_rule_is_caught(emulator, stages):
    # Ties broken towards the higher flat index instead of the lower one, in one stage.
    replace = {
        spec.name: broken(spec, "header", "flat < other_flat", "flat > other_flat")
        for spec in stages
    }
    failures = expand_mismatches(emulator.with_replacements(replace), kinds=["ties"], chunks=[3])
    assert failures, "the harness accepted a kernel with the wrong tie rule"
    # Without ties the broken rule is invisible, and the harness says so too.
    assert (
        expand_mismatches(emulator.with_replacements(replace), kinds=["normal"], chunks=[3]) == []
    )


def test_off_by_one_walk_is_caught(emulator):
    # The walk stops one node early: the last drafted token is never accepted.
    replace = {ACCEPT.name: broken(ACCEPT, "source", "run + 1 < length", "run + 2 < length")}
    failures, _ = accept_mismatches(emulator.with_replacements(replace))
    assert failures, "the harness accepted an off-by-one walk"


def test_token_not_attending_to_itself_is_caught(emulator):
    replace = {PACK_TREE.name: broken(PACK_TREE, "source", "e <= k", "e < k")}
    assert pack_mismatches(emulator.with_replacements(replace))


def test_unwritten_output_is_caught(emulator):
    replace = {
        BEAM_SELECT.name: broken(BEAM_SELECT, "source", "tokens[row + j] = flat % vocab;", "")
    }
    scores, logits = expand_inputs("normal", (2, 3, 11), np.random.default_rng(0))
    with pytest.raises(KernelRunError, match="differs between runs"):
        expand_beams_fused(scores, logits, launch=emulator.with_replacements(replace).launch)


def test_out_of_bounds_read_is_caught(emulator):
    if not emulator.sanitized:
        pytest.skip("g++ here has no AddressSanitizer: out-of-bounds reads are not detected")
    # The last chunk reads past its beam's vocabulary (and the last beam past the buffer).
    replace = {
        BEAM_CANDIDATES.name: broken(
            BEAM_CANDIDATES, "source", "metal::min(start + chunk, vocab)", "start + chunk"
        )
    }
    scores, logits = expand_inputs("normal", (2, 3, 11), np.random.default_rng(0))
    with pytest.raises(KernelRunError, match="heap-buffer-overflow"):
        expand_beams_fused(
            scores, logits, launch=emulator.with_replacements(replace).launch, chunk=4
        )


# ---------------------------------------------------------------- the harness itself


@pytest.mark.parametrize("spec", ALL_KERNELS, ids=lambda s: s.name)
def test_harness_compiles_the_kernel_text_verbatim(spec):
    inputs, outputs = {
        ACCEPT.name: ([mx.int32] * 4, [mx.int32] * 5),
        BEAM_CANDIDATES.name: ([mx.float32] * 3 + [mx.int32], [mx.float32, mx.int32]),
        BEAM_SELECT.name: ([mx.float32, mx.int32, mx.int32], [mx.float32, mx.int32, mx.int32]),
        PACK_TREE.name: ([mx.int32] * 2, [mx.int32] * 4 + [mx.bool_, mx.int32]),
    }[spec.name]
    text = generate(spec, inputs, outputs)
    assert spec.source in text and spec.header in text
    # MLX's rule: shape arrays only for `<input>_shape` named in the body.
    for name in spec.input_names:
        assert (f"const constant int* {name}_shape" in text) == (f"{name}_shape" in spec.source)
    assert "uint3 thread_position_in_grid" in text


def test_threadgroup_attributes_are_refused():
    spec = dataclasses.replace(
        ACCEPT, source=ACCEPT.source + "\n(void)thread_index_in_threadgroup;"
    )
    with pytest.raises(NotEmulated, match="threadgroup"):
        generate(spec, [mx.int32] * 4, [mx.int32] * 5)


# ---------------------------------------------------------------- in the decoding loop


def decode(model, drafter, beam, sampling, kernels):
    """Tokens per prompt and the number of steps, decoding with the given kernels."""
    key = None if sampling.greedy else mx.random.key(7)
    outputs, events = decode_tokens(
        model,
        drafter,
        [[1, 2, 3], [4, 5]],
        beam,
        12,
        sampling,
        key,
        compiled=False,
        kernels=kernels,
    )
    return outputs, len(events)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "beam", [TreeConfig(3, 4), TreeConfig(3, 4, draft_nodes=6)], ids=["fixed", "dynamic"]
)
def test_decoding_with_emulated_kernels_matches_the_fallback(emulator, temperature, beam):
    model = prepare_target(tiny_model("llama"))
    drafter = Drafter.create(model)
    sampling = SamplingConfig(temperature=temperature)
    emulated = emulator.with_replacements({})
    want, _ = decode(model, drafter, beam, sampling, "mlx")
    got, steps = decode(model, drafter, beam, sampling, fused_kernels(emulated.launch, "emulated"))
    assert got == want
    assert emulated.launches.count(ACCEPT.name) == steps
    assert emulated.launches.count(PACK_TREE.name) == steps
    # One draft per step, plus the one drafted ahead after the last step.
    drafts = steps + 1
    assert emulated.launches.count(BEAM_SELECT.name) == drafts * (beam.beam_length - 1)
