"""EAGLE heads as proposer: the MTP proposer's machinery (core/spec/mtp.py) around an EAGLE-1 or EAGLE-3 head."""

from __future__ import annotations

from flashllm.config import SpeculativeConfigError
from flashllm.core.spec.mtp import LoadedHead, head_kv_bytes_per_block
from flashllm.core.spec.speculator import Target


def load_eagle_drafter(target: Target) -> LoadedHead:
    """The --speculative-model EAGLE head, loaded beside the target (sharing its embedding; an EAGLE-1 head also
    its LM head, while an EAGLE-3 head has its own and reads three of the target's layers, which the target's
    stack then taps). Method eagle takes either layout, eagle3 an EAGLE-3 head only. ValueError (one line) for
    a head of another hidden size or vocabulary, or of the other layout than asked for."""
    from flashllm.models.eagle import Eagle3Head, load_eagle_head
    from flashllm.models.hf_config import ModelLoadError

    config, model = target.config, target.model
    method = config.speculative.method
    hidden_size = getattr(model.config, "hidden_size", None)
    dtype = next(model.parameters()).dtype
    try:
        head = load_eagle_head(str(config.speculative.model), model, hidden_size, target.hf_config.vocab_size,
                               target.ops, dtype, target.selection.device, version=3 if method == "eagle3" else None,
                               vocabulary=target.vocabulary)
    except ModelLoadError as exc:
        raise SpeculativeConfigError(f"--speculate_method {method}: {exc}") from None
    kind = "EAGLE-3" if isinstance(head, Eagle3Head) else "EAGLE-1"
    return LoadedHead(head, target.hf_config.vocab_size, head_kv_bytes_per_block(head, config.cache.block_size),
                      f"{kind} head {config.speculative.model}")
