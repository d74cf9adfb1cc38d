"""Drafter export to the reference and TensorRT-LLM layouts, and back.

The readers here are written from docs/convert.md's tables alone (numpy, float64),
not from the converter's code: a reference folder is config.json + model.safetensors
with out x in Linear weights; a TensorRT-LLM folder holds `drafter.*` tensors split
along axis 0 over rank{r}.safetensors.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_redrafter.convert.cli import EXIT_ERROR, main
from tiny_models import _COMMON, FAMILY_CONFIGS, VOCAB_SIZE, tiny_model, tiny_tokenizer

from mlx_redrafter.beam_search import beam_search
from mlx_redrafter.drafter import Drafter, DrafterConfig
from mlx_redrafter.metrics import AcceptanceTable
from mlx_redrafter.ngrams import build_ngram_table, load_ngram_table

HIDDEN = 32
DRAFT_IDS = [int(i) for i in np.random.default_rng(7).permutation(VOCAB_SIZE)[:24]]


def _reduced_drafter(
    exit_dim: int = 48, seed: int = 0, hidden: int = HIDDEN, reduced: bool = True
) -> Drafter:
    """A drafter over 24 of the 64 tokens (in a shuffled order; all 64 unless
    `reduced`), with an n-gram table and an acceptance table: what training writes."""
    config = DrafterConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        exit_dim=exit_dim,
        draft_vocab_size=24 if reduced else None,
    )
    mx.random.seed(seed)
    table = build_ngram_table([[1, 2, 3, 4, 1, 2, 5]], min_count=1)
    drafter = Drafter(config, DRAFT_IDS if reduced else None, table)
    drafter.acceptance = AcceptanceTable(
        beams=((0.5, 0.25),),
        lookup=((0.4, 0.2),),
        joint=(),
        temperature=0.0,
        steps=9,
        source="test",
    )
    mx.eval(drafter.parameters())
    return drafter


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def _user_error(code: int, err: str, message: str) -> None:
    """The CLI refused with its user-error code and one `error:` line saying `message`
    (not an internal error, which exits 1 with the exception's type)."""
    assert code == EXIT_ERROR, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "internal error" not in err and message in err, err


def _silu(x: np.ndarray) -> np.ndarray:
    return x * 0.5 * (1.0 + np.tanh(0.5 * x))  # x * sigmoid(x), without overflow


class LayoutReader:
    """A drafter read from the documented layout: reference names, float64."""

    def __init__(self, config: dict[str, Any], weights: dict[str, np.ndarray]):
        self.config, self.w = config, weights
        assert set(weights) == self.expected_names(), sorted(weights)

    def expected_names(self) -> set[str]:
        n = self.config["num_draft_layers"]
        names = {f"lm_head.{n}.weight", "rnn_u.weight", "rnn_u.bias", "rnn_w.weight"}
        names |= {f"lm_head.{i}.linear.{p}" for i in range(n) for p in ("weight", "bias")}
        if self.config["exit_dim"] != 2 * self.config["hidden_size"]:
            names |= {"input_proj.weight", "input_proj.bias"}
        return names

    @classmethod
    def reference(cls, folder: Path) -> LayoutReader:
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "recurrent_drafting_drafter"
        tensors = mx.load(str(folder / "model.safetensors"))
        return cls(
            config, {k: np.array(v.astype(mx.float32), np.float64) for k, v in tensors.items()}
        )

    @classmethod
    def tensorrt(cls, folder: Path) -> LayoutReader:
        config = json.loads((folder / "config.json").read_text())
        assert config["architecture"] == "ReDrafterForCausalLM"
        tp = config["mapping"]["tp_size"]
        ranks = [mx.load(str(folder / f"rank{r}.safetensors")) for r in range(tp)]
        n = config["redrafter_num_layers"]
        weights = {}
        for name in ranks[0]:
            joined = np.concatenate(
                [np.array(r[name].astype(mx.float32), np.float64) for r in ranks]
            )
            name = name.removeprefix("drafter.").replace("layers.", "lm_head.")
            if name == "lm_head.weight":  # rows past vocab_size pad it to a multiple of tp
                weights[f"lm_head.{n}.weight"] = joined[: config["vocab_size"]]  # (V, E)
            else:
                weights[name] = joined
        ours = {
            "vocab_size": config["vocab_size"],
            "hidden_size": config["redrafter_hidden_size"],
            "exit_dim": config["redrafter_exit_dim"],
            "num_draft_layers": n,
            "rnn": config["redrafter_is_rnn"],
        }
        return cls(ours, weights)

    def log_probs(self, hidden: np.ndarray, state: np.ndarray) -> np.ndarray:
        z = np.concatenate([hidden, state], axis=-1)  # (..., 2D)
        if "input_proj.weight" in self.w:
            z = z @ self.w["input_proj.weight"].T + self.w["input_proj.bias"]
        n = self.config["num_draft_layers"]
        for i in range(n):
            z = z + _silu(
                z @ self.w[f"lm_head.{i}.linear.weight"].T + self.w[f"lm_head.{i}.linear.bias"]
            )
        logits = z @ self.w[f"lm_head.{n}.weight"].T  # (..., V)
        top = logits.max(axis=-1, keepdims=True)
        return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))

    def beams(
        self, embed: np.ndarray, hidden: np.ndarray, root: int, width: int, length: int
    ) -> np.ndarray:
        """One row's beam search: (W, L) token ids, best first."""
        beams = [[root] for _ in range(width)]
        scores = np.array([0.0] + [-np.inf] * (width - 1))
        state = np.zeros((width, hidden.shape[-1]))
        for _ in range(length - 1):
            e = embed[[b[-1] for b in beams]]  # (W, D)
            state = _silu(
                state @ self.w["rnn_u.weight"].T
                + self.w["rnn_u.bias"]
                + e @ self.w["rnn_w.weight"].T
            )
            candidates = (
                scores[:, None] + self.log_probs(np.broadcast_to(hidden, state.shape), state)
            ).ravel()
            order = np.lexsort((np.arange(candidates.size), -candidates))[:width]
            vocab = self.config["vocab_size"]
            beams = [beams[i // vocab] + [int(i % vocab)] for i in order]
            state, scores = state[order // vocab], candidates[order]
        return np.array(beams)


def _our_beams(
    drafter: Drafter, embed: np.ndarray, hidden: np.ndarray, roots: np.ndarray
) -> np.ndarray:
    table = mx.array(embed.astype(np.float32))
    out = beam_search(
        drafter, lambda ids: table[ids], mx.array(hidden.astype(np.float32)), mx.array(roots), 4, 4
    )
    return np.array(out)


def _check_reader_beams(reader: LayoutReader, drafter: Drafter) -> None:
    rng = np.random.default_rng(1)
    embed = rng.normal(size=(VOCAB_SIZE, drafter.config.hidden_size))
    hidden = rng.normal(size=(16, drafter.config.hidden_size))
    roots = rng.integers(0, VOCAB_SIZE, 16)
    ours = _our_beams(drafter, embed, hidden, roots)  # (16, 4, 4)
    for row in range(16):
        np.testing.assert_array_equal(
            reader.beams(embed, hidden[row], int(roots[row]), 4, 4), ours[row]
        )


def _same_drafter(a: Path, b: Path) -> None:
    x, y = mx.load(str(a / "model.safetensors")), mx.load(str(b / "model.safetensors"))
    assert sorted(x) == sorted(y)
    for name in x:
        assert x[name].dtype == y[name].dtype and mx.array_equal(x[name], y[name]).item(), name
    assert json.loads((a / "config.json").read_text()) == json.loads(
        (b / "config.json").read_text()
    )
    ta, tb = load_ngram_table(a / "ngrams.safetensors"), load_ngram_table(b / "ngrams.safetensors")
    assert np.array_equal(np.array(ta.keys), np.array(tb.keys))
    assert np.array_equal(np.array(ta.continuations), np.array(tb.continuations))
    assert json.loads((a / "acceptance.json").read_text()) == json.loads(
        (b / "acceptance.json").read_text()
    )


@pytest.mark.parametrize("exit_dim", [48, 2 * HIDDEN])  # with an input projection, and without
def test_reference_export_drafts_like_the_original_and_comes_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], exit_dim: int
) -> None:
    drafter = _reduced_drafter(exit_dim)
    src = drafter.save(tmp_path / "ours")
    (src / "stray.safetensors").write_bytes(b"not a drafter weight")  # never read as weights
    code, err = _run(
        ["drafter", str(src), "-o", str(tmp_path / "ref"), "--to", "reference"], capsys
    )
    assert code == 0, err
    assert "top-8 drafts agree on 2000/2000 states (100.00 %)" in err, err
    assert "beam searches identical in 64/64" in err and "random Gaussian states" in err, err
    reader = LayoutReader.reference(tmp_path / "ref")
    assert (
        reader.config["vocab_size"] == VOCAB_SIZE
        and reader.w["lm_head.2.weight"].shape[0] == VOCAB_SIZE
    )
    assert not sorted((tmp_path / "ref").glob("*.safetensors"))[1:]  # one weights file
    _check_reader_beams(reader, Drafter.load(src))
    code, err = _run(["drafter", str(tmp_path / "ref"), "-o", str(tmp_path / "back")], capsys)
    assert code == 0 and "restored the reduced draft vocabulary" in err, err
    _same_drafter(src, tmp_path / "back")


@pytest.mark.parametrize(
    ("tp_size", "hidden", "reduced"),
    [(1, HIDDEN, True), (2, HIDDEN, True), (3, 48, True), (3, 48, False)],
)
def test_tensorrt_export_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tp_size: int, hidden: int, reduced: bool
) -> None:
    """tp 3 does not divide V = 64: the head is padded with NEVER rows (a full
    vocabulary gains the constant feature for them), and the import drops them."""
    src = _reduced_drafter(hidden=hidden, reduced=reduced).save(tmp_path / "ours")
    out = tmp_path / "trt"
    args = ["drafter", str(src), "-o", str(out), "--to", "tensorrt-llm", "--tp-size", str(tp_size)]
    code, err = _run([*args, "--beams", "4x4"], capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["mapping"]["tp_size"] == tp_size and config["redrafter_num_beams"] == 4
    assert config["redrafter_draft_len_per_beam"] == 3 and config["vocab_size"] == VOCAB_SIZE
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        f"rank{r}.safetensors" for r in range(tp_size)
    ]
    rows = -(-VOCAB_SIZE // tp_size)  # head rows per rank
    rank0 = mx.load(str(out / "rank0.safetensors"))
    assert rank0["drafter.lm_head.weight"].shape == (rows, config["redrafter_exit_dim"])
    if VOCAB_SIZE % tp_size:
        record = config["mlx_redrafter_export"]
        assert record["vocab_padding"] == rows * tp_size - VOCAB_SIZE
        last = mx.load(str(out / f"rank{tp_size - 1}.safetensors"))["drafter.lm_head.weight"]
        padding = np.array(last)[VOCAB_SIZE - rows * (tp_size - 1) :]  # (padding, E')
        expected = np.zeros_like(padding)
        expected[:, record["exit_dim"]] = -30000.0
        np.testing.assert_array_equal(padding, expected)
    _check_reader_beams(LayoutReader.tensorrt(out), Drafter.load(src))
    code, err = _run(["drafter", str(out), "-o", str(tmp_path / "back")], capsys)
    assert code == 0, err
    _same_drafter(src, tmp_path / "back")


def _tiny_model_dir(tmp_path: Path) -> Path:
    """A tiny llama folder that mlx_lm.load opens (hidden 32, vocabulary 64)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = {**_COMMON, **FAMILY_CONFIGS["llama"], "eos_token_id": 63}
    (model_dir / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(tiny_model("llama").parameters()))
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    tiny_tokenizer()._tokenizer.save_pretrained(str(model_dir))
    return model_dir


def test_export_checks_on_a_target_models_states(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model: the states are the target's hidden states on the prompts given (a
    prompt of fewer than 3 tokens has no state followed by two tokens: skipped)."""
    model_dir = _tiny_model_dir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(0)
    lines = [
        json.dumps({"prompt": " ".join(f"w{t}" for t in rng.integers(0, 64, 30))}) for _ in range(8)
    ]
    lines += [json.dumps({"prompt": "w1 w2"}), json.dumps({"prompt": "w3"})]
    prompts.write_text("\n".join(lines) + "\n")
    src = _reduced_drafter().save(tmp_path / "ours")
    args = ["drafter", str(src), "-o", str(tmp_path / "ref"), "--to", "reference"]
    code, err = _run(
        [*args, "--model", str(model_dir), "--prompts", str(prompts), "--samples", "100"], capsys
    )
    assert code == 0, err
    assert "agree on 200/200 states" in err and "prompts.jsonl through" in err, err

    wrong = DrafterConfig(vocab_size=VOCAB_SIZE, hidden_size=16, exit_dim=24)
    other = Drafter(wrong).save(tmp_path / "other")
    args = ["drafter", str(other), "-o", str(tmp_path / "x"), "--to", "reference"]
    code, err = _run([*args, "--model", str(model_dir)], capsys)
    _user_error(code, err, "was not made for")


def test_an_inexact_export_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head whose outside rows are not pushed down would put non-draft tokens into
    beams: the agreement check refuses it and writes nothing."""
    from mlx_redrafter.convert import drafter_formats

    monkeypatch.setattr(drafter_formats, "NEVER_LOGIT", 0.0)
    src = _reduced_drafter().save(tmp_path / "ours")
    code, err = _run(
        ["drafter", str(src), "-o", str(tmp_path / "ref"), "--to", "reference"], capsys
    )
    _user_error(code, err, "does not draft like the original")
    assert "nothing was written" in err, err
    assert not (tmp_path / "ref").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def _dequantized(drafter: Drafter) -> Drafter:
    """A float32 drafter whose Linear weights are `drafter`'s, dequantized (MLX affine)."""
    weights = dict(tree_flatten(drafter.parameters()))
    for name, module in drafter.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            del weights[f"{name}.scales"], weights[f"{name}.biases"]
            weights[f"{name}.weight"] = mx.dequantize(
                module.weight, module.scales, module.biases, module.group_size, module.bits
            )
    ids = np.array(drafter.draft_vocab_ids).tolist()
    out = Drafter(drafter.config, ids)
    out.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()])
    return out


