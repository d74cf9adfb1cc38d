"""Sampled speculative decoding is distributed exactly as plain sampling from the target.

The target is a tiny model with a 6-token vocabulary. The exact distribution of
its first three sampled tokens (216 outcomes) is computed by enumerating every
prefix with mlx-lm's own sampling filters; thousands of rows decoded together
with a trained drafter must fit it (chi-square). A deliberately inexact
acceptance (independent samples at duplicate copies of a prefix, the flaw of the
reference's per-beam rule) must fail the same test.
"""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
import pytest
from conftest import decode_tokens
from mlx_lm.sample_utils import apply_top_k, apply_top_p
from tiny_models import VOCAB_SIZE, tiny_model

from mlx_redrafter.accept import accept
from mlx_redrafter.beam_search import expand_beams
from mlx_redrafter.config import SamplingConfig, TreeConfig
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.kernels import Kernels
from mlx_redrafter.sampling import filter_top_k, filter_top_p
from mlx_redrafter.target import prepare_target
from mlx_redrafter.training import FitConfig, fit
from mlx_redrafter.tree import pack_tree

VOCAB = 6
LENGTH = 3
PROMPT = [1, 4, 2]
SAMPLES = 3000


def exact_distribution(model, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3 | prompt) by enumeration, with mlx-lm's filters and temperature."""

    def conditional(prefix):
        logits = model(mx.array([PROMPT + list(prefix)]))[0, -1]
        logprobs = logits - mx.logsumexp(logits)
        if sampling.top_p < 1:
            logprobs = apply_top_p(logprobs[None], sampling.top_p)[0]
        if sampling.top_k > 0:
            logprobs = apply_top_k(logprobs[None], sampling.top_k)[0]
        return mx.softmax(logprobs / sampling.temperature).tolist()

    probabilities = {}
    cache = {}
    for sequence in itertools.product(range(VOCAB), repeat=LENGTH):
        p = 1.0
        for k in range(LENGTH):
            prefix = sequence[:k]
            if prefix not in cache:
                cache[prefix] = conditional(prefix)
            p *= cache[prefix][sequence[k]]
        probabilities[sequence] = p
    return probabilities


def chi_square_p_value(counts, probabilities, total) -> float:
    """Pearson's test, pooling outcomes with expected count < 5; Wilson-Hilferty tail."""
    statistic, bins, pooled_observed, pooled_expected = 0.0, 0, 0, 0.0
    for outcome, p in probabilities.items():
        expected = p * total
        if expected < 5:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += expected
            continue
        statistic += (counts.get(outcome, 0) - expected) ** 2 / expected
        bins += 1
    if pooled_expected > 0:
        statistic += (pooled_observed - pooled_expected) ** 2 / max(pooled_expected, 1e-9)
        bins += 1
    dof = bins - 1
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def small_vocab_target():
    model = prepare_target(
        tiny_model("llama", vocab_size=VOCAB, weight_scale=2.0, seed=3, tie_word_embeddings=False)
    )
    # Train the drafter on the target's own samples so drafts are often accepted.
    sampling = SamplingConfig(temperature=1.0)
    prompts = [PROMPT] * 256
    outputs, _ = decode_tokens(
        model, None, prompts, TreeConfig(1, 1), 12, sampling=sampling, key=mx.random.key(0)
    )
    drafter = Drafter.create(model)
    fit(model, drafter, [PROMPT + o for o in outputs], FitConfig(num_steps=2, iterations=150))
    return model, drafter


def sample_sequences(model, drafter, sampling, beam, seed, kernels=None):
    outputs, events = decode_tokens(
        model,
        drafter,
        [PROMPT] * SAMPLES,
        beam,
        LENGTH,
        sampling=sampling,
        key=mx.random.key(seed),
        kernels=kernels,
    )
    counts: dict[tuple[int, ...], int] = {}
    for output in outputs:
        counts[tuple(output)] = counts.get(tuple(output), 0) + 1
    accepted = sum(sum(e.num_accepted) for e in events)
    return counts, accepted


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.7, top_k=4),
        SamplingConfig(temperature=1.3, top_p=0.8),
    ],
    ids=["t1", "t0.7-topk4", "t1.3-topp0.8"],
)
def test_speculative_sampling_matches_the_target_distribution(small_vocab_target, sampling):
    model, drafter = small_vocab_target
    expected = exact_distribution(model, sampling)
    counts, accepted = sample_sequences(model, drafter, sampling, TreeConfig(3, 3), seed=1)
    assert accepted > SAMPLES // 2, "drafts must be accepted often for the test to mean much"
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3
    # Filtered tokens never appear.
    impossible = {o for o, p in expected.items() if p == 0.0}
    assert not impossible & set(counts)


