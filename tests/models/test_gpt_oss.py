"""gpt-oss (transformers' GptOssForCausalLM) against transformers' own class on tiny random checkpoints (per-head
sinks at unit scale, biased experts, sliding layers of window 8, YaRN past an original context of 64): varlen
prefill and decode over the paged cache, chunked prefill beside a decode, the engine's greedy tokens and logits, an
MXFP4-expert checkpoint as transformers dequantizes it, two tensor-parallel and two expert-parallel ranks, int8
experts; bad configs refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.llm import LLM
from flashllm.models.gpt_oss import GptOssAttention, GptOssForCausalLM, OaiExperts, dequantize_mxfp4
from flashllm.models.hf_config import ModelLoadError, kernel_request, parse_hf_config
from flashllm.models.layers.moe import SparseMoeBlock
from flashllm.models.loader import load_model
from flashllm.ops.quant_matmul import dequantize
from flashllm.registry.fusions import DECODER_STACK
from flashllm.sampling_params import SamplingParams
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import (
    check_engine_greedy_against,
    random_tokens,
)
from flashllm.testing.tiny_moe import GPT_OSS_PRESET, MOE_BASE, build_moe_model, check_paged_parity, moe_reference

VOCAB = MOE_BASE["vocab_size"]
PROMPT_LENGTHS = (1, 7, 63, 65, 130)
ATOL = 1e-4


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(transformers GptOssForCausalLM, its directory)."""
    return moe_reference(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=3)


def test_the_model_has_sinks_biased_experts_and_alternating_windows(gpt_oss, ops, model_registry) -> None:
    _, model_dir = gpt_oss
    ours, config = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert type(ours) is GptOssForCausalLM
    assert kernel_request(config) == {"alibi": False, "softcap": False, "sinks": True, "moe_activation": "swigluoai"}
    assert [layer.self_attn.attn.sliding_window for layer in ours.model.layers] == [8, None, 8, None]
    first = ours.model.layers[0]
    assert type(first.self_attn) is GptOssAttention and first.self_attn.sinks.abs().max() > 0.5
    assert type(first.mlp) is SparseMoeBlock and type(first.mlp.experts) is OaiExperts
    assert first.mlp.gate.bias is not None and first.mlp.renormalize
    assert DECODER_STACK not in ours.fusions()  # the fused decode stack has no sinks or expert biases


def test_varlen_prefill_and_decode_match_transformers(gpt_oss, ops, model_registry, paged_driver) -> None:
    check_paged_parity(gpt_oss, ops, model_registry, paged_driver, VOCAB, PROMPT_LENGTHS, ATOL)


def test_chunked_prefill_beside_a_decode_matches_transformers(gpt_oss, ops, model_registry, paged_driver) -> None:
    check_paged_parity(gpt_oss, ops, model_registry, paged_driver, VOCAB, None, ATOL)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_engine_greedy_tokens_and_logits_match_transformers(gpt_oss, backend) -> None:
    hf_model, model_dir = gpt_oss
    llm = LLM(str(model_dir), dtype="float32", device="cpu", backend=backend, block_size=16, max_model_len=256,
              num_kv_blocks=64)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in PROMPT_LENGTHS], 12, ATOL)


