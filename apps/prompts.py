"""Turning conversations and text into token ids, shared by the chat command and the server."""

from __future__ import annotations

from typing import Any


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
