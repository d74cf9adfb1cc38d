"""The installed package: convert/ and apps/ install as mlx_redrafter.convert and
mlx_redrafter.apps, and nothing named `convert` or `apps` lands in site-packages.

The wheel is built from this checkout and installed into a folder of its own; a
Python without site processing (so without this checkout's editable install) then
imports from that folder and the environment's dependencies alone, from a working
directory outside the repository.
"""

from __future__ import annotations

import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the built wheel, the folder it is installed in)."""
    folder = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-q", "-w", str(folder), str(ROOT)], check=True)
    (wheel,) = folder.glob("mlx_redrafter-*.whl")
    target = folder / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target"]
    subprocess.run([*install, str(target), str(wheel)], check=True)
    return wheel, target


def run_isolated(target: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Python with only the installed wheel and the dependencies on its path."""
    path = ":".join([str(target), *site.getsitepackages()])
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=cwd,
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_wheel_has_no_top_level_convert_or_apps(installed: tuple[Path, Path]) -> None:
    wheel, target = installed
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert "convert" not in top and "apps" not in top
    assert "mlx_redrafter/convert/cli.py" in names
    assert "mlx_redrafter/apps/server.py" in names
    assert "mlx_redrafter/apps/static/index.html" in names
    assert "mlx_redrafter/training/__init__.py" in names
    assert not (target / "convert").exists() and not (target / "apps").exists()
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "mlx-redrafter-convert = mlx_redrafter.convert.cli:main" in scripts
    assert "mlx-redrafter = mlx_redrafter.cli:main" in scripts


def test_the_installed_package_imports_and_its_commands_run(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    _, target = installed
    for name in ("convert", "apps"):
        missing = run_isolated(target, f"import {name}", tmp_path)
        assert missing.returncode != 0 and "ModuleNotFoundError" in missing.stderr, name
    code = (
        "import mlx_redrafter.convert, mlx_redrafter.apps.server, mlx_redrafter\n"
        f"assert mlx_redrafter.__file__.startswith({str(target)!r}), mlx_redrafter.__file__\n"
        "print('ok')"
    )
    imported = run_isolated(target, code, tmp_path)
    assert imported.returncode == 0 and imported.stdout.strip() == "ok", imported.stderr
    for command, argv in (
        ("mlx_redrafter.convert.cli", ["--help"]),
        ("mlx_redrafter.cli", ["serve", "--help"]),
    ):
        code = f"import sys; from {command} import main; sys.exit(main({argv!r}))"
        shown = run_isolated(target, code, tmp_path)
        assert shown.returncode == 0 and "usage:" in shown.stdout, (command, shown.stderr)


def test_the_installed_package_carries_mt_bench(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    """bench and the export check read MT-Bench from the package, not from ../shared."""
    wheel, target = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert {"mlx_redrafter/data/mt_bench.jsonl.gz", "mlx_redrafter/data/README.md"} <= set(names)
    code = (
        "from collections import Counter\n"
        "from mlx_redrafter.prompts import MT_BENCH, read_prompts\n"
        f"assert str(MT_BENCH).startswith({str(target)!r}), MT_BENCH\n"
        "records = read_prompts(MT_BENCH)\n"
        "print(len(records), sorted(Counter(r.source for r in records).values()))"
    )
    result = run_isolated(target, code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"80 {[10] * 8}"
