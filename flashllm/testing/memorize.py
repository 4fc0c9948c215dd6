"""Fine-tune a tiny model until greedy decoding of given prompts yields given continuations.

Random-weight models say nothing in particular; tests of output parsing (tool calls, stop
handling) need a model that says something exact. A few hundred Adam steps on a 2-layer model
are enough for it to memorize a handful of (prompt, continuation) pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def memorize(model_dir: str | Path, pairs: Sequence[tuple[list[int], list[int]]], steps: int = 400,
             lr: float = 1e-2, seed: int = 0) -> float:
    """Train the model in `model_dir` in place on (prompt ids, continuation ids) pairs; returns the final loss.

    The loss covers only the continuation tokens, so the prompt is left to the chat template.
    Training stops once every continuation token is the teacher-forced argmax with a low loss,
    which is what greedy decoding needs.
    The directory is rewritten with safetensors weights in the model's original dtype.
    """
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    # one thread: these models are too small to share out, and on a busy machine the intra-op threads
    # of a backward pass wait on each other (43 steps took 49 s with 2 threads under load, 4.5 s with 1)
    torch.set_num_threads(1)
    try:
        return _train(model_dir, pairs, steps, lr, seed, AutoModelForCausalLM)
    finally:
        torch.set_num_threads(threads)


def _train(model_dir: str | Path, pairs: Sequence[tuple[list[int], list[int]]], steps: int, lr: float, seed: int,
           auto_model: type) -> float:
    torch.manual_seed(seed)
    model = auto_model.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    rows = [torch.tensor(p + c) for p, c in pairs]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for i, ((prompt, cont), row) in enumerate(zip(pairs, rows, strict=True)):
        input_ids[i, : len(row)] = row
        labels[i, len(prompt): len(row)] = torch.tensor(cont)
        attention[i, : len(row)] = 1
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.tensor(float("inf"))
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
        loss = out.loss
        predicted = out.logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        if loss.item() < 0.02 and bool((predicted == target)[target != -100].all()):
            break
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return float(loss.item())
