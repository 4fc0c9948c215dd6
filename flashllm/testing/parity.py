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


def assert_rows_match(rows: list[tuple[list[int], torch.Tensor]], prompt: list[int], tokens: list[int],
                      logits: torch.Tensor, steps: int, atol: float) -> None:
    """Every recorded row that scored a prefix of prompt + tokens, from the prompt on (at least `steps` of
    them), is within `atol` of `logits` (the reference's rows over prompt + tokens) at its last position."""
    full = prompt + tokens
    mine = [(ctx, row) for ctx, row in rows if len(ctx) >= len(prompt) and ctx == full[:len(ctx)]]
    assert len(mine) >= steps, f"prompt of {len(prompt)} tokens: {len(mine)} logits rows recorded"
    for ctx, row in mine:
        torch.testing.assert_close(row, logits[len(ctx) - 1], atol=atol, rtol=0)


class LogitRecorder:
    """`record_logits` as an object: `.rows` fills as the LLM generates."""

    def __init__(self, llm: Any) -> None:
        self.rows = record_logits(llm)


def random_tokens(n: int, vocab_size: int, seed: int) -> list[int]:
    """`n` token ids drawn uniformly from [0, vocab_size) by a generator seeded with `seed`."""
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V) float32 logits of a transformers model's own forward over the whole sequence."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


@torch.inference_mode()
def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by repeated full forwards (no cache code involved): the `steps` new tokens, and the
    (len(prompt) + steps, V) float32 logits of every position of the final sequence."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(hf_model, ids)[-1].argmax()))
    return ids[len(prompt):], hf_logits(hf_model, ids)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4) -> None:
    """Same shape and max |actual - expected| <= atol; the message gives the difference found."""
    assert actual.shape == expected.shape, f"logits of shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item()
    assert err <= atol, f"max abs logit difference {err:.2e} > {atol:.0e}"


def check_varlen_prefill_and_decode(driver: Any, hf_model: torch.nn.Module, prompts: list[list[int]],
                                    atol: float = 1e-4, steps: int = 3) -> None:
    """One varlen prefill of every prompt through a paged test driver, then `steps` greedy decode steps of all of
    them together; every logit row within `atol` of transformers' full forward. Extends `prompts` in place."""
    seqs = [driver.add_sequence() for _ in prompts]
    outputs = driver.step(list(zip(seqs, prompts, strict=True)))
    for prompt, logits in zip(prompts, outputs, strict=True):
        assert_logits_close(logits, hf_logits(hf_model, prompt), atol)
    for _ in range(steps):
        for prompt, logits in zip(prompts, outputs, strict=True):
            prompt.append(int(logits[-1].argmax()))
        outputs = driver.step([(seq, [prompt[-1]]) for seq, prompt in zip(seqs, prompts, strict=True)])
        for prompt, logits in zip(prompts, outputs, strict=True):
            assert_logits_close(logits, hf_logits(hf_model, prompt)[-1:], atol)


def check_chunked_prefill_beside_a_decode(driver: Any, hf_model: torch.nn.Module, vocab_size: int,
                                          atol: float = 1e-4, short_len: int = 20) -> None:
    """A 150-token prompt prefilled in three chunks (0-37, 37-100, 100-150) through a paged test driver, each in a
    step beside another sequence's one-token decode; every logit row within `atol` of transformers' full forward."""
    long_prompt, short = random_tokens(150, vocab_size, seed=6), random_tokens(short_len, vocab_size, seed=8)
    a, b = driver.add_sequence(), driver.add_sequence()
    driver.step([(b, short)])
    for lo, hi in ((0, 37), (37, 100), (100, 150)):
        short.append(random_tokens(1, vocab_size, seed=hi)[0])
        chunk_logits, decode_logits = driver.step([(a, long_prompt[lo:hi]), (b, short[-1:])])
        assert_logits_close(chunk_logits, hf_logits(hf_model, long_prompt[:hi])[lo:hi], atol)
        assert_logits_close(decode_logits, hf_logits(hf_model, short)[-1:], atol)


def check_engine_greedy_against(llm: Any, hf_model: torch.nn.Module, prompts: list[list[int]], steps: int,
                                atol: float = 1e-4, greedy: Any = hf_greedy) -> None:
    """The engine's `steps` greedy tokens after each prompt equal transformers' (full forwards, no cache), and every
    logits row it scored on the way is within `atol` of transformers'. `greedy(hf_model, prompt, steps)` gives
    transformers' (tokens, logits): hf_greedy, or a cache of it where several tests share prompts."""
    from flashllm.sampling_params import SamplingParams

    rows = record_logits(llm)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logits = greedy(hf_model, prompt, steps)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert_rows_match(rows, prompt, tokens, logits, steps, atol=atol)
