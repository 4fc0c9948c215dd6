"""Sustained load under CPU contention: `nox -s stress` (FLASHLLM_STRESS=1); not part of the default run."""

from __future__ import annotations

import os

if not os.environ.get("FLASHLLM_STRESS"):
    collect_ignore_glob = ["test_*.py"]  # minutes of load with every core busy: only when asked for
