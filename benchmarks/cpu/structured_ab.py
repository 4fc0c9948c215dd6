"""Offline throughput of a JSON-schema batch of 16 against the same batch unconstrained (qwen2.5-0.5b shape, CPU).

Run: PYTHONPATH=. python benchmarks/cpu/structured_ab.py [repeats]  (under /work/notes/bin/cpu-bench on the team VM);
the same as `flashllm bench structured --shape qwen2.5-0.5b --repeats N` (flashllm/bench/structured.py).
"""

from __future__ import annotations

import sys

from flashllm.cli import main

if __name__ == "__main__":
    repeats = sys.argv[1] if len(sys.argv) > 1 else "3"
    raise SystemExit(main(["bench", "structured", "--shape", "qwen2.5-0.5b", "--repeats", repeats]))
