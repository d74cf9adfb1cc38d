"""The public API: generate, stream_generate, batch_generate, errors, and the CLI."""

import mlx.core as mx
import pytest
from conftest import mlx_lm_greedy
from tiny_models import tiny_model, tiny_tokenizer

import mlx_redrafter
from mlx_redrafter import Drafter, batch_generate, generate, stream_generate
from mlx_redrafter import auto as auto_module
from mlx_redrafter.calibrate import SIZES, Calibration, CalibrationKey
from mlx_redrafter.cli import main as cli_main
from mlx_redrafter.config import TreeConfig


@pytest.fixture(scope="module")
def setup(trained_llama):
    model, drafter, prompts = trained_llama
    return model, drafter, tiny_tokenizer(), prompts


def words(tokens):
    return " ".join(f"w{t}" for t in tokens)


def test_generate_text_equals_mlx_lm_greedy(setup):
    model, drafter, tokenizer, prompts = setup
    prompt = prompts[0]
    text = generate(model, drafter, tokenizer, prompt, max_tokens=30, tree="3x4")
    assert text == words(mlx_lm_greedy(model, prompt, 30))
    # A string prompt is tokenized the way mlx-lm does it.
    assert generate(model, drafter, tokenizer, words(prompt), max_tokens=30) == text
    # Lookup branches of their own length beside short drafter beams.
    tree = TreeConfig(1, 2, lookup_branches=1, lookup_length=6)
    assert generate(model, drafter, tokenizer, prompt, max_tokens=30, tree=tree) == text


def test_stream_generate_reports_steps_and_totals(setup):
    model, drafter, tokenizer, prompts = setup
    responses = list(
        stream_generate(model, drafter, tokenizer, prompts[1], max_tokens=40, tree="4x5")
    )
    tokens = [t for r in responses for t in r.tokens]
    assert tokens == mlx_lm_greedy(model, prompts[1], 40)
    assert all(len(r.tokens) == r.num_accepted + 1 for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason == "length"
    assert all(r.finish_reason is None for r in responses[:-1])
    assert last.generation_tokens == 40
    assert last.steps == len(responses)
    assert last.tokens_per_step == pytest.approx(40 / len(responses))
    assert last.tokens_per_step > 1.5
    assert last.prompt_tokens == len(prompts[1])
    assert last.prompt_tps > 0 and last.generation_tps > 0 and last.peak_memory > 0
    assert "".join(r.text for r in responses).strip() == words(tokens)


def test_drafter_none_with_the_plain_tree_is_the_plain_baseline(setup):
    model, _, tokenizer, prompts = setup
    options = {"max_tokens": 12, "tree": "plain"}
    responses = list(stream_generate(model, None, tokenizer, prompts[2], **options))
    assert [r.tokens for r in responses] == [[t] for t in mlx_lm_greedy(model, prompts[2], 12)]
    assert responses[-1].tokens_per_step == 1.0 and responses[-1].tree == "1x1"


def test_drafter_none_by_default_looks_up_and_stays_lossless(setup, monkeypatch):
    """The default tree (auto) without a drafter chooses among lookup trees. A flat
    synthetic cost curve stands in for this machine's calibration, so that whether
    speculating pays does not hang on a timing."""
    model, _, tokenizer, prompts = setup
    key = CalibrationKey("m", "d", "cpu:test", "float32", "none", "0")
    flat = Calibration(key, SIZES, (256,), ((0.01,) * len(SIZES),))
    monkeypatch.setattr(auto_module, "cached_calibration", lambda *args, **kwargs: (flat, None))
    responses = list(stream_generate(model, None, tokenizer, prompts[2], max_tokens=24))
    tokens = [t for r in responses for t in r.tokens]
    assert tokens == mlx_lm_greedy(model, prompts[2], 24)
    assert any(r.tree.startswith("0x") for r in responses)  # lookup trees were tried


def test_batch_generate_equals_generate(setup):
    model, drafter, tokenizer, prompts = setup
    batch = [prompts[3], prompts[4][:1], prompts[5]]
    texts = batch_generate(model, drafter, tokenizer, batch, max_tokens=25)
    assert texts == [generate(model, drafter, tokenizer, p, max_tokens=25) for p in batch]


def test_stop_at_eos_and_stop_strings(setup):
    model, drafter, _, prompts = setup
    reference = mlx_lm_greedy(model, prompts[0], 30)
    eos = reference[8]
    tokenizer = tiny_tokenizer(eos_token=f"w{eos}")
    responses = list(stream_generate(model, drafter, tokenizer, prompts[0], max_tokens=30))
    assert responses[-1].finish_reason == "stop"
    assert [t for r in responses for t in r.tokens] == reference[: reference.index(eos)]
    # tau counts the EOS token the target produced, though it is not in the text.
    produced = reference.index(eos) + 1
    assert responses[-1].tokens_per_step == pytest.approx(produced / len(responses))
    stop_word = f" w{reference[12]}"
    text = generate(model, drafter, tiny_tokenizer(), prompts[0], max_tokens=30, stop=stop_word)
    full = words(reference)
    assert text == full[: full.index(stop_word)]


def test_sampling_through_the_api_is_seeded(setup):
    model, drafter, tokenizer, prompts = setup
    first = generate(
        model,
        drafter,
        tokenizer,
        prompts[0],
        max_tokens=20,
        temperature=1.0,
        top_p=0.9,
        top_k=10,
        seed=7,
    )
    again = generate(
        model,
        drafter,
        tokenizer,
        prompts[0],
        max_tokens=20,
        temperature=1.0,
        top_p=0.9,
        top_k=10,
        seed=7,
    )
    assert first == again and len(first.split()) == 20


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tree": "1x0"}, "beam_length"),
        ({"tree": "2by2"}, "is not a tree"),
        ({"tree": 22}, "tree must be .auto., a TreeConfig"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"tree": "1x2+1x0"}, "lookup_length"),
    ],
)
def test_invalid_arguments_say_what_to_change(setup, kwargs, message):
    model, drafter, tokenizer, prompts = setup
    with pytest.raises(ValueError, match=message):
        generate(model, drafter, tokenizer, prompts[0], **kwargs)


