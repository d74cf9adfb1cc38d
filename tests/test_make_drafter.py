"""`make-drafter` end to end on a tiny model: the whole recipe, killed in every phase and
resumed, makes the drafter an uninterrupted run makes; drafter discovery by fingerprint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import decode_tokens, mlx_lm_greedy
from mlx.utils import tree_flatten
from tiny_models import _COMMON, FAMILY_CONFIGS, tiny_model, tiny_tokenizer

from mlx_redrafter.cli import main
from mlx_redrafter.config import TreeConfig
from mlx_redrafter.drafter import Drafter, DrafterError
from mlx_redrafter.fingerprint import (
    TARGET_FILE,
    mismatch,
    read_fingerprint,
    target_fingerprint,
)
from mlx_redrafter.loading import load
from mlx_redrafter.prompts import TRAIN_PROMPTS, encode_prompt, read_prompts
from mlx_redrafter.training.budget import parse_duration

RECIPE = [
    "--records", "120", "--max-tokens", "32", "--epochs", "20",
    "--eval-prompts", "4", "--eval-max-tokens", "16", "--quiet",
]  # fmt: skip
DRAFTER_FILES = ("config.json", "model.safetensors", "ngrams.safetensors", "acceptance.json")


def _model_folder(folder: Path, seed: int = 0) -> Path:
    import mlx_lm.utils

    folder.mkdir(parents=True)
    mlx_lm.utils.save_model(folder, tiny_model("llama", seed=seed))
    mlx_lm.utils.save_config({**_COMMON, **FAMILY_CONFIGS["llama"]}, folder / "config.json")
    tiny_tokenizer(eos_token="w20")._tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny model folder, a prompt file (two sources), and an uninterrupted run."""
    root = tmp_path_factory.mktemp("make-drafter")
    model = _model_folder(root / "model")
    rng = np.random.default_rng(3)
    lines = [
        json.dumps(
            {
                "id": f"q{i}",
                "source": "a" if i % 3 else "b",
                "prompt": " ".join(f"w{t}" for t in rng.integers(21, 64, 5)),
            }
        )
        for i in range(160)
    ]
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    reference = root / "reference"
    command = ["make-drafter", str(model), "--output", str(reference), "--prompts", str(prompts)]
    assert main([*command, *RECIPE]) == 0
    return model, prompts, reference