def test_lookup_beams_sample_the_target_distribution(small_vocab_target):
    model, drafter = small_vocab_target
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_distribution(model, sampling)
    for beam in (
        TreeConfig(1, 3, lookup_branches=1),
        TreeConfig(1, 2, lookup_branches=1, lookup_length=4),
    ):
        counts, accepted = sample_sequences(model, drafter, sampling, beam, seed=5)
        assert accepted > SAMPLES // 2, beam
        assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3, beam


def test_dynamic_tree_sampling_is_exact(small_vocab_target):
    model, drafter = small_vocab_target
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_distribution(model, sampling)
    counts, accepted = sample_sequences(
        model, drafter, sampling, TreeConfig(3, 3, draft_nodes=4), seed=3
    )
    assert accepted > SAMPLES // 2, "drafts must be accepted often for the test to mean much"
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


def test_unshared_tree_sampling_is_exact(small_vocab_target):
    model, drafter = small_vocab_target
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_distribution(model, sampling)
    beam = TreeConfig(3, 3, share_prefixes=False)
    counts, _ = sample_sequences(model, drafter, sampling, beam, seed=2)
    assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3


def test_the_test_catches_inexact_acceptance(small_vocab_target):
    """An acceptance that sometimes replaces the target's own draw (here: 30% of rows
    take their root token again at the root) must fail the same test. (Trusting the
    drafter's best guess would not do: drafted with the target's own noise, it is
    itself nearly a sample of the target's distribution.)"""
    model, drafter = small_vocab_target
    sampling = SamplingConfig(temperature=1.0)
    expected = exact_distribution(model, sampling)

    def lenient_acceptance(beams, unpack, canonical, choices):
        trusted = mx.random.uniform(shape=(beams.shape[0],), key=mx.random.key(0)) < 0.3
        root = mx.where(trusted, beams[:, 0, 0], choices[:, 0])
        choices = mx.concatenate([root[:, None], choices[:, 1:]], axis=1)
        return accept(beams, unpack, canonical, choices)

    broken = Kernels("inexact", expand_beams, pack_tree, lenient_acceptance)
    counts, _ = sample_sequences(model, drafter, sampling, TreeConfig(3, 3), seed=2, kernels=broken)
    assert chi_square_p_value(counts, expected, SAMPLES) < 1e-6


def test_fixed_seed_is_reproducible(small_vocab_target):
    model, drafter = small_vocab_target
    sampling = SamplingConfig(temperature=1.0)
    first = decode_tokens(
        model, drafter, [PROMPT] * 4, TreeConfig(3, 3), 8, sampling=sampling, key=mx.random.key(42)
    )[0]
    second = decode_tokens(
        model, drafter, [PROMPT] * 4, TreeConfig(3, 3), 8, sampling=sampling, key=mx.random.key(42)
    )[0]
    third = decode_tokens(
        model, drafter, [PROMPT] * 4, TreeConfig(3, 3), 8, sampling=sampling, key=mx.random.key(43)
    )[0]
    assert first == second
    assert first != third


def test_filters_agree_with_mlx_lm():
    mx.random.seed(0)
    logits = mx.random.normal((16, 50)) * 3
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        ours = mx.isinf(filter_top_p(logprobs, top_p))
        theirs = mx.isinf(apply_top_p(logprobs, top_p))
        assert mx.array_equal(ours, theirs).item()
    for top_k in (1, 5, 49):
        assert mx.array_equal(
            mx.isinf(filter_top_k(logprobs, top_k)), mx.isinf(apply_top_k(logprobs, top_k))
        ).item()


