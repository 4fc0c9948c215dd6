"""Start a real `flashllm serve` process on 127.0.0.1 and a free port, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A running server: `url` is the API root (`http://127.0.0.1:PORT/v1`)."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1"

    def log(self) -> str:
        """Everything the server printed so far (stdout and stderr together)."""
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig`, wait for the exit and return the exit code (SIGKILL after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_server(args: Sequence[str] = (), env: dict[str, str] | None = None, timeout: float = 120.0,
                 port: int | None = None, launcher: Sequence[str] = ()) -> ServerProcess:
    """Run `python -m flashllm serve *args --host 127.0.0.1 --port P` and wait until /health answers 200.

    `args` holds the model directory and any other serve flags. `env` is added to the
    environment. `launcher` runs flashllm under another launcher (e.g. torchrun's arguments up to
    its `-m`). Raises RuntimeError with the server's log if it exits or stays unhealthy.
    """
    port = port or free_port()
    log = Path(tempfile.mkstemp(prefix="flashllm-serve-", suffix=".log")[1])
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", *launcher, *(["-m"] if launcher else []), "flashllm", "serve", *args,
           "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(proc, port, log)
    if wait_healthy(proc, f"{server.base_url}/health", timeout, lambda: f"flashllm serve exited with "
                    f"{proc.returncode}:\n{server.log()[-4000:]}"):
        return server
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"flashllm serve was not healthy after {timeout:.0f} s:\n{server.log()[-4000:]}")


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, exited: Callable[[], str]) -> bool:
    """Poll GET `url` until it answers 200 (True) or `timeout` seconds pass (False). When `proc` exits
    first, RuntimeError with the message `exited()` composes (the process's return code is set by then)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(exited())
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


@contextmanager
def running_server(args: Sequence[str] = (), env: dict[str, str] | None = None,
                   timeout: float = 120.0) -> Iterator[ServerProcess]:
    """`with running_server([model_dir, ...]) as server:` ... the server is stopped afterwards."""
    server = start_server(args, env, timeout)
    try:
        yield server
    finally:
        server.stop()
