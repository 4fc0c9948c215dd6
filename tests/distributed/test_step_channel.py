"""The step channel between an idle driver and a rank: the rank waits for the next step however long the
engine idles (FLASHLLM_DIST_TIMEOUT_S bounds a collective under way, not the gap between two) and answers
the driver's pings (the executor's heartbeat; tests/distributed/test_tp_faults.py has a rank that hangs)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from flashllm.core.parallel import (
    DIST_TIMEOUT_ENV,
    RankContext,
    StepChannel,
    destroy_process_group,
    init_process_group,
    rendezvous,
    wait_for_ranks,
)
from flashllm.testing.server import free_port

TIMEOUT_S = 1.0  # FLASHLLM_DIST_TIMEOUT_S for both ranks: the driver idles past it

# Rank 1 with no model: it serves the channel until the driver stops it; the first line says it is imported,
# so the short timeout bounds only the meeting, not starting Python and torch.
RANK = """
import sys
import torch
from flashllm.core import parallel
print("imported", flush=True)
rank = parallel.RankContext(1, 2)
parallel.init_process_group(rank, "gloo", store=parallel.rendezvous(sys.argv[1], rank))
assert parallel.StepChannel(torch.device("cpu")).receive() is None, "the driver sent a step"
parallel.destroy_process_group()
"""


@contextmanager
def _driver_and_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[StepChannel, subprocess.Popen[str]]]:
    """This process as the driver (rank 0) and a rank 1 process, over gloo with TIMEOUT_S."""
    monkeypatch.setenv(DIST_TIMEOUT_ENV, str(TIMEOUT_S))
    address = f"127.0.0.1:{free_port()}"
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "imported", rank.communicate()[1]
        driver = RankContext(0, 2)
        store = rendezvous(address, driver)
        wait_for_ranks(store, 2, lambda: None)
        init_process_group(driver, "gloo", store=store)
        yield StepChannel(torch.device("cpu"), driver=True), rank
    finally:
        rank.kill()  # a rank the test left running or stopped (SIGKILL ends a stopped process too)
        rank.communicate()
        destroy_process_group()


def test_an_idle_rank_waits_past_the_timeout_and_answers_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    with _driver_and_rank(monkeypatch) as (channel, rank):
        time.sleep(1.5 * TIMEOUT_S)  # the engine idles
        channel.ping()  # a barrier with the rank: it fails if the rank left its loop
        channel.ping()
        channel.send_stop()  # the rank went back to waiting after each ping and reads the stop
        assert rank.wait(10) == 0, rank.communicate()[1]
