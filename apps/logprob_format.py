"""Log-probabilities in the OpenAI response formats.

Chat completions: `choices[0].logprobs = {"content": [{"token", "logprob", "bytes",
"top_logprobs": [...]}, ...]}`; completions (legacy): `choices[0].logprobs =
{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, offsets counted in
characters from the start of the completion's text.

A token's text is what it adds to the text before it: the previous token is
decoded with it and without it, so a SentencePiece word's leading space is kept,
and the tokens of a reply join up to its text. The first token decodes alone; in a
completion, which continues its prompt, it keeps the space its piece starts with
(as the completion's text does). A token that is only part of a character reads as U+FFFD, and its
`bytes` are those of that text. The tokens of a matched stop string are reported
too, although the reply's text ends before them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_redrafter.logprobs import TokenLogprob

WORD_MARKERS = ("\u0120", "\u2581", " ")  # byte-level BPE, SentencePiece, plain


def starts_word(tokenizer: Any, token: int) -> bool:
    """Whether the token's piece starts with a space marker (a new word)."""
    piece = tokenizer.convert_ids_to_tokens(int(token))
    return isinstance(piece, str) and piece.startswith(WORD_MARKERS)


class LogprobFormat:
    """One request's log-probabilities, formatted step by step in order: it keeps the
    previous token and the running text offset, so streamed chunks and a whole reply
    read the same."""

    def __init__(self, tokenizer: Any, keep_space: bool = False) -> None:
        self.tokenizer = tokenizer
        self.keep_space = keep_space  # a completion: the first word keeps its space
        self.previous: int | None = None  # the token before the next one reported
        self.offset = 0  # characters of completion text reported so far

    def text(self, token: int) -> str:
        """What `token` adds to the text after the previous token."""
        if self.previous is None:
            alone = str(self.tokenizer.decode([int(token)]))
            space = self.keep_space and not alone.startswith(" ")
            return " " + alone if space and starts_word(self.tokenizer, token) else alone
        before = str(self.tokenizer.decode([self.previous]))
        both = str(self.tokenizer.decode([self.previous, int(token)]))
        return both[len(before) :] if both.startswith(before) else both

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, figures: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The chat format of the next tokens' figures."""
        content = []
        for figure in figures:
            entry = self._entry(figure.token, figure.logprob)
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in figure.top]
            content.append(entry)
            self.previous = figure.token
        return {"content": content}

    def completion(self, figures: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The legacy completions format of the next tokens' figures."""
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        for figure in figures:
            text = self.text(figure.token)
            tops.append({self.text(t): lp for t, lp in figure.top})
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            self.previous = figure.token
        return {
            "tokens": tokens,
            "token_logprobs": [figure.logprob for figure in figures],
            "top_logprobs": tops,
            "text_offset": offsets,
        }
