"""Process checks for tests: a process's live children, and waiting until processes are gone (Linux /proc)."""

from __future__ import annotations

import time
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None when gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def gone(pid: int) -> bool:
    """The process no longer exists, or is a zombie that runs nothing until its parent reaps it."""
    fields = _stat(pid)
    return fields is None or fields[0] == "Z"


def children(pid: int) -> list[int]:
    """The live (non-zombie) child processes of pid."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    """Children, their children, and so on."""
    found, queue = [], children(pid)
    while queue:
        kid = queue.pop()
        found.append(kid)
        queue.extend(children(kid))
    return found


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to `timeout` seconds for every pid to be gone; the ones still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not gone(p)]
