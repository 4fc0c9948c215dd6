"""Peak resident memory of a process and its children, read from Linux's /proc/<pid>/status (VmHWM)."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def status_kib(text: str, key: str = "VmHWM") -> int | None:
    """The value of `key` in a /proc/<pid>/status text, in KiB ("VmHWM:\\t  123456 kB" -> 123456).

    None when the key is absent (a kernel thread, a process that is exiting, a non-Linux system);
    ValueError when the line is there but is not "<number> kB".
    """
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name == key:
            parts = value.split()
            if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
                raise ValueError(f"unexpected {key} line in /proc status: {line!r}; expected '{key}: <number> kB'")
            return int(parts[0])
    return None


def process_tree(pid: int, proc: Path = PROC) -> list[int]:
    """`pid` and every live descendant, parents before children (from /proc/<pid>/task/*/children)."""
    order, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        order.append(current)
        for task in sorted((proc / str(current) / "task").glob("*/children")):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:  # the task exited between the listing and the read
                continue
    return order


def peak_rss_bytes(pid: int, proc: Path = PROC) -> dict[str, int] | None:
    """Peak resident memory of `pid` ("process": its VmHWM) and of its tree ("tree": the sum of each
    live process's own VmHWM, an upper bound, since their peaks need not coincide), in bytes.

    Read it while the process still runs (the numbers go with it). None where /proc has no status
    for `pid` (not Linux, or the process is gone).
    """
    peaks = []
    for member in process_tree(pid, proc):
        try:
            kib = status_kib((proc / str(member) / "status").read_text())
        except OSError:
            kib = None
        if member == pid and kib is None:
            return None
        peaks.append(kib or 0)
    return {"process": peaks[0] * 1024, "tree": sum(peaks) * 1024}


def reset_peak(pid: int | str = "self", proc: Path = PROC) -> bool:
    """Reset `pid`'s VmHWM to its current resident size (writes 5 to /proc/<pid>/clear_refs, Linux >= 4.0),
    so a later peak_rss_bytes measures from now; False where the kernel does not allow it."""
    try:
        (proc / str(pid) / "clear_refs").write_text("5")
    except OSError:
        return False
    return True
