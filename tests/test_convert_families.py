"""GGUF files of every supported family, written as llama.cpp writes them, converted
by `mlx-redrafter-convert` and checked against transformers' own GGUF loader (an
independent reader of the same file, in torch float32).

The files are tiny and random; what they exercise is each family's metadata keys,
tensor names and layout changes (permuted Q/K rows, fused QKV, norms stored as
1 + w, Q/K norms, biases, tied heads).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_redrafter.convert import ConversionError, convert_model
from mlx_redrafter.convert.gguf import read_gguf
from mlx_redrafter.convert.gguf_families import architecture_for
from test_convert import SPECIALS, train_byte_level_tokenizer

# Sizes of the tiny models (Qwen 3 and Gemma 2 use the head sizes transformers'
# GGUF loader assumes for them: it does not read those from the file).
SIZES = {"hidden": 64, "ff": 96, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16}
HEAD_DIM = {"qwen3": 128, "gemma2": 256}

# family -> (general.architecture, general.name, per-layer tensor parts). llama.cpp
# writes Mistral models as llama files; transformers reads this one as a Llama model
# (it takes only the exact name "mistral" for Mistral, and then fails in gguf-py).
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "mistral": (
        "llama",
        "Mistral-Tiny-v0.3",
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"),
    ),
    "qwen2": ("qwen2", "Qwen2 tiny", ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")),
    "qwen3": (
        "qwen3",
        "Qwen3 tiny",
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "attn_q_norm", "attn_k_norm"),
    ),
    "phi3": ("phi3", "Phi3 tiny", ("attn_qkv", "attn_output", "ffn_norm")),
    "gemma2": (
        "gemma2",
        "Gemma2 tiny",
        ("attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm", "ffn_norm")
        + ("post_ffw_norm",),
    ),
}
# Max |log p_mlx - log p_transformers| over the vocabulary at every position:
# float32 rounding of two implementations of a 2-layer model (measured 3.8e-6 to
# 5.7e-6 across the families).
TOLERANCE = 5e-5
SEQUENCES = [[5, 40, 77, 120, 9, 200, 33, 31, 7], [1, 2, 3, 250, 251, 17]]


def tensor_shapes(family: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> (rows, columns) as llama.cpp writes the family."""
    hidden, ff, heads = SIZES["hidden"], SIZES["ff"], SIZES["heads"]
    head_dim = HEAD_DIM.get(family, SIZES["head_dim"])
    q_rows, kv_rows = heads * head_dim, SIZES["kv_heads"] * head_dim
    per_layer = {
        "attn_norm": (hidden,),
        "attn_q": (q_rows, hidden),
        "attn_k": (kv_rows, hidden),
        "attn_v": (kv_rows, hidden),
        "attn_qkv": (q_rows + 2 * kv_rows, hidden),
        "attn_output": (hidden, q_rows),
        "attn_q_norm": (head_dim,),
        "attn_k_norm": (head_dim,),
        "ffn_norm": (hidden,),
        "post_attention_norm": (hidden,),
        "post_ffw_norm": (hidden,),
        "ffn_gate": (ff, hidden),
        "ffn_up": (2 * ff if family == "phi3" else ff, hidden),
        "ffn_down": (hidden, ff),
    }
    parts = ("attn_norm", *FAMILIES[family][2], "ffn_up", "ffn_down")
    if family != "phi3":
        parts += ("ffn_gate",)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if family != "gemma2":  # Gemma ties its output head to the embedding
        shapes["output.weight"] = (vocab, hidden)
    for i in range(SIZES["layers"]):
        shapes.update({f"blk.{i}.{part}.weight": per_layer[part] for part in parts})
        if family == "qwen2":
            for part in ("attn_q", "attn_k", "attn_v"):
                shapes[f"blk.{i}.{part}.bias"] = per_layer[part][:1]
    return shapes