def _as_mxfp4(model_dir: Path, seed: int) -> None:
    """Replace the checkpoint's float experts by random MXFP4 blocks and scales, stored as the published gpt-oss
    checkpoints store them ((E, N, K/32, 16) codes, (E, N, K/32) exponents), with their quantization_config."""
    tensors = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, k, n = tensors.pop(name).shape  # transformers' (E, K, N)
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(120, 128, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> Path:
    model_dir = build_moe_model(tmp_path_factory.mktemp("mxfp4"), "gpt_oss", seed=4, intermediate_size=64)
    _as_mxfp4(model_dir, seed=6)  # intermediate 64: the down projection's inputs are whole 32-value blocks
    return model_dir


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_mxfp4_experts_stay_blocks_and_run_as_transformers_dequantizes_them(mxfp4_dir, backend) -> None:
    """One rank keeps each expert's MXFP4 projections as exact int8 blocks (twice the e2m1 values, power-of-two
    scales per 32), gate rows then up; the engine's tokens and logits are transformers' on its dequantized model."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    # dequantize=True: transformers >= 5.25 otherwise fetches its MXFP4 kernels from the Hub
    hf_model = AutoModelForCausalLM.from_pretrained(mxfp4_dir, dtype=torch.float32,
                                                    quantization_config=Mxfp4Config(dequantize=True)).eval()
    llm = LLM(str(mxfp4_dir), dtype="float32", device="cpu", backend=backend, block_size=16, max_model_len=256,
              num_kv_blocks=64)
    experts = llm.engine.parts.model.model.layers[0].mlp.experts
    assert experts.w13_weight is None and len(experts.expert_blocks) == 4
    w13, w2 = experts.expert_blocks[1]
    assert (w13.scheme, w13.group_size, w13.data.dtype, tuple(w13.data.shape)) == ("w8a16", 32, torch.int8, (128, 64))
    dense = hf_model.model.layers[0].mlp.experts
    torch.testing.assert_close(dequantize(w13)[:64], dense.gate_up_proj[1].T[0::2], rtol=0, atol=0)
    torch.testing.assert_close(dequantize(w2), dense.down_proj[1].T, rtol=0, atol=0)
    check_engine_greedy_against(llm, hf_model, [random_tokens(n, VOCAB, seed=n) for n in (5, 70)], 8, ATOL)


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_of_an_mxfp4_checkpoint_give_one_rank_s_tokens(mxfp4_dir, options) -> None:
    """Tensor parallel ranks dequantize the experts (blocks are kept for whole experts only); expert parallel ranks
    keep their whole experts as blocks."""
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=60 + n) for n in (5, 40)], mxfp4_dir, **options)


def test_mxfp4_codes_and_exponents_decode_as_the_format_defines() -> None:
    """Byte 0x2F holds 0xF (-6.0) in the low nibble, first, and 0x2 (1.0); exponent 129 scales by 4, 126 by 1/2."""
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[1, 0, 15] = 0x2F, 0x93
    scales = torch.tensor([[129], [126]], dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, scales, torch.float32)
    assert values.shape == (2, 32)
    assert values[0, :2].tolist() == [-24.0, 4.0] and values[1, 30:].tolist() == [0.75, -0.25]
    assert values[0, 2:].abs().sum() == 0 and values[1, :30].abs().sum() == 0


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_give_one_rank_s_tokens(gpt_oss, options) -> None:
    two_ranks_decode_as_one([random_tokens(n, VOCAB, seed=50 + n) for n in (5, 40)], gpt_oss[1], **options)


def test_int8_experts_keep_float_biases_and_score_near_the_float_model(gpt_oss) -> None:
    """--quant_type weight_only_int8 stores the experts as int8 codes beside their float biases; the prompt logprobs
    stay within int8 rounding of the float model's on average (the cpu kernel's biased int8 experts are checked against the
    reference op by op in tests/unit/test_sinks_and_oai_experts.py)."""
    prompts = [random_tokens(n, VOCAB, seed=40 + n) for n in (3, 33, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    chosen = {}
    for quant in ("weight_only_int8", None):
        llm = LLM(str(gpt_oss[1]), dtype="float32", device="cpu", block_size=16, max_model_len=128, num_kv_blocks=32,
                  quant_type=quant)
        experts = llm.engine.parts.model.model.layers[0].mlp.experts
        assert (experts.w13_weight.dtype == torch.int8) == (quant is not None)
        assert experts.gate_up_proj_bias.dtype == torch.float32
        chosen[quant] = torch.cat([torch.tensor([entry[0] for entry in o.prompt_logprobs[1:]])
                                   for o in llm.generate(prompts, params)])
    # int8 rounding moves Mixtral's tiny model as much (mean 0.015, largest 0.19)
    assert (chosen["weight_only_int8"] - chosen[None]).abs().mean() < 0.05


def test_bad_configs_are_refused_in_one_line() -> None:
    model_type, architecture, fields = GPT_OSS_PRESET
    raw = {"architectures": [architecture], "model_type": model_type, **MOE_BASE, **fields}
    for changes, fragment in (({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}},
                               "quant_method='gptq' is not supported for gpt-oss"),
                              ({"swiglu_limit": 5.0}, "swiglu_limit=5.0 is not supported"),
                              ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4")):
        with pytest.raises(ModelLoadError) as info:
            parse_hf_config({**raw, **changes})
        assert fragment in str(info.value) and "\n" not in str(info.value)


def test_absent_fields_take_gpt_oss_defaults() -> None:
    model_type, architecture, fields = GPT_OSS_PRESET
    raw = {"architectures": [architecture], "model_type": model_type, **MOE_BASE, **fields}
    for key in ("layer_types", "rope_parameters", "sliding_window"):
        raw.pop(key, None)
    config = parse_hf_config(raw)
    assert config.sliding_windows == (128, None, 128, None)
    assert config.rope_theta == 150000.0 and config.rope_scaling["rope_type"] == "yarn"
    assert config.rope_scaling["factor"] == 32.0 and config.rope_scaling["truncate"] is False