def _top_drafts(drafter: Drafter, width: int = 8) -> np.ndarray:
    """(256, W) target ids of the W best drafts on fixed random states."""
    keys = mx.random.split(mx.random.key(3))
    hidden = mx.random.normal((256, HIDDEN), key=keys[0])  # (256, D)
    state = mx.random.normal((256, HIDDEN), key=keys[1])  # (256, D)
    logits = np.array(drafter.draft_logits(hidden, state).astype(mx.float32))  # (256, Vd)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :width]  # (256, W) draft indices
    return np.array(drafter.to_target_ids(mx.array(top)))


@pytest.mark.parametrize("to", ["reference", "tensorrt-llm"])
def test_a_quantized_drafter_exports_dequantized_and_comes_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], to: str
) -> None:
    src = _reduced_drafter(exit_dim=96).save(tmp_path / "ours")  # every width divides 32
    quantized = tmp_path / "q4"
    code, err = _run(
        ["drafter", str(src), "-o", str(quantized), "--quantize", "--group-size", "32"], capsys
    )
    assert code == 0, err
    code, err = _run(["drafter", str(quantized), "-o", str(tmp_path / "copy")], capsys)
    assert code == 0, err  # --to mlx-redrafter keeps it quantized
    copy = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert copy["quantization"] == {"group_size": 32, "bits": 4}
    code, err = _run(["drafter", str(quantized), "-o", str(tmp_path / "out"), "--to", to], capsys)
    assert code == 0 and "agree on 2000/2000 states" in err, err
    code, err = _run(["drafter", str(tmp_path / "out"), "-o", str(tmp_path / "back")], capsys)
    assert code == 0 and "restored the reduced draft vocabulary" in err, err
    back, dequantized = Drafter.load(tmp_path / "back"), _dequantized(Drafter.load(quantized))
    assert back.quantization is None and back.config == Drafter.load(src).config
    expected = dict(tree_flatten(dequantized.parameters()))
    for name, value in tree_flatten(back.parameters()):
        assert mx.array_equal(value, expected[name]).item(), name
    np.testing.assert_array_equal(_top_drafts(back), _top_drafts(dequantized))


