"""DeepSeek GGUF files (`deepseek2`), written by flashllm's llama.cpp exporter from tiny transformers DeepSeek-V2-Lite
(softmax routing, no q bottleneck), DeepSeek-V3 (sigmoid routing with the choice bias, expert groups,
renormalized weights, YaRN) and GLM-4.7-Flash (V3's layers, two dense ones first) directories, load into the directory's model: the configuration the directory's own,
F32 logits equal to the directory's and greedy tokens equal to transformers', both the split latent up-projection
(attn_k_b / attn_v_b) and the older single attn_kv_b, Q8_0 as gguf dequantizes each stored tensor. Routing llama.cpp
runs differently from the checkpoint's is refused on export and on loading, in one line."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file, save_file  # noqa: E402

from flashllm.bench.gguf_deepseek import LAYER_NAMES  # noqa: E402
from flashllm.bench.gguf_export import GGUFExportError, export_gguf, gguf_tensor_name  # noqa: E402
from flashllm.models.errors import ModelLoadError  # noqa: E402
from flashllm.models.hf_config import load_hf_config  # noqa: E402
from flashllm.testing.deepseek import _YARN, build_deepseek_model  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    exports,
    load_float_model,
    patched_metadata,
    prompt_logits,
    rewritten_copy,
    two_ranks_decode_as_one,
    with_nextn_layer,
)
from flashllm.testing.tokenizer import train_tokenizer  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
# V3 with YaRN as llama.cpp runs it (mscale == mscale_all_dim); qk_nope 32: k_b rows are whole Q8_0 blocks
# GLM-4.7-Flash: llama.cpp's converter writes it as a deepseek2 file too (two leading dense layers here)
PRESETS = {"v2_lite": {}, "v3": {"rope_parameters": {**_YARN, "mscale": 0.8}, "qk_nope_head_dim": 32},
           "glm4_moe_lite": {}}
CONFIG_FIELDS = ("architecture", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                 "moe_intermediate_size", "sigmoid_scoring", "group_limited", "n_group", "topk_group",
                 "norm_topk_prob", "routed_scaling_factor", "rope_interleaved", "rope_theta", "tie_word_embeddings",
                 "vocab_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    built = {}
    for preset, changes in PRESETS.items():
        out = tmp_path_factory.mktemp(preset)
        tokenizer = train_tokenizer(out, vocab_size=300)  # the exporter writes the vocabulary
        built[preset] = build_deepseek_model(out, preset, seed=3, **{"vocab_size": len(tokenizer), **changes})
    return built


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    """(preset, "f32" | "q8_0") -> the exported GGUF file, written once."""
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {key.removeprefix("deepseek2."): field.contents() for key, field in reader.fields.items()
            if key.startswith("deepseek2.")}


def _kv_b_parts(weight: torch.Tensor, heads: int, nope: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj (H * (Dn + Dv), L) -> what llama.cpp's converter stores: k_b (H, L, Dn) and v_b (H, Dv, L)."""
    per_head = weight.reshape(heads, -1, weight.shape[-1]).numpy()
    return per_head[:, :nope].transpose(0, 2, 1), per_head[:, nope:]


