"""The real SmolLM2-135M-Instruct (fp32): greedy speculative output is token-identical to
mlx-lm's own greedy decoding on MT-Bench first turns."""

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler
from real_models import mt_bench_first_turns, smollm2_path

from mlx_redrafter import BeamConfig, Drafter, stream_generate
from mlx_redrafter.target import prepare_target

pytestmark = pytest.mark.slow

NUM_PROMPTS = 10
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = mlx_lm_load(str(smollm2_path()))
    assert model.model.embed_tokens.weight.dtype == mx.float32
    return model, tokenizer


def chat(tokenizer, question):
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_mt_bench_greedy_is_identical_to_mlx_lm(smollm2):
    model, tokenizer = smollm2
    prompts = [chat(tokenizer, q) for q in mt_bench_first_turns(NUM_PROMPTS)]
    references = [
        [
            r.token
            for r in mlx_lm_stream_generate(
                model, tokenizer, p, max_tokens=MAX_TOKENS, sampler=make_sampler(0.0)
            )
        ]
        for p in prompts
    ]
    prepare_target(model)
    mx.random.seed(0)
    drafter = Drafter.create(model, draft_vocab_size=4096)  # random: tau ~ 1, still lossless
    beam = BeamConfig(beam_width=2, beam_length=3)
    for prompt, reference in zip(prompts, references):
        tokens = [
            t
            for r in stream_generate(
                model, drafter, tokenizer, prompt, max_tokens=MAX_TOKENS, beam=beam
            )
            for t in r.tokens
        ]
        # mlx-lm yields the EOS token itself; we stop before it.
        expected = [t for t in reference if t not in tokenizer.eos_token_ids]
        assert tokens == expected
