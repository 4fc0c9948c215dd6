"""--moe_quant_type: only the MoE experts are stored as int8 / int4 codes; checked against transformers running the
same model with its experts replaced by their round-to-nearest per-channel int8 values (quantized here, not by
flashllm's code)."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.sampling_params import SamplingParams
from flashllm.testing.deepseek import build_deepseek_model
from flashllm.testing.parity import LogitRecorder

STEPS = 16


def fake_int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """Each output row (last dim = input features) rounded to 255 levels of max|row| / 127."""
    scale = (weight.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-10)
    return torch.round(weight / scale).clamp(-127, 127) * scale


@torch.inference_mode()
def greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = list(prompt)
    for _ in range(STEPS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):], model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_int8_experts_give_transformers_tokens_on_the_same_int8_values(tmp_path, backend: str) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = build_deepseek_model(tmp_path, "v3", seed=5)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if ".mlp.experts." in name:  # stacked (E, 2I, H) gate_up_proj and (E, H, I) down_proj
                param.copy_(fake_int8_rows(param))
    llm = LLM(str(model_dir), dtype="float32", device="cpu", backend=backend, block_size=16, num_kv_blocks=64,
              moe_quant_type="weight_only_int8")
    layer = llm.engine.parts.model.model.layers[1]
    assert layer.mlp.experts.w13_weight.dtype == torch.int8 and layer.mlp.experts.w2_weight.dtype == torch.int8
    assert layer.mlp.shared_experts.gate_up_proj.qweight.scheme == "none"  # only the routed experts
    assert layer.self_attn.o_proj.qweight.scheme == "none"
    prompts = [[(5 * i + 7) % 250 + 3 for i in range(n)] for n in (3, 21)]
    recorder = LogitRecorder(llm)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True),
                           use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logits = greedy(theirs, prompt)
        assert output.outputs[0].token_ids == tokens
        full = prompt + tokens
        rows = [(ctx, row) for ctx, row in recorder.rows if ctx == full[: len(ctx)] and len(ctx) >= len(prompt)]
        assert len(rows) >= STEPS
        for ctx, row in rows:
            torch.testing.assert_close(row, logits[len(ctx) - 1], atol=1e-4, rtol=0)


def test_an_unknown_moe_quant_type_is_refused(tmp_path) -> None:
    from flashllm.core.builder import EngineConfigError

    model_dir = build_deepseek_model(tmp_path, "v2_lite", seed=1)
    with pytest.raises(EngineConfigError, match="--moe_quant_type 'a8w8' is not one of weight_only_int8"):
        LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=16, block_size=16, moe_quant_type="a8w8")
