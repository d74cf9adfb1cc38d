"""mlx-redrafter-convert: tiny HF/GGUF round trips, CLI behaviour, error cases.

Everything here runs on tiny models built in a temporary folder (seconds). The
comparisons of real GGUF models with transformers' own GGUF loader are in
test_convert_reference.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_redrafter.convert import SUPPORTED_ARCHITECTURES, ConversionError, convert_model
from mlx_redrafter.convert.cli import main
from mlx_redrafter.convert.gguf import permute_rotary_rows, unpermute_rotary_rows

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- tiny models

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tiny model for testing the converter, with numbers 12 345 and 6789.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts several tokens and verifies them at once.",
    "Recurrent drafters predict beams of tokens from the last hidden state.",
    "Hello world! How are you today? I am fine, thank you.",
] * 20

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPTS = ["The quick brown", "Hello world", "def add(a, b):", "Speculative decoding drafts"]

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
}


def train_byte_level_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def hf_names(model_type: str, layers: int, tied: bool) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not tied:
        names.append("lm_head.weight")
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [
            p + "input_layernorm.weight",
            p + "post_attention_layernorm.weight",
            p + "self_attn.q_proj.weight",
            p + "self_attn.k_proj.weight",
            p + "self_attn.v_proj.weight",
            p + "self_attn.o_proj.weight",
            p + "mlp.gate_proj.weight",
            p + "mlp.up_proj.weight",
            p + "mlp.down_proj.weight",
        ]
        if model_type == "gemma3_text":
            names += [
                p + "pre_feedforward_layernorm.weight",
                p + "post_feedforward_layernorm.weight",
                p + "self_attn.q_norm.weight",
                p + "self_attn.k_norm.weight",
            ]
    return names


def hf_shape(name: str, c: dict[str, Any]) -> tuple[int, ...]:
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (hd,)
    if "norm" in name:
        return (h,)
    if "embed_tokens" in name or "lm_head" in name:
        return (c["vocab_size"], h)
    table = {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }
    for key, shape in table.items():
        if key in name:
            return shape
    raise AssertionError(name)


def make_tiny_hf(
    folder: Path, model_type: str = "llama", tied: bool = False, seed: int = 0
) -> dict[str, Any]:
    """A tiny random HF checkpoint (config.json, model.safetensors, tokenizer)."""
    from safetensors.numpy import save_file
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True)
    backend = train_byte_level_tokenizer()
    vocab_size = backend.get_vocab_size()
    config: dict[str, Any] = {
        **TINY,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        config.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu")
    else:
        config.update(
            model_type="gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            query_pre_attn_scalar=16,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
            rope_theta=1_000_000.0,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            num_hidden_layers=6,  # Gemma 3's global layer is every 6th
        )
    rng = np.random.default_rng(seed)
    weights = {}
    for name in hf_names(config["model_type"], config["num_hidden_layers"], tied):
        shape = hf_shape(name, config)
        if "norm" in name:
            base = 0.0 if model_type == "gemma3_text" else 1.0
            weights[name] = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (0.15 * rng.standard_normal(shape)).astype(np.float32)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(folder))
    return {"config": config, "weights": weights, "backend": backend}


def llama_cpp_row_order(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K export order, written out index by index (independent of convert/).

    In each head of d rows, GGUF row 2j+t holds HF row t*d/2 + j.
    """
    d = weight.shape[0] // n_heads
    order = [
        h * d + t * (d // 2) + j for h in range(n_heads) for j in range(d // 2) for t in range(2)
    ]
    return weight[order]


GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf: str, model_type: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    if module == "post_attention_layernorm":
        short = "ffn_norm" if model_type == "llama" else "post_attention_norm"
    else:
        short = GGUF_LAYER_NAMES[module]
    return f"blk.{layer}.{short}.{kind}"


def write_tiny_gguf(
    path: Path,
    tiny: dict[str, Any],
    *,
    arch: str | None = None,
    metadata_overrides: dict[str, int] | None = None,
    drop: tuple[str, ...] = (),
    quantize: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Export a tiny HF checkpoint as llama.cpp would (independent test-side writer)."""
    import gguf

    c = tiny["config"]
    model_type = c["model_type"]
    arch = arch or ("llama" if model_type == "llama" else "gemma3")
    writer = gguf.GGUFWriter(str(path), arch)
    meta = {
        "block_count": c["num_hidden_layers"],
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"],
        "rope.dimension_count": c["head_dim"],
        "attention.key_length": c["head_dim"],
        "attention.value_length": c["head_dim"],
        "vocab_size": c["vocab_size"],
    }
    meta.update(metadata_overrides or {})
    for key, value in meta.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", c["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    if arch == "gemma3":
        writer.add_uint32("gemma3.attention.sliding_window", c["sliding_window"])
    backend = tiny["backend"]
    vocab = backend.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(backend.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_uint32("tokenizer.ggml.unknown_token_id", vocab["<|endoftext|>"])
    writer.add_uint32("tokenizer.ggml.padding_token_id", vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, value in tiny["weights"].items():
        out = gguf_name(name, model_type)
        if out in drop:
            continue
        value = value.copy()
        if model_type == "llama" and ".attn_q." in out:
            value = llama_cpp_row_order(value, c["num_attention_heads"])
        if model_type == "llama" and ".attn_k." in out:
            value = llama_cpp_row_order(value, c["num_key_value_heads"])
        if model_type == "gemma3_text" and out.endswith("norm.weight"):
            value = value + np.float32(1.0)
        if quantize and out in quantize:
            qtype = quantize[out]
            writer.add_tensor(out, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(out, value)
    for out, value in (extra_tensors or {}).items():
        writer.add_tensor(out, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ----------------------------------------------------------------------------- helpers


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code: int, err: str, *fragments: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def logits(model_dir: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    from mlx_lm import load

    model, _ = load(str(model_dir))
    return [np.array(model(mx.array([p])).astype(mx.float32))[0] for p in prompts]


def greedy(model_dir: Path, prompt: str, max_tokens: int = 12) -> list[int]:
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(prompt)
    steps = generate_step(mx.array(ids), model, max_tokens=max_tokens, sampler=make_sampler(0.0))
    return [int(t) for t, _ in steps]


def weights_of(model_dir: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.endswith(".partial")]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("tiny") / "llama-hf"
    tiny = make_tiny_hf(folder, "llama", tied=False)
    tiny["dir"] = folder
    return tiny


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("tiny") / "gemma3-hf"
    tiny = make_tiny_hf(folder, "gemma3_text", tied=True, seed=1)
    tiny["dir"] = folder
    return tiny


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_llama: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", tiny_llama)


@pytest.fixture(scope="session")
def mlx_lm_reference(tiny_llama: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny HF model converted by mlx-lm itself (the reference for our output)."""
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp("ref") / "mlx-lm"
    convert(str(tiny_llama["dir"]), mlx_path=str(out), dtype="float32")
    return out


# ----------------------------------------------------------------------------- CLI surface


def test_help_lists_subcommands_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "model" in text and "drafter" in text and "examples:" in text
    with pytest.raises(SystemExit):
        main(["model", "--help"])
    text = capsys.readouterr().out
    for option in ("--quantize", "--bits", "--group-size", "--dtype", "--force", ".gguf"):
        assert option in text
    assert "mlx-redrafter-convert model" in text


def test_cli_rejects_bad_bits(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["model", "x.gguf", "-o", "out", "--bits", "3"])
    assert exc.value.code == 2


# ----------------------------------------------------------------------------- HF input


def test_tiny_hf_matches_mlx_lm_conversion(
    tiny_llama: dict[str, Any],
    mlx_lm_reference: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "ours"
    code, _, err = run_cli(
        ["model", str(tiny_llama["dir"]), "-o", str(out), "--dtype", "float32"], capsys
    )
    assert code == 0, err
    ours, ref = weights_of(out), weights_of(mlx_lm_reference)
    assert sorted(ours) == sorted(ref)
    for name in ref:
        assert ours[name].dtype == ref[name].dtype
        assert mx.array_equal(ours[name], ref[name]).item(), name
    for prompt in PROMPTS:
        assert greedy(out, prompt) == greedy(mlx_lm_reference, prompt)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def test_tiny_hf_quantized_matches_mlx_lm(
    tiny_llama: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlx_lm.convert import convert

    ref = tmp_path / "ref-q8"
    convert(
        str(tiny_llama["dir"]),
        mlx_path=str(ref),
        quantize=True,
        q_bits=8,
        q_group_size=32,
        dtype="float32",
    )
    out = tmp_path / "ours-q8"
    code, _, err = run_cli(
        [
            "model",
            str(tiny_llama["dir"]),
            "-o",
            str(out),
            "--quantize",
            "--bits",
            "8",
            "--group-size",
            "32",
            "--dtype",
            "float32",
            "-q",
        ],
        capsys,
    )
    assert code == 0, err
    assert err == ""  # --quiet
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    ours, theirs = weights_of(out), weights_of(ref)
    assert sorted(ours) == sorted(theirs)
    assert any(name.endswith(".scales") for name in ours)
    for name in theirs:
        assert mx.array_equal(ours[name], theirs[name]).item(), name
    assert greedy(out, PROMPTS[0]) == greedy(ref, PROMPTS[0])


def test_hf_dtype_option(
    tiny_llama: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bf16"
    code, _, err = run_cli(
        ["model", str(tiny_llama["dir"]), "-o", str(out), "--dtype", "bfloat16", "-q"], capsys
    )
    assert code == 0, err
    assert {v.dtype for v in weights_of(out).values()} == {mx.bfloat16}


# ----------------------------------------------------------------------------- GGUF input


def test_unpermute_inverts_llama_cpp_order() -> None:
    rng = np.random.default_rng(3)
    for heads, head_dim, cols in ((1, 2, 3), (4, 16, 8), (3, 64, 5), (8, 8, 1)):
        w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        gguf_order = llama_cpp_row_order(w, heads)
        np.testing.assert_array_equal(unpermute_rotary_rows(gguf_order, heads), w)
        np.testing.assert_array_equal(permute_rotary_rows(w, heads), gguf_order)
        bias = rng.standard_normal(heads * head_dim).astype(np.float32)
        np.testing.assert_array_equal(
            unpermute_rotary_rows(llama_cpp_row_order(bias, heads), heads), bias
        )


def test_tiny_llama_gguf_matches_hf_conversion(
    tiny_llama: dict[str, Any],
    tiny_llama_gguf: Path,
    mlx_lm_reference: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """GGUF (permuted Q/K, stored tokenizer) -> MLX equals HF -> MLX by mlx-lm."""
    out = tmp_path / "from-gguf"
    code, _, err = run_cli(["model", str(tiny_llama_gguf), "-o", str(out)], capsys)
    assert code == 0, err
    assert "[gguf] dequantizing" in err  # progress is shown
    ours, ref = weights_of(out), weights_of(mlx_lm_reference)
    assert sorted(ours) == sorted(ref)
    for name in ref:  # F32 GGUF: the un-permuted weights are bit-identical
        assert mx.array_equal(ours[name], ref[name]).item(), name
    config = json.loads((out / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "vocab_size",
        "head_dim",
    ):
        assert config[key] == tiny_llama["config"][key]
    assert config["tie_word_embeddings"] is False

    from mlx_lm import load

    _, ours_tok = load(str(out))
    _, ref_tok = load(str(mlx_lm_reference))
    texts = [*PROMPTS, "numbers 12 345", "  two spaces\nand a newline", "<|im_start|>hi<|im_end|>"]
    for text in texts:
        assert ours_tok.encode(text) == ref_tok.encode(text), text
        assert ours_tok.decode(ours_tok.encode(text)) == text
    assert ours_tok.eos_token_id == ref_tok.eos_token_id
    assert ours_tok.chat_template is not None
    for prompt in PROMPTS:
        assert greedy(out, prompt) == greedy(mlx_lm_reference, prompt)


def test_interleaved_rope_on_raw_gguf_layout_is_equivalent(
    tiny_llama: dict[str, Any], tiny_llama_gguf: Path, mlx_lm_reference: Path
) -> None:
    """Why un-permuting is right: the raw GGUF rows only work with interleaved
    (traditional) RoPE, and then give the same logits; with mlx-lm's default
    rotate-half RoPE they do not."""
    from mlx_lm import load

    model, _ = load(str(mlx_lm_reference))
    c = tiny_llama["config"]
    ids = mx.array([[5, 40, 77, 120, 9, 200, 33]])
    expected = model(ids)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj.weight = mx.array(
            llama_cpp_row_order(np.array(attn.q_proj.weight), c["num_attention_heads"])
        )
        attn.k_proj.weight = mx.array(
            llama_cpp_row_order(np.array(attn.k_proj.weight), c["num_key_value_heads"])
        )
    wrong = model(ids)
    assert mx.abs(wrong - expected).max().item() > 1e-2
    for layer in model.model.layers:
        layer.self_attn.rope.traditional = True
    np.testing.assert_allclose(np.array(model(ids)), np.array(expected), atol=1e-4)


def test_tiny_gemma3_gguf_matches_hf_conversion(
    tiny_gemma3: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gemma3: norms stored as 1 + w come back as w; config from gemma3.* keys."""
    from mlx_lm.convert import convert

    ref = tmp_path / "ref"
    convert(str(tiny_gemma3["dir"]), mlx_path=str(ref), dtype="float32")
    path = write_tiny_gguf(tmp_path / "tiny-gemma3.gguf", tiny_gemma3)
    out = tmp_path / "ours"
    code, _, err = run_cli(["model", str(path), "-o", str(out), "-q"], capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["query_pre_attn_scalar"] == 16 and config["sliding_window_pattern"] == 6
    ours, theirs = weights_of(out), weights_of(ref)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_allclose(
            np.array(ours[name]), np.array(theirs[name]), atol=1e-6, err_msg=name
        )
    prompts = [[3, 50, 70, 90], [100, 101, 102, 5, 6]]
    for a, b in zip(logits(out, prompts), logits(ref, prompts)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_gguf_quantized_tensor_dequantized_exactly(
    tiny_llama: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Q8_0 tensor comes out as exactly the value the Q8_0 blocks encode."""
    import gguf

    name = "blk.0.ffn_up.weight"
    path = write_tiny_gguf(
        tmp_path / "q8.gguf", tiny_llama, quantize={name: gguf.GGMLQuantizationType.Q8_0}
    )
    out = tmp_path / "out"
    code, _, err = run_cli(["model", str(path), "-o", str(out), "-q"], capsys)
    assert code == 0, err
    original = tiny_llama["weights"]["model.layers.0.mlp.up_proj.weight"]
    # decode the stored Q8_0 blocks by hand: per 32 values, one float16 scale
    # followed by 32 int8 quants; value = scale * quant
    raw = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    blocks = np.asarray(raw.data, dtype=np.uint8).reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    quants = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    expected = (scale * quants).reshape(original.shape)
    got = np.array(weights_of(out)["model.layers.0.mlp.up_proj.weight"])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(got, original, atol=np.abs(original).max() / 127)
    assert not np.array_equal(got, original)  # it really was quantized


def test_llama3_rope_scaling_recovered_from_rope_freqs(
    tiny_llama: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp stores Llama-3.1 rope scaling as per-frequency divisors."""
    c = tiny_llama["config"]
    dim, base, factor, original = c["head_dim"], c["rope_theta"], 8.0, 8192
    divisors = []
    for i in range(0, dim, 2):
        wavelen = 2 * np.pi * base ** (i / dim)
        if wavelen < original / 4.0:
            divisors.append(1.0)
        elif wavelen > original / 1.0:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - 1.0) / (4.0 - 1.0)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    assert len(set(divisors)) >= 3  # all three regimes occur
    path = write_tiny_gguf(
        tmp_path / "llama31.gguf",
        tiny_llama,
        extra_tensors={"rope_freqs.weight": np.array(divisors, dtype=np.float32)},
    )
    out = tmp_path / "out"
    code, _, err = run_cli(["model", str(path), "-o", str(out), "-q"], capsys)
    assert code == 0, err
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert np.isfinite(logits(out, [[1, 2, 3]])[0]).all()


# ----------------------------------------------------------------------------- safety


def test_existing_output_needs_force(
    tiny_llama_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    code, _, err = run_cli(["model", str(tiny_llama_gguf), "-o", str(out), "-q"], capsys)
    assert_one_line_error(code, err, "already exists", "--force")
    assert (out / "keep.txt").read_text() == "old"

    code, _, err = run_cli(["model", str(tiny_llama_gguf), "-o", str(out), "-q", "--force"], capsys)
    assert code == 0, err
    assert not (out / "keep.txt").exists()
    assert (out / "config.json").is_file()
    assert no_leftovers(tmp_path)


def test_force_keeps_old_output_when_conversion_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    code, _, err = run_cli(["model", str(bad), "-o", str(out), "--force", "-q"], capsys)
    assert_one_line_error(code, err)
    assert (out / "keep.txt").read_text() == "old"
    assert no_leftovers(tmp_path)


def test_interrupted_run_leaves_nothing(
    tiny_llama_gguf: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlx_redrafter.convert import api as convert_api

    def interrupted(src: str, dst: Path, **_: Any) -> None:
        dst.mkdir()
        (dst / "config.json").write_text("{}")  # half-written output
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_api, "_mlx_lm_convert", interrupted)
    out = tmp_path / "out"
    code, _, err = run_cli(["model", str(tiny_llama_gguf), "-o", str(out), "-q"], capsys)
    assert code == 130 and "interrupted" in err and "Traceback" not in err
    assert not out.exists()
    assert no_leftovers(tmp_path)

    out.mkdir()
    (out / "keep.txt").write_text("old")
    code, _, _ = run_cli(["model", str(tiny_llama_gguf), "-o", str(out), "-q", "--force"], capsys)
    assert code == 130
    assert (out / "keep.txt").read_text() == "old"
    assert no_leftovers(tmp_path)


# ----------------------------------------------------------------------------- error cases


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.gguf"
    code, _, err = run_cli(["model", str(missing), "-o", str(tmp_path / "o")], capsys)
    assert_one_line_error(code, err, "no such file", str(missing))
    code, _, err = run_cli(
        ["model", str(tmp_path / "no-folder"), "-o", str(tmp_path / "o")], capsys
    )
    assert_one_line_error(code, err, "no such file or directory")
    assert not (tmp_path / "o").exists()


def test_folder_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(["model", str(tmp_path / "empty"), "-o", str(tmp_path / "o")], capsys)
    assert_one_line_error(code, err, "config.json")


def test_unknown_architecture(
    tiny_llama: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_tiny_gguf(tmp_path / "mamba.gguf", tiny_llama, arch="mamba")
    code, _, err = run_cli(["model", str(path), "-o", str(tmp_path / "o")], capsys)
    line = assert_one_line_error(code, err, "'mamba'")
    for name in SUPPORTED_ARCHITECTURES:
        assert name in line
    assert set(SUPPORTED_ARCHITECTURES) >= {"llama", "gemma3", "qwen2", "qwen3", "mistral"}
    assert set(SUPPORTED_ARCHITECTURES) >= {"phi3", "gemma2"}
    assert not (tmp_path / "o").exists() and no_leftovers(tmp_path)


def test_corrupt_and_truncated_gguf(
    tiny_llama_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tiny_llama_gguf.read_bytes()
    cases = {
        "garbage.gguf": b"this is not a gguf file" * 40,
        "empty.gguf": b"",
        "header.gguf": data[:20],
        "metadata.gguf": data[: len(data) // 10],
        "tensors.gguf": data[: len(data) // 2],
        "last-bytes.gguf": data[:-64],
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        out = tmp_path / f"out-{name}"
        code, _, err = run_cli(["model", str(path), "-o", str(out), "-q"], capsys)
        line = assert_one_line_error(code, err)
        assert "corrupt" in line or "truncated" in line or "GGUF" in line, line
        assert not out.exists()
    assert no_leftovers(tmp_path)


def test_shapes_that_do_not_match_config(
    tiny_llama: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_tiny_gguf(
        tmp_path / "bad-ffn.gguf", tiny_llama, metadata_overrides={"feed_forward_length": 80}
    )
    code, _, err = run_cli(["model", str(path), "-o", str(tmp_path / "o1")], capsys)
    assert_one_line_error(code, err, "shape", "ffn_")

    path = write_tiny_gguf(
        tmp_path / "bad-heads.gguf", tiny_llama, metadata_overrides={"attention.head_count": 2}
    )
    code, _, err = run_cli(["model", str(path), "-o", str(tmp_path / "o2")], capsys)
    assert_one_line_error(code, err, "shape", "attn_")

    path = write_tiny_gguf(tmp_path / "missing.gguf", tiny_llama, drop=("blk.1.ffn_down.weight",))
    code, _, err = run_cli(["model", str(path), "-o", str(tmp_path / "o3")], capsys)
    assert_one_line_error(code, err, "model.layers.1.mlp.down_proj.weight")
    assert no_leftovers(tmp_path)


def test_hf_folder_with_wrong_shapes(
    tiny_llama: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(tiny_llama["dir"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 80
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(["model", str(folder), "-o", str(tmp_path / "o"), "-q"], capsys)
    assert_one_line_error(code, err)
    assert not (tmp_path / "o").exists() and no_leftovers(tmp_path)


def test_library_raises_conversion_error(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="no such file"):
        convert_model(tmp_path / "x.gguf", tmp_path / "o")


def test_console_script_prints_one_line(tmp_path: Path) -> None:
    """The real process: one 'error:' line on stderr, exit status 2, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_redrafter.convert.cli",
            "model",
            str(tmp_path / "nope.gguf"),
            "-o",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("error: no such file")


# ----------------------------------------------------------------------------- SPM tokenizers


def _sentencepiece_model(add_dummy_prefix: bool) -> Any:
    import io

    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=buffer,
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        user_defined_symbols=["<tool>"],
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=buffer.getvalue())


def _gguf_spm_metadata(sp: Any, add_dummy_prefix: bool) -> dict[str, Any]:
    """The tokenizer.ggml.* keys llama.cpp writes for a SentencePiece model."""
    types = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        elif sp.id_to_piece(i) == "<tool>":
            types.append(4)
        else:
            types.append(1)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_dummy_prefix,
        "tokenizer.ggml.add_bos_token": True,
    }


@pytest.mark.parametrize(("architecture", "add_dummy_prefix"), [("llama", True), ("gemma3", False)])
def test_sentencepiece_vocabulary_encodes_like_sentencepiece(
    architecture: str, add_dummy_prefix: bool
) -> None:
    """The rebuilt SPM tokenizer (merges recovered from scores, byte fallback)
    agrees with the sentencepiece library on the model it was rebuilt from."""
    from mlx_redrafter.convert.tokenizer import build_tokenizer

    sp = _sentencepiece_model(add_dummy_prefix)
    tokenizer = build_tokenizer(_gguf_spm_metadata(sp, add_dummy_prefix), architecture)
    texts = [*CORPUS[:6], "unseen wörds ✓ and 東京", "  spaces  inside ", "a\nb"]
    if not add_dummy_prefix:  # see build_tokenizer: llama.cpp's prefix around added tokens
        texts += ["x<tool>y", "<tool>y"]
    for text in texts:
        ids = tokenizer(text).input_ids
        assert ids[0] == 1  # BOS
        assert ids[1:] == sp.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == sp.decode(sp.encode(text))
