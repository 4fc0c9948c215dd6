"""LoRA on MoE models (tiny Mixtral and Qwen2-MoE): merged at load and batched per request, against
transformers + peft; adapters on experts merge at load and are refused by multi-LoRA with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("peft")

from flashllm.llm import LLM  # noqa: E402
from flashllm.lora import LoRAError, LoRARequest  # noqa: E402
from flashllm.sampling_params import SamplingParams  # noqa: E402
from flashllm.testing.parity import assert_rows_match, record_logits  # noqa: E402
from flashllm.testing.tiny_lora import (  # noqa: E402
    build_peft_adapter,
    build_random_adapter,
    greedy_reference,
    load_peft_model,
)
from flashllm.testing.tiny_moe import build_moe_model  # noqa: E402

STEPS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
# attention everywhere; on Qwen2-MoE also the shared expert and the dense layers' MLP (transformers 5
# stacks the routed experts into 3-D parameters, which peft's target_modules do not reach)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, tuple[Path, list[LoRARequest]]]:
    made = {}
    for preset in ("mixtral", "qwen2_moe"):
        root = tmp_path_factory.mktemp(f"moe-{preset}")
        base = build_moe_model(root / "base", preset, seed=11)
        requests = [LoRARequest(f"a{i}", i + 1, str(build_peft_adapter(base, root / f"a{i}", r=r, alpha=alpha,
                                                                         targets=TARGETS, use_rslora=i == 1,
                                                                         seed=60 + i)))
                    for i, (r, alpha) in enumerate(((8, 16), (4, 12)))]
        made[preset] = (base, requests)
    return made


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def _check(llm: LLM, rows, prompts, loras, base: Path, batched: bool = True) -> None:
    """Every output against peft's unmerged model with loras[i] (disabled for None rows): greedy tokens
    identical over STEPS steps and every logits row the engine computed for it within 1e-4. batched:
    the engine gets the LoRA requests (multi-LoRA), else the plain prompts (an adapter merged at load)."""
    outputs = llm.generate(prompts, GREEDY, lora_request=loras if batched else None)
    references: dict[str, object] = {}
    for prompt, lora, output in zip(prompts, loras, outputs, strict=True):
        path = (lora or loras[0]).lora_path
        reference = references.setdefault(path, load_peft_model(base, path))
        if lora is None:
            with reference.disable_adapter():
                tokens, logits = greedy_reference(reference, prompt, STEPS)
        else:
            tokens, logits = greedy_reference(reference, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"{lora and lora.lora_name} diverged from peft"
        assert_rows_match(rows, prompt, tokens, logits, STEPS, atol=1e-4)


ENGINE = dict(dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=32)  # 32: the 40-token prompt is prefilled in chunks


@pytest.mark.parametrize("preset", ["mixtral", "qwen2_moe"])
def test_moe_merged_adapter_matches_peft(preset, moe) -> None:
    base, requests = moe[preset]
    llm = LLM(str(base), lora_path=requests[0].lora_path, **ENGINE)
    rows = record_logits(llm)
    _check(llm, rows, _prompts((40, 7), seed=1), [requests[0]] * 2, base, batched=False)


@pytest.mark.parametrize("preset", ["mixtral", "qwen2_moe"])
def test_moe_batched_adapters_match_peft(preset, moe) -> None:
    """One batch: two adapters (rank 8, and rank 4 with rsLoRA) and a base-model row."""
    base, requests = moe[preset]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    rows = record_logits(llm)
    _check(llm, rows, _prompts((40, 9, 23), seed=2), [requests[0], None, requests[1]], base)


def _expert_shapes(base: Path) -> dict[str, tuple[int, int]]:
    tensors = load_file(base / "model.safetensors")
    return {name: tuple(t.shape) for name, t in tensors.items() if ".experts." in name or ".self_attn.q_proj." in name}


def test_expert_adapter_merges_at_load_and_multi_lora_refuses_it(moe, tmp_path) -> None:
    """An adapter on every routed expert's projections (Mixtral's w1/w2/w3, as older peft versions wrote
    them) merged at load equals transformers on a checkpoint merged here with plain torch; multi-LoRA
    has no expert slots and refuses the adapter in one line."""
    base, _ = moe["mixtral"]
    adapter = build_random_adapter(tmp_path / "experts", _expert_shapes(base), r=4, alpha=8, seed=3, std=0.2)
    lora = load_file(adapter / "adapter_model.safetensors")
    merged = tmp_path / "merged"
    merged.mkdir()
    for path in base.iterdir():
        if path.suffix != ".safetensors":
            (merged / path.name).write_bytes(path.read_bytes())
    tensors = load_file(base / "model.safetensors")
    for name in _expert_shapes(base):
        module = name.removesuffix(".weight")
        a, b = lora[f"base_model.model.{module}.lora_A.weight"], lora[f"base_model.model.{module}.lora_B.weight"]
        tensors[name] = tensors[name] + (8 / 4) * b @ a
    save_file(tensors, merged / "model.safetensors")
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    llm = LLM(str(base), lora_path=str(adapter), **ENGINE)
    rows = record_logits(llm)
    prompt = _prompts((30,), seed=3)[0]
    output = llm.generate([prompt], GREEDY)[0]
    tokens, logits = greedy_reference(reference, prompt, STEPS)
    assert output.outputs[0].token_ids == tokens
    for ctx, row in rows:
        torch.testing.assert_close(row, logits[len(ctx) - 1], atol=1e-4, rtol=0)
    multi = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE)
    with pytest.raises(LoRAError, match="experts.*merge the adapter at load with --lora_path") as info:
        multi.generate([prompt], GREEDY, lora_request=LoRARequest("experts", 1, str(adapter)))
    assert "\n" not in str(info.value)
