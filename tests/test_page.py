"""The chat page at `/`, in headless Chromium driven over the DevTools protocol.

The test types a message, presses Enter, and watches the assistant's reply grow in the
DOM (streamed, several updates) to the library's greedy reply, with the tau and
tokens/s readout filled in. Run as a script, it screenshots a running server's page:

    python tests/test_page.py --url http://127.0.0.1:8080 --out docs/images/chat_page.png
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,800",
    "--remote-debugging-port=0",
]

# Records every text the assistant's message shows, from before the message is sent.
WATCH = """
window.__seen = [];
new MutationObserver(() => {
  const replies = document.querySelectorAll('.message.assistant .text');
  if (replies.length) window.__seen.push(replies[replies.length - 1].textContent);
}).observe(document.getElementById('messages'),
           {childList: true, subtree: true, characterData: true});
"""


class Browser:
    """Headless Chromium with one page, driven by DevTools protocol calls."""

    def __init__(self, url: str):
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        self.process: subprocess.Popen[bytes] | None = None
        try:
            self._start(url)
        except BaseException:
            self.close()
            raise

    def _start(self, url: str) -> None:
        from websockets.sync.client import connect

        assert CHROMIUM is not None
        self.process = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.environment(),
        )
        port_file = Path(self.profile) / "DevToolsActivePort"  # Chromium writes its port here
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline and self.process.poll() is None:
            lines = port_file.read_text().split() if port_file.exists() else []
            if lines and lines[0].isdigit():
                port = int(lines[0])
            time.sleep(0.05)
        if port is None:
            raise RuntimeError("Chromium did not start its DevTools endpoint")
        targets: list[dict[str, Any]] = []
        while time.monotonic() < deadline and not targets:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as response:
                targets = [t for t in json.load(response) if t.get("type") == "page"]
            time.sleep(0.05)
        self.socket = connect(targets[0]["webSocketDebuggerUrl"], max_size=2**26).__enter__()
        self.ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def environment(self) -> dict[str, str]:
        """Ours without the OpenBLAS preload (it breaks Chromium's network service), and
        temporary files inside the profile, which `close` removes."""
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env["TMPDIR"] = self.profile
        return env

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self.ids)
        self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(
                f"(() => {{ try {{ return {expression}; }} catch {{ return 0; }} }})()"
            )
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {expression}")

    def type_and_send(self, text: str) -> None:
        """Type into the message box and press Enter, as a person would."""
        self.evaluate("document.getElementById('input').focus()")
        self.call("Input.insertText", text=text)
        for kind in ("keyDown", "keyUp"):
            self.call(
                "Input.dispatchKeyEvent",
                type=kind,
                key="Enter",
                code="Enter",
                windowsVirtualKeyCode=13,
                text="\r" if kind == "keyDown" else "",
            )

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            if hasattr(self, "socket"):
                self.socket.close()
        finally:
            if self.process is not None:
                self.process.terminate()
                try:
                    self.process.wait(10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(10)
            # Chromium's helper processes may still write for a moment after it exits.
            deadline = time.monotonic() + 5
            while True:
                shutil.rmtree(self.profile, ignore_errors=True)
                time.sleep(0.2)
                if not os.path.exists(self.profile) or time.monotonic() > deadline:
                    break


def chat_on_page(browser: Browser, message: str, settings: dict[str, str]) -> dict[str, Any]:
    """Apply settings, send `message`, wait for the reply; the page's state after it."""
    browser.wait_for("document.getElementById('model').options.length > 0")
    for field, value in settings.items():
        browser.evaluate(
            f"document.getElementById({json.dumps(field)}).value = {json.dumps(value)}"
        )
    browser.evaluate(WATCH)
    browser.type_and_send(message)
    browser.wait_for(
        "document.querySelector('.message.assistant') && "
        "document.querySelector('.message.assistant').dataset.finish",
        timeout=120,
    )
    return dict(
        browser.evaluate(
            """({
              user: document.querySelector('.message.user .text').textContent,
              reply: document.querySelector('.message.assistant .text').textContent,
              finish: document.querySelector('.message.assistant').dataset.finish,
              meta: document.querySelector('.message.assistant .meta').textContent,
              tau: document.getElementById('tau').textContent,
              tps: document.getElementById('tps').textContent,
              mode: document.getElementById('mode').textContent,
              seen: window.__seen,
            })"""
        )
    )


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")
def test_the_chat_page_streams_a_reply(trained_llama: Any, tmp_path: Path) -> None:
    pytest.importorskip("websockets")
    from test_server import Served

    from mlx_redrafter.prompts import chat_tokens

    model, drafter, prompts = trained_llama
    served = Served(model, drafter, prompts, "3:4x4")
    message = " ".join(f"w{t}" for t in prompts[5])
    prompt = chat_tokens(served.tokenizer, [{"role": "user", "content": message}])
    expected = served.alone(prompt, 60)
    with served.background:
        browser = Browser(served.url + "/")
        try:
            page = chat_on_page(browser, message, {"max_tokens": "60", "temperature": "0"})
            browser.screenshot(tmp_path / "chat_page.png")
        finally:
            browser.close()
    served.batcher.close()
    assert page["user"] == message
    assert page["reply"] == expected
    assert page["finish"] in ("stop", "length")
    partial = {text for text in page["seen"] if text and text != expected}
    assert len(partial) >= 2, page["seen"]  # the reply grew step by step
    assert float(page["tau"]) > 1.0 and float(page["tps"]) > 0
    assert "ReDrafter" in page["mode"]
    assert (tmp_path / "chat_page.png").stat().st_size > 10_000


def main() -> int:
    parser = argparse.ArgumentParser(description="Screenshot the chat page of a running server")
    parser.add_argument("--url", default="http://127.0.0.1:8080/")
    parser.add_argument("--out", type=Path, default=Path("docs/images/chat_page.png"))
    parser.add_argument("--message", default="Give me three tips for learning to cook.")
    parser.add_argument("--max-tokens", default="120")
    args = parser.parse_args()
    browser = Browser(args.url)
    try:
        page = chat_on_page(browser, args.message, {"max_tokens": args.max_tokens})
        browser.screenshot(args.out)
    finally:
        browser.close()
    print(json.dumps({k: v for k, v in page.items() if k != "seen"}, indent=1))
    print(f"{len(page['seen'])} DOM updates; screenshot: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
