"""Reading prompt files: MT-Bench (`{"turns": [...]}`) or `{"prompt": ...}` JSONL."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MLX_REDRAFTER_DATA", REPO_ROOT.parent / "shared" / "data"))
MT_BENCH = SHARED_DATA / "eval" / "mt_bench.jsonl"


def read_prompts(path: str | os.PathLike[str], strict: bool = False) -> list[str]:
    """First user turns from a JSONL file of MT-Bench questions or {"prompt": ...} rows.

    A malformed or empty line is reported with its line number and skipped
    (or raises ValueError when strict).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no prompt file at {file}")
    prompts = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                prompts.append(_first_turn(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError, IndexError) as error:
                message = f"{file}:{number}: not a prompt record ({error})"
                if strict:
                    raise ValueError(message) from None
                warnings.warn(message + "; skipped", stacklevel=2)
    if not prompts:
        raise ValueError(f"{file} holds no prompts")
    return prompts


def _first_turn(record: Any) -> str:
    if "prompt" in record:
        text = record["prompt"]
    elif "turns" in record:
        text = record["turns"][0]
    else:
        raise KeyError("expected a 'prompt' or 'turns' field")
    if not isinstance(text, str) or not text.strip():
        raise TypeError("the prompt is empty or not a string")
    return text


def chat_tokens(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt as one user turn with the model's chat template (raw text without one)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt))
