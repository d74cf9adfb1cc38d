"""Shared fixtures: tiny mlx-lm targets, a trained tiny drafter, mlx-lm's reference decoding."""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import VOCAB_SIZE, tiny_model  # noqa: E402

from mlx_redrafter.config import SamplingConfig, StopConfig, TreeConfig  # noqa: E402
from mlx_redrafter.drafter import Drafter  # noqa: E402
from mlx_redrafter.session import DecodingSession, Request  # noqa: E402
from mlx_redrafter.target import prepare_target  # noqa: E402
from mlx_redrafter.training import FitConfig, fit  # noqa: E402


def mlx_lm_greedy(model, prompt, max_tokens, prompt_cache=None):
    """mlx-lm's own greedy decoding: the reference every greedy test compares with."""
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=make_sampler(0.0),
        prompt_cache=prompt_cache,
    )
    return [int(token) for token, _ in steps]


@dataclass(frozen=True)
class StepEvent:
    """The updates of one session step, by row: the requests that took part, their new
    tokens, accepted drafted tokens, tree sizes, and the rows that finished."""

    row_ids: list[int]
    tokens: list[list[int]]
    num_accepted: list[int]
    tree_sizes: list[int]
    finished: dict[int, str] = field(default_factory=dict)


def decode_tokens(
    model,
    drafter,
    prompts,
    tree,
    max_tokens,
    sampling=None,
    key=None,
    eos=frozenset(),
    cache_config=None,
    compiled=None,
    kernels=None,
):
    """Decode token-id prompts together in one `DecodingSession`; returns (tokens per
    prompt, one StepEvent per step). `key`: one PRNG key (2,), split per row, or the
    rows' own keys (B, 2)."""
    session = DecodingSession(
        model, drafter, tree=tree, cache=cache_config, compiled=compiled, kernels=kernels
    )
    keys = [None] * len(prompts)
    if key is not None:
        keys = list(mx.random.split(key, len(prompts)) if key.ndim == 1 else key)
    stop = StopConfig(max_tokens=max_tokens, eos_token_ids=frozenset(eos))
    rules = sampling or SamplingConfig()
    rules = rules if isinstance(rules, list) else [rules] * len(prompts)  # per row, or all
    requests = [Request(p, r, stop, k) for p, r, k in zip(prompts, rules, keys)]
    session.add(requests, range(len(prompts)))
    outputs = [[] for _ in prompts]
    events = []
    while session.active:
        updates = session.step()
        events.append(
            StepEvent(
                [u.request for u in updates],
                [u.tokens for u in updates],
                [u.num_accepted for u in updates],
                [u.tree_size for u in updates],
                {u.request: u.finish_reason for u in updates if u.finish_reason},
            )
        )
        for update in updates:
            outputs[update.request].extend(update.tokens)
    return outputs, events


@pytest.fixture
def umask_022():
    """The process umask set to 022 for one test (files 0644, folders 0755), so that a
    file left with a private temporary file's 0600 (or a folder's 0700) is caught."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def random_prompts(count, seed=0, vocab_size=VOCAB_SIZE, lengths=(1, 9)):
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)]


@pytest.fixture(scope="session")
def trained_llama():
    """A tiny llama, a drafter trained on its own greedy continuations of `prompts`,
    and those prompts (on which the drafter is accepted often: tau well above 1)."""
    model = prepare_target(tiny_model("llama"))
    prompts = random_prompts(48, seed=1, lengths=(2, 8))
    continuations, _ = decode_tokens(model, None, prompts, TreeConfig(1, 1), max_tokens=40)
    sequences = [p + c for p, c in zip(prompts, continuations)]
    drafter = Drafter.create(model)
    fit(model, drafter, sequences, FitConfig(num_steps=4, iterations=300))
    return model, drafter, prompts


@pytest.fixture(scope="session", autouse=True)
def calibration_cache(tmp_path_factory):
    """Calibrations of the tests' tiny models go to a temporary folder, not the
    user's cache."""
    from mlx_redrafter import calibrate

    folder = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "calibration_folder", lambda: folder)
        yield folder


@pytest.fixture(autouse=True)
def fresh_measured_costs(monkeypatch):
    """Each test's auto trees start from the calibration: the step costs that auto
    trees measure are shared by a process's sessions (`auto.shared_measured_costs`),
    which would make a test's tree choices hang on the tests before it."""
    from mlx_redrafter import auto
    from mlx_redrafter.per_model import PerModel

    monkeypatch.setattr(auto, "_MEASURED", PerModel())


@pytest.fixture(autouse=True)
def fresh_confidence(monkeypatch):
    """Each test's dynamic trees start from no measured draft confidence: it is
    shared by a process's sessions (`confidence.shared_confidence`)."""
    from mlx_redrafter import confidence
    from mlx_redrafter.per_model import PerModel

    monkeypatch.setattr(confidence, "_SHARED", PerModel())
