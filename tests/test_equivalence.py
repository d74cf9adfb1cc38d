"""Greedy speculative decoding is token-identical to mlx-lm's plain greedy decoding (fp32)."""

import mlx.core as mx
import pytest
from conftest import decode_tokens, mlx_lm_greedy, random_prompts
from mlx_lm.models.cache import QuantizedKVCache
from tiny_models import FAMILY_CONFIGS, tiny_model

from mlx_redrafter.config import CacheConfig, SamplingConfig, StopConfig, TreeConfig
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.target import prepare_target

BEAM_SHAPES = [(1, 1), (1, 4), (4, 1), (3, 3), (4, 5)]


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family_model(request):
    model = tiny_model(request.param)
    prompts = random_prompts(3, seed=7)
    references = [mlx_lm_greedy(model, p, 40) for p in prompts]  # before any adaptation
    prepare_target(model)
    return request.param, model, prompts, references


@pytest.mark.parametrize("beam_width,beam_length", BEAM_SHAPES)
def test_every_family_matches_mlx_lm(family_model, beam_width, beam_length):
    family, model, prompts, references = family_model
    drafter = Drafter.create(model)
    for prompt, reference in zip(prompts, references):
        outputs, _ = decode_tokens(
            model, drafter, [prompt], TreeConfig(beam_width, beam_length), 40
        )
        assert outputs[0] == reference, f"{family} W={beam_width} L={beam_length} prompt={prompt}"


@pytest.mark.parametrize("batch_size", [2, 3])
def test_every_family_matches_mlx_lm_in_a_batch(family_model, batch_size):
    """Rows of different prompt lengths verified together (masks broadcast over B)."""
    family, model, prompts, references = family_model
    drafter = Drafter.create(model)
    outputs, _ = decode_tokens(model, drafter, prompts[:batch_size], TreeConfig(3, 3), 40)
    assert outputs == references[:batch_size], family


def test_gemma2_with_as_many_kv_heads_as_heads_in_a_batch():
    """Gemma 2 groups its attention scores only when H > H_kv; without grouping the
    mask must keep its plain (B, 1, N, T + N) shape."""
    model = tiny_model("gemma2", num_key_value_heads=4)
    prompts = random_prompts(3, seed=11)
    references = [mlx_lm_greedy(model, p, 24) for p in prompts]
    prepare_target(model)
    outputs, _ = decode_tokens(model, Drafter.create(model), prompts, TreeConfig(2, 3), 24)
    assert outputs == references


def test_sliding_window_is_exercised():
    # gemma3_text's tiny config has a window of 8; 40 tokens go far past it.
    assert FAMILY_CONFIGS["gemma3_text"]["sliding_window"] < 40


@pytest.mark.parametrize(
    "beam",
    [
        TreeConfig(1, 5),
        TreeConfig(4, 5),
        TreeConfig(3, 3),
        TreeConfig(4, 5, share_prefixes=False),
        TreeConfig(4, 5, tree_budget=7),
        TreeConfig(4, 5, draft_nodes=7),
        TreeConfig(3, 4, draft_nodes=5, lookup_branches=1, lookup_length=6),
    ],
    ids=[
        "W1L5",
        "W4L5",
        "W3L3",
        "W4L5-unshared",
        "W4L5-budget7",
        "W4L5-dynamic7",
        "dynamic+lookup",
    ],
)
def test_trained_drafter_matches_mlx_lm_and_accepts(trained_llama, beam):
    model, drafter, trained_prompts = trained_llama
    prompts = trained_prompts[:6]
    produced, steps = 0, 0
    for prompt in prompts:
        outputs, events = decode_tokens(model, drafter, [prompt], beam, 40)
        assert outputs[0] == mlx_lm_greedy(model, prompt, 40), f"prompt={prompt}"
        produced += len(outputs[0])
        steps += len(events)
    # The drafter is really accepted, so the multi-token paths are exercised.
    assert produced / steps > 1.5


def test_batch_equals_each_row_alone(trained_llama):
    model, drafter, trained_prompts = trained_llama
    prompts = trained_prompts[6:12] + [[5]]
    assert len({len(p) for p in prompts}) > 2
    beam = TreeConfig(3, 4)
    batched, events = decode_tokens(model, drafter, prompts, beam, 32)
    for prompt, output in zip(prompts, batched):
        alone, _ = decode_tokens(model, drafter, [prompt], beam, 32)
        assert output == alone[0]
        assert output == mlx_lm_greedy(model, prompt, 32)
    # Rows accepted different numbers of tokens in the same step.
    assert any(len(set(event.num_accepted)) > 1 for event in events)


