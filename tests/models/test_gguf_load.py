"""GGUF files load into the same model as their source directory: F32 exactly, block formats as gguf dequantizes them."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file, save_file  # noqa: E402

from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.models.loader import load_model  # noqa: E402
from flashllm.ops.quant_matmul import QuantizedWeight  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    gguf_name,
    interleave_rope_rows,
    quantize_rows,
    tensor_type,
    write_gguf,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 300, 77, 12, 1, 402, 64, 33, 7, 210, 150, 9, 60]


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in built:
            built[preset] = build_tiny_model(tmp_path_factory.mktemp(preset), preset, seed=3)
        return built[preset]

    return get


def _logits(model: torch.nn.Module, driver_cls, tokens: list[int]) -> torch.Tensor:
    driver = driver_cls(model, block_size=8, num_blocks=16)
    seq = driver.add_sequence()
    return driver.step([(seq, tokens)])[0]


def _greedy(model: torch.nn.Module, driver_cls, tokens: list[int], steps: int) -> list[int]:
    driver = driver_cls(model, block_size=8, num_blocks=16)
    seq = driver.add_sequence()
    logits = driver.step([(seq, tokens)])[0][-1]
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = driver.step([(seq, [out[-1]])])[0][-1]
    return out


@pytest.mark.parametrize("preset", ["llama", "qwen2", "llama-tied", "qwen3"])
def test_f32_gguf_equals_its_source_directory_and_transformers(preset, tiny_with_tokenizer, tmp_path, ops,
                                                                model_registry, paged_driver):
    from transformers import AutoModelForCausalLM

    source = tiny_with_tokenizer(preset)
    path = write_gguf(source, tmp_path / "model.gguf", "F32")
    ours, config = load_model(path, ops, torch.float32, "cpu", model_registry, progress=False)
    reference, ref_config = load_model(source, ops, torch.float32, "cpu", model_registry, progress=False)
    assert (config.architecture, config.vocab_size, config.tie_word_embeddings) == (
        ref_config.architecture, ref_config.vocab_size, ref_config.tie_word_embeddings)
    # the weights are the same fp32 values once the q/k row order is undone: the logits are identical
    torch.testing.assert_close(_logits(ours, paged_driver, PROMPT), _logits(reference, paged_driver, PROMPT),
                               rtol=0, atol=1e-6)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert _greedy(ours, paged_driver, PROMPT, 12) == expected[0, len(PROMPT):].tolist()


def _dequantized_copy(source: Path, out: Path, qtype: str, types: dict[str, str] | None = None) -> Path:
    """`source` with every 2-D weight replaced by what gguf's quantize-then-dequantize gives (the float model)."""
    shutil.copytree(source, out)
    weights = load_file(str(source / "model.safetensors"))
    for name, value in weights.items():
        if value.dim() == 2:
            kind = gguf.GGMLQuantizationType[tensor_type(gguf_name(name), qtype, types)]
            array = value.float().numpy()
            weights[name] = torch.from_numpy(gguf.quants.dequantize(quantize_rows(array, kind.name), kind))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("preset,qtype", [("llama", "Q8_0"), ("qwen2", "Q8_0"), ("llama", "Q4_0"),
                                          ("llama", "Q4_1"), ("qwen3", "Q4_1")])
