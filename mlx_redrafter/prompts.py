"""Prompt files and prompt tokens, shared by distill, train, bench and the apps.

A prompt file is JSONL, one record per line: `{"prompt": ...}`, ShareGPT-style
`{"conversations": [{"from": "human", "value": ...}, ...]}` (or `"messages"` with
`role`/`content`; system turns kept, up to the first user turn), or MT-Bench's
`{"turns": [...]}` (the first turn). Optional `id` (MT-Bench: `question_id`) and
`source` (MT-Bench: `category`).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

PACKAGED_DATA = Path(__file__).parent / "data"
# MT-Bench (Apache-2.0, attribution in data/README.md) ships compressed in the package;
# MLX_REDRAFTER_DATA=DIR reads DIR/eval/mt_bench.jsonl instead.
MT_BENCH = (
    Path(os.environ["MLX_REDRAFTER_DATA"]) / "eval" / "mt_bench.jsonl"
    if os.environ.get("MLX_REDRAFTER_DATA")
    else PACKAGED_DATA / "mt_bench.jsonl.gz"
)
# The built-in distillation prompts (11,046; MIT and Apache-2.0 sources, attribution in
# data/README.md), what `make-drafter` distils when given no --prompts.
TRAIN_PROMPTS = (
    Path(os.environ["MLX_REDRAFTER_DATA"]) / "prompts" / "train_prompts.jsonl"
    if os.environ.get("MLX_REDRAFTER_DATA")
    else PACKAGED_DATA / "train_prompts.jsonl.gz"
)


class PromptRecord(NamedTuple):
    """One prompt: its id, its source tag (`source`, else MT-Bench's `category`) and its
    chat messages up to the first user turn."""

    id: str
    source: str
    messages: list[dict[str, str]]


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def _messages_from(record: Any) -> list[dict[str, str]]:
    """The chat messages of a JSONL record, up to its first user turn."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    prompt = record.get("prompt")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError('"prompt" must be a non-empty string')
        return [{"role": "user", "content": prompt}]
    turns = record.get("conversations", record.get("messages"))
    if turns is None and isinstance(record.get("turns"), list):  # MT-Bench: first turn
        turns = [{"role": "user", "content": t} for t in record["turns"][:1]]
    if not isinstance(turns, list):
        raise ValueError('no "prompt" string and no "conversations" list')
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError("a conversation turn is not an object")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role == "system" and isinstance(content, str):
            messages.append({"role": "system", "content": content})
            continue
        if _ROLES.get(str(role)) == "user" and isinstance(content, str) and content.strip():
            messages.append({"role": "user", "content": content})
            return messages
    raise ValueError("the conversation has no non-empty user turn")


def read_prompts(
    path: str | os.PathLike[str],
    strict: bool = False,
    warn: Callable[[str], None] | None = None,
) -> list[PromptRecord]:
    """Prompt records from a JSONL file (or .jsonl.gz); bad lines are reported and
    skipped (or raise)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no prompts file at {file}")
    warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
    records: list[PromptRecord] = []
    seen: set[str] = set()
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            try:
                if not line.strip():
                    raise ValueError("empty line")
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"invalid JSON ({error.msg})") from None
                messages = _messages_from(raw)
                record_id = str(raw.get("id", raw.get("question_id", f"line-{number}")))
                if record_id in seen:
                    raise ValueError(f"duplicate id {record_id!r}")
            except ValueError as error:
                message = f"{file}:{number}: {error}"
                if strict:
                    raise ValueError(f"{message} (--strict)") from None
                warn(f"{message}; skipped")
                continue
            seen.add(record_id)
            source = raw.get("source", raw.get("category", ""))
            records.append(PromptRecord(record_id, str(source), messages))
    if not records:
        raise ValueError(f"{file} holds no usable prompt")
    return records


def select_prompts(
    records: list[PromptRecord], per_category: int | None = None, limit: int | None = None
) -> list[PromptRecord]:
    """The first `per_category` records of each category (`source`), then the first
    `limit` of those (None: all)."""
    if per_category is not None and per_category < 1:
        raise ValueError("per_category (--per-category) must be >= 1")
    if limit is not None and limit < 1:
        raise ValueError("limit (--limit) must be >= 1")
    if per_category:
        seen: dict[str, int] = {}
        kept = []
        for record in records:
            seen[record.source] = seen.get(record.source, 0) + 1
            if seen[record.source] <= per_category:
                kept.append(record)
        records = kept
    return records[:limit]


def read_turns(path: str | os.PathLike[str]) -> list[list[str]]:
    """The user turns of each MT-Bench-style record (`{"turns": [...]}`), in order."""
    file = Path(path)
    opener = gzip.open if file.suffix == ".gz" else open
    conversations = []
    with opener(file, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line) if line.strip() else None
            turns = record.get("turns") if isinstance(record, dict) else None
            if isinstance(turns, list) and all(isinstance(t, str) and t for t in turns):
                conversations.append(list(turns))
    if not conversations:
        raise ValueError(f"{file} holds no record with a 'turns' list")
    return conversations


def text_tokens(tokenizer: Any, text: str) -> list[int]:
    """Token ids of raw text, with the tokenizer's BOS unless the text already has it."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not text.startswith(bos)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=add_special)]


def chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt of a conversation: the model's chat template with the assistant's turn
    opened, or, for a tokenizer without a template, a plain 'role: content' transcript."""
    if getattr(tokenizer, "chat_template", None):
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if hasattr(tokens, "keys"):  # some tokenizers answer a BatchEncoding
            tokens = tokens["input_ids"]
        return [int(t) for t in tokens]
    transcript = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return text_tokens(tokenizer, transcript)


def encode_prompt(
    tokenizer: Any, messages: list[dict[str, str]], chat_template: bool = True
) -> list[int]:
    """A prompt record's token ids: the chat template (`chat_tokens`), or, with
    chat_template False or a tokenizer without one, the turns' text joined by newlines
    (what distill, train and bench send a base model)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return chat_tokens(tokenizer, messages)
    return text_tokens(tokenizer, "\n".join(m["content"] for m in messages))