def test_a_bfloat16_export_comes_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bfloat16 stores -30000 as -29952; the import compares in the stored dtype."""
    src = _reduced_drafter().save(tmp_path / "ours")
    ref = tmp_path / "ref"
    args = ["drafter", str(src), "-o", str(ref), "--to", "reference", "--dtype", "bfloat16"]
    assert _run(args, capsys)[0] == 0
    head = mx.load(str(ref / "model.safetensors"))["lm_head.2.weight"]
    outside = next(i for i in range(VOCAB_SIZE) if i not in DRAFT_IDS)
    assert head.dtype == mx.bfloat16 and head[outside, 48].item() == -29952.0
    code, err = _run(["drafter", str(ref), "-o", str(tmp_path / "back")], capsys)
    assert code == 0 and "restored the reduced draft vocabulary" in err, err
    original = mx.load(str(src / "model.safetensors"))
    for name, value in mx.load(str(tmp_path / "back" / "model.safetensors")).items():
        assert mx.array_equal(value, original[name].astype(mx.bfloat16)).item(), name


def _set(name: str, index: tuple[Any, ...], value: float) -> Callable[[dict[str, mx.array]], None]:
    def edit(weights: dict[str, mx.array]) -> None:
        weights[name][index] = value

    return edit


def _move_outside_rows(weights: dict[str, mx.array]) -> None:
    """Every outside row's logit -30000 -> -20000, all together."""
    head = weights["lm_head.2.weight"]  # (V, E')
    head[:, 48] = mx.where(head[:, 48] == 0, 0.0, -20000.0)
    weights["lm_head.2.weight"] = head


