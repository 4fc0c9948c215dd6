"""Block-FP8 checkpoints of the Llama-family decoders (the format of Qwen3's, Qwen3-MoE's and GLM-4.5's official
FP8 releases: e4m3 codes, one weight_scale_inv per block, quantization_config quant_method "fp8"): dequantized as they
load, the engine's tokens and logits are transformers' on code x block scale; --quant_type still applies on top;
another FP8 flavour is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.sampling_params import SamplingParams
from flashllm.testing.deepseek import write_block_fp8_copy, write_dequantized_copy
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model
from flashllm.testing.tiny_moe import build_moe_model

PROMPTS = [random_tokens(n, 256, seed=n) for n in (3, 40)]


def _engine(model_dir, **options) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64,
               **options)


@pytest.mark.parametrize(("builder", "preset", "block"), [
    (build_tiny_model, "qwen3", (128, 128)), (build_tiny_model, "llama", (16, 24)),
    (build_moe_model, "qwen3_moe", (16, 24)), (build_moe_model, "mixtral", (32, 32)),
])
def test_a_block_fp8_checkpoint_runs_as_transformers_runs_its_dequantized_weights(builder, preset, block, tmp_path):
    from transformers import AutoModelForCausalLM

    fp8_dir = write_block_fp8_copy(builder(tmp_path / "float", preset, seed=3), tmp_path / "fp8", block)
    stored = load_file(fp8_dir / "model.safetensors")
    assert stored["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    llm = _engine(fp8_dir)
    config = llm.engine.parts.model.config
    assert config.fp8_block == block and config.quantization is None
    hf = AutoModelForCausalLM.from_pretrained(write_dequantized_copy(fp8_dir, tmp_path / "dequantized"),
                                              dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, PROMPTS, 8, 1e-4)


def test_quant_type_quantizes_the_dequantized_weights(tmp_path) -> None:
    fp8_dir = write_block_fp8_copy(build_tiny_model(tmp_path / "float", "qwen3", seed=3), tmp_path / "fp8", (16, 24))
    float_twin = write_dequantized_copy(fp8_dir, tmp_path / "dequantized")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    ours, twin = (_engine(path, quant_type="weight_only_int8").generate(PROMPTS, greedy) for path in (fp8_dir, float_twin))
    for a, b in zip(ours, twin, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-5)


@pytest.mark.parametrize("qc", [
    {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
    {"quant_method": "fp8", "activation_scheme": "static"},  # per-tensor FP8 (no blocks)
])
def test_other_fp8_flavours_are_refused_in_one_line(qc, tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path, "qwen3", seed=3, tokenizer=False)
    raw = {**json.loads((model_dir / "config.json").read_text()), "quantization_config": qc}
    with pytest.raises(ModelLoadError, match="Qwen3ForCausalLM checkpoints load as float or as block FP8") as info:
        parse_hf_config(raw)
    assert "\n" not in str(info.value)
