"""The documentation describes the product: no lab-notebook history, a small docs/
folder, and relative links that resolve."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"

HISTORY = re.compile(r"(?i)session [0-9]+|issue #?[0-9]+")
# [text](target) and ![alt](target); the target ends at whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...
MAX_DOCS_BYTES = 2 * 1024 * 1024


def doc_files() -> list[Path]:
    return [README] + sorted(path for path in DOCS.rglob("*") if path.is_file())


def markdown_files() -> list[Path]:
    return [README] + sorted(DOCS.glob("*.md"))


def test_no_history_in_the_docs() -> None:
    hits = []
    for path in doc_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # images
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "history belongs in CHANGELOG.md:\n" + "\n".join(hits)


def test_docs_folder_is_small() -> None:
    total = sum(path.stat().st_size for path in DOCS.rglob("*") if path.is_file())
    assert total < MAX_DOCS_BYTES, f"docs/ holds {total} bytes; results go to benchmarks/"


def test_relative_links_point_at_existing_files() -> None:
    broken = []
    for path in markdown_files():
        text = path.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            if EXTERNAL.match(target) or target.startswith("#"):
                continue
            file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
            if not (path.parent / file_part).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_pattern_finds_links() -> None:
    found = LINK.findall("see [a](docs/api.md#trees), ![img](images/x.png) and [b](https://x.y)")
    assert found == ["docs/api.md#trees", "images/x.png", "https://x.y"]
