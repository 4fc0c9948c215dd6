"""Multi-LoRA: per-request adapters batched through lora_shrink / lora_expand, against transformers + peft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from flashllm.llm import LLM  # noqa: E402
from flashllm.lora import LoRAError, LoRARequest  # noqa: E402
from flashllm.models.layers.linear import LinearBase  # noqa: E402
from flashllm.sampling_params import SamplingParams  # noqa: E402
from flashllm.testing.parity import assert_rows_match, record_logits  # noqa: E402
from flashllm.testing.tiny_lora import build_peft_adapter, greedy_reference, load_peft_model  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

STEPS = 32
# (r, alpha, targets, rsLoRA): ranks below the slots' 8, every projection, some subsets
ADAPTERS = [
    (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    (4, 12, ("q_proj", "v_proj", "down_proj"), True),
    (8, 8, ("k_proj", "o_proj", "gate_proj", "up_proj"), False),
    (2, 6, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), True),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, tuple[Path, list[LoRARequest]]]:
    made = {}
    for preset in ("llama", "qwen2", "qwen3"):
        root = tmp_path_factory.mktemp(f"multi-{preset}")
        base = build_tiny_model(root / "base", preset, seed=8, tokenizer=False)
        requests = []
        for i, (r, alpha, targets, rslora) in enumerate(ADAPTERS):
            path = build_peft_adapter(base, root / f"a{i}", r=r, alpha=alpha, targets=targets, use_rslora=rslora,
                                      seed=20 + i)
            requests.append(LoRARequest(f"adapter-{i}", i + 1, str(path)))
        made[preset] = (base, requests)
    return made


def _prompts(lengths: tuple[int, ...], seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _llm(base: Path, **kw) -> LLM:
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", device="cpu", block_size=16,
                   max_model_len=256, num_kv_blocks=96)
    options.update(kw)
    return LLM(str(base), **options)


GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


@pytest.mark.parametrize("preset", ["llama", "qwen2", "qwen3"])
def test_batched_adapters_match_transformers_and_peft(preset, setup) -> None:
    """One batch: two adapters and the base model, prompts crossing blocks and prefill chunks; every
    logits row within 1e-4 of peft's (unmerged) and greedy tokens identical over 32 steps."""
    base, requests = setup[preset]
    llm = _llm(base, max_num_batched_tokens=40)
    rows = record_logits(llm)
    prompts = _prompts((23, 9, 50, 1))
    loras = [requests[0], None, requests[1], requests[0]]
    outputs = llm.generate(prompts, GREEDY, lora_request=loras)
    references = {}
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        key = None if lora is None else lora.lora_path
        if key not in references:
            references[key] = load_peft_model(base, requests[0].lora_path if key is None else key)
        reference = references[key]
        if lora is None:
            with reference.disable_adapter():
                tokens, logits = greedy_reference(reference, prompt, STEPS)
        else:
            tokens, logits = greedy_reference(reference, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"{lora and lora.lora_name} diverged"
        assert_rows_match(rows, prompt, tokens, logits, STEPS, atol=1e-4)


def test_mixed_batch_gives_each_row_what_it_gives_alone(setup) -> None:
    """4 adapters and base rows over 2 device slots (LRU eviction, the scheduler holding a third adapter
    back), chunked prefill, preemption (few KV blocks) and prefix-cache hits (repeated prompts)."""
    base, requests = setup["llama"]
    llm = _llm(base, num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=24, max_num_seqs=6)
    shared = _prompts((40,), seed=9)[0]
    prompts = [shared, shared, *_prompts((30, 17, 5, 33, 21), seed=4), shared]
    loras = [requests[0], requests[1], requests[2], None, requests[3], requests[1], None, requests[0]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = [llm.generate([p], params, lora_request=lora)[0].outputs[0].token_ids
             for p, lora in zip(prompts, loras, strict=True)]
    manager = llm.engine.runner.lora
    loads_before, preempted_before = manager.num_slot_loads, llm.engine.scheduler.num_preemptions
    together = llm.generate(prompts, params, lora_request=loras)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert llm.engine.scheduler.num_preemptions > preempted_before, "the test meant to preempt"
    assert manager.num_slot_loads > loads_before, "adapters should have been swapped through the 2 slots"
    assert sum(o.metrics.num_cached_tokens for o in together) > 0, "the repeated prompts should hit the cache"
    assert llm.engine.num_free_blocks() == llm.engine.block_manager.num_total_blocks


def test_two_adapters_never_share_prefix_blocks(setup) -> None:
    base, requests = setup["llama"]
    llm = _llm(base)
    prompt = _prompts((50,), seed=12)[0]  # three full blocks of 16 may be cached
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def cached(lora: LoRARequest | None) -> int:
        return llm.generate([prompt], params, lora_request=lora)[0].metrics.num_cached_tokens

    assert cached(requests[0]) == 0
    assert cached(requests[0]) == 48  # the same adapter hits its own blocks
    assert cached(requests[1]) == 0  # another adapter does not
    assert cached(None) == 0  # nor the base model
    assert cached(None) == 48 and cached(requests[1]) == 48


def test_lora_requests_are_refused_clearly(setup, tmp_path) -> None:
    base, requests = setup["llama"]
    plain = LLM(str(base), dtype="float32", device="cpu", num_kv_blocks=16, block_size=16, max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([[1, 2, 3]], GREEDY, lora_request=requests[0])
    assert not any(hasattr(m, "lora") for m in plain.engine.parts.model.modules() if isinstance(m, LinearBase))
    assert all("forward" not in vars(m) for m in plain.engine.parts.model.modules())  # the plain path is untouched
    llm = _llm(base, max_lora_rank=4)
    with pytest.raises(LoRAError, match=r"rank r=8.*--max-lora-rank"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=requests[0])
    llm.generate([[1, 2, 3]], GREEDY, lora_request=requests[1])  # rank 4 fits
    with pytest.raises(ValueError, match="already"):
        llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("other", 2, requests[3].lora_path))
    with pytest.raises(ValueError, match="id >= 1|whole number"):
        LoRARequest("x", 0, "p")


def test_float_adapters_on_a_weight_only_int8_base(setup, tmp_path) -> None:
    """w8a16 base layers with float adapters: transformers + peft on a float model holding the int8 codes
    times their scales (quantized per projection here, with flashllm's quantize_weight) is the oracle."""
    from safetensors.torch import load_file, save_file

    from flashllm.ops.quant_matmul import dequantize
    from flashllm.quant.weight_only import quantize_weight

    base, requests = setup["llama"]
    snapped = tmp_path / "snapped"
    snapped.mkdir()
    for path in base.iterdir():
        if path.suffix != ".safetensors":
            (snapped / path.name).write_bytes(path.read_bytes())
    tensors = load_file(base / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight"):  # every linear layer the engine quantizes (not embeddings / head)
            tensors[name] = dequantize(quantize_weight(tensor, "w8a16", -1, True))
    save_file(tensors, snapped / "model.safetensors")
    llm = _llm(base, quant_type="weight_only_int8", backend="reference")
    rows = record_logits(llm)
    prompt = _prompts((21,), seed=30)[0]
    output = llm.generate([prompt], GREEDY, lora_request=requests[0])[0]
    tokens, logits = greedy_reference(load_peft_model(snapped, requests[0].lora_path), prompt, STEPS)
    assert output.outputs[0].token_ids == tokens
    for ctx, row in rows:
        torch.testing.assert_close(row, logits[len(ctx) - 1], atol=1e-4, rtol=0)


def test_speculative_decoding_verifies_with_each_rows_adapter(setup) -> None:
    """ngram drafts verified under each row's adapter: the greedy tokens are those without speculation."""
    base, requests = setup["llama"]
    prompt = _prompts((12,), seed=40)[0] * 3  # repeats give the ngram proposer something to draft
    prompts, loras = [prompt, prompt, prompt[5:]], [requests[0], None, requests[1]]
    plain = [o.outputs[0].token_ids for o in _llm(base).generate(prompts, GREEDY, lora_request=loras)]
    spec = _llm(base, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, GREEDY, lora_request=loras)] == plain
    assert spec.engine.speculator.stats.num_drafted > 0
