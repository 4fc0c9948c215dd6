"""Fixtures for the web UI tests: a real `serve --ui`, a headless Chromium and a page driver."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flashllm.serving.webui import Message, list_models
from flashllm.testing.server import ServerProcess, free_port, running_server
from flashllm.testing.tiny_models import build_tiny_model

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SERVE_FLAGS = ["--max-model-len", "512", "--device", "cpu", "--dtype", "float32", "--ui"]
TIMEOUT_MS = 60_000
NEEDS_GRADIO = "the web UI needs gradio>=6 (pip install 'flashllm[ui]')"


class ChatPage:
    """Drives the chat page the way a person does: sliders, typing, clicking."""

    BOT = '#flashllm-chat [data-testid="bot"]'
    USER = '#flashllm-chat [data-testid="user"]'
    BOT_LABEL = "bot's message: "  # gradio's aria-label of a message: this prefix, then the raw text

    def __init__(self, browser: Any, url: str) -> None:
        from playwright.sync_api import expect

        self.expect = expect
        self.page = browser.new_page()
        self.page.goto(url)
        self.page.locator("#flashllm-message textarea").wait_for(timeout=TIMEOUT_MS)

    def widget(self, name: str) -> Any:
        """The element with elem_id `flashllm-<name>` (send, stop, clear, chat, message, ...)."""
        return self.page.locator(f"#flashllm-{name}")

    def set_slider(self, name: str, value: float) -> None:
        box = self.widget(name).locator("input[type=number]")
        box.fill(str(value))
        box.press("Enter")

    def type(self, text: str) -> None:
        self.widget("message").locator("textarea").fill(text)

    def last_reply(self) -> str:
        """The raw text of the latest bot message (markdown not rendered)."""
        label = self.page.locator(self.BOT).last.get_attribute("aria-label") or ""
        assert label.startswith(self.BOT_LABEL), label
        return label[len(self.BOT_LABEL):]

    def send(self, text: str, press_enter: bool = False) -> str:
        """Send `text`, wait until the reply is complete, return its raw text."""
        bots = self.page.locator(self.BOT)
        count = bots.count()
        self.type(text)
        if press_enter:
            self.widget("message").locator("textarea").press("Enter")
        else:
            self.widget("send").click()
        # Send is disabled in the same update that shows the message, so "enabled again" means "done".
        self.expect(bots).to_have_count(count + 1, timeout=TIMEOUT_MS)
        self.expect(self.widget("send")).to_be_enabled(timeout=TIMEOUT_MS)
        return self.last_reply()

    def watch_bot_text(self) -> Callable[[], list[str]]:
        """Record every text the latest bot message shows; the returned callable gives the record."""
        self.page.evaluate("""() => { window.seen = []; const chat = document.querySelector('#flashllm-chat');
          new MutationObserver(() => { const bots = chat.querySelectorAll('[data-testid="bot"]');
            if (bots.length) window.seen.push(bots[bots.length - 1].getAttribute('aria-label')); })
          .observe(chat, {subtree: true, childList: true, attributes: true, characterData: true}); }""")
        return lambda: [s[len(self.BOT_LABEL):] for s in self.page.evaluate("window.seen")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("webui") / "tiny-chat", "qwen2", seed=0)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    """`flashllm serve MODEL --ui` on a free port."""
    pytest.importorskip("gradio", minversion="6", reason=NEEDS_GRADIO)
    with running_server([str(model_dir), *SERVE_FLAGS]) as server:
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Debian Chromium through playwright (never a browser playwright downloads)."""
    pytest.importorskip("gradio", minversion="6", reason=NEEDS_GRADIO)
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs python playwright (pip install playwright)")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"needs Chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_chat(browser: Any) -> Iterator[Callable[[str], ChatPage]]:
    """`open_chat(url)` opens the page in a fresh tab, closed after the test."""
    pages: list[ChatPage] = []

    def open_page(url: str) -> ChatPage:
        pages.append(ChatPage(browser, url))
        return pages[-1]
    yield open_page
    for chat in pages:
        chat.page.close()


@pytest.fixture(scope="module")
def greedy(server: ServerProcess) -> Callable[[list[Message], int], str]:
    """`greedy(messages, max_tokens)`: the server's own non-streamed greedy answer."""
    model = list_models(server.url)[0]

    def reply(messages: list[Message], max_tokens: int) -> str:
        response = httpx.post(f"{server.url}/chat/completions", timeout=120, json={
            "model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": False})
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])
    return reply


@pytest.fixture
def standalone_webui(server: ServerProcess, tmp_path: Path) -> Iterator[str]:
    """`flashllm webui --url <server>` on a free port; yields the page's URL."""
    port, log = free_port(), tmp_path / "webui.log"
    cmd = [sys.executable, "-m", "flashllm", "webui", "--url", server.url, "--port", str(port)]
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        _wait_for_page(proc, url, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_page(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"flashllm webui exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"flashllm webui did not serve {url} within {timeout:.0f} s:\n{log.read_text()[-4000:]}")
