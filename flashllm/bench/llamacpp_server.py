"""llama.cpp's own `llama-server` as the batched serving baseline: find it, start it on a GGUF, stop it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "FLASHLLM_LLAMA_SERVER"
BUILD_COMMAND = "python -m flashllm.bench.llamacpp_build"
CTX_MULTIPLE = 256  # per-slot context is rounded up to this many tokens
SERVED_NAME = "llama.cpp"


class LlamaServerUnavailable(RuntimeError):
    """No llama-server binary was found; the message is one line saying where it was looked for."""


def built_binary() -> Path:
    """Where `python -m flashllm.bench.llamacpp_build` puts llama-server (under the shape cache root)."""
    from flashllm.bench.shapes import cache_root

    return cache_root() / "llama.cpp" / "bin" / "llama-server"


def find_llama_server(explicit: str | os.PathLike[str] | None = None,
                      environ: dict[str, str] | None = None) -> Path:
    """The llama-server to run: `explicit` (--llama-server), else $FLASHLLM_LLAMA_SERVER, else
    `llama-server` on PATH, else the helper's build (built_binary); LlamaServerUnavailable if none.

    An explicit path or the variable must name an executable file: a wrong one is an error, not a
    reason to fall back to another binary.
    """
    environ = dict(os.environ) if environ is None else environ
    for source, given in (("--llama-server", explicit), (ENV_VAR, environ.get(ENV_VAR))):
        if given:
            path = Path(given).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise LlamaServerUnavailable(f"{source} {given!r} is not an executable file; point it at a "
                                             f"llama-server binary (or build one: {BUILD_COMMAND})")
            return path
    on_path = shutil.which("llama-server", path=environ.get("PATH"))
    if on_path:
        return Path(on_path)
    built = built_binary()
    if built.is_file() and os.access(built, os.X_OK):
        return built
    raise LlamaServerUnavailable(f"no llama-server found (--llama-server, ${ENV_VAR}, PATH, {built}); build it "
                                 f"from llama.cpp's source with `{BUILD_COMMAND}` (minutes) or pass "
                                 "--llama-server PATH")


def slot_context(longest_request: int, requested: int | None = None) -> int:
    """Tokens of context per slot: `requested` (--max-model-len) when given, else the workload's
    longest prompt + output rounded up to a multiple of CTX_MULTIPLE."""
    if requested is not None:
        if requested < longest_request:
            raise ValueError(f"--max-model-len {requested} is shorter than the longest request "
                             f"({longest_request} tokens of prompt and output); raise it or shorten the workload")
        return requested
    return -(-longest_request // CTX_MULTIPLE) * CTX_MULTIPLE


@dataclass(frozen=True, slots=True)
class LlamaServerPlan:
    """How llama-server is started: one slot per concurrent request, each with `ctx_per_slot`
    tokens of KV (so -c is their product: llama-server splits its context evenly over the slots),
    and `threads` threads for both decode and prompt processing."""

    gguf: Path
    parallel: int
    ctx_per_slot: int
    threads: int
    extra_args: tuple[str, ...] = ()

    def command(self, binary: Path, port: int) -> list[str]:
        """The argv: listening on 127.0.0.1:`port`, served under the name SERVED_NAME, no web UI."""
        if self.parallel < 1 or self.ctx_per_slot < 1 or self.threads < 1:
            raise ValueError(f"llama-server needs at least one slot, one token of context and one thread; got "
                             f"parallel={self.parallel}, ctx_per_slot={self.ctx_per_slot}, threads={self.threads}")
        return [str(binary), "--model", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(self.parallel), "--ctx-size", str(self.parallel * self.ctx_per_slot),
                "--threads", str(self.threads), "--threads-batch", str(self.threads),
                "--alias", SERVED_NAME, "--no-webui", *self.extra_args]


@dataclass
class LlamaServer:
    """A running llama-server: `url` is its OpenAI API root (`http://127.0.0.1:PORT/v1`)."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    command: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_llama_server(binary: Path, plan: LlamaServerPlan, timeout: float = 300.0) -> LlamaServer:
    """Start llama-server and wait until GET /health answers 200 (it answers 503 while loading).

    Raises RuntimeError with the end of its log when it exits or is not ready within `timeout` s.
    """
    from flashllm.testing.server import free_port, wait_healthy

    port = free_port()
    command = plan.command(binary, port)
    fd, log_name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
    log = Path(log_name)
    with os.fdopen(fd, "wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = LlamaServer(proc, port, log, command)
    if wait_healthy(proc, f"http://127.0.0.1:{port}/health", timeout, lambda: f"llama-server exited with "
                    f"{proc.returncode} ({' '.join(command)}):\n{server.log()[-3000:]}"):
        return server
    server.stop()
    raise RuntimeError(f"llama-server was not ready after {timeout:.0f} s ({' '.join(command)}):\n{server.log()[-3000:]}")


@contextmanager
def running_llama_server(binary: Path, plan: LlamaServerPlan) -> Iterator[LlamaServer]:
    """`with running_llama_server(binary, plan) as server:` ... stopped (and its log removed) afterwards."""
    server = start_llama_server(binary, plan)
    try:
        yield server
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def llama_server_version(binary: Path) -> str:
    """The first line `llama-server --version` prints ("version: 1 (0c1e570)"), or "unknown"."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip().startswith("version")]
    return lines[0] if lines else "unknown"