def test_rows_with_different_rules_share_a_batch_exactly(small_vocab_target):
    """One batch, half the rows at t=1.0, half at t=0.7 with top-k 4 (per-row sampling)."""
    model, drafter = small_vocab_target
    rules = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4)]
    per_row = [rules[i % 2] for i in range(2 * SAMPLES)]
    outputs, _ = decode_tokens(
        model,
        drafter,
        [PROMPT] * len(per_row),
        TreeConfig(3, 3),
        LENGTH,
        sampling=per_row,
        key=mx.random.key(5),
    )
    for parity, rule in enumerate(rules):
        counts: dict[tuple[int, ...], int] = {}
        for output in outputs[parity::2]:
            counts[tuple(output)] = counts.get(tuple(output), 0) + 1
        expected = exact_distribution(model, rule)
        assert chi_square_p_value(counts, expected, SAMPLES) > 1e-3, rule
        assert not {o for o, p in expected.items() if p == 0.0} & set(counts)


def test_greedy_rows_stay_greedy_in_a_mixed_batch(small_vocab_target):
    model, drafter = small_vocab_target
    per_row = [SamplingConfig(), SamplingConfig(temperature=1.0)] * 4
    outputs, _ = decode_tokens(
        model, drafter, [PROMPT] * 8, TreeConfig(3, 3), 6, sampling=per_row, key=mx.random.key(1)
    )
    greedy, _ = decode_tokens(model, drafter, [PROMPT], TreeConfig(3, 3), 6)
    assert all(output == greedy[0] for output in outputs[0::2])


def test_a_seeded_row_samples_the_same_alone_and_in_a_batch(small_vocab_target):
    """Each row carries its own PRNG key, so batch company does not change its draws."""
    model, drafter = small_vocab_target
    rule = SamplingConfig(temperature=1.0)
    mine = mx.random.key(11)
    alone, _ = decode_tokens(
        model, drafter, [PROMPT], TreeConfig(3, 3), 12, sampling=rule, key=mine[None]
    )
    others = mx.stack([mx.random.key(1), mine, mx.random.key(2)])
    prompts = [[3, 1], PROMPT, [5, 5, 5, 2]]
    rules = [SamplingConfig(temperature=0.8), rule, SamplingConfig()]
    batched, _ = decode_tokens(
        model, drafter, prompts, TreeConfig(3, 3), 12, sampling=rules, key=others
    )
    assert batched[1] == alone[0]
    assert batched[0] != alone[0]


@pytest.mark.parametrize(
    "rule",
    [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9, top_k=4)],
    ids=["t1", "t0.7-topp-topk"],
)
def test_seeded_sampling_emits_exactly_what_plain_sampling_emits(small_vocab_target, rule):
    """The noise of a token is keyed by its position, so for a fixed seed the tree only
    changes how many target steps it takes, never which tokens come out."""
    model, drafter = small_vocab_target
    keys = mx.stack([mx.random.key(seed) for seed in range(16)])
    prompts = [PROMPT] * 16
    plain, plain_events = decode_tokens(
        model, None, prompts, TreeConfig(1, 1), 16, sampling=rule, key=keys
    )
    assert len({tuple(p) for p in plain}) > 8  # the seeds really sample differently
    for beam in (
        TreeConfig(3, 3),
        TreeConfig(2, 5),
        TreeConfig(4, 4, share_prefixes=False),
        TreeConfig(4, 4, tree_budget=6),
        TreeConfig(4, 4, draft_nodes=5),
        TreeConfig(3, 3, draft_nodes=4, lookup_branches=1, lookup_length=5),
        TreeConfig(1, 3, lookup_branches=1),
        TreeConfig(2, 4, lookup_branches=2),
        TreeConfig(1, 2, lookup_branches=1, lookup_length=5),
        TreeConfig(2, 4, lookup_branches=1, lookup_length=2),
    ):
        speculative, events = decode_tokens(
            model, drafter, prompts, beam, 16, sampling=rule, key=keys
        )
        assert speculative == plain, beam
        assert len(events) < len(plain_events)  # and it took fewer target steps


def test_small_seeds_do_not_share_noise_across_positions():
    """Seed s at position p and seed s' at position p ^ s ^ s' once drew the same noise."""
    from mlx_redrafter.decode import row_keys
    from mlx_redrafter.sampling import position_keys

    keys = mx.stack([mx.random.key(seed) for seed in range(64)])  # (64, 2) as users seed
    rows = row_keys(keys, [SamplingConfig(temperature=1.0)] * 64)  # (64, 2)
    positions = mx.broadcast_to(mx.arange(64, dtype=mx.int32)[None], (64, 64))  # (64, 64)
    every = position_keys(rows, positions).reshape(-1, 2)  # (64 * 64, 2)
    assert len({tuple(key) for key in every.tolist()}) == 64 * 64


