"""Greedy generation for ROUGE: flashllm's engine, and transformers on the same weights and prompt tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm


def prompt_ids(llm: Any, src: str, use_chat_template: bool) -> list[int]:
    """Token ids of `src`: as the user turn of the model's chat template, or the raw text encoded."""
    if use_chat_template:
        return llm.render_chat([{"role": "user", "content": src}])
    return llm.tokenizer.encode(src)


def generate_flashllm(llm: Any, prompts: list[list[int]], max_tokens: int, progress: bool = False) -> list[str]:
    """Greedy completions (text, special tokens skipped) of token-id prompts, batched by the engine."""
    from flashllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [output.text for output in llm.generate(prompts, params, use_tqdm=progress)]


@torch.inference_mode()
def generate_transformers(model_dir: str | Path, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype,
                          tokenizer: Any, eos_token_ids: list[int], progress: bool = False) -> list[str]:
    """Greedy completions with transformers `generate` on the same weights, one prompt at a time.

    Batch 1 needs no padding, so the reference sees exactly the prompt tokens flashllm saw.
    Stops at the same EOS ids; decodes with the same tokenizer, skipping special tokens.
    """
    from transformers import GenerationConfig

    from flashllm.bench.hf_baseline import load

    model = load(Path(model_dir), dtype)
    config = GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, num_beams=1, repetition_penalty=1.0,
        eos_token_id=eos_token_ids or None, pad_token_id=eos_token_ids[0] if eos_token_ids else 0,
    )
    texts = []
    for ids in tqdm(prompts, desc="transformers", unit="prompt", disable=not progress):
        input_ids = torch.tensor([ids], dtype=torch.int64)
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
        texts.append(tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True))
    return texts