def test_the_file_holds_what_llama_cpp_s_converter_writes(sources, files):
    fields = _fields(files("v3", "f32"))
    # MLA as one latent head: key = kv_lora_rank + rope, value = kv_lora_rank; the per-head sizes apart
    assert {k: fields[k] for k in ("attention.head_count_kv", "attention.key_length", "attention.value_length",
                                   "attention.key_length_mla", "attention.value_length_mla", "rope.dimension_count",
                                   "attention.kv_lora_rank", "attention.q_lora_rank")} == {
        "attention.head_count_kv": 1, "attention.key_length": 32 + 8, "attention.value_length": 32,
        "attention.key_length_mla": 32 + 8, "attention.value_length_mla": 24, "rope.dimension_count": 8,
        "attention.kv_lora_rank": 32, "attention.q_lora_rank": 48}
    assert {k: fields[k] for k in ("expert_gating_func", "expert_group_count", "expert_group_used_count",
                                   "expert_weights_norm", "leading_dense_block_count", "expert_shared_count")} == {
        "expert_gating_func": 2, "expert_group_count": 4, "expert_group_used_count": 2, "expert_weights_norm": True,
        "leading_dense_block_count": 1, "expert_shared_count": 1}
    assert fields["rope.scaling.yarn_log_multiplier"] == pytest.approx(0.08)  # 0.1 x mscale_all_dim
    assert "expert_gating_func" in _fields(files("v2_lite", "f32")) and _fields(files("v2_lite", "f32"))[
        "expert_gating_func"] == 1
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(files("v3", "f32")).tensors}
    weights = load_file(str(sources["v3"] / "model.safetensors"))
    k_b, v_b = _kv_b_parts(weights["model.layers.1.self_attn.kv_b_proj.weight"], 4, 32)
    assert np.array_equal(stored["blk.1.attn_k_b.weight"], k_b) and np.array_equal(stored["blk.1.attn_v_b.weight"], v_b)
    assert np.array_equal(stored["blk.1.exp_probs_b.bias"], weights["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert stored["blk.1.ffn_gate_exps.weight"].shape == (8, 32, 64)  # (E, N, K)
    assert "blk.1.attn_kv_b.weight" not in stored and "blk.0.ffn_gate.weight" in stored  # layer 0 dense


@pytest.mark.parametrize("preset", list(PRESETS))
def test_config_is_the_directory_s(preset, sources, files):
    ours, expected = load_hf_config(files(preset, "f32")), load_hf_config(sources[preset])
    for field in CONFIG_FIELDS[1:]:  # float fields from float32 keys (1.8 is not one)
        value = getattr(expected, field)
        assert getattr(ours, field) == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), field
    # a deepseek2 file names no architecture: sigmoid routing is V3's, whose class runs GLM-4.7-Flash too
    assert ours.architecture == ("DeepseekV3ForCausalLM" if preset == "glm4_moe_lite" else expected.architecture)
    assert ours.softmax_scale == pytest.approx(expected.softmax_scale, rel=1e-6)  # mscale from a float32 key
    if preset == "v3":
        scaling = ours.rope_scaling
        assert scaling["rope_type"] == "yarn" and scaling["mscale_all_dim"] == pytest.approx(0.8, rel=1e-6)
        assert (scaling["factor"], scaling["original_max_position_embeddings"]) == (4.0, 128)
        assert scaling["attention_factor"] == 1.0  # cos / sin unscaled, as mscale == mscale_all_dim gives


def test_yarn_without_a_log_multiplier_scales_neither_softmax_nor_rotation(files, tmp_path):
    """llama.cpp's graph: softmax scale (1 + 0.1 x yarn_log_multiplier / 0.1 x ln factor)^2 / sqrt(head size), cos and
    sin cancelled back to 1; a file without the multiplier (0) gets plain 1 / sqrt(head size) and unscaled cos/sin."""
    from flashllm.ops.rope_cache import rope_inv_freq

    key = "deepseek2.rope.scaling.yarn_log_multiplier"
    assert gguf.GGUFReader(files("v3", "f32")).fields[key].types == [gguf.GGUFValueType.FLOAT32]
    config = load_hf_config(patched_metadata(files("v3", "f32"), tmp_path / "plain.gguf", key, struct.pack("<f", 0.0)))
    assert config.softmax_scale == pytest.approx((32 + 8) ** -0.5, rel=1e-9)
    assert rope_inv_freq(8, config.rope_theta, config.rope_scaling, config.max_position_embeddings)[1] == 1.0
    scaled = load_hf_config(files("v3", "f32"))
    assert scaled.softmax_scale == pytest.approx((32 + 8) ** -0.5 * (1 + 0.1 * 0.8 * np.log(4.0)) ** 2, rel=1e-6)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_f32_gguf_equals_its_source_directory_and_transformers(preset, sources, files, ops, model_registry,
                                                                paged_driver):
    check_f32_file(files(preset, "f32"), sources[preset], ops, model_registry, paged_driver, PROMPT)


def test_a_glm_4_7_flash_file_with_its_appended_mtp_block_loads_without_it(files, ops, model_registry, paged_driver,
                                                                           tmp_path):
    """Newer converters write GLM-4.7-Flash's MTP layer as one more deepseek2 block (nextn_predict_layers 1): it is
    skipped, the model and its logits are those of the file without it."""
    path = with_nextn_layer(files("glm4_moe_lite", "f32"), tmp_path / "mtp.gguf", "deepseek2", layers=4, hidden=64)
    config = load_hf_config(path)
    assert config.num_hidden_layers == 4 and config.raw["num_nextn_predict_layers"] == 1
    ours, plain = (load_float_model(p, ops, model_registry) for p in (path, files("glm4_moe_lite", "f32")))
    params = dict(ours.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(params[name], param), name
    assert torch.equal(prompt_logits(ours, paged_driver, PROMPT), prompt_logits(plain, paged_driver, PROMPT))


def _single_kv_b_copy(path: Path, out: Path) -> Path:
    """The file as llama.cpp's converter wrote it before splitting the latent up-projection: attn_k_b / attn_v_b
    joined back into attn_kv_b, key / value lengths the per-head sizes, head_count_kv the head count."""
    fields = gguf.GGUFReader(path).fields
    sizes = {"deepseek2.attention.key_length": fields["deepseek2.attention.key_length_mla"].contents(),
             "deepseek2.attention.value_length": fields["deepseek2.attention.value_length_mla"].contents(),
             "deepseek2.attention.head_count_kv": fields["deepseek2.attention.head_count"].contents()}

    def joined(tensors):
        for name, tensor in tensors.items():
            if ".attn_v_b." in name:
                continue
            if ".attn_k_b." in name:
                k_b, v_b = np.array(tensor.data), np.array(tensors[name.replace("attn_k_b", "attn_v_b")].data)
                kv_b = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(-1, k_b.shape[1])
                yield name.replace("attn_k_b", "attn_kv_b"), np.ascontiguousarray(kv_b), None
            else:
                yield name, np.array(tensor.data), tensor.tensor_type

    return rewritten_copy(path, out, joined, values=sizes, dropped=("_length_mla",))


def test_a_file_with_the_single_kv_b_tensor_loads_the_same_model(files, ops, model_registry, paged_driver, tmp_path):
    old = _single_kv_b_copy(files("v3", "f32"), tmp_path / "old.gguf")
    assert _fields(old)["attention.key_length"] == 40 and "attention.key_length_mla" not in _fields(old)
    ours = load_float_model(old, ops, model_registry)
    split = load_float_model(files("v3", "f32"), ops, model_registry)
    for name, param in split.named_parameters():
        assert torch.equal(dict(ours.named_parameters())[name], param), name
    torch.testing.assert_close(prompt_logits(ours, paged_driver, PROMPT), prompt_logits(split, paged_driver, PROMPT),
                               rtol=0, atol=0)


def _as_stored(weights: dict[str, torch.Tensor], path: Path, heads: int, nope: int) -> dict[str, torch.Tensor]:
    """The directory's weights each rounded as the GGUF file at `path` stores it (gguf's quantize / dequantize for
    Q8_0 tensors, float16 for F16 ones); kv_b_proj through its stored k_b and v_b."""
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}

    def stored(values: np.ndarray, kind) -> np.ndarray:
        if kind == gguf.GGMLQuantizationType.F16:
            return values.astype(np.float16).astype(np.float32)
        if kind == gguf.GGMLQuantizationType.Q8_0:
            return gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind)
        return values

    out = {}
    for name, value in weights.items():
        array = value.float().numpy()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("kv_b_proj.weight"):
            k_b, v_b = _kv_b_parts(value.float(), heads, nope)
            k_b = stored(np.ascontiguousarray(k_b), types[f"blk.{layer}.attn_k_b.weight"])
            v_b = stored(np.ascontiguousarray(v_b), types[f"blk.{layer}.attn_v_b.weight"])
            array = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(array.shape)
        elif ".experts." in name:
            proj = name.rsplit(".", 2)[-2].removesuffix("_proj")
            array = stored(array, types[f"blk.{layer}.ffn_{proj}_exps.weight"])
        elif value.dim() == 2:
            gguf_name = gguf_tensor_name(name, LAYER_NAMES)
            array = stored(array, types.get(gguf_name, types["token_embd.weight"]))  # a tied head: the embedding's
        out[name] = torch.from_numpy(np.ascontiguousarray(array))
    return out