_OUTSIDE = next(i for i in range(VOCAB_SIZE) if i not in DRAFT_IDS)


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        pytest.param(_set("lm_head.2.weight", (_OUTSIDE, 0), 0.5), "head rows", id="one-row"),
        pytest.param(_move_outside_rows, "head rows", id="outside-rows-together"),
        pytest.param(
            _set("input_proj.bias", (48,), 2.0), "input_proj constant feature", id="bias-2"
        ),
        pytest.param(_set("lm_head.0.linear.bias", (48,), -2048.0), "block 0 gate", id="gate"),
    ],
)
def test_a_changed_export_imports_with_its_full_vocabulary(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, mx.array]], None],
    what: str,
) -> None:
    """Fine-tuned elsewhere (an added weight is not exactly what the export wrote):
    kept as a full-vocabulary drafter, as it is."""
    src = _reduced_drafter().save(tmp_path / "ours")
    ref = tmp_path / "ref"
    assert _run(["drafter", str(src), "-o", str(ref), "--to", "reference"], capsys)[0] == 0
    weights = mx.load(str(ref / "model.safetensors"))
    edit(weights)
    mx.save_safetensors(str(ref / "model.safetensors"), weights)
    code, err = _run(["drafter", str(ref), "-o", str(tmp_path / "back")], capsys)
    assert code == 0, err
    assert f"kept the full vocabulary: {what}: the folder changed after export" in err, err
    back = Drafter.load(tmp_path / "back")
    assert back.config.draft_vocab_size is None and back.config.vocab_size == VOCAB_SIZE


