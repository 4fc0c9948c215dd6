"""GPTQ / AWQ Mixtral, Qwen2-MoE, GLM-4.5 and ERNIE 4.5 checkpoints: attention, dense MLPs and shared experts stay packed, routed
experts are dequantized at load; logits equal transformers' own classes on the float weights the integers stand
for (packed here by flashllm.testing.packed_quant, written from the published layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashllm.models.hf_config import ModelLoadError
from flashllm.models.loader import load_model
from flashllm.testing.packed_quant import quantize_linear
from flashllm.testing.parity import assert_logits_close, hf_logits, random_tokens
from flashllm.testing.tiny_moe import build_moe_model

BLOCK = 16
QUANTIZED = {
    "gptq-int4": {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": True},
    "gptq-int8-act-order": {"quant_method": "gptq", "bits": 8, "group_size": 16, "desc_act": True, "sym": True},
    "awq-int4": {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"},
}
# float in the published checkpoints: embeddings, norms, the LM head, the routers
FLOAT = ("embed_tokens", "norm", "lm_head", "mlp.gate.", "block_sparse_moe.gate.", "shared_expert_gate")


def _read(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _input_of(name: str) -> str:
    """Linears reading one input share an act order, as GPTQ's shared Hessian gives them."""
    for group, members in (("qkv", ("q_proj", "k_proj", "v_proj")), ("w13", ("w1", "w3")),
                           ("gate_up", ("gate_proj", "up_proj"))):
        if any(f".{m}." in name for m in members):
            return name.rsplit(".", 2)[0] + "." + group if group != "qkv" else name.split(".self_attn.")[0] + ".qkv"
    return name


def quantized_dirs(float_dir: Path, out: Path, qconfig: dict, seed: int) -> tuple[Path, Path]:
    """(the checkpoint with every decoder linear but the routers packed, a float checkpoint of the weights
    those integers stand for)."""
    tensors, gen = _read(float_dir), torch.Generator().manual_seed(seed)
    packed, twin, orders = {}, {}, {}
    for name, tensor in sorted(tensors.items()):
        if any(part in name for part in FLOAT) or not name.endswith(".weight"):
            packed[name] = twin[name] = tensor
            continue
        key, k = _input_of(name), tensor.shape[1]
        if key not in orders:
            orders[key] = torch.randperm(k, generator=gen) if qconfig.get("desc_act") else torch.arange(k)
        layer, twin[name] = quantize_linear(tensor, qconfig, orders[key])
        packed.update({f"{name[:-len('.weight')]}.{suffix}": t for suffix, t in layer.items()})
    config = json.loads((float_dir / "config.json").read_text())
    dirs = []
    for sub, weights, extra in (("packed", packed, {"quantization_config": qconfig}), ("twin", twin, {})):
        (out / sub).mkdir(parents=True)
        (out / sub / "config.json").write_text(json.dumps({**config, **extra}))
        save_file({k: v.contiguous() for k, v in weights.items()}, out / sub / "model.safetensors",
                  metadata={"format": "pt"})
        dirs.append(out / sub)
    return dirs[0], dirs[1]


@pytest.mark.parametrize("preset, case", [("mixtral", "gptq-int4"), ("mixtral", "gptq-int8-act-order"),
                                          ("mixtral", "awq-int4"), ("qwen2_moe", "gptq-int4"),
                                          ("glm4_moe", "gptq-int4"), ("glm4_moe", "awq-int4"),
                                          ("ernie4_5_moe", "gptq-int4")])
