"""A terminal chat over `stream_generate`: multi-turn, streamed, with live statistics.

Commands: /reset (forget the conversation), /stats (tau, tokens/s and speed-up of the
last reply), /save FILE and /load FILE (the conversation as JSON), /help, /quit. A turn
that does not fit the model's context is refused with a message (or, with
`drop_oldest`, the oldest turns make room) and the conversation goes on. Ctrl-C stops
the current reply and keeps the session; Ctrl-D or /quit leaves. With `show_drafts`,
text from drafted tokens the target accepted is coloured, so speculation can be watched
at work; the target's own token of each step is printed plainly.

Speed-up: tau x (plain step time / speculative step time). The plain step time is
measured once, by decoding a few tokens of the conversation plainly (no drafter) the
first time /stats needs it, so the baseline runs on the same machine and context.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import mlx.nn as nn

from mlx_redrafter.auto import AutoTree
from mlx_redrafter.config import DEFAULT_TREE, TreeConfig
from mlx_redrafter.decode import plan_step
from mlx_redrafter.drafter import Drafter
from mlx_redrafter.files import write_json
from mlx_redrafter.generate import GenerationResponse, stream_generate
from mlx_redrafter.policy import TreeChoice
from mlx_redrafter.prompt_cache import PromptCache
from mlx_redrafter.prompts import chat_tokens
from mlx_redrafter.session import DecodingSession
from mlx_redrafter.target import context_length

DRAFTED = "\033[32m"  # green: drafted by the drafter and accepted by the target
RESET = "\033[0m"
BASELINE_TOKENS = 16

HELP = """commands:
  /reset       forget the conversation
  /stats       tau, tokens/s and speed-up of the last reply
  /save FILE   write the conversation to FILE (JSON)
  /load FILE   continue the conversation saved in FILE
  /help        this text
  /quit        leave (Ctrl-D too); Ctrl-C stops a reply"""
CONVERSATION_FORMAT = "mlx-redrafter-chat"


@dataclass
class ReplyStats:
    """Figures of one reply."""

    last: GenerationResponse
    seconds: float
    stopped: bool  # interrupted with Ctrl-C

    @property
    def step_seconds(self) -> float:
        """Mean wall-clock of one decoding step (excluding prefill)."""
        if not self.last.steps or not self.last.generation_tps:
            return 0.0
        decode_seconds = self.last.generation_tokens / self.last.generation_tps
        return decode_seconds / self.last.steps


@dataclass
class ChatSession:
    """A conversation with the model; `reply` streams the answer to `out`."""

    model: nn.Module
    drafter: Drafter | None
    tokenizer: Any
    tree: TreeConfig | TreeChoice | str = DEFAULT_TREE
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    system: str | None = None
    show_drafts: bool = False
    drop_oldest: bool = False  # a turn that does not fit drops the oldest turns
    out: TextIO = sys.stdout
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt_cache: PromptCache | None = field(default_factory=PromptCache)  # None: no reuse
    decoder: DecodingSession | None = field(default=None, repr=False)  # kept across turns
    last: ReplyStats | None = None
    plain_step_seconds: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tree, str) and self.tree.strip().lower() == "auto":
            # One auto tree for the whole conversation: what it learns carries over.
            self.tree = AutoTree.for_model(self.model, self.drafter)
        if self.decoder is None:  # one session: compiled steps carry over between turns
            self.decoder = DecodingSession(self.model, self.drafter, self.tokenizer, tree=self.tree)

    def describe_tree(self) -> str:
        if isinstance(self.tree, TreeConfig):
            return self.tree.label
        if isinstance(self.tree, str):
            return self.tree
        return self.tree.describe()

    def reset(self) -> None:
        self.messages = []
        self.last = None
        if self.prompt_cache is not None:
            self.prompt_cache.clear()

    def prompt(self) -> list[int]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return chat_tokens(self.tokenizer, system + self.messages)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def fit_context(self) -> str | None:
        """Make the conversation fit the model's context (dropping the oldest turns when
        `drop_oldest`); None when it fits, else what to do."""
        limit = context_length(self.model)
        if limit is None:
            return None
        dropped = 0
        while len(self.prompt()) >= limit and self.drop_oldest and len(self.messages) > 1:
            del self.messages[:2]  # the oldest user turn and its reply
            dropped += 1
        if dropped:
            self._write(f"(dropped the {dropped} oldest turn(s) to fit the context)\n")
        length = len(self.prompt())
        if length < limit:
            return None
        where = "this turn" if len(self.messages) == 1 else "the conversation with this turn"
        return (
            f"{where} has {length} tokens but the model's context is {limit}: shorten it, "
            "/reset, or start the chat with --drop-oldest to drop the oldest turns"
        )

    def reply(self, user_text: str) -> str:
        """Add the user's turn, stream the model's answer, and keep it in the conversation.
        A turn that does not fit is not kept: the message says why."""
        self.messages.append({"role": "user", "content": user_text})
        problem = self.fit_context()
        if problem is not None:
            self.messages.pop()
            self._write(f"({problem})\n")
            return ""
        drafts = _DraftColours(self.tokenizer.detokenizer)
        pieces: list[str] = []
        last: GenerationResponse | None = None
        stopped = False
        started = time.perf_counter()
        responses = None
        try:
            responses = stream_generate(
                self.model,
                self.drafter,
                self.tokenizer,
                self.prompt(),
                prompt_cache=self.prompt_cache,
                session=self.decoder,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                stop=self.stop,
            )
            for response in responses:
                last = response
                if self.show_drafts:
                    self._write(drafts.add(response))
                else:
                    self._write(response.text)
                pieces.append(response.text)
        except KeyboardInterrupt:
            stopped = True
            close = getattr(responses, "close", None)
            if close is not None:  # end the generator now, not when collected
                close()
        self._write(" [stopped]\n" if stopped else "\n")
        text = "".join(pieces)
        self.messages.append({"role": "assistant", "content": text})
        if last is not None:
            self.last = ReplyStats(last, time.perf_counter() - started, stopped)
        return text

    def save(self, path: str) -> None:
        """Write the conversation to `path` as JSON (atomically)."""
        record = {
            "format": CONVERSATION_FORMAT,
            "version": 1,
            "system": self.system,
            "messages": self.messages,
        }
        try:
            write_json(os.path.expanduser(path), record, indent=1)
        except OSError as error:
            raise ValueError(f"cannot write {path}: {error.strerror or error}") from None

    def load(self, path: str) -> None:
        """Continue the conversation saved in `path`; on any problem nothing changes."""
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as file:
                record = json.load(file)
        except OSError as error:
            raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not a saved conversation (not JSON: {error})") from None
        self.system, self.messages = read_conversation(record, path)
        self.last = None
        if self.prompt_cache is not None:
            self.prompt_cache.clear()

    def measure_plain_step(self) -> float:
        """Seconds per plain decoding step on the current conversation (measured once)."""
        if self.plain_step_seconds is None:
            responses = stream_generate(
                self.model,
                None,
                self.tokenizer,
                self.prompt(),
                max_tokens=BASELINE_TOKENS,
                tree="plain",
            )
            last = list(responses)[-1]
            self.plain_step_seconds = 1.0 / max(last.generation_tps, 1e-9)
        return self.plain_step_seconds

    def stats(self) -> str:
        if self.last is None:
            return "no reply yet"
        last = self.last.last
        lines = [
            f"last reply: {last.generation_tokens} tokens in {last.steps} target steps"
            + (" (stopped)" if self.last.stopped else ""),
            f"tau (tokens per target step): {last.tokens_per_step:.2f}",
            f"speed: {last.generation_tps:.1f} tokens/s (prompt {last.prompt_tokens} tokens, "
            f"{last.cached_tokens} from the prompt cache, the rest prefilled in "
            f"{last.prompt_seconds * 1e3:.0f} ms)",
        ]
        fixed = self.tree if isinstance(self.tree, TreeConfig) else None
        if fixed is not None and plan_step(fixed, self.drafter is not None).plain:
            lines.append("speed-up: 1.00x (plain decoding: no drafter loaded)")
        elif last.steps:
            plain = self.measure_plain_step()
            speculative = self.last.step_seconds
            speedup = last.tokens_per_step * plain / max(speculative, 1e-9)
            lines.append(
                f"speed-up: {speedup:.2f}x = tau {last.tokens_per_step:.2f} x plain step "
                f"{plain * 1e3:.1f} ms / speculative step {speculative * 1e3:.1f} ms "
                f"({self.describe_tree()}; plain step measured "
                f"once on this conversation, {BASELINE_TOKENS} tokens)"
            )
        return "\n".join(lines)


class _DraftColours:
    """The released text of a reply, with the text of drafted tokens the target accepted
    coloured. Each token's own text comes from a detokenizer of its own; what is shown
    never runs past the text the session released (so never into a stop string)."""

    def __init__(self, detokenizer: Any):
        self.detokenizer = detokenizer
        self.detokenizer.reset()
        self.pieces: list[tuple[str, bool]] = []  # (text, drafted), not yet shown
        self.released = 0  # characters released by the session, not yet shown

    def add(self, response: GenerationResponse) -> str:
        for position, token in enumerate(response.tokens):
            self.detokenizer.add_token(token)
            self.pieces.append((self.detokenizer.last_segment, position < response.num_accepted))
        if response.finish_reason is not None:
            self.detokenizer.finalize()
            self.pieces.append((self.detokenizer.last_segment, False))
        self.released += len(response.text)
        shown = []
        while self.pieces and self.released:
            text, drafted = self.pieces.pop(0)
            if len(text) > self.released:
                self.pieces.insert(0, (text[self.released :], drafted))
                text = text[: self.released]
            self.released -= len(text)
            shown.append(f"{DRAFTED}{text}{RESET}" if drafted and text else text)
        return "".join(shown)


def read_conversation(record: Any, path: str) -> tuple[str | None, list[dict[str, str]]]:
    """(system, messages) of a saved conversation record; ValueError saying what is wrong."""
    if not isinstance(record, dict) or record.get("format") != CONVERSATION_FORMAT:
        raise ValueError(f"{path} is not a saved conversation (no format {CONVERSATION_FORMAT!r})")
    system, messages = record.get("system"), record.get("messages")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"{path}: 'system' must be a string or null")
    if not isinstance(messages, list):
        raise ValueError(f"{path}: 'messages' must be a list")
    for index, message in enumerate(messages):
        expected = "user" if index % 2 == 0 else "assistant"
        ok = isinstance(message, dict) and set(message) == {"role", "content"}
        if not ok or message["role"] != expected or not isinstance(message["content"], str):
            raise ValueError(
                f"{path}: message {index} must be {{'role': '{expected}', 'content': text}}"
            )
    return system, [dict(m) for m in messages]


def terminal_input(prompt: str) -> str:
    """`input` for a terminal that Ctrl-C always interrupts.

    A blocking read is interrupted only when SIGINT reaches the main thread, and MLX's
    and BLAS's threads may take it instead: the read would then wait for Enter. Waiting
    in short selects lets Python check for the signal in between. (In canonical mode a
    terminal read returns one line, so nothing is left in Python's buffer.)
    """
    sys.stdout.write(prompt)
    sys.stdout.flush()
    while not select.select([sys.stdin], [], [], 0.1)[0]:
        pass
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def run_chat(
    session: ChatSession, read: Callable[[str], str] = input, out: TextIO | None = None
) -> int:
    """The read-reply loop; returns the exit code."""
    out = out or session.out
    while True:
        try:
            line = read(">>> ").strip()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n(/quit to leave)\n")
            continue
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        command, _, argument = line.partition(" ")
        if line == "/reset":
            session.reset()
            out.write("(conversation cleared)\n")
        elif command in ("/save", "/load"):
            out.write(_save_or_load(session, command, argument.strip()) + "\n")
        elif line == "/stats":
            out.write(session.stats() + "\n")
        elif line == "/help":
            out.write(HELP + "\n")
        elif line.startswith("/"):
            out.write(f"unknown command {line.split()[0]}; /help lists them\n")
        else:
            try:
                session.reply(line)
            except KeyboardInterrupt:  # a second Ctrl-C while the reply was wrapping up
                out.write(" [stopped]\n")
        out.flush()


def _save_or_load(session: ChatSession, command: str, path: str) -> str:
    """Run /save or /load; the line to show."""
    if not path:
        return f"usage: {command} FILE"
    try:
        if command == "/save":
            session.save(path)
            return f"(saved {len(session.messages)} messages to {path})"
        session.load(path)
        return f"(loaded {len(session.messages)} messages from {path})"
    except ValueError as error:
        return f"({error})"