def test_prompt_longer_than_the_context_is_a_clear_error(setup):
    model, drafter, tokenizer, _ = setup
    with pytest.raises(ValueError, match="context is 512"):
        generate(model, drafter, tokenizer, [1] * 600)
    with pytest.raises(ValueError, match="empty"):
        generate(model, drafter, tokenizer, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, drafter, tokenizer, [1, 99999])


def test_drafter_that_does_not_fit_is_refused(setup):
    model, _, tokenizer, prompts = setup
    other = tiny_model("llama", hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="hidden_size 48 does not match"):
        generate(model, Drafter.create(other), tokenizer, prompts[0], max_tokens=4)
    bigger = tiny_model("llama", vocab_size=80)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, Drafter.create(bigger), tokenizer, prompts[0], max_tokens=4)


def test_reduced_draft_vocabulary_decodes_losslessly(setup):
    model, _, tokenizer, prompts = setup
    reference = mlx_lm_greedy(model, prompts[0], 20)
    drafter = Drafter.create(model, draft_vocab_ids=sorted(set(reference))[:8] + [60, 61])
    assert drafter.config.draft_vocab_size == 10
    out = list(stream_generate(model, drafter, tokenizer, prompts[0], max_tokens=20, tree="3x3"))
    assert [t for r in out for t in r.tokens] == reference
    with pytest.raises(ValueError, match="exceeds the drafter's vocabulary"):
        generate(model, drafter, tokenizer, prompts[0], tree="11x2")
    with pytest.raises(ValueError, match="exceeds the drafter's vocabulary"):
        generate(model, drafter, tokenizer, prompts[0], tree=TreeConfig(11, 2))


def test_load_from_folders(tmp_path, setup):
    model, drafter, _, _ = setup
    drafter.save(tmp_path / "drafter")
    loaded = mlx_redrafter.load_drafter(tmp_path / "drafter")
    hidden = mx.ones((2, 32))
    state = mx.ones((2, 32)) * 0.5
    assert mx.array_equal(loaded.draft_logits(hidden, state), drafter.draft_logits(hidden, state))
    with pytest.raises(FileNotFoundError):
        mlx_redrafter.load_drafter(tmp_path / "missing")


def test_a_model_that_is_no_model_folder_is_a_clear_error(tmp_path):
    """An empty name, or a folder without config.json (such as "" or "."), is named
    as such before mlx-lm looks for the file."""
    with pytest.raises(ValueError, match="the model name is empty"):
        mlx_redrafter.load("")
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        mlx_redrafter.load(tmp_path)


def test_cli_reports_bad_input_without_a_traceback(capsys, tmp_path):
    code = cli_main(["generate", "--model", str(tmp_path / "nope"), "--max-tokens", "2"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("error: ")
    assert "Traceback" not in captured.err
