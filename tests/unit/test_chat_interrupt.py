"""Ctrl-C during a streamed chat reply (flashllm/cli/chat.py), without a terminal: SIGINT raised in-process."""

from __future__ import annotations

import io
import signal
import threading
from collections.abc import Iterator

import pytest

from flashllm.chat_session import ChatSession
from flashllm.cli.chat import ChatRepl


class FakeResponder:
    """Streams up to 50 deltas, checking `stop` before each as RemoteResponder does; sends itself
    SIGINT after `interrupt_at` deltas, inside code that swallows the KeyboardInterrupt when `lose`
    (Python drops an exception raised while a finalizer runs)."""

    name = "fake"

    def __init__(self, defer_interrupt: bool, lose: bool, interrupt_at: int = 3) -> None:
        self.defer_interrupt, self.lose, self.interrupt_at = defer_interrupt, lose, interrupt_at
        self.sent = 0

    def stream(self, messages: list[dict[str, str]], settings: object, stop: threading.Event) -> Iterator[str]:
        for _ in range(50):
            if stop.is_set():
                return
            if self.sent == self.interrupt_at:
                if self.lose:
                    try:
                        signal.raise_signal(signal.SIGINT)
                    except KeyboardInterrupt:
                        pass
                else:
                    signal.raise_signal(signal.SIGINT)
            self.sent += 1
            yield "tok "

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("defer_interrupt", "lose"), [(False, False), (False, True), (True, False)])
def test_ctrl_c_stops_the_reply_and_keeps_what_was_shown(defer_interrupt: bool, lose: bool) -> None:
    out = io.StringIO()
    responder = FakeResponder(defer_interrupt, lose)
    session = ChatSession()
    before = signal.getsignal(signal.SIGINT)
    ChatRepl(responder, session, interactive=False, out=out).turn("hello")
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back after the reply
    # three deltas shown; the interrupt ended the reply before a fourth, even where it was lost
    assert responder.sent == (4 if lose or defer_interrupt else 3)
    assert out.getvalue().startswith("tok tok tok ") and "(reply stopped)" in out.getvalue()
    assert session.history.messages("next")[-2]["content"].startswith("tok tok tok")


def test_without_ctrl_c_the_reply_runs_to_its_end() -> None:
    out = io.StringIO()
    responder = FakeResponder(defer_interrupt=False, lose=False, interrupt_at=-1)
    ChatRepl(responder, ChatSession(), interactive=False, out=out).turn("hello")
    assert responder.sent == 50 and "(reply stopped)" not in out.getvalue()
