"""Block-FP8 DeepSeek checkpoints (e4m3 weights, one weight_scale_inv per block, as DeepSeek-V3 ships): dequantized
at load to exactly code * block scale, and the model then computes what transformers computes on those weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.models.hf_config import ModelLoadError
from flashllm.models.loader import load_model
from flashllm.testing.deepseek import (
    block_fp8_values,
    build_deepseek_model,
    write_block_fp8_copy,
    write_dequantized_copy,
)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return build_deepseek_model(tmp_path_factory.mktemp("v3"), "v3", seed=11)


@pytest.mark.parametrize("block", [(128, 128), (16, 24)], ids=["128x128", "16x24-ragged"])
def test_block_fp8_weights_load_as_code_times_block_scale(block, float_dir, tmp_path, model_registry, ops) -> None:
    fp8_dir = write_block_fp8_copy(float_dir, tmp_path / "fp8", block)
    stored = load_file(fp8_dir / "model.safetensors")
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # (40, 64): partial blocks on both axes at 16x24
    assert stored[name].dtype == torch.float8_e4m3fn
    assert stored[name + "_scale_inv"].shape == (-(-40 // block[0]), -(-64 // block[1]))
    model, config = load_model(fp8_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert config.fp8_block == block
    params = dict(model.named_parameters())
    for key in (name, "model.layers.1.self_attn.kv_b_proj.weight", "model.layers.2.mlp.shared_experts.down_proj.weight"):
        want = block_fp8_values(stored[key], stored[key + "_scale_inv"], block)
        torch.testing.assert_close(params[key], want, atol=0, rtol=0)
    experts = model.model.layers[1].mlp.experts.w2_weight[3]
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    torch.testing.assert_close(experts, block_fp8_values(stored[key], stored[key + "_scale_inv"], block), atol=0, rtol=0)


def test_a_block_fp8_model_gives_transformers_logits_on_the_dequantized_weights(float_dir, tmp_path, model_registry,
                                                                               ops, paged_driver) -> None:
    from transformers import AutoModelForCausalLM

    block = (16, 24)
    fp8_dir = write_block_fp8_copy(float_dir, tmp_path / "fp8", block)
    theirs = AutoModelForCausalLM.from_pretrained(write_dequantized_copy(fp8_dir, tmp_path / "float"),
                                                  dtype=torch.float32).eval()
    ours, _ = load_model(fp8_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    driver = paged_driver(ours, block_size=16, num_blocks=8, seed=2)
    logits = driver.step([(driver.add_sequence(), tokens)])[0]
    with torch.inference_mode():
        expected = theirs(torch.tensor([tokens])).logits[0]
    assert (logits - expected).abs().max().item() <= 1e-4


def test_an_fp8_weight_without_its_scale_is_refused(float_dir, tmp_path, model_registry, ops) -> None:
    fp8_dir = write_block_fp8_copy(float_dir, tmp_path / "fp8")
    tensors = load_file(fp8_dir / "model.safetensors")
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, fp8_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="without their pair .* 'model.layers.0.self_attn.o_proj.weight'"):
        load_model(fp8_dir, ops, torch.float32, "cpu", model_registry, progress=False)


def test_mtp_layers_past_num_hidden_layers_are_skipped(float_dir, tmp_path, model_registry, ops) -> None:
    """V3 checkpoints append their next-token-prediction layer as model.layers.{num_hidden_layers}."""
    tensors = load_file(float_dir / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(160, 32)
    (tmp_path / "mtp").mkdir()
    save_file(tensors, tmp_path / "mtp" / "model.safetensors")
    config = json.loads((float_dir / "config.json").read_text())
    (tmp_path / "mtp" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    model, _ = load_model(tmp_path / "mtp", ops, torch.float32, "cpu", model_registry, progress=False)
    assert len(model.model.layers) == 3