def test_each_row_stops_at_its_own_eos(trained_llama):
    model, drafter, _ = trained_llama
    prompts = random_prompts(4, seed=3, lengths=(2, 6))
    full, _ = decode_tokens(model, drafter, prompts, TreeConfig(3, 4), 30)
    eos = full[0][10]
    outputs, events = decode_tokens(model, drafter, prompts, TreeConfig(3, 4), 30, eos={eos})
    for reference, output in zip(full, outputs):
        expected = reference[: reference.index(eos)] if eos in reference else reference
        assert output == expected
    # Row 0 left the batch at its EOS while the others kept decoding.
    stopped_at = next(i for i, e in enumerate(events) if 0 in e.finished)
    assert stopped_at < len(events) - 1
    assert all(0 not in e.row_ids for e in events[stopped_at + 1 :])
    finished = {row: reason for event in events for row, reason in event.finished.items()}
    assert finished[0] == "stop"
    assert sorted(finished) == list(range(len(prompts)))


def test_max_tokens_is_exact_even_mid_step(trained_llama):
    model, drafter, _ = trained_llama
    prompt = random_prompts(1, seed=2)[0]
    for max_tokens in (1, 2, 7, 13):
        outputs, events = decode_tokens(model, drafter, [prompt], TreeConfig(3, 5), max_tokens)
        assert outputs[0] == mlx_lm_greedy(model, prompt, max_tokens)
        assert events[-1].finished == {0: "length"}


def test_quantized_kv_cache_matches_mlx_lm_quantized_cache():
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    prompts = random_prompts(3, seed=4, lengths=(3, 9))
    references = [
        mlx_lm_greedy(model, p, 30, prompt_cache=[QuantizedKVCache(64, 8) for _ in model.layers])
        for p in prompts
    ]
    prepare_target(model)
    drafter = Drafter.create(model)
    cache_config = CacheConfig(kv_bits=8, kv_group_size=64)
    for prompt, reference in zip(prompts, references):
        outputs, _ = decode_tokens(
            model, drafter, [prompt], TreeConfig(3, 3), 30, cache_config=cache_config
        )
        assert outputs[0] == reference


def test_adapted_model_still_runs_mlx_lm_unchanged(trained_llama):
    model, _, _ = trained_llama
    fresh = tiny_model("llama")  # the same seed and weights, never adapted
    prompt = [3, 1, 4, 1, 5]
    assert mlx_lm_greedy(model, prompt, 20) == mlx_lm_greedy(fresh, prompt, 20)


def test_drafter_none_is_plain_decoding(trained_llama):
    model, _, _ = trained_llama
    prompt = [2, 7, 1, 8]
    outputs, events = decode_tokens(model, None, [prompt], TreeConfig(4, 5), 20)
    assert outputs[0] == mlx_lm_greedy(model, prompt, 20)
    assert len(events) == 20 and all(n == 0 for e in events for n in e.num_accepted)


def test_prompt_of_one_token(trained_llama):
    model, drafter, _ = trained_llama
    outputs, _ = decode_tokens(model, drafter, [[9]], TreeConfig(3, 3), 15)
    assert outputs[0] == mlx_lm_greedy(model, [9], 15)


def test_half_precision_runs(trained_llama):
    # Tree verification changes matmul shapes; bf16 near-ties may flip, so this only
    # checks it runs and mostly agrees (losslessness is proven in fp32 above).
    model = prepare_target(tiny_model("llama", dtype=mx.bfloat16))
    drafter = Drafter.create(model)
    prompt = [1, 2, 3]
    outputs, _ = decode_tokens(model, drafter, [prompt], TreeConfig(2, 3), 20)
    reference = mlx_lm_greedy(tiny_model("llama", dtype=mx.bfloat16), prompt, 20)
    assert len(outputs[0]) == 20
    assert outputs[0][:3] == reference[:3]


