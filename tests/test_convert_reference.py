"""Real GGUF models converted by convert/ against independent references.

* transformers' own GGUF loader (torch, float32) gives the reference next-token
  log-probabilities; the converted MLX model (float32) must match them within a
  stated tolerance and agree on the top-1 token at every position;
* transformers' GGUF tokenizer must encode like the rebuilt tokenizer;
* transformers' torch dequantizer (a separate implementation from the gguf
  package's NumPy one that convert/ uses) must give the same float32 weights.

SmolLM2-135M-Instruct (llama, Q4_1 + Q8_0) is converted once per session
through ``default_model_path()`` with a temporary cache, which also tests the
cache; Gemma-3-270M (gemma3, Q4_K/Q5_0/Q6_K/Q8_0) when its packages are
installed.  Tests that need torch skip with a visible reason without it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_redrafter import defaults

# Max |log p_mlx - log p_transformers| over the whole vocabulary, every position
# of every prompt. Measured: 3.1e-4 (SmolLM2), 1.0e-3 (Gemma 3, embedding scale
# aligned, see below). Both are float32 rounding across 30 / 18 layers.
SMOLLM2_TOLERANCE = 2e-3
GEMMA3_TOLERANCE = 5e-3

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "1 + 1 = 2, 2 + 2 =",
    "Hello! How are you today?",
    "The quick brown fox jumps over the lazy dog because",
]

TOKENIZER_TEXTS = [
    *PROMPTS,
    "  leading spaces and trailing ",
    "tabs\tand\nnewlines\n\n\nend",
    "The year 2024 had 366 days; pi is 3.14159.",
    "Ünïcödé façade — naïve café 東京 🚀",
    "<|im_start|>user\nhi<|im_end|>",
    "<start_of_turn>user\nhi<end_of_turn>",
    "multiple    spaces   here",
    "don't can't I'll we've",
    "",
]


def _torch() -> Any:
    return pytest.importorskip("torch", reason="torch is needed for the transformers reference")


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("mlx-redrafter-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(defaults.CACHE_ENV, str(root))
        yield root


@pytest.fixture(scope="session")
def smollm2(cache_root: Path) -> dict[str, Any]:
    os.environ[defaults.CACHE_ENV] = str(cache_root)
    start = time.monotonic()
    path = defaults.default_model_path(progress=False)
    return {"gguf": defaults.smollm2_gguf_path(), "mlx": path, "seconds": time.monotonic() - start}


@pytest.fixture(scope="session")
def gemma3(cache_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not defaults.gemma3_270m_available():
        pytest.skip(f"Gemma-3-270M packages not installed ({defaults.GEMMA3_INSTALL})")
    os.environ[defaults.CACHE_ENV] = str(cache_root)
    gguf_path = defaults.assemble_gemma3_270m_gguf(
        tmp_path_factory.mktemp("gemma3") / defaults.GEMMA3_GGUF
    )
    return {"gguf": gguf_path, "mlx": defaults.gemma3_270m_path(progress=False)}


def _reference_model(gguf_path: Path) -> Any:
    torch = _torch()
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


def _compare_logprobs(mlx_dir: Path, reference: Any, add_bos: bool) -> tuple[float, int]:
    """Max abs log-prob difference and number of positions compared."""
    import torch
    from mlx_lm import load

    model, tokenizer = load(str(mlx_dir))
    worst, positions = 0.0, 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert (ids[0] == tokenizer.bos_token_id) == add_bos
        out = model(mx.array([ids])).astype(mx.float32)
        ours = np.array(out - mx.logsumexp(out, axis=-1, keepdims=True))[0]
        with torch.no_grad():
            ref = torch.log_softmax(reference(torch.tensor([ids])).logits.float(), -1)[0]
        ref_np = ref.numpy()
        np.testing.assert_array_equal(ours.argmax(-1), ref_np.argmax(-1), err_msg=prompt)
        worst = max(worst, float(np.abs(ours - ref_np).max()))
        positions += len(ids)
    return worst, positions


# ----------------------------------------------------------------------------- SmolLM2


def test_smollm2_matches_transformers(smollm2: dict[str, Any]) -> None:
    reference = _reference_model(smollm2["gguf"])
    worst, positions = _compare_logprobs(smollm2["mlx"], reference, add_bos=False)
    print(f"SmolLM2: max |dlogp| = {worst:.2e} over {positions} positions")
    assert worst < SMOLLM2_TOLERANCE


def test_smollm2_tokenizer_matches_transformers(smollm2: dict[str, Any]) -> None:
    _torch()
    from mlx_lm.utils import load_tokenizer
    from transformers import AutoTokenizer

    gguf_path = smollm2["gguf"]
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = load_tokenizer(smollm2["mlx"])
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids) == text
    # SmolLM's pre-tokenizer puts every digit in its own token
    assert len(ours.encode("2024")) == 4
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


def test_smollm2_folder_loads_with_mlx_lm_and_generates(smollm2: dict[str, Any]) -> None:
    from mlx_lm import generate, load

    model, tokenizer = load(str(smollm2["mlx"]))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    text = generate(model, tokenizer, prompt=prompt, max_tokens=12, verbose=False)
    assert "Paris" in text


# ----------------------------------------------------------------------------- dequantization


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_dequantization_matches_transformers_torch_kernels(
    which: str, request: pytest.FixtureRequest
) -> None:
    torch = _torch()
    try:
        from transformers.integrations.gguf.dequant import GGML_BLOCK
        from transformers.integrations.gguf.dequant import dequantize as torch_dequantize
    except ImportError:
        pytest.skip("this transformers version has no torch GGUF dequantizer")
    from mlx_redrafter.convert.gguf import read_gguf

    if which == "smollm2":
        gguf_path = defaults.smollm2_gguf_path()
    else:
        gguf_path = request.getfixturevalue("gemma3")["gguf"]
    model = read_gguf(gguf_path)
    checked: dict[str, int] = {}
    for tensor in model.tensors.values():
        ggml_type = int(tensor._raw.tensor_type)
        if ggml_type not in GGML_BLOCK or checked.get(tensor.type_name, 0) >= 3:
            continue
        raw = torch.from_numpy(np.array(tensor._raw.data, dtype=np.uint8).reshape(-1))
        expected = torch_dequantize(raw, ggml_type).numpy().reshape(tensor.shape)
        np.testing.assert_allclose(
            tensor.dequantize(),
            expected,
            rtol=1e-6,
            atol=1e-7,
            err_msg=f"{tensor.name} ({tensor.type_name})",
        )
        checked[tensor.type_name] = checked.get(tensor.type_name, 0) + 1
    expected_types = {"smollm2": {"Q4_1", "Q8_0"}, "gemma3": {"Q4_K", "Q6_K", "Q8_0"}}[which]
    assert expected_types <= set(checked)


# ----------------------------------------------------------------------------- Gemma 3


@pytest.mark.slow
def test_gemma3_matches_transformers(gemma3: dict[str, Any]) -> None:
    """mlx-lm's gemma3_text multiplies embeddings by sqrt(hidden_size) rounded to
    bfloat16 (25.25 instead of 25.298 for 640), transformers in float32; that
    modelling choice alone moves log-probs by up to ~0.06. The reference is given
    the same constant so the comparison measures the conversion."""
    torch = _torch()
    reference = _reference_model(gemma3["gguf"])
    embed = reference.model.embed_tokens
    hidden = reference.config.hidden_size
    embed.embed_scale = torch.tensor(hidden**0.5, dtype=torch.bfloat16).float()
    worst, positions = _compare_logprobs(gemma3["mlx"], reference, add_bos=True)
    print(f"Gemma 3: max |dlogp| = {worst:.2e} over {positions} positions")
    assert worst < GEMMA3_TOLERANCE


@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers(gemma3: dict[str, Any]) -> None:
    _torch()
    from mlx_lm.utils import load_tokenizer
    from transformers import AutoTokenizer

    gguf_path = gemma3["gguf"]
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = load_tokenizer(gemma3["mlx"])
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ids[0] == ours.bos_token_id == 2  # <bos> is added
        assert ours.decode(ids[1:]) == text


# ----------------------------------------------------------------------------- cache


def test_default_model_is_cached_and_reused(
    smollm2: dict[str, Any], cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_redrafter.convert import api as convert_api

    path = smollm2["mlx"]
    assert path.parent == cache_root
    assert path.name.startswith(defaults.DEFAULT_MODEL_NAME)
    assert (path / "config.json").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def must_not_convert(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the cached folder should have been reused")

    monkeypatch.setattr(convert_api, "convert_model", must_not_convert)
    monkeypatch.setenv(defaults.CACHE_ENV, str(cache_root))
    start = time.monotonic()
    again = defaults.default_model_path(progress=False)
    assert again == path
    assert time.monotonic() - start < 5.0
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in cache_root.iterdir() if p.name.endswith(".partial")]
    print(f"first conversion took {smollm2['seconds']:.1f}s")


def test_the_converted_gemma_finds_its_shipped_drafter_and_decodes_as_mlx_lm(
    gemma3: dict[str, Any],
) -> None:
    """Discovery by fingerprint: `load()` of the converted Gemma-3-270M folder picks the
    drafter shipped for it (not SmolLM2's), and greedy output stays mlx-lm's."""
    from conftest import decode_tokens, mlx_lm_greedy

    from mlx_redrafter import Drafter, TreeConfig, load
    from mlx_redrafter.loading import SHIPPED_DRAFTERS
    from mlx_redrafter.prompts import encode_prompt

    model, drafter, tokenizer = load(gemma3["mlx"])
    assert drafter is not None
    shipped = Drafter.load(SHIPPED_DRAFTERS / "gemma-3-270m")
    assert drafter.config == shipped.config
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": "List three primary colors."}])
    tree = TreeConfig(2, 3, lookup_branches=1)
    (ours,), _ = decode_tokens(model, drafter, [prompt], tree, max_tokens=32)
    assert ours == mlx_lm_greedy(model, prompt, 32)