def test_q8_0_file_runs_the_values_it_stores(sources, files, ops, model_registry, paged_driver, tmp_path):
    path = files("v3", "q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.1.attn_k_b.weight"] == types["blk.1.attn_v_b.weight"] == "Q8_0"
    assert types["blk.1.attn_q_b.weight"] == "F16"  # q_lora_rank 48: not whole blocks of 32
    rounded = tmp_path / "rounded"
    shutil.copytree(sources["v3"], rounded)
    weights = load_file(str(sources["v3"] / "model.safetensors"))
    save_file(_as_stored(weights, path, 4, 32), str(rounded / "model.safetensors"), metadata={"format": "pt"})
    ours = load_float_model(path, ops, model_registry)
    expected = prompt_logits(load_float_model(rounded, ops, model_registry), paged_driver, PROMPT)
    logits = prompt_logits(ours, paged_driver, PROMPT)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    unrounded = prompt_logits(load_float_model(sources["v3"], ops, model_registry), paged_driver, PROMPT)
    assert (unrounded - logits).abs().max() > 1e-4, "the Q8_0 rounding did not change the logits"


def test_llm_runs_a_deepseek_gguf_file_like_its_directory(sources, files):
    """The engine's own path (the cpu backend's runner, the file's vocabulary as tokenizer), not only the model."""
    from flashllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = []
    for model in (sources["v3"], files("v3", "q8_0")):
        llm = LLM(str(model), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
        results.append([o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "hello"], params)])
    assert len(results[1]) == 2 and all(len(ids) == 8 for ids in results[1])
    f32 = LLM(str(files("v3", "f32")), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
    assert [o.outputs[0].token_ids for o in f32.generate(["The quick brown fox", "hello"], params)] == results[0]


def test_a_vocabulary_flashllm_cannot_build_runs_with_the_source_tokenizer(sources, files, tmp_path):
    """A file recording a pre-tokenizer flashllm does not build (Kimi K2's, here) is refused at its vocabulary, and
    with tokenizer= the source directory's (vLLM's advice for GGUF files too) it answers text prompts as the directory
    does."""
    from flashllm import LLM, SamplingParams

    path = rewritten_copy(files("v2_lite", "f32"), tmp_path / "v2.gguf",
                          lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items()),
                          values={"tokenizer.ggml.pre": "kimi-k2"})
    options = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32)
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'kimi-k2' is not supported"):
        LLM(str(path), **options)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["The quick brown fox", "hello"]
    ours = LLM(str(path), tokenizer=str(sources["v2_lite"]), **options).generate(prompts, params)
    expected = LLM(str(sources["v2_lite"]), **options).generate(prompts, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in ours] == [
        (o.outputs[0].token_ids, o.outputs[0].text) for o in expected]


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True}], ids=["tensor", "expert"])
def test_two_ranks_decode_a_q8_0_file_as_one(options, files, monkeypatch, exact_w8_products):
    """Heads, the joined latent up-projection, blocks and experts split over two gloo ranks (exact fp32 activations:
    the sums differ in order only) give one rank's greedy tokens and logprobs."""
    monkeypatch.setenv("FLASHLLM_CPU_W8_ACTIVATIONS", "fp32")
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], files("v3", "q8_0"), **options)