def test_compiled_hot_path_gives_identical_output(trained_llama):
    model, drafter, prompts = trained_llama
    beam = TreeConfig(4, 5)
    for prompt in prompts[:3]:
        compiled, events = decode_tokens(model, drafter, [prompt], beam, 30, compiled=True)
        plain, _ = decode_tokens(model, drafter, [prompt], beam, 30, compiled=False)
        assert compiled == plain
        assert compiled[0] == mlx_lm_greedy(model, prompt, 30)
    sampling = SamplingConfig(temperature=1.0, top_k=8)
    rows = [prompts[0]] * 4
    first = decode_tokens(model, drafter, rows, beam, 20, sampling, mx.random.key(3), compiled=True)
    second = decode_tokens(
        model, drafter, rows, beam, 20, sampling, mx.random.key(3), compiled=False
    )
    assert first[0] == second[0]


def test_requests_join_a_running_batch(trained_llama):
    """Rows prefilled later and appended mid-decode (continuous batching) stay exact."""
    from mlx_redrafter.session import DecodingSession, Request

    model, drafter, prompts = trained_llama
    session = DecodingSession(model, drafter, tree=TreeConfig(3, 4))
    stop = StopConfig(max_tokens=30)
    session.add([Request(p, stop=stop) for p in prompts[:2]], ids=[0, 1])
    outputs: dict[int, list[int]] = {0: [], 1: [], 2: [], 3: [], 4: []}
    joined = False
    while session.active:
        if not joined and len(outputs[0]) >= 7:
            session.add([Request(p, stop=stop) for p in prompts[2:5]], ids=[2, 3, 4])
            joined = True
        for update in session.step():
            outputs[update.request].extend(update.tokens)
    assert joined
    for row, prompt in enumerate(prompts[:5]):
        assert outputs[row] == mlx_lm_greedy(model, prompt, 30), row


def test_drafting_ahead_and_the_generation_stream_change_nothing(trained_llama):
    """The session drafts step t+1 with mx.async_eval while the host handles step t,
    on its own generation stream: tokens, acceptances and tree sizes are those of a
    session that drafts each step when it starts, for every kind of tree, greedy and
    sampled, with rows leaving the batch at different steps."""
    from mlx_redrafter.session import DecodingSession, Request

    model, drafter, prompts = trained_llama
    rows = prompts[:3]
    for tree in (TreeConfig(3, 4), TreeConfig.parse("1x2+1x7"), TreeConfig.parse("0x5+1:text")):
        for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
            runs = []
            for prefetch in (True, False):
                session = DecodingSession(model, drafter, tree=tree, prefetch=prefetch)
                keys = list(mx.random.split(mx.random.key(4), len(rows)))
                stops = [StopConfig(max_tokens=n) for n in (9, 23, 31)]
                requests = [Request(p, sampling, s, k) for p, s, k in zip(rows, stops, keys)]
                updates = list(session.run(requests))
                runs.append([(u.request, u.tokens, u.num_accepted, u.tree_size) for u in updates])
            assert runs[0] == runs[1], (tree.label, sampling)
            if sampling.greedy:
                got = {r: [t for u in runs[0] if u[0] == r for t in u[1]] for r in range(3)}
                for row, (prompt, n) in enumerate(zip(rows, (9, 23, 31))):
                    assert got[row] == mlx_lm_greedy(model, prompt, n)


def test_wired_limit_is_a_no_op_without_metal(trained_llama):
    from mlx_redrafter.session import wired_limit

    model, _, _ = trained_llama
    if mx.metal.is_available():
        pytest.skip("this machine has Metal: the next test covers it")
    with wired_limit(model):  # no Metal: nothing to wire, and nothing fails
        assert mx.array(1).item() == 1


@pytest.mark.metal
@pytest.mark.skipif(
    not mx.metal.is_available(), reason="no Metal here (mx.metal.is_available() is False)"
)
def test_wired_limit_wires_and_restores_on_metal(trained_llama):
    from mlx_redrafter.session import wired_limit

    model, _, _ = trained_llama
    before = mx.set_wired_limit(0)
    mx.set_wired_limit(before)
    with wired_limit(model):
        inside = mx.set_wired_limit(before)
        mx.set_wired_limit(inside)
        limit = int(mx.metal.device_info()["max_recommended_working_set_size"])
        assert inside == limit
    assert mx.set_wired_limit(before) == before
