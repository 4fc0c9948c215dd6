"""Parity-test helpers: the logits rows an engine samples from, with the tokens each row scored."""

from __future__ import annotations

from typing import Any

import torch


def record_logits(llm: Any) -> list[tuple[list[int], torch.Tensor]]:
    """Wrap `llm`'s driver runner so every logits row it computes is kept with the context it scored.

    Returns the list the rows are appended to, in step order. The engine then runs one step per
    scheduling round (num_scheduler_steps 1), and greedy steps go through the logits too, so every
    sampled token has its row; the tokens sampled are unchanged (the argmax of those rows).
    """
    rows: list[tuple[list[int], torch.Tensor]] = []
    llm.engine.config.scheduler.num_scheduler_steps = 1
    runner, original = llm.engine.runner, llm.engine.runner.execute_model

    def execute_model(batch: Any, greedy: bool = False) -> torch.Tensor:
        logits = original(batch)
        samplers = [item.seq for item in batch.scheduled if item.produces_token]
        rows.extend((list(seq.token_ids), row.clone()) for seq, row in zip(samplers, logits, strict=True))
        return runner.argmax(logits) if greedy else logits

    runner.execute_model = execute_model
    return rows


class LogitRecorder:
    """`record_logits` as an object: `.rows` fills as the LLM generates."""

    def __init__(self, llm: Any) -> None:
        self.rows = record_logits(llm)
