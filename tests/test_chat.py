"""`mlx-redrafter chat` in a pseudo-terminal: a question, a streamed reply, /stats,
Ctrl-C stopping a reply but not the session, /reset and /quit.

The tiny llama and its trained drafter are saved as folders, as a user would pass
them with --model and --drafter.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_redrafter.apps.chat import ChatSession, run_chat
from tiny_models import _COMMON, FAMILY_CONFIGS, tiny_tokenizer

from mlx_redrafter import generate, stream_generate
from mlx_redrafter.cli import main as cli_main
from mlx_redrafter.config import TreeConfig
from mlx_redrafter.prompts import chat_tokens

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CHAT_TEMPLATE = (
    "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)


def chat_tokenizer() -> Any:
    """The word-level test tokenizer (w0..w63), EOS w63, with a small chat template."""
    tokenizer = tiny_tokenizer(eos_token="w63")
    tokenizer._tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny(model: Any, drafter: Any, folder: Path) -> tuple[Path, Path]:
    """The tiny llama as an mlx-lm model folder (with the chat tokenizer) and the drafter."""
    model_dir, drafter_dir = folder / "model", folder / "drafter"
    model_dir.mkdir(parents=True)
    config = {**_COMMON, **FAMILY_CONFIGS["llama"], "eos_token_id": 63}
    (model_dir / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(model_dir / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    chat_tokenizer()._tokenizer.save_pretrained(str(model_dir))
    drafter.save(drafter_dir)
    return model_dir, drafter_dir


@pytest.fixture(scope="module")
def saved(trained_llama: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model, drafter, _ = trained_llama
    return save_tiny(model, drafter, tmp_path_factory.mktemp("tiny"))


class Terminal:
    """A child process on a pseudo-terminal (its controlling terminal: Ctrl-C works)."""

    def __init__(self, argv: list[str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            # A program started from a script in the background inherits SIGINT ignored
            # (and Python then installs no KeyboardInterrupt); on its own terminal Ctrl-C
            # must interrupt it, as it does for a user.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(argv[0], argv)
        self.output = ""
        self.cursor = 0

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, pattern: str, timeout: float = 60) -> str:
        """Read until `pattern` (a regex) appears after the previous match; return the
        text from there up to and including it, ANSI colours removed."""
        deadline = time.monotonic() + timeout
        while True:
            clean = ANSI.sub("", self.output)
            found = re.compile(pattern).search(clean, self.cursor)
            if found:
                text, self.cursor = clean[self.cursor : found.end()], found.end()
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not seen; output so far:\n{self.output}")
            ready, _, _ = select.select([self.fd], [], [], 0.01)
            if ready:
                try:
                    self.output += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"{pattern!r} not seen; output:\n{self.output}") from None

    def wait(self, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                select.select([self.fd], [], [], 0.1)
                os.read(self.fd, 4096)
            except OSError:
                pass
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the chat did not exit")


def test_generate_command_decodes_the_tree_it_is_given(
    trained_llama: Any, saved: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`mlx-redrafter generate --tree` (the spelling of bench, distill and train)."""
    model, drafter, prompts = trained_llama
    model_dir, drafter_dir = saved
    question = " ".join(f"w{t}" for t in prompts[0])
    steps = {}
    for label in ("2x3+1x5", "1x2+1x7"):
        tree = TreeConfig.parse(label)
        *_, last = stream_generate(
            model, drafter, chat_tokenizer(), question, max_tokens=30, tree=tree
        )
        steps[label] = last.steps
    assert steps["2x3+1x5"] != steps["1x2+1x7"]  # the tree shows in the steps
    expected = generate(model, drafter, chat_tokenizer(), question, max_tokens=30)
    argv = ["generate", "--model", str(model_dir), "--drafter", str(drafter_dir)]
    argv += ["--prompt", question, "--no-chat-template", "--max-tokens", "30"]
    assert cli_main([*argv, "--tree", "2x3+1x5"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert "ReDrafter 2x3+1x5" in captured.err
    assert f" {steps['2x3+1x5']} target steps" in captured.err
    assert cli_main([*argv, "--tree", "2by3"]) == 2
    assert capsys.readouterr().err.startswith("error: --tree: '2by3' is not a tree")


def test_chat_in_a_terminal(trained_llama: Any, saved: tuple[Path, Path]) -> None:
    model, drafter, prompts = trained_llama
    model_dir, drafter_dir = saved
    tokenizer = chat_tokenizer()
    question = " ".join(f"w{t}" for t in prompts[0])
    conversation = [{"role": "user", "content": question}]
    expected = generate(
        model, drafter, tokenizer, chat_tokens(tokenizer, conversation), max_tokens=400
    )
    argv = [sys.executable, "-m", "mlx_redrafter.cli", "chat", "--model", str(model_dir)]
    argv += ["--drafter", str(drafter_dir), "--max-tokens", "400", "--show-drafts"]
    terminal = Terminal(argv)
    terminal.expect(r">>> ", timeout=90)
    terminal.send(question + "\n")
    reply = terminal.expect(r">>> ")
    assert expected.strip() in reply  # the streamed reply, coloured or not
    assert "\x1b[32m" in terminal.output  # some text came from accepted drafts
    terminal.send("/stats\n")
    stats = terminal.expect(r">>> ")
    assert re.search(r"tau \(tokens per target step\): \d\.\d\d", stats)
    assert re.search(r"speed-up: \d+\.\d\dx = tau", stats)
    assert "tokens/s" in stats
    terminal.send("/reset\n")
    terminal.expect(r"conversation cleared")
    # Ctrl-C while a long reply streams: the reply stops, the session goes on.
    second = " ".join(f"w{t}" for t in prompts[1])
    terminal.send(second + "\n")
    terminal.expect(re.escape(second) + r"\r?\n")  # the terminal's echo
    terminal.expect(r"w\d+ w\d+")  # the reply has started
    terminal.send("\x03")
    terminal.expect(r"\[stopped\]\r?\n>>> ")
    terminal.send("/stats\n")
    assert "(stopped)" in terminal.expect(r">>> ")
    terminal.send("\x03")  # Ctrl-C at the prompt: a reminder, the session goes on
    terminal.expect(r"/quit to leave")
    terminal.send("/quit\n")
    assert terminal.wait() == 0


class _Interrupting:
    """An output stream that raises KeyboardInterrupt (as Ctrl-C does) on its 3rd write."""

    def __init__(self) -> None:
        self.text, self.writes = "", 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes == 3:
            raise KeyboardInterrupt
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def test_ctrl_c_stops_the_reply_not_the_session(trained_llama: Any) -> None:
    model, drafter, prompts = trained_llama
    out = _Interrupting()
    session = ChatSession(model, drafter, chat_tokenizer(), max_tokens=200, out=out)  # type: ignore[arg-type]
    lines = iter(["w5 w6 w7", "/stats", "w8 w9", "/quit"])
    assert run_chat(session, read=lambda _: next(lines)) == 0
    assert "[stopped]" in out.text and "(stopped)" in out.text
    assert len(session.messages) == 4  # both turns kept, the stopped one partial
    assert session.last is not None and not session.last.stopped


class _Text(io.StringIO):
    @property
    def text(self) -> str:
        return self.getvalue()


def test_an_over_long_turn_is_refused_and_the_chat_goes_on(trained_llama: Any) -> None:
    """The tiny model's context is 512 positions: a 600-word turn cannot fit."""
    model, drafter, _ = trained_llama
    out = _Text()
    session = ChatSession(model, drafter, chat_tokenizer(), max_tokens=6, out=out)  # type: ignore[arg-type]
    lines = iter(["w5 w6", " ".join(["w9"] * 600), "w7 w8", "/quit"])
    assert run_chat(session, read=lambda _: next(lines)) == 0
    assert "with this turn has 615 tokens but the model's context is 512" in out.text, out.text
    assert "--drop-oldest" in out.text
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["w5 w6", "w7 w8"]
    assert session.last is not None and session.last.last.generation_tokens > 0


def test_drop_oldest_makes_room_for_a_turn(trained_llama: Any) -> None:
    model, drafter, _ = trained_llama
    out = _Text()
    session = ChatSession(
        model,
        drafter,
        chat_tokenizer(),
        max_tokens=4,
        out=out,
        drop_oldest=True,  # type: ignore[arg-type]
    )
    first, second = " ".join(["w9"] * 300), " ".join(["w8"] * 300)
    session.reply(first)
    session.reply(second)  # fits alone, not after the first turn
    assert "(dropped the 1 oldest turn(s) to fit the context)" in out.text
    assert [m["content"] for m in session.messages if m["role"] == "user"] == [second]
    assert len(session.messages) == 2


def test_save_and_load_a_conversation(trained_llama: Any, tmp_path: Path) -> None:
    model, drafter, _ = trained_llama
    out = _Text()
    session = ChatSession(
        model,
        drafter,
        chat_tokenizer(),
        max_tokens=5,
        system="w3",
        out=out,  # type: ignore[arg-type]
    )
    path = tmp_path / "talk.json"
    lines = iter(["w5 w6", f"/save {path}", "/reset", f"/load {path}", "w7", "/quit"])
    assert run_chat(session, read=lambda _: next(lines)) == 0
    saved = json.loads(path.read_text())
    assert saved["format"] == "mlx-redrafter-chat" and saved["system"] == "w3"
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert "(saved 2 messages" in out.text and "(loaded 2 messages" in out.text
    assert session.messages[:2] == saved["messages"] and len(session.messages) == 4

    before = list(session.messages)
    for content, fragment in (
        ("{not json", "not JSON"),
        (json.dumps({"format": "other"}), "not a saved conversation"),
        (json.dumps({**saved, "messages": [{"role": "assistant", "content": "x"}]}), "message 0"),
    ):
        path.write_text(content)
        script = iter([f"/load {path}", "/quit"])
        assert run_chat(session, read=lambda _, script=script: next(script)) == 0
        assert fragment in out.text, out.text
        assert session.messages == before
    commands = [f"/load {tmp_path / 'missing.json'}", f"/save {path}/x.json", "/load", "/quit"]
    lines = iter(commands)
    assert run_chat(session, read=lambda _: next(lines)) == 0
    assert "cannot read" in out.text and "cannot write" in out.text
    assert "usage: /load FILE" in out.text