def test_a_quantized_moe_checkpoint_computes_its_dequantized_weights(preset, case, tmp_path, ops, model_registry,
                                                                    paged_driver):
    from transformers import AutoModelForCausalLM

    float_dir = build_moe_model(tmp_path / "float", preset, seed=3)
    packed_dir, twin_dir = quantized_dirs(float_dir, tmp_path, QUANTIZED[case], seed=4)
    with safe_open(packed_dir / "model.safetensors", framework="pt") as f:
        assert any(".experts.1." in n and n.endswith(".qweight") for n in f.keys())
    theirs = AutoModelForCausalLM.from_pretrained(twin_dir, dtype=torch.float32).eval()
    model, parsed = load_model(packed_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert parsed.quantization.method == QUANTIZED[case]["quant_method"]
    layer = model.model.layers[1]
    assert layer.self_attn.qkv_proj.weight is None and layer.mlp.gate.weight is not None  # packed; router float
    if preset == "qwen2_moe":
        assert layer.mlp.shared_expert.gate_up_proj.weight is None
    if preset == "glm4_moe":  # the shared experts packed, the router's correction bias float
        assert layer.mlp.shared_experts.gate_up_proj.weight is None and layer.self_attn.qkv_proj.bias is not None
        assert layer.mlp.gate.e_score_correction_bias.abs().sum() > 0
    driver = paged_driver(model, block_size=BLOCK, num_blocks=32, seed=5)
    prompts = [random_tokens(n, model.config.vocab_size, seed=n) for n in (37, 5)]
    seqs = [driver.add_sequence() for _ in prompts]
    new_tokens = [list(p) for p in prompts]
    for _ in range(4):  # the prompts, then three decode steps of both sequences
        for prompt, logits in zip(prompts, driver.step(list(zip(seqs, new_tokens, strict=True))), strict=True):
            assert_logits_close(logits, hf_logits(theirs, prompt)[-len(logits):])
            prompt.append(int(logits[-1].argmax()))
        new_tokens = [prompt[-1:] for prompt in prompts]


def test_the_engine_keeps_gptq_experts_at_their_checkpoint_values(tmp_path):
    """The engine resolves the dense layers' w4a16 from the checkpoint; the dequantized experts are not rounded
    to it again: greedy tokens and logits rows equal transformers' on the float weights."""
    from transformers import AutoModelForCausalLM

    from flashllm.llm import LLM
    from flashllm.sampling_params import SamplingParams
    from flashllm.testing.parity import LogitRecorder, assert_rows_match

    float_dir = build_moe_model(tmp_path / "float", "mixtral", seed=3)
    packed_dir, twin_dir = quantized_dirs(float_dir, tmp_path, QUANTIZED["gptq-int4"], seed=4)
    theirs = AutoModelForCausalLM.from_pretrained(twin_dir, dtype=torch.float32).eval()
    llm = LLM(str(packed_dir), dtype="float32", device="cpu", block_size=BLOCK, max_model_len=256, num_kv_blocks=32)
    assert llm.engine.parts.model.model.layers[0].mlp.experts.w13_scale is None  # float experts
    recorder, steps = LogitRecorder(llm), 16
    prompt = random_tokens(40, 256, seed=9)
    tokens = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))[0]
    tokens = tokens.outputs[0].token_ids
    with torch.no_grad():
        expected = hf_logits(theirs, prompt + tokens)
    assert tokens == [int(expected[i].argmax()) for i in range(len(prompt) - 1, len(prompt) + steps - 1)]
    assert_rows_match(recorder.rows, prompt, tokens, expected, steps, atol=1e-4)


def test_an_incomplete_packed_expert_is_refused_naming_it(tmp_path, ops, model_registry):
    float_dir = build_moe_model(tmp_path / "float", "mixtral", seed=3)
    packed_dir, _ = quantized_dirs(float_dir, tmp_path, QUANTIZED["gptq-int4"], seed=4)
    tensors = _read(packed_dir)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.scales"]
    save_file(tensors, packed_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.2\.w3 is missing scales"):
        load_model(packed_dir, ops, torch.float32, "cpu", model_registry, progress=False)


def test_an_expert_parallel_rank_dequantizes_only_its_own_experts(tmp_path, ops, model_registry, monkeypatch):
    """Rank 1 of 2 under --enable-expert-parallel dequantizes the packed projections of its experts 2 and 3 alone
    (the others' tensors are dropped unread) and holds them at the values one rank holds."""
    from flashllm.models.layers import packed_experts

    float_dir = build_moe_model(tmp_path / "float", "mixtral", seed=3)
    packed_dir, _ = quantized_dirs(float_dir, tmp_path, QUANTIZED["gptq-int4"], seed=4)
    whole, _ = load_model(packed_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    dequantized, dequantize = [], packed_experts._dequantize

    def counted(linear, parts, quant):
        dequantized.append(linear)
        return dequantize(linear, parts, quant)

    monkeypatch.setattr(packed_experts, "_dequantize", counted)
    rank, _ = load_model(packed_dir, ops, torch.float32, "cpu", model_registry, progress=False, tp_rank=1, tp_size=2,
                         expert_parallel=True)
    assert len(dequantized) == 2 * 2 * 3  # 2 layers x experts 2, 3 x w1, w3, w2
    assert {int(name.split(".experts.")[1].split(".")[0]) for name in dequantized} == {2, 3}
    for ours, one in zip(rank.model.layers, whole.model.layers, strict=True):
        assert torch.equal(ours.mlp.experts.w13_weight, one.mlp.experts.w13_weight[2:])
        assert torch.equal(ours.mlp.experts.w2_weight, one.mlp.experts.w2_weight[2:])