def random_tensors(family: str, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in tensor_shapes(family, vocab).items():
        if "norm" in name:  # stored norm weights sit near one (Gemma: 1 + w)
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (0.15 * rng.standard_normal(shape)).astype(np.float32)
    return tensors


def write_family_gguf(
    path: Path,
    family: str,
    extra: dict[str, int | float | str] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """A tiny GGUF of `family` with a byte-level BPE tokenizer, as llama.cpp writes it
    (plus `extra` metadata, uint32, float32 or string by type, and `extra_tensors`,
    without the tensors ending in one of `drop`)."""
    import gguf

    arch, name, _ = FAMILIES[family]
    backend = train_byte_level_tokenizer()
    vocab = backend.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    head_dim = HEAD_DIM.get(family, SIZES["head_dim"])
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    for key, value in {
        "block_count": SIZES["layers"],
        "context_length": 256,
        "embedding_length": SIZES["hidden"],
        "feed_forward_length": SIZES["ff"],
        "attention.head_count": SIZES["heads"],
        "attention.head_count_kv": SIZES["kv_heads"],
        "rope.dimension_count": head_dim,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "vocab_size": len(tokens),
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if family == "gemma2":
        writer.add_uint32("gemma2.attention.sliding_window", 4096)
        writer.add_float32("gemma2.attn_logit_softcapping", 50.0)
        writer.add_float32("gemma2.final_logit_softcapping", 30.0)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    merges = json.loads(backend.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    tensors = {**random_tensors(family, len(tokens)), **(extra_tensors or {})}
    for tensor_name, value in tensors.items():
        if not tensor_name.endswith(drop):
            writer.add_tensor(tensor_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_logprobs(gguf_path: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    torch = pytest.importorskip("torch", reason="torch is needed for the transformers reference")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return [
            torch.log_softmax(model(torch.tensor([ids])).logits.float(), -1)[0].numpy()
            for ids in sequences
        ]


def mlx_logprobs(model_dir: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    from mlx_lm import load

    model, _ = load(str(model_dir))
    out = []
    for ids in sequences:
        logits = model(mx.array([ids])).astype(mx.float32)
        out.append(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0])
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_gguf_matches_transformers(family: str, tmp_path: Path) -> None:
    path = write_family_gguf(tmp_path / f"{family}.gguf", family)
    assert architecture_for(read_gguf(path)).model_type == family
    out = tmp_path / "mlx"
    convert_model(path, out, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == family
    assert config["head_dim"] == HEAD_DIM.get(family, SIZES["head_dim"])
    ours = mlx_logprobs(out, SEQUENCES)
    reference = transformers_logprobs(path, SEQUENCES)
    for ids, a, b in zip(SEQUENCES, ours, reference):
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1), err_msg=f"{family} {ids}")
        assert np.abs(a - b).max() < TOLERANCE, (family, float(np.abs(a - b).max()))


def test_mistral_rows_are_unpermuted_and_a_plain_llama_is_not_mistral(tmp_path: Path) -> None:
    """The Mistral file differs from its converted weights exactly by llama.cpp's
    Q/K row order; without a Mistral name the same file is a llama model."""
    from mlx_lm import load
    from mlx_redrafter.convert.gguf import permute_rotary_rows

    path = write_family_gguf(tmp_path / "m.gguf", "mistral")
    out = tmp_path / "mlx"
    convert_model(path, out, progress=False)
    model, _ = load(str(out))
    stored = random_tensors("mistral", read_gguf(path).tensors["token_embd.weight"].shape[0])
    q = np.array(model.model.layers[1].self_attn.q_proj.weight)
    np.testing.assert_array_equal(
        permute_rotary_rows(q, SIZES["heads"]), stored["blk.1.attn_q.weight"]
    )
    gguf_file = read_gguf(path)
    gguf_file.metadata["general.name"] = "tiny"
    assert architecture_for(gguf_file).model_type == "llama"


def test_phi3_longrope_factors_go_back_into_the_config(tmp_path: Path) -> None:
    """LongRoPE factors, stored by llama.cpp as two tensors of one value per rotary
    pair, come back as the config's rope_scaling, which mlx-lm builds its rotary
    embedding from."""
    from mlx_lm import load

    long = np.linspace(1.0, 4.0, SIZES["head_dim"] // 2, dtype=np.float32)
    short = np.linspace(1.0, 1.5, SIZES["head_dim"] // 2, dtype=np.float32)
    path = write_family_gguf(
        tmp_path / "phi3.gguf",
        "phi3",
        {"phi3.rope.scaling.original_context_length": 64},
        {"rope_factors_long.weight": long, "rope_factors_short.weight": short},
    )
    out = tmp_path / "mlx"
    convert_model(path, out, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["type"] == "longrope"
    np.testing.assert_allclose(config["rope_scaling"]["long_factor"], long)
    np.testing.assert_allclose(config["rope_scaling"]["short_factor"], short)
    assert config["original_max_position_embeddings"] == 64
    model, _ = load(str(out))
    assert model.model.layers[0].self_attn.rope.__class__.__name__ == "SuScaledRoPE"
    assert np.isfinite(np.array(model(mx.array([[1, 2, 3]])))).all()


def test_phi3_longrope_factors_of_the_wrong_length_are_refused(tmp_path: Path) -> None:
    wrong = np.ones(SIZES["head_dim"], dtype=np.float32)  # one per dimension, not per pair
    path = write_family_gguf(
        tmp_path / "phi3.gguf",
        "phi3",
        extra_tensors={"rope_factors_long.weight": wrong, "rope_factors_short.weight": wrong},
    )
    with pytest.raises(ConversionError, match="LongRoPE factors have"):
        convert_model(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_yarn_scaling_keeps_its_betas_and_refuses_an_attention_factor(tmp_path: Path) -> None:
    from mlx_lm import load

    yarn: dict[str, int | float | str] = {
        "qwen2.rope.scaling.type": "yarn",
        "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 64,
        "qwen2.rope.scaling.yarn_beta_fast": 16.0,
        "qwen2.rope.scaling.yarn_beta_slow": 2.0,
    }
    out = tmp_path / "mlx"
    convert_model(write_family_gguf(tmp_path / "q.gguf", "qwen2", yarn), out, progress=False)
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling == {
        "rope_type": "yarn",
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    }
    model, _ = load(str(out))
    assert model.model.layers[0].self_attn.rope.__class__.__name__ == "YarnRoPE"
    scaled = {**yarn, "qwen2.rope.scaling.attn_factor": 0.5}
    with pytest.raises(ConversionError, match=r"attn_factor = 0.5 is not supported"):
        convert_model(write_family_gguf(tmp_path / "b.gguf", "qwen2", scaled), tmp_path / "b")


def test_qwen2_without_its_qkv_biases_is_refused(tmp_path: Path) -> None:
    broken = write_family_gguf(tmp_path / "q.gguf", "qwen2", drop=(".bias",))
    with pytest.raises(ConversionError, match=r"lacks 6 tensor.*self_attn.k_proj.bias"):
        convert_model(broken, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_converted_family_decodes_with_lookup_exactly_as_mlx_lm(
    family: str, tmp_path: Path
) -> None:
    """The converted folder runs in the speculative loop (lookup branches, no drafter)
    and its greedy output is mlx-lm's own."""
    from mlx_lm import generate as mlx_lm_generate
    from mlx_lm import load as mlx_lm_load

    import mlx_redrafter

    out = tmp_path / "mlx"
    convert_model(write_family_gguf(tmp_path / f"{family}.gguf", family), out, progress=False)
    model, drafter, tokenizer = mlx_redrafter.load(out)
    assert drafter is None
    prompt = [5, 40, 77, 120, 5, 40, 77]
    ours = mlx_redrafter.generate(
        model, None, tokenizer, prompt, max_tokens=24, tree="0x1+2x4", stop=[]
    )
    reference_model, reference_tokenizer = mlx_lm_load(str(out))
    expected = mlx_lm_generate(reference_model, reference_tokenizer, prompt, max_tokens=24)
    assert ours == expected and len(reference_tokenizer.encode(expected)) >= 12


def test_qwen2_pre_tokenizer_splits_every_digit() -> None:
    """`tokenizer.ggml.pre = qwen2` splits numbers into single digits, where the
    Llama 3 rule keeps groups of up to three."""
    from mlx_redrafter.convert.tokenizer import build_tokenizer
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [*alphabet, alphabet[0] + alphabet[1]],
        "tokenizer.ggml.merges": [f"{alphabet[0]} {alphabet[1]}"],
    }
    text = "Pay 12345 now, don't wait"

    def pieces(pre: str) -> list[str]:
        tokenizer = build_tokenizer({**meta, "tokenizer.ggml.pre": pre}, "qwen2")
        split = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        return [piece for piece, _ in split]

    assert pieces("qwen2") == [
        "Pay",
        "Ġ",
        "1",
        "2",
        "3",
        "4",
        "5",
        "Ġnow",
        ",",
        "Ġdon",
        "'t",
        "Ġwait",
    ]
    assert pieces("llama-bpe") == ["Pay", "Ġ", "123", "45", "Ġnow", ",", "Ġdon", "'t", "Ġwait"]
