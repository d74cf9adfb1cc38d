"""mlx-redrafter-convert drafter: reference checkpoints -> the project's drafter folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_redrafter.convert.cli import main

from mlx_redrafter.drafter import Drafter, DrafterConfig

CONFIG = DrafterConfig(vocab_size=64, hidden_size=32, exit_dim=96, num_draft_layers=2, rnn=True)


def _drafter(seed: int = 0) -> Drafter:
    mx.random.seed(seed)
    drafter = Drafter(CONFIG)
    mx.eval(drafter.parameters())
    return drafter


def _weights(drafter: Drafter) -> dict[str, mx.array]:
    return dict(tree_flatten(drafter.parameters()))


def _reference_checkpoint(
    folder: Path, drafter: Drafter, *, prefix: str = "", dtype: Any = mx.bfloat16
) -> Path:
    """What the reference PyTorch trainer's save_pretrained writes."""
    folder.mkdir(parents=True)
    config = {
        "architectures": ["Drafter"],
        "model_type": "recurrent_drafting_drafter",
        "vocab_size": CONFIG.vocab_size,
        "hidden_size": CONFIG.hidden_size,
        "exit_dim": CONFIG.exit_dim,
        "num_draft_layers": CONFIG.num_draft_layers,
        "num_lookback_tokens": -1,
        "rnn": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.0",
    }
    (folder / "config.json").write_text(json.dumps(config))
    weights = {prefix + k: v.astype(dtype) for k, v in _weights(drafter).items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "pt"})
    return folder


def _logits(drafter: Drafter) -> np.ndarray:
    hidden = mx.random.normal((3, CONFIG.hidden_size), key=mx.random.key(1))
    state = mx.random.normal((3, CONFIG.hidden_size), key=mx.random.key(2))
    return np.array(drafter.draft_logits(hidden, state).astype(mx.float32))


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def _one_error_line(code: int, err: str, fragment: str = "") -> None:
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], err


def test_reference_checkpoint_converts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    original = _drafter()
    src = _reference_checkpoint(tmp_path / "ref", original, prefix="drafter.")
    out = tmp_path / "out"
    code, err = _run(["drafter", str(src), "-o", str(out), "--dtype", "float32"], capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "recurrent_drafting_drafter"
    assert "num_lookback_tokens" not in config and "architectures" not in config
    loaded = Drafter.load(out)
    names = set(_weights(loaded))
    assert {
        "input_proj.weight",
        "lm_head.0.linear.bias",
        "lm_head.2.weight",
        "rnn_u.bias",
        "rnn_w.weight",
    } <= names
    for name, value in _weights(loaded).items():
        assert value.dtype == mx.float32
        expected = _weights(original)[name].astype(mx.bfloat16).astype(mx.float32)
        assert mx.array_equal(value, expected).item(), name
    bf16_original = _drafter()
    bf16_original.load_weights(
        [(k, v.astype(mx.bfloat16).astype(mx.float32)) for k, v in _weights(original).items()]
    )
    np.testing.assert_array_equal(_logits(loaded), _logits(bf16_original))


def test_project_folder_quantized(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    original = _drafter(seed=3)
    src = original.save(tmp_path / "project")
    out = tmp_path / "q8"
    code, err = _run(
        ["drafter", str(src), "-o", str(out), "--quantize", "--bits", "8", "--group-size", "32"],
        capsys,
    )
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8}
    loaded = Drafter.load(out)
    assert any(name.endswith(".scales") for name in _weights(loaded))
    np.testing.assert_allclose(_logits(loaded), _logits(original), atol=0.05)


def test_torch_pickle_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch", reason="torch is needed to write a pytorch_model.bin")
    original = _drafter(seed=5)
    folder = _reference_checkpoint(tmp_path / "ref", original)
    (folder / "model.safetensors").unlink()
    state = {k: torch.from_numpy(np.array(v)) for k, v in _weights(original).items()}
    torch.save(state, folder / "pytorch_model.bin")
    out = tmp_path / "out"
    code, err = _run(["drafter", str(folder), "-o", str(out), "-q"], capsys)
    assert code == 0, err
    np.testing.assert_array_equal(_logits(Drafter.load(out)), _logits(original))


def test_drafter_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(["drafter", str(tmp_path / "missing"), "-o", str(tmp_path / "o")], capsys)
    _one_error_line(code, err, "no such file")

    src = _reference_checkpoint(tmp_path / "ref", _drafter())
    config = json.loads((src / "config.json").read_text())

    (src / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    code, err = _run(["drafter", str(src), "-o", str(tmp_path / "o")], capsys)
    _one_error_line(code, err, "model_type")

    (src / "config.json").write_text(json.dumps({**config, "hidden_size": 40}))
    code, err = _run(["drafter", str(src), "-o", str(tmp_path / "o")], capsys)
    _one_error_line(code, err, "shape")

    (src / "config.json").write_text(json.dumps(config))
    (src / "model.safetensors").write_bytes(b"not safetensors")
    code, err = _run(["drafter", str(src), "-o", str(tmp_path / "o")], capsys)
    _one_error_line(code, err, "model.safetensors")
    assert not (tmp_path / "o").exists()

    out = tmp_path / "exists"
    out.mkdir()
    good = _drafter().save(tmp_path / "good")
    code, err = _run(["drafter", str(good), "-o", str(out)], capsys)
    _one_error_line(code, err, "--force")
    code, err = _run(["drafter", str(good), "-o", str(out), "--force", "-q"], capsys)
    assert code == 0, err
    assert Drafter.load(out).config == CONFIG
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
