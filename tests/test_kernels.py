"""Kernel selection (explicit, per session), the real Metal kernels on a Mac, the benchmark."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_tokens
from kernel_harness.cases import (
    EXPAND_KINDS,
    EXPAND_SHAPES,
    accept_cases,
    expand_inputs,
    pack_cases,
    same,
)
from tiny_models import tiny_model

from mlx_redrafter.accept import accept
from mlx_redrafter.beam_search import expand_beams
from mlx_redrafter.cli import main
from mlx_redrafter.commands.kernels import NO_METAL, benchmark
from mlx_redrafter.config import SamplingConfig, TreeConfig
from mlx_redrafter.decode import step_functions
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.kernels import (
    ENV_VAR,
    METAL_KERNELS,
    MLX_KERNELS,
    Kernels,
    accept_fused,
    expand_beams_fused,
    pack_tree_fused,
    requested_backend,
    resolve_backend,
    select_kernels,
)
from mlx_redrafter.target import prepare_target
from mlx_redrafter.tree import pack_tree

HAS_METAL = mx.metal.is_available()
needs_metal = pytest.mark.skipif(
    not HAS_METAL, reason="no Metal here (mx.metal.is_available() is False): real kernels not run"
)

# ---------------------------------------------------------------- selection rules


def test_argument_beats_environment_beats_auto():
    assert requested_backend(None, {}) == "auto"
    assert requested_backend(None, {ENV_VAR: " MLX "}) == "mlx"
    assert requested_backend("metal", {ENV_VAR: "mlx"}) == "metal"
    assert requested_backend("auto", {ENV_VAR: "mlx"}) == "auto"


@pytest.mark.parametrize("available", [True, False])
def test_auto_follows_metal_availability(available):
    expected = "metal" if available else "mlx"
    assert resolve_backend(None, metal_available=available, environ={}) == expected
    assert resolve_backend("auto", metal_available=available, environ={}) == expected
    assert resolve_backend("mlx", metal_available=available, environ={}) == "mlx"


def test_forcing_metal_without_metal_is_an_error():
    with pytest.raises(ValueError, match="Metal is not available"):
        resolve_backend("metal", metal_available=False, environ={})
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_backend(None, metal_available=False, environ={ENV_VAR: "metal"})
    assert resolve_backend(None, metal_available=True, environ={ENV_VAR: "metal"}) == "metal"


def test_unknown_choices_are_refused():
    with pytest.raises(ValueError, match=ENV_VAR):
        requested_backend(None, {ENV_VAR: "cuda"})
    with pytest.raises(ValueError, match="argument"):
        requested_backend("fast", {})


def test_select_kernels_returns_the_implementations():
    assert select_kernels("mlx") is MLX_KERNELS
    assert MLX_KERNELS.expand is expand_beams and MLX_KERNELS.accept is accept
    assert MLX_KERNELS.pack is pack_tree
    assert select_kernels("auto", metal_available=True, environ={}) is METAL_KERNELS
    assert select_kernels(None, metal_available=False, environ={}) is MLX_KERNELS
    custom = Kernels("custom", expand_beams, pack_tree, accept)
    assert select_kernels(custom) is custom


# ---------------------------------------------------------------- in the decoding loop


@pytest.fixture(scope="module")
def tiny():
    model = prepare_target(tiny_model("llama"))
    return model, Drafter.create(model)


def test_step_functions_pick_kernels_by_platform(tiny, monkeypatch):
    model, drafter = tiny
    beam = TreeConfig(2, 3)
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert step_functions(model, drafter, beam, compiled=False).kernels == "mlx"
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    assert step_functions(model, drafter, beam, compiled=False).kernels == "metal"
    assert step_functions(model, drafter, beam, compiled=False, kernels="mlx").kernels == "mlx"
    monkeypatch.setenv(ENV_VAR, "mlx")
    assert step_functions(model, drafter, beam, compiled=False).kernels == "mlx"


def test_this_machine_decodes_with_the_right_kernels(tiny, monkeypatch):
    model, drafter = tiny
    monkeypatch.delenv(ENV_VAR, raising=False)
    steps = step_functions(model, drafter, TreeConfig(2, 3))
    assert steps.kernels == ("metal" if HAS_METAL else "mlx")


def test_a_session_uses_the_kernels_it_was_built_with(tiny):
    model, drafter = tiny
    calls = {"expand": 0, "pack": 0, "accept": 0}

    def expand(scores, logits):
        calls["expand"] += 1
        return expand_beams(scores, logits)

    def pack(*args):
        calls["pack"] += 1
        return pack_tree(*args)

    def accept_step(*args):
        calls["accept"] += 1
        return accept(*args)

    spy = Kernels("spy", expand, pack, accept_step)
    tree = TreeConfig(2, 3)
    assert step_functions(model, drafter, tree, compiled=False, kernels=spy).kernels == "spy"
    calls.update(expand=0)
    _, events = decode_tokens(model, drafter, [[1, 2, 3]], tree, 6, compiled=False, kernels=spy)
    # Two expansions per draft (L = 3): one draft per step, and one more drafted ahead
    # after the last step (the session drafts step t+1 while the host handles step t).
    drafts = len(events) + 1
    assert calls == {"expand": 2 * drafts, "pack": len(events), "accept": len(events)}


# ---------------------------------------------------------------- the real kernels (Mac)


@pytest.mark.metal
@needs_metal
def test_metal_expansion_matches_the_fallback():
    for shape in EXPAND_SHAPES:
        for kind in EXPAND_KINDS:
            scores, logits = expand_inputs(kind, shape, np.random.default_rng(len(kind)))
            want = expand_beams(scores, logits)
            for chunk in (None, 1, 7):
                got = expand_beams_fused(scores, logits, chunk=chunk)
                assert same(got, want), f"{kind} {shape} chunk={chunk}"


@pytest.mark.metal
@needs_metal
def test_metal_acceptance_matches_the_fallback():
    for shape, inputs in accept_cases():
        assert same(accept_fused(*inputs), accept(*inputs)), f"B,W,L={shape}"


@pytest.mark.metal
@needs_metal
def test_metal_pack_tree_matches_the_fallback():
    for beams, budget, share_prefixes in pack_cases():
        got = pack_tree_fused(beams, budget, share_prefixes)
        assert same(got, pack_tree(beams, budget, share_prefixes)), f"{beams.shape} N={budget}"


@pytest.mark.metal
@needs_metal
def test_metal_kernels_compile_inside_mx_compile():
    scores, logits = expand_inputs("ties", (2, 4, 100), np.random.default_rng(0))
    assert same(mx.compile(METAL_KERNELS.expand)(scores, logits), expand_beams(scores, logits))


@pytest.mark.metal
@needs_metal
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_metal_decoding_matches_the_fallback(tiny, temperature):
    model, drafter = tiny
    outputs = []
    for kernels in ("mlx", "metal"):
        tokens, _ = decode_tokens(
            model,
            drafter,
            [[1, 2, 3], [4, 5]],
            TreeConfig(3, 4),
            16,
            SamplingConfig(temperature=temperature),
            key=mx.random.key(3),
            kernels=kernels,  # compiled by default on the GPU
        )
        outputs.append(tokens)
    assert outputs[0] == outputs[1]


# ---------------------------------------------------------------- the benchmark command


def test_benchmark_times_the_fallback_and_says_metal_is_missing(capsys, monkeypatch):
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    code = main(
        [
            "kernels",
            "--beam-width",
            "3",
            "--vocab",
            "50",
            "--hidden",
            "32",
            "--iterations",
            "2",
            "--warmup",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert NO_METAL in out
    assert "expand  mlx " in out and "pack    mlx " in out and "accept  mlx compiled" in out
    assert "draft   mlx compiled" in out
    assert "metal" not in out.replace(NO_METAL, "").lower()


def test_benchmark_checks_the_kernel_it_times():
    fake = Kernels(
        "fake",
        expand_beams,
        pack_tree,
        lambda *args: accept(*args)._replace(bonus_tokens=args[3][:, 0] + 1),
    )
    timings = benchmark(1, TreeConfig(2, 3), 20, iterations=1, warmup=0, metal=fake, hidden_size=32)
    verdicts = {(t.step, t.implementation): t.identical for t in timings}
    assert verdicts[("draft", "mlx compiled")] is True  # the whole draft, compiled
    assert verdicts[("draft", "fake")] is True  # its expansion is the fallback's
    assert verdicts[("expand", "fake")] is True
    assert verdicts[("pack", "fake")] is True
    assert verdicts[("accept", "fake")] is False
