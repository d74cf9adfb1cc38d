"""Drafter export to the reference and TensorRT-LLM layouts, and back.

The readers here are written from docs/convert.md's tables alone (numpy, float64),
not from the converter's code: a reference folder is config.json + model.safetensors
with out x in Linear weights; a TensorRT-LLM folder holds `drafter.*` tensors split
along axis 0 over rank{r}.safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_redrafter.convert.cli import main
from tiny_models import _COMMON, FAMILY_CONFIGS, VOCAB_SIZE, tiny_model, tiny_tokenizer

from mlx_redrafter.beam_search import beam_search
from mlx_redrafter.drafter import Drafter, DrafterConfig
from mlx_redrafter.metrics import AcceptanceTable
from mlx_redrafter.ngrams import build_ngram_table, load_ngram_table

HIDDEN = 32
DRAFT_IDS = [int(i) for i in np.random.default_rng(7).permutation(VOCAB_SIZE)[:24]]


def _reduced_drafter(exit_dim: int = 48, seed: int = 0) -> Drafter:
    """A drafter over 24 of the 64 tokens (in a shuffled order), with an n-gram table
    and an acceptance table: what training writes."""
    config = DrafterConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, exit_dim=exit_dim, draft_vocab_size=24
    )
    mx.random.seed(seed)
    drafter = Drafter(config, DRAFT_IDS, build_ngram_table([[1, 2, 3, 4, 1, 2, 5]], min_count=1))
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
            weights[f"lm_head.{n}.weight" if name == "lm_head.weight" else name] = joined
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
    embed = rng.normal(size=(VOCAB_SIZE, HIDDEN))
    hidden = rng.normal(size=(16, HIDDEN))
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


@pytest.mark.parametrize("tp_size", [1, 2])
def test_tensorrt_export_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tp_size: int
) -> None:
    src = _reduced_drafter().save(tmp_path / "ours")
    out = tmp_path / "trt"
    args = ["drafter", str(src), "-o", str(out), "--to", "tensorrt-llm", "--tp-size", str(tp_size)]
    code, err = _run([*args, "--beams", "4x4"], capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["mapping"]["tp_size"] == tp_size and config["redrafter_num_beams"] == 4
    assert config["redrafter_draft_len_per_beam"] == 3
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        f"rank{r}.safetensors" for r in range(tp_size)
    ]
    rank0 = mx.load(str(out / "rank0.safetensors"))
    assert rank0["drafter.lm_head.weight"].shape == (
        VOCAB_SIZE // tp_size,
        config["redrafter_exit_dim"],
    )
    _check_reader_beams(LayoutReader.tensorrt(out), Drafter.load(src))
    code, err = _run(["drafter", str(out), "-o", str(tmp_path / "back")], capsys)
    assert code == 0, err
    _same_drafter(src, tmp_path / "back")


def test_export_checks_on_a_target_models_states(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model: the states are the target's hidden states on the prompts given."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = {**_COMMON, **FAMILY_CONFIGS["llama"], "eos_token_id": 63}
    (model_dir / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(tiny_model("llama").parameters()))
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    tiny_tokenizer()._tokenizer.save_pretrained(str(model_dir))
    prompts = tmp_path / "prompts.jsonl"
    rng = np.random.default_rng(0)
    lines = [
        json.dumps({"prompt": " ".join(f"w{t}" for t in rng.integers(0, 64, 30))}) for _ in range(8)
    ]
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
    code, err = _run(
        [
            "drafter",
            str(other),
            "-o",
            str(tmp_path / "x"),
            "--to",
            "reference",
            "--model",
            str(model_dir),
        ],
        capsys,
    )
    assert code == 2 and "was not made for" in err and "Traceback" not in err, err


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
    assert (
        code == 2 and "does not draft like the original" in err and "nothing was written" in err
    ), err
    assert not (tmp_path / "ref").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_a_changed_export_imports_with_its_full_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fine-tuned elsewhere (an outside row moved): kept as a full-vocabulary drafter."""
    src = _reduced_drafter().save(tmp_path / "ours")
    assert (
        _run(["drafter", str(src), "-o", str(tmp_path / "ref"), "--to", "reference"], capsys)[0]
        == 0
    )
    weights = mx.load(str(tmp_path / "ref" / "model.safetensors"))
    outside = next(i for i in range(VOCAB_SIZE) if i not in DRAFT_IDS)
    weights["lm_head.2.weight"] = weights["lm_head.2.weight"].at[outside, 0].add(0.5)
    mx.save_safetensors(str(tmp_path / "ref" / "model.safetensors"), weights)
    code, err = _run(["drafter", str(tmp_path / "ref"), "-o", str(tmp_path / "back")], capsys)
    assert code == 0 and "kept the full vocabulary: head rows" in err, err
    back = Drafter.load(tmp_path / "back")
    assert back.config.draft_vocab_size is None and back.config.vocab_size == VOCAB_SIZE


def test_export_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _reduced_drafter().save(tmp_path / "ours")
    code, err = _run(
        ["drafter", str(src), "-o", str(tmp_path / "o"), "--to", "reference", "--quantize"], capsys
    )
    assert code == 2 and "float weights: drop --quantize" in err, err
    code, err = _run(
        ["drafter", str(src), "-o", str(tmp_path / "o"), "--to", "tensorrt-llm", "--tp-size", "3"],
        capsys,
    )
    assert code == 2 and "not divisible by --tp-size 3" in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as exit_info:
        main(["drafter", str(src), "-o", str(tmp_path / "o"), "--beams", "8"])
    assert exit_info.value.code == 2 and "expected WxL" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_broken_tensorrt_folder_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _reduced_drafter().save(tmp_path / "ours")
    out = tmp_path / "trt"
    args = ["drafter", str(src), "-o", str(out), "--to", "tensorrt-llm", "--tp-size", "2"]
    assert _run(args, capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    del config["redrafter_exit_dim"]
    (out / "config.json").write_text(json.dumps(config))
    code, err = _run(["drafter", str(out), "-o", str(tmp_path / "a")], capsys)
    assert code == 2 and "lacks redrafter_exit_dim" in err and "Traceback" not in err, err
    config["redrafter_exit_dim"] = 48
    (out / "config.json").write_text(json.dumps(config))
    (out / "rank1.safetensors").unlink()
    code, err = _run(["drafter", str(out), "-o", str(tmp_path / "b")], capsys)
    assert code == 2 and "no rank1.safetensors" in err, err
