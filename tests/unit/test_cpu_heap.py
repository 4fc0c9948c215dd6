"""The cpu backend's malloc setting (heap.py): a step's freed tensors are reused without page faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashllm.backends.cpu import CpuAdapter, heap

glibc = pytest.mark.skipif(not heap.is_glibc(), reason="the setting is glibc's mallopt")

# In a fresh process (the setting is process-wide and this one may hold it already): the minor
# faults of each of a run of 64 MiB tensors, each written and freed before the next (as steps
# follow steps), before and after keep_freed_memory(), then in a thread started after it. The
# first few after it still fault:
# torch's 64-byte-aligned request asks glibc for a little more than a freed block holds, so the
# heap grows until its free blocks merge (within 6 tensors in 40 tries here); the test looks at the
# last four of 16.
_PROBE = """
import json, resource, threading, torch
from flashllm.backends.cpu import heap

def faults(count):
    out = []
    for _ in range(count):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 << 20).fill_(1.0)  # allocated, written and freed
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out

default = faults(8)
kept = heap.keep_freed_memory()
after = faults(16)
threaded = {}  # a thread started afterwards, as the server's engine thread is
worker = threading.Thread(target=lambda: threaded.update(faults=faults(16)))
worker.start()
worker.join()
print(json.dumps({"default": default, "kept": kept, "after": after, "thread": threaded["faults"]}))
"""
PAGES = (64 << 20) // 4096


def _probe(**env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc
def test_freed_memory_is_reused_without_faults() -> None:
    result = _probe()
    # glibc maps a 64 MiB request afresh each time by default: every page faults again
    assert min(result["default"][-4:]) >= PAGES // 2, result
    assert result["kept"] is True
    assert sum(result["after"][-4:]) < PAGES // 50, result
    assert sum(result["thread"][-4:]) < PAGES // 50, result


@glibc
def test_switch_leaves_malloc_alone() -> None:
    result = _probe(**{heap.ENV_SWITCH: "0"})
    assert result["kept"] is False
    assert min(result["after"][-4:]) >= PAGES // 2, result


def test_cpu_runner_applies_it_when_weights_are_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.backends.cpu.runner import CpuRunner

    calls = []
    monkeypatch.setattr(heap, "keep_freed_memory", lambda: calls.append(True) or True)
    CpuRunner.prepare_model(torch.nn.Linear(4, 4), CpuAdapter())
    assert calls == [True]
