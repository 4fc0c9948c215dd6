"""Run a command with every core kept busy by a competing process: `python tests/stress/saturate.py CMD ...`."""

from __future__ import annotations

import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: python tests/stress/saturate.py COMMAND [ARGS...]")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        return subprocess.run(argv, check=False).returncode
    finally:
        for proc in loops:
            proc.kill()
        for proc in loops:
            proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