def test_export_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _reduced_drafter().save(tmp_path / "ours")
    code, err = _run(
        ["drafter", str(src), "-o", str(tmp_path / "o"), "--to", "reference", "--quantize"], capsys
    )
    _user_error(code, err, "float weights: drop --quantize")
    code, err = _run(
        ["drafter", str(src), "-o", str(tmp_path / "o"), "--to", "tensorrt-llm", "--tp-size", "3"],
        capsys,
    )
    _user_error(code, err, "drafter.rnn_u.weight has 32 rows, not divisible by --tp-size 3")
    for bad in (["--beams", "8"], ["--tp-size", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["drafter", str(src), "-o", str(tmp_path / "o"), "--to", "reference", *bad])
        message = "expected WxL" if bad[0] == "--beams" else "must be positive: 0"
        assert exit_info.value.code == EXIT_ERROR and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_export_check_is_validated() -> None:
    """The Python entry refuses what the command line's types refuse."""
    from mlx_redrafter.convert.drafter import ExportCheck, convert_drafter
    from mlx_redrafter.convert.errors import ConversionError

    for bad, message in [
        ({"tp_size": 0}, "--tp-size must be a positive number"),
        ({"tp_size": -2}, "--tp-size must be a positive number"),
        ({"samples": 0}, "--samples must be a positive integer"),
        ({"beams": (0, 5)}, "--beams must be WxL"),
        ({"beams": (8, 1)}, "--beams must be WxL"),
    ]:
        with pytest.raises(ConversionError, match=message):
            ExportCheck(**bad)
    with pytest.raises(ConversionError, match="applies only to to='reference'"):
        convert_drafter("nowhere", "out", check=ExportCheck())


def test_a_broken_tensorrt_folder_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _reduced_drafter().save(tmp_path / "ours")
    out = tmp_path / "trt"
    args = ["drafter", str(src), "-o", str(out), "--to", "tensorrt-llm", "--tp-size", "2"]
    assert _run(args, capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    exit_dim = config.pop("redrafter_exit_dim")
    assert exit_dim == 80  # E + 1 = 49 rounded up to 16 is 64 = 2D, so the next multiple
    (out / "config.json").write_text(json.dumps(config))
    code, err = _run(["drafter", str(out), "-o", str(tmp_path / "a")], capsys)
    _user_error(code, err, "lacks redrafter_exit_dim")
    (out / "config.json").write_text(json.dumps(config | {"redrafter_exit_dim": exit_dim}))
    code, err = _run(["drafter", str(out), "-o", str(tmp_path / "a")], capsys)
    assert code == 0 and "restored the reduced draft vocabulary" in err, err
    (out / "config.json").write_text(
        json.dumps(config | {"redrafter_exit_dim": exit_dim, "vocab_size": 100})
    )
    code, err = _run(["drafter", str(out), "-o", str(tmp_path / "b")], capsys)
    _user_error(code, err, "has 64 rows over the ranks, fewer than vocab_size 100")
    (out / "config.json").write_text(json.dumps(config | {"redrafter_exit_dim": exit_dim}))
    (out / "rank1.safetensors").unlink()
    code, err = _run(["drafter", str(out), "-o", str(tmp_path / "b")], capsys)
    _user_error(code, err, "no rank1.safetensors")


# -- malformed inputs: one `error:` line, exit 2 ----------------------------------------


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A reduced drafter ("ours"), its reference and TensorRT-LLM exports, and a
    4-bit copy ("quantized"); cases copy them before changing anything."""
    root = tmp_path_factory.mktemp("exports")
    src = _reduced_drafter().save(root / "ours")
    folders = {"ours": src}
    for name, extra in [
        ("reference", ["--to", "reference"]),
        ("tensorrt-llm", ["--to", "tensorrt-llm"]),
        ("quantized", ["--quantize", "--group-size", "32"]),
    ]:
        assert main(["drafter", str(src), "-o", str(root / name), "-q", *extra]) == 0
        folders[name] = root / name
    return folders


Case = Callable[[dict[str, Path], Path], list[str]]


def _config_case(layout: str, edit: Callable[[dict[str, Any]], object]) -> Case:
    def make(exports: dict[str, Path], tmp: Path) -> list[str]:
        folder = Path(shutil.copytree(exports[layout], tmp / layout))
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
        return [str(folder)]

    return make


def _order_case(text: str) -> Case:
    def make(exports: dict[str, Path], tmp: Path) -> list[str]:
        folder = Path(shutil.copytree(exports["reference"], tmp / "reference"))
        (folder / "mlx_redrafter" / "draft_vocab_ids.json").write_text(text)
        return [str(folder)]

    return make


def _args_case(layout: str, *extra: str) -> Case:
    return lambda exports, tmp: [str(exports[layout]), *extra]


def _unloadable_model(exports: dict[str, Path], tmp: Path) -> list[str]:
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")
    return [str(exports["ours"]), "--to", "reference", "--model", str(tmp / "model")]


def _short_prompts(exports: dict[str, Path], tmp: Path) -> list[str]:
    prompts = tmp / "short.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2"}) + "\n" + json.dumps({"prompt": "w3"}))
    model = str(_tiny_model_dir(tmp))
    return [str(exports["ours"]), "--to", "reference", "--model", model, "--prompts", str(prompts)]


_RECORD = "mlx_redrafter_export"
_BAD_INPUTS = [
    pytest.param(
        _config_case("tensorrt-llm", lambda c: c["mapping"].update(tp_size=0)),
        "mapping.tp_size is 0; it must be the number of rank*.safetensors files",
        id="trt-tp-size-0",
    ),
    pytest.param(
        _config_case("tensorrt-llm", lambda c: c.update(redrafter_is_rnn="false")),
        "redrafter_is_rnn must be true or false (a JSON boolean), not 'false'",
        id="trt-rnn-string",
    ),
    pytest.param(
        _config_case("reference", lambda c: c.update(rnn="false")),
        "rnn must be true or false (a JSON boolean), not 'false'",
        id="reference-rnn-string",
    ),
    pytest.param(
        _config_case("reference", lambda c: c.update({_RECORD: [1]})),
        f"{_RECORD} is not a JSON object; restore config.json from the export",
        id="record-not-an-object",
    ),
    pytest.param(
        _config_case("reference", lambda c: c[_RECORD].pop("never_logit")),
        f"{_RECORD} lacks never_logit",
        id="record-missing-field",
    ),
    pytest.param(
        _config_case("reference", lambda c: c[_RECORD].update(exit_dim="48")),
        f"{_RECORD}.exit_dim must be an integer in [1, 56), not '48'",
        id="record-wrong-type",
    ),
    pytest.param(
        _config_case("tensorrt-llm", lambda c: c[_RECORD].update(draft_vocab_size=99)),
        f"{_RECORD}.draft_vocab_size must be null or an integer in [1, 64], not 99",
        id="record-out-of-range",
    ),
    pytest.param(
        _config_case("reference", lambda c: c[_RECORD].update(version=2)),
        f"{_RECORD} has version 2, but this converter reads version 1",
        id="record-unknown-version",
    ),
    pytest.param(
        _order_case('{"ids": [1]}'), "it is not a JSON list of integers", id="order-not-a-list"
    ),
    pytest.param(_order_case("[1, 2,"), "order: it is not valid JSON", id="order-json"),
    pytest.param(
        _order_case(json.dumps(DRAFT_IDS[:-1])),
        "it has 23 ids, the export records 24",
        id="order-length",
    ),
    pytest.param(
        _order_case(json.dumps([*DRAFT_IDS[:-1], 64])),
        "an id is outside [0, 64)",
        id="order-out-of-range",
    ),
    pytest.param(
        _order_case(json.dumps([*DRAFT_IDS[:-1], DRAFT_IDS[0]])),
        "an id repeats",
        id="order-duplicate",
    ),
    pytest.param(
        _args_case("ours", "--to", "reference", "--beams", "30x4"),
        "the width 30 is more than the drafter's 24 draft tokens",
        id="beams-wider-than-the-draft-vocabulary",
    ),
    pytest.param(
        _args_case("ours", "--samples", "10", "--tp-size", "2"),
        "--samples, --tp-size apply only to --to reference|tensorrt-llm",
        id="export-options-without-an-export",
    ),
    pytest.param(
        _args_case("ours", "--to", "reference", "--tp-size", "2"),
        "--tp-size applies only to --to tensorrt-llm",
        id="tp-size-with-reference",
    ),
    pytest.param(
        _args_case("quantized", "--quantize"),
        "is already quantized (4 bits, groups of 32): drop --quantize",
        id="quantize-twice",
    ),
    pytest.param(_unloadable_model, "cannot load --model", id="unloadable-model"),
    pytest.param(_short_prompts, "has 3 tokens or more", id="short-prompts"),
]


@pytest.mark.parametrize(("case", "message"), _BAD_INPUTS)
def test_a_malformed_input_is_a_one_line_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    exports: dict[str, Path],
    case: Case,
    message: str,
) -> None:
    out = tmp_path / "out"
    code, err = _run(["drafter", *case(exports, tmp_path), "-o", str(out)], capsys)
    _user_error(code, err, message)
    assert not out.exists()