def test_quantized_gguf_equals_the_gguf_dequantized_float_model(preset, qtype, tiny_with_tokenizer, tmp_path, ops,
                                                                model_registry, paged_driver):
    source = tiny_with_tokenizer(preset)
    path = write_gguf(source, tmp_path / "model.gguf", qtype)
    float_dir = _dequantized_copy(source, tmp_path / "float", qtype)
    ours, _ = load_model(path, ops, torch.float32, "cpu", model_registry, progress=False)
    reference, _ = load_model(float_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    down = ours.model.layers[0].mlp.down_proj
    assert down.weight is None and down.qweight.scheme in ("w8a16", "w4a16")  # kept as stored (quant/gguf_blocks.py)
    ours_logits, ref_logits = _logits(ours, paged_driver, PROMPT), _logits(reference, paged_driver, PROMPT)
    torch.testing.assert_close(ours_logits, ref_logits, rtol=0, atol=1e-5)
    # and the quantization did change the model, so the comparison above could fail
    float_model, _ = load_model(source, ops, torch.float32, "cpu", model_registry, progress=False)
    assert (_logits(float_model, paged_driver, PROMPT) - ref_logits).abs().max() > 1e-4


@pytest.mark.parametrize("preset", ["llama", "qwen2"])
def test_a_fused_layer_of_two_block_types_of_one_layout_loads_as_blocks(preset, tiny_with_tokenizer, tmp_path, ops,
                                                                       model_registry, paged_driver):
    """llama.cpp's Q4_K_M of rows that are not whole super-blocks: q, k Q5_0 and v Q8_0 (both int8 codes,
    group 32, fp16 scales) join into one qkv weight instead of loading as float."""
    mix = {"attn_v": "Q8_0", "ffn_up": "Q8_0"}
    source = tiny_with_tokenizer(preset)
    path = write_gguf(source, tmp_path / "model.gguf", "Q5_0", types=mix)
    float_dir = _dequantized_copy(source, tmp_path / "float", "Q5_0", mix)
    ours, _ = load_model(path, ops, torch.float32, "cpu", model_registry, progress=False)
    layer = ours.model.layers[0]
    assert layer.self_attn.qkv_proj.weight is None and layer.self_attn.qkv_proj.qweight.gguf_type == "Q5_0+Q8_0"
    assert layer.mlp.gate_up_proj.qweight.gguf_type == "Q5_0+Q8_0"
    assert layer.self_attn.o_proj.qweight.gguf_type == "Q5_0"
    reference, _ = load_model(float_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    torch.testing.assert_close(_logits(ours, paged_driver, PROMPT), _logits(reference, paged_driver, PROMPT),
                               rtol=0, atol=1e-5)


# Q4_K_M as llama.cpp mixes it (attn_v and ffn_down one step up, Q6_K); K-quants need whole 256-feature rows
K_QUANT_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K"}


@pytest.mark.parametrize("preset", ["llama", "qwen2"])
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q6_K"])
def test_k_quant_gguf_equals_the_gguf_dequantized_float_model(preset, mix, tmp_path, ops, model_registry,
                                                              paged_driver):
    source = build_tiny_model(tmp_path / "source", preset, seed=4, **K_QUANT_SHAPE)
    qtype, types = ("Q4_K", Q4_K_M) if mix == "Q4_K_M" else ("Q6_K", None)
    path = write_gguf(source, tmp_path / "model.gguf", qtype, types=types)
    float_dir = _dequantized_copy(source, tmp_path / "float", qtype, types)
    ours, _ = load_model(path, ops, torch.float32, "cpu", model_registry, progress=False)
    layer = ours.model.layers[0]
    assert layer.mlp.down_proj.qweight.gguf_type == "Q6_K"
    assert layer.mlp.gate_up_proj.qweight.gguf_type == qtype and layer.self_attn.o_proj.qweight.gguf_type == qtype
    if mix == "Q4_K_M":  # int4 q, k and 6-bit v: no one layout holds both, the layer loads float
        assert layer.self_attn.qkv_proj.weight is not None
    reference, _ = load_model(float_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    ours_logits = _logits(ours, paged_driver, PROMPT)
    torch.testing.assert_close(ours_logits, _logits(reference, paged_driver, PROMPT), rtol=0, atol=1e-5)
    float_model, _ = load_model(source, ops, torch.float32, "cpu", model_registry, progress=False)
    assert (_logits(float_model, paged_driver, PROMPT) - ours_logits).abs().max() > 1e-4


def test_a_fused_layer_of_two_layouts_loads_as_float(tiny_with_tokenizer, tmp_path, ops, model_registry):
    path = write_gguf(tiny_with_tokenizer("llama"), tmp_path / "model.gguf", "Q4_0", types={"attn_v": "Q8_0"})
    ours, _ = load_model(path, ops, torch.float32, "cpu", model_registry, progress=False)
    layer = ours.model.layers[0]
    assert layer.self_attn.qkv_proj.weight is not None  # int4 and int8 codes: no one weight holds both
    assert layer.mlp.down_proj.qweight.gguf_type == "Q4_0"


def _w8a16_from_q8_0(raw: np.ndarray, ggml_type, shape: tuple[int, int]) -> QuantizedWeight:
    """A stand-in for flashllm.quant.gguf_blocks: Q8_0 blocks (fp16 scale + 32 int8) as w8a16 group 32, exactly."""
    assert ggml_type == gguf.GGMLQuantizationType.Q8_0
    rows, cols = shape
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, 34)
    scales = blocks[..., :2].copy().view(np.float16).reshape(rows, cols // 32).astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return QuantizedWeight("w8a16", torch.from_numpy(codes), torch.from_numpy(scales), group_size=32)


def test_linear_layers_take_quantized_weights_from_gguf_blocks(tiny_with_tokenizer, tmp_path, ops, model_registry,
                                                                paged_driver, monkeypatch):
    fake = types.ModuleType("flashllm.quant.gguf_blocks")
    fake.SUPPORTED_TYPES = {gguf.GGMLQuantizationType.Q8_0}
    fake.weight_from_gguf = _w8a16_from_q8_0
    fake.layout_of = lambda ggml_type: ("w8a16", 32, "float32", False)
    monkeypatch.setitem(sys.modules, "flashllm.quant.gguf_blocks", fake)
    source = tiny_with_tokenizer("llama")
    path = write_gguf(source, tmp_path / "model.gguf", "Q8_0")
    float_dir = _dequantized_copy(source, tmp_path / "float", "Q8_0")
    ours, _ = load_model(path, ops, torch.float32, "cpu", model_registry, progress=False)
    attn = ours.model.layers[0].self_attn
    assert attn.qkv_proj.weight is None and attn.qkv_proj.qweight.scheme == "w8a16"
    assert attn.qkv_proj.qweight.data.shape == (attn.qkv_proj.output_size_per_partition, 64)
    reference, _ = load_model(float_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    torch.testing.assert_close(_logits(ours, paged_driver, PROMPT), _logits(reference, paged_driver, PROMPT),
                               rtol=0, atol=1e-4)


def test_the_rope_row_order_round_trips():
    rows = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    from flashllm.models.gguf.tensors import unpermute_rope_rows

    assert np.array_equal(unpermute_rope_rows(interleave_rope_rows(rows, 4), 4), rows)
    assert not np.array_equal(interleave_rope_rows(rows, 4), rows)


def test_config_maps_the_architecture_metadata(tiny_with_tokenizer, tmp_path):
    source = tiny_with_tokenizer("qwen2")
    path = write_gguf(source, tmp_path / "model.gguf", "F16")
    config, expected = load_hf_config(path), load_hf_config(source)
    for field in ("architecture", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                  "tie_word_embeddings", "eos_token_id"):
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    assert config.torch_dtype == torch.float16


def test_yarn_metadata_is_the_directory_s_yarn(tiny_with_tokenizer, tmp_path):
    """`<arch>.rope.scaling.*` yarn keys (Qwen2.5 / Qwen3 long-context files) give the frequencies and attention factor
    of the directory's yarn rope_scaling; absent betas are llama.cpp's 32 / 1, as transformers' defaults."""
    from flashllm.ops.rope_cache import rope_inv_freq

    source = tiny_with_tokenizer("qwen2")
    path = write_gguf(source, tmp_path / "model.gguf", "F32", metadata={
        "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32, "qwen2.rope.scaling.yarn_beta_fast": 16.0})
    directory = tmp_path / "directory"
    shutil.copytree(source, directory)
    raw = json.loads((directory / "config.json").read_text())
    raw["rope_parameters"] = {**raw["rope_parameters"], "rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 32, "beta_fast": 16}
    (directory / "config.json").write_text(json.dumps(raw))
    ours, expected = load_hf_config(path), load_hf_config(directory)
    assert ours.rope_scaling["rope_type"] == "yarn"
    got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling, ours.max_position_embeddings)
    want = rope_inv_freq(expected.head_dim, expected.rope_theta, expected.rope_scaling, expected.max_position_embeddings)
    assert torch.equal(got[0], want[0]) and got[1] == want[1] != 1.0
    plain = rope_inv_freq(ours.head_dim, ours.rope_theta, None)[0]
    assert not torch.equal(got[0], plain)


def test_quant_type_dequantizes_the_blocks_first(tiny_with_tokenizer, tmp_path, ops, model_registry):
    from flashllm.quant.spec import weight_quant_spec

    path = write_gguf(tiny_with_tokenizer("llama"), tmp_path / "model.gguf", "Q4_1")
    ours, _ = load_model(path, ops, torch.float32, "cpu", model_registry, progress=False,
                         quant=weight_quant_spec("w8a16", -1, False))
    down = ours.model.layers[0].mlp.down_proj
    assert down.qweight.scheme == "w8a16" and down.qweight.offsets is None and down.qweight.group_size == -1


def test_llm_runs_a_gguf_file_like_its_directory(tiny_with_tokenizer, tmp_path):
    from flashllm import LLM, SamplingParams

    source = tiny_with_tokenizer("qwen2")
    path = write_gguf(source, tmp_path / "model.gguf", "F32")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    messages = [[{"role": "user", "content": "Hello there"}]]
    results = []
    for model in (source, path):
        llm = LLM(str(model), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
        results.append(([o.outputs[0].token_ids for o in llm.generate(["The quick brown fox"], params)],
                        [o.outputs[0].token_ids for o in llm.chat(messages, params)]))
    assert results[0] == results[1]
    assert json.loads((source / "config.json").read_text())["model_type"] == "qwen2"


def test_a_chat_model_s_turn_end_stops_a_reply_as_llama_cpp_stops_it(tiny_with_tokenizer, tmp_path):
    """A GGUF names one EOS; llama.cpp also ends a reply at the end-of-turn tokens it recognises (the `eot` /
    `eom` ids and added tokens spelt like one): the tiny vocabulary's <|im_end|> (2) stops it besides EOS (0),
    and an `eot_token_id` adds its token."""
    from flashllm import LLM

    source = tiny_with_tokenizer("qwen2")
    plain = write_gguf(source, tmp_path / "plain.gguf", "F32")
    with_eot = write_gguf(source, tmp_path / "eot.gguf", "F32", metadata={"tokenizer.ggml.eot_token_id": 1})
    stops = {}
    for name, path in (("plain", plain), ("eot", with_eot)):
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8)
        stops[name] = set(llm.engine.parts.eos_token_ids)
    assert stops == {"plain": {0, 2}, "eot": {0, 1, 2}}