@pytest.mark.parametrize("changes,fragment", [
    ({"topk_method": "group_limited_greedy"}, "ranks expert groups by the sum of their two best scores"),
    ({"rope_parameters": _YARN}, "mscale != mscale_all_dim"),
])
def test_routing_or_rope_llama_cpp_runs_otherwise_is_not_exported(changes, fragment, tmp_path):
    preset = "v2_lite" if "topk_method" in changes else "v3"
    extra = {"n_group": 4, "topk_group": 2} if "topk_method" in changes else {}
    source = build_deepseek_model(tmp_path / "model", preset, seed=1, **changes, **extra)
    with pytest.raises(GGUFExportError, match=fragment):
        export_gguf(source, tmp_path / "out.gguf")


def _uint32(value: int) -> bytes:
    return struct.pack("<I", value)


@pytest.mark.parametrize("preset,key,value,fragment", [
    ("v3", "deepseek2.expert_gating_func", 1, "softmax gating with expert_group_count 4"),
    ("v3", "deepseek2.attention.head_count_kv", 4, "stores MLA as one latent head"),
    ("v3", "deepseek2.attention.key_length_mla", 8, "must be even and below the query / key head size"),
    ("v2_lite", "deepseek2.expert_gating_func", 2, "sigmoid gating without exp_probs_b"),
    ("v2_lite", "deepseek2.expert_used_count", 9, "expected a whole number in 0..8"),
])
def test_metadata_flashllm_cannot_run_as_llama_cpp_does_is_refused_in_one_line(preset, key, value, fragment, files,
                                                                              tmp_path):
    assert gguf.GGUFReader(files(preset, "f32")).fields[key].types == [gguf.GGUFValueType.UINT32]
    path = patched_metadata(files(preset, "f32"), tmp_path / "bad.gguf", key, _uint32(value))
    with pytest.raises(ModelLoadError) as err:
        load_hf_config(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_split_up_projection_without_its_value_half_is_refused(files, ops, model_registry, tmp_path):
    data = files("v2_lite", "f32").read_bytes()
    name = b"blk.1.attn_v_b.weight"
    assert data.count(name) == 1
    path = tmp_path / "bad.gguf"
    path.write_bytes(data.replace(name, b"blk.1.attn_v_x.weight"))
    with pytest.raises(ModelLoadError, match=r"has blk\.1\.attn_k_b\.weight without blk\.1\.attn_v_b\.weight"):
        load_float_model(path, ops, model_registry)