def _run_killed_when(command: list[str], ready, env: dict[str, str]) -> bool:
    """Start the CLI; SIGKILL it as soon as ready() holds. True if it was killed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_redrafter.cli", *command],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while process.poll() is None:
        if ready():
            process.send_signal(signal.SIGKILL)
            process.wait()
            return True
        time.sleep(0.02)
    return False


def _done(folder: Path) -> list[str]:
    try:
        return list(json.loads((folder / "work" / "state.json").read_text())["done"])
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_killed_in_every_phase_and_resumed_makes_the_same_drafter(workspace, tmp_path):
    model, prompts, reference = workspace
    output = tmp_path / "resumed"
    command = ["make-drafter", str(model), "--output", str(output), "--prompts", str(prompts)]
    command += RECIPE
    env = {**os.environ, "MLX_REDRAFTER_CACHE": str(tmp_path / "cache")}
    kills = [
        lambda: any((output / "work" / "distilled").glob("shard-*.npz")),  # mid-distill
        lambda: "distill" in _done(output),  # in training
        lambda: "train" in _done(output),  # in the evaluation
    ]
    killed = [_run_killed_when(command, ready, env) for ready in kills]
    assert killed == [True, True, True]
    assert main(command) == 0
    for name in DRAFTER_FILES + (TARGET_FILE,):
        assert (output / name).read_bytes() == (reference / name).read_bytes(), name
    card = (output / "README.md").read_text()
    for section in ("## Base model", "## Data", "## Recipe", "## Metrics", "## Reproduce"):
        assert section in card
    assert "--records 120 --max-tokens 32 --epochs 20" in card
    assert not (output / "work" / "hidden").exists()
    assert not list(output.glob(".*partial"))


def test_replies_distilled_earlier_are_used_and_the_card_says_how_to_reproduce(workspace, tmp_path):
    """A folder that already holds more distilled replies than --records asks for
    trains on all of them; the card says so and puts the copy into its reproduce
    commands. Here those replies are the reference run's 120, so the drafter is the
    reference drafter bit for bit."""
    import shutil

    model, prompts, reference = workspace
    output = tmp_path / "more"
    shutil.copytree(reference / "work" / "distilled", output / "work" / "distilled")
    recipe = [*RECIPE]
    recipe[recipe.index("--records") + 1] = "60"
    command = ["make-drafter", str(model), "--output", str(output), "--prompts", str(prompts)]
    assert main([*command, *recipe]) == 0
    for name in ("config.json", "model.safetensors", "ngrams.safetensors"):
        assert (output / name).read_bytes() == (reference / name).read_bytes(), name
    card = (output / "README.md").read_text()
    assert "cp -r DISTILLED NEW_FOLDER/work/distilled" in card
    assert "trained on 120 distilled replies, more than the 60" in card
    assert "cp -r DISTILLED" not in (reference / "README.md").read_text()


def test_the_drafter_decodes_losslessly_and_its_card_names_its_figures(workspace):
    model_folder, _, reference = workspace
    model, drafter, tokenizer = load(model_folder, drafter=reference)
    assert drafter is not None and drafter.acceptance is not None
    held_out = read_prompts(reference / "eval_prompts.jsonl")
    prompts = [encode_prompt(tokenizer, r.messages) for r in held_out]
    for tree in ("auto", TreeConfig(2, 4)):
        ours, events = decode_tokens(model, drafter, prompts, tree, max_tokens=24)
        assert ours == [mlx_lm_greedy(model, p, 24)[: len(o)] for p, o in zip(prompts, ours)]
    accepted = sum(n for event in events for n in event.num_accepted)
    assert accepted >= 8  # it drafts well
    evaluation = json.loads((reference / "work" / "evaluation.json").read_text())
    rows = {row["method"]: row for row in evaluation["bench"]["summary"]}
    card = (reference / "README.md").read_text()
    assert list(rows) == ["mlx-lm", "plain", "redrafter auto no drafter", "redrafter auto"]
    auto = rows["redrafter auto"]
    assert all(row["match_rate"] == 1.0 for row in rows.values())
    assert f"{auto['speedup']:.2f}x" in card and f"{auto['tau']:.2f}" in card
    assert len(held_out) == 4
    distilled = {r.id for r in read_prompts(workspace[1])} - {r.id for r in held_out}
    assert len(distilled) == 156


def test_a_drafter_folder_inside_the_model_is_found_and_checked(workspace, tmp_path):
    import shutil

    model_folder, _, reference = workspace
    copy = tmp_path / "model"
    shutil.copytree(model_folder, copy)
    shutil.copytree(reference, copy / "drafter", ignore=shutil.ignore_patterns("work"))
    _, drafter, _ = load(copy)
    assert drafter is not None
    explicit = load(model_folder, drafter=reference)[1]
    found, given = tree_flatten(drafter.parameters()), tree_flatten(explicit.parameters())
    assert [k for k, _ in found] == [k for k, _ in given]
    assert all(np.array_equal(np.array(a), np.array(b)) for (_, a), (_, b) in zip(found, given))
    other = _model_folder(tmp_path / "other", seed=5)
    with pytest.raises(DrafterError, match=r"was made for llama .* but the model .*other"):
        load(other, drafter=reference)
    shutil.copytree(reference, other / "drafter", ignore=shutil.ignore_patterns("work"))
    with pytest.raises(DrafterError, match="embedding weights differ"):
        load(other)
    assert load(model_folder)[1] is None  # nothing beside it, nothing shipped for it


def test_the_fingerprint_survives_quantization_and_tells_models_apart():
    tokenizer = tiny_tokenizer(eos_token="w20")
    model = tiny_model("llama", hidden_size=64, intermediate_size=128)
    original = target_fingerprint(model, tokenizer)
    quantized = tiny_model("llama", hidden_size=64, intermediate_size=128)
    nn.quantize(quantized, group_size=32, bits=4)
    assert mismatch(original, target_fingerprint(quantized, tokenizer)) is None
    half = tiny_model("llama", hidden_size=64, intermediate_size=128, dtype=mx.bfloat16)
    assert mismatch(original, target_fingerprint(half, tokenizer)) is None
    other = tiny_model("llama", seed=1, hidden_size=64, intermediate_size=128)
    assert "embedding weights differ" in str(
        mismatch(original, target_fingerprint(other, tokenizer))
    )
    renamed = tiny_tokenizer(vocab_size=65)  # one more word: another vocabulary
    assert "tokenizers" in str(mismatch(original, target_fingerprint(model, renamed)))


def test_a_malformed_fingerprint_is_a_clear_error(tmp_path):
    (tmp_path / TARGET_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a valid target fingerprint"):
        read_fingerprint(tmp_path)


def test_the_prompt_set_ships_in_the_package():
    records = read_prompts(TRAIN_PROMPTS)
    assert len(records) == 11046
    assert {r.source for r in records} == {
        "gsm8k-train",
        "gpteacher-roleplay",
        "self-instruct-user-oriented",
        "self-instruct-seed",
    }


@pytest.mark.parametrize(
    ("text", "seconds"), [("8m", 480), ("4h", 14400), ("1h30m", 5400), ("90s", 90), ("75", 75)]
)
def test_time_budgets_parse(text, seconds):
    assert parse_duration(text) == seconds


def test_bad_options_are_one_line_errors(workspace, tmp_path, capsys):
    model, prompts, reference = workspace
    base = ["make-drafter", str(model), "--prompts", str(prompts)]
    cases = [
        (["--output", str(tmp_path / "a"), "--time-budget", "soon"], "not a duration"),
        (["--output", str(tmp_path / "b"), "--time-budget", "30s"], "at least 1m"),
        (["--output", str(tmp_path / "c"), "--records", "0"], "--records must be >= 1"),
        (["--output", str(model)], "not a make-drafter run"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
    other = _model_folder(tmp_path / "other", seed=5)
    assert main(["make-drafter", str(other), "--output", str(reference), *RECIPE]) == 2
    assert "holds a make-drafter run for" in capsys.readouterr().err


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_model_gets_a_drafter_too(workspace, tmp_path, bits):
    """The recipe on an mlx-lm model quantized to 4 or 8 bits (as mlx-community ships
    them): the drafter loads against it and decodes as mlx-lm does."""
    from mlx_redrafter.training.recipe import Recipe, Run, Target, make_drafter

    _, prompts, _ = workspace
    model = tiny_model("llama", hidden_size=64, intermediate_size=128)
    nn.quantize(model, group_size=32, bits=bits)
    tokenizer = tiny_tokenizer(eos_token="w20")
    recipe = Recipe(records=24, max_tokens=16, eval_prompts=2, eval_max_tokens=8)
    output = make_drafter(
        Target(model, tokenizer, f"tiny-{bits}bit"),
        read_prompts(prompts),
        Run(tmp_path / "drafter", progress=False),
        recipe,
        "test prompts",
    )
    drafter = Drafter.load(output)
    drafter.check_fits(model)
    assert read_fingerprint(output) == target_fingerprint(model, tokenizer)
    prompt = [encode_prompt(tokenizer, r.messages) for r in read_prompts(prompts)[:1]]
    (ours,), _ = decode_tokens(model, drafter, prompt, TreeConfig(2, 3), max_tokens=12)
    assert ours == mlx_lm_greedy(model, prompt[0], 12)


def test_the_card_is_formatted_as_the_repository_checks_it(workspace):
    """Cards get committed (the shipped ones are): their code blocks pass `ruff format`."""
    card = workspace[2] / "README.md"
    check = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(card)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