def uniform_target_and_drafter(draft_vocab_ids=None):
    """A tiny target whose every logit is 0 (final norm zeroed) and a drafter whose
    head is zeroed: both distributions are uniform, at any temperature."""
    model = prepare_target(tiny_model("llama"))
    model.model.norm.weight = mx.zeros_like(model.model.norm.weight)
    drafter = Drafter.create(model, draft_vocab_ids=draft_vocab_ids)
    head = drafter.lm_head[-1]
    head.weight = mx.zeros_like(head.weight)
    return model, drafter


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("permuted", [False, True], ids=["full-vocab", "permuted-draft-vocab"])
def test_sampled_rows_draft_with_the_targets_own_noise(temperature, permuted):
    """Coupled drafting (beam_search.py): a sampled row's drafter scores each position's
    candidates with the noise the target samples that position with. With the target
    and the drafter both uniform, the target's sample is the argmax of that noise and so
    is the drafter's guess: every drafted token is accepted (without the coupling, one
    in V would be), on draft-vocabulary ids mapped back to target ids, and the output
    is still exactly what plain sampling with the same seeds emits."""
    vocab = VOCAB_SIZE
    ids = list(reversed(range(vocab))) if permuted else None
    model, drafter = uniform_target_and_drafter(ids)
    rule = SamplingConfig(temperature=temperature)
    keys = mx.stack([mx.random.key(seed) for seed in range(3)])
    prompts = [[1, 2, 3], [4, 5], [6]]
    plain, _ = decode_tokens(model, None, prompts, TreeConfig(1, 1), 13, sampling=rule, key=keys)
    assert len({tuple(p) for p in plain}) == 3  # the seeds sample differently
    coupled, events = decode_tokens(model, drafter, prompts, TreeConfig(2, 4), 13, rule, keys)
    assert coupled == plain
    full_steps = [n for event in events[:-1] for n in event.num_accepted]
    assert full_steps and all(n == 3 for n in full_steps), full_steps


def test_each_position_draws_its_noise_once_and_verification_reuses_the_drafters():
    """`DecodeState.node_noise`: every node gets the noise of its absolute position
    (committed length + depth), nodes at one depth share one draw, the noise the
    drafter drew for the next tree (`drawn`) is what verifying that tree uses, and
    none of it is reused once a commit moves the roots on."""
    from mlx_redrafter.config import CacheConfig
    from mlx_redrafter.decode import prefill
    from mlx_redrafter.sampling import position_keys, position_noise

    model = prepare_target(tiny_model("llama"))
    rule = SamplingConfig(temperature=0.8)
    keys = mx.stack([mx.random.key(seed) for seed in (4, 5)])
    state = prefill(model, [[1, 2, 3, 4], [5, 6]], CacheConfig(), rule, keys=keys)
    depths = mx.array([[0, 1, 1, 2], [0, 1, 2, 2]])  # (B, N)
    positions = state.cache.lengths[:, None] + depths  # (B, N)
    expected = position_noise(position_keys(state.keys, positions), VOCAB_SIZE)  # (B, N, V)
    assert mx.array_equal(state.node_noise(depths, 3, VOCAB_SIZE), expected).item()
    drawn = state.noise_from_root(2, VOCAB_SIZE)  # what a 1x3 drafter draws
    state.drawn = drawn * 0 + 7.0  # marked: reused, not drawn again
    reused = state.node_noise(depths, 3, VOCAB_SIZE)
    from_drawn = depths < 2  # depths 0 and 1 come from `drawn`, depth 2 is drawn now
    assert mx.all(mx.where(from_drawn[..., None], reused == 7.0, reused == expected)).item()
    state.record(mx.zeros((2, 1), dtype=mx.int32))
    state.drawn = mx.full(reused.shape[:1] + (3, VOCAB_SIZE), 7.0)  # marked again
    state.cache.commit([[0], [0]], [1, 1])  # the roots move on by one position
    moved = position_noise(position_keys(state.keys, positions + 1), VOCAB_SIZE)
    assert mx.array_equal(state.node_noise(depths, 3, VOCAB_SIZE), moved).item()
