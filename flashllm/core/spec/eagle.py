"""EAGLE-1 heads as proposer: the MTP proposer's machinery (core/spec/mtp.py) around an EagleHead."""

from __future__ import annotations

from flashllm.core.spec.mtp import LoadedHead, head_kv_bytes_per_block
from flashllm.core.spec.speculator import Target


def load_eagle_drafter(target: Target) -> LoadedHead:
    """The --speculative-model EAGLE head, loaded beside the target (sharing its embedding and LM head);
    ValueError (one line) for a head of another hidden size or vocabulary, or one that is not EAGLE-1's."""
    from flashllm.models.eagle import load_eagle_head
    from flashllm.models.hf_config import ModelLoadError

    config, model = target.config, target.model
    hidden_size = getattr(model.config, "hidden_size", None)
    dtype = next(model.parameters()).dtype
    try:
        head = load_eagle_head(str(config.speculative.model), model, hidden_size, target.hf_config.vocab_size,
                               target.ops, dtype, target.selection.device)
    except ModelLoadError as exc:
        raise ValueError(f"--speculate_method eagle: {exc}") from None
    return LoadedHead(head, target.hf_config.vocab_size, head_kv_bytes_per_block(head, config.cache.block_size),
                      f"EAGLE head {config.speculative.model}")
