"""Loading model directories: safetensors layouts, hostile directories, configs, dtypes, registry, demo."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from flashllm.models.builtin import BUILTIN_MODELS, flashllm_register_models
from flashllm.models.demo import demo_model_dir
from flashllm.models.hf_config import ModelLoadError, normalize_rope, parse_hf_config
from flashllm.models.llama import LlamaForCausalLM
from flashllm.models.loader import load_generation_config, load_model, resolve_dtype
from flashllm.models.registry import ModelRegistry, UnknownArchitectureError
from flashllm.testing.timing import time_limit
from flashllm.testing.tiny_models import build_random_model_from_config, build_tiny_model

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, read directly with safetensors."""
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def expected_params(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each flashllm parameter must hold: the HF tensor, or its fused shards concatenated."""
    expected = {}
    for name, _ in model.named_parameters():
        shards = next((s for packed, s in FUSED.items() if f".{packed}." in name), None)
        if shards is None:
            expected[name] = checkpoint[name]
        else:
            packed = next(p for p in FUSED if f".{p}." in name)
            expected[name] = torch.cat([checkpoint[name.replace(packed, s)] for s in shards])
    return expected


def rewrite_single_file(model_dir: Path, edit) -> None:
    tensors = read_checkpoint(model_dir)
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def load(model_dir, ops, registry, dtype=torch.float32):
    return load_model(model_dir, ops, dtype, "cpu", registry, progress=False)


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- safetensors layouts


def test_sharded_checkpoint_fills_every_parameter(tmp_path, ops, model_registry):
    model_dir = build_tiny_model(tmp_path, "qwen2", tokenizer=False, max_shard_size="20KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = load(model_dir, ops, model_registry)
    for name, tensor in expected_params(model, read_checkpoint(model_dir)).items():
        assert torch.equal(model.get_parameter(name), tensor), name


@pytest.mark.parametrize("checkpoint_dtype, load_dtype",
                         [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_checkpoint_dtype_is_converted_on_load(tmp_path, ops, model_registry, checkpoint_dtype, load_dtype):
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False, dtype=checkpoint_dtype)
    checkpoint = read_checkpoint(model_dir)
    assert {t.dtype for t in checkpoint.values()} == {checkpoint_dtype}
    model, config = load(model_dir, ops, model_registry, dtype=load_dtype)
    assert config.torch_dtype == checkpoint_dtype
    for name, tensor in expected_params(model, checkpoint).items():
        param = model.get_parameter(name)
        assert param.dtype == load_dtype
        assert torch.equal(param, tensor.to(load_dtype)), name


def test_hf_cache_snapshot_links_into_blobs_are_allowed(tmp_path, ops, model_registry):
    source = build_tiny_model(tmp_path / "src", "llama", tokenizer=False)
    repo = tmp_path / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(Path("../..") / "blobs" / blob.name)
    model, _ = load(snapshot, ops, model_registry)
    assert torch.equal(model.model.norm.weight, read_checkpoint(source)["model.norm.weight"])


# ---------------------------------------------------------------- hostile directories


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".ckpt"])
def test_pickle_only_directory_is_refused_with_a_conversion_hint(tmp_path, ops, model_registry, suffix):
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    (model_dir / "model.safetensors").unlink()
    (model_dir / f"pytorch_model{suffix}").write_bytes(b"\x80\x04 never unpickled")
    with pytest.raises(ModelLoadError) as excinfo:
        load(model_dir, ops, model_registry)
    message = one_line_error(excinfo)
    assert f"pytorch_model{suffix}" in message and "pickle" in message and "safetensors" in message


@pytest.fixture
def sharded_dir(tmp_path) -> Path:
    return build_tiny_model(tmp_path / "model", "llama", tokenizer=False, max_shard_size="20KB")


def point_index_entry(model_dir: Path, file_name: str) -> str:
    """Make the index send one tensor to `file_name`; return that tensor's name."""
    path = model_dir / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    tensor = sorted(index["weight_map"])[0]
    index["weight_map"][tensor] = file_name
    path.write_text(json.dumps(index))
    return tensor


@pytest.mark.parametrize("file_name", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS"])
def test_index_paths_escaping_the_directory_are_refused(sharded_dir, ops, model_registry, file_name):
    outside = sharded_dir.parent / "outside.safetensors"
    save_file({"x": torch.zeros(1)}, outside)
    file_name = str(outside) if file_name == "ABS" else file_name
    point_index_entry(sharded_dir, file_name)
    limit = time_limit(5.0)
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as excinfo:
        load(sharded_dir, ops, model_registry)
    assert time.monotonic() - start < limit
    assert file_name in one_line_error(excinfo) and "outside" in str(excinfo.value)


def test_index_symlink_pointing_outside_is_refused(sharded_dir, ops, model_registry):
    outside = sharded_dir.parent / "elsewhere.safetensors"
    save_file({"x": torch.zeros(1)}, outside)
    (sharded_dir / "link.safetensors").symlink_to(outside)
    point_index_entry(sharded_dir, "link.safetensors")
    with pytest.raises(ModelLoadError, match="outside the model directory") as excinfo:
        load(sharded_dir, ops, model_registry)
    one_line_error(excinfo)


def test_index_naming_a_missing_file_is_refused(sharded_dir, ops, model_registry):
    point_index_entry(sharded_dir, "model-99999-of-99999.safetensors")
    with pytest.raises(ModelLoadError, match="model-99999-of-99999.safetensors.*does not exist"):
        load(sharded_dir, ops, model_registry)


def test_index_promising_a_tensor_its_file_lacks_is_refused(sharded_dir, ops, model_registry):
    path = sharded_dir / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = next(iter(index["weight_map"].values()))
    path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.extra.weight"):
        load(sharded_dir, ops, model_registry)


@pytest.mark.parametrize("dropped", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                     "model.norm.weight", "lm_head.weight"])
def test_missing_tensor_is_named(tmp_path, ops, model_registry, dropped):
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    rewrite_single_file(model_dir, lambda tensors: tensors.pop(dropped))
    with pytest.raises(ModelLoadError, match="missing 1 tensor") as excinfo:
        load(model_dir, ops, model_registry)
    assert dropped in one_line_error(excinfo)


def test_unexpected_tensor_is_named(tmp_path, ops, model_registry):
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    rewrite_single_file(model_dir, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(ModelLoadError, match="model.layers.0.self_attn.q_norm.weight"):
        load(model_dir, ops, model_registry)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight",
                                  "model.layers.1.post_attention_layernorm.weight"])
def test_tensor_with_the_wrong_shape_is_reported(tmp_path, ops, model_registry, name):
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    good_shape = tuple(read_checkpoint(model_dir)[name].shape)
    bad_shape = (good_shape[0] + 1, *good_shape[1:])
    rewrite_single_file(model_dir, lambda tensors: tensors.update({name: torch.zeros(bad_shape)}))
    with pytest.raises(ModelLoadError) as excinfo:
        load(model_dir, ops, model_registry)
    message = one_line_error(excinfo)
    assert name in message and str(bad_shape) in message and str(good_shape) in message


def test_missing_config_json_is_refused(tmp_path, ops, model_registry):
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(model_dir, ops, model_registry)


class MustNotBeBuilt(LlamaForCausalLM):
    """Llama's config parsing (the architecture parses its own config), but constructing it fails the test."""

    def __init__(self, *args, **kwargs):
        raise AssertionError("the model was constructed although its config is invalid")


HUGE = dict(hidden_size=65536, num_attention_heads=512, num_key_value_heads=512, num_hidden_layers=512,
            intermediate_size=262144, vocab_size=4_000_000, head_dim=128)


@pytest.mark.parametrize("changes, fragment", [
    ({"hidden_size": 10**7}, "hidden_size=10000000 exceeds"),
    ({"num_hidden_layers": 100_000}, "num_hidden_layers=100000 exceeds"),
    ({"vocab_size": 10**9}, "vocab_size=1000000000 exceeds"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": ...}, "not divisible by num_attention_heads=5"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"hidden_size": -64}, "hidden_size=-64 must be a positive int"),
    ({"hidden_size": "64"}, "hidden_size='64' must be a positive int"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True must be a positive int"),
    ({"intermediate_size": ...}, "missing required field 'intermediate_size'"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    ({"architectures": ...}, "no 'architectures' list"),
    (HUGE, "parameters, above"),
])
def test_absurd_config_fails_fast_before_allocation(tmp_path, ops, changes, fragment):
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    edit_config(model_dir, **changes)
    registry = ModelRegistry()
    registry.register("LlamaForCausalLM", MustNotBeBuilt)
    limit = time_limit(1.0)
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as excinfo:
        load(model_dir, ops, registry)
    assert time.monotonic() - start < limit
    assert fragment in one_line_error(excinfo)


def test_auto_map_is_ignored_with_a_warning(tmp_path, ops, model_registry, caplog):
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    marker = tmp_path / "remote_code_ran"
    (model_dir / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    edit_config(model_dir, auto_map={"AutoModelForCausalLM": "modeling_evil.LlamaForCausalLM"})
    with caplog.at_level(logging.WARNING):
        model, _ = load(model_dir, ops, model_registry)
    assert any("auto_map" in r.getMessage() and "never executes" in r.getMessage() for r in caplog.records)
    assert not marker.exists() and "modeling_evil" not in sys.modules
    assert type(model).__module__ == "flashllm.models.llama"


def test_unknown_architecture_lists_the_supported_ones(tmp_path, ops, model_registry):
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    edit_config(model_dir, architectures=["LlamaForCausalLMWithExtras"])
    with pytest.raises(ModelLoadError) as excinfo:
        load(model_dir, ops, model_registry)
    message = one_line_error(excinfo)
    assert "LlamaForCausalLMWithExtras" in message
    assert all(arch in message for arch in BUILTIN_MODELS)


# ---------------------------------------------------------------- generation config and dtype policy


def test_generation_config_is_read_and_optional(tmp_path):
    defaults = {"temperature": 0.7, "top_p": 0.8, "eos_token_id": [3, 4]}
    (tmp_path / "generation_config.json").write_text(json.dumps(defaults))
    assert load_generation_config(tmp_path) == defaults
    assert load_generation_config(tmp_path / "nowhere") == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_generation_config(tmp_path)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("requested, checkpoint, native_bf16, device_type, expected", [
    ("auto", BF16, True, "cuda", BF16),      # accelerators keep the checkpoint's dtype
    ("auto", FP16, True, "cuda", FP16),
    ("auto", FP32, True, "npu", FP32),
    ("auto", BF16, False, "cuda", FP16),     # e.g. Volta: no bf16, fp16 instead
    ("auto", None, True, "cuda", FP32),      # undeclared dtype: assume fp32
    ("auto", BF16, False, "cpu", FP32),      # CPUs compute fp32 unless bf16 is native
    ("auto", FP16, False, "cpu", FP32),
    ("auto", BF16, True, "cpu", BF16),
    ("auto", FP32, True, "cpu", FP32),
    ("float16", BF16, False, "cpu", FP16),   # an explicit choice is honoured
    ("bfloat16", FP32, False, "cuda", BF16),
    ("float32", BF16, True, "cuda", FP32),
])
def test_resolve_dtype(requested, checkpoint, native_bf16, device_type, expected):
    assert resolve_dtype(requested, checkpoint, native_bf16, accelerator=device_type != "cpu") == expected


def test_resolve_dtype_rejects_unknown_names():
    with pytest.raises(ValueError, match="float64.*auto, float32, float16, bfloat16"):
        resolve_dtype("float64", FP32, True, accelerator=False)


# ---------------------------------------------------------------- config parsing


BASE_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}


def test_rope_settings_read_the_same_from_legacy_and_transformers5_layouts():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    legacy = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}}
    legacy_rope_type = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    v5 = {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", **scaling}}
    want = (500000.0, {"rope_type": "llama3", **scaling})
    assert normalize_rope(legacy) == normalize_rope(legacy_rope_type) == normalize_rope(v5) == want
    assert normalize_rope({}) == (10000.0, None)
    assert normalize_rope({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (1e6, None)


def test_defaults_of_optional_fields():
    config = parse_hf_config(BASE_CONFIG)
    assert (config.num_key_value_heads, config.head_dim, config.rotary_dim) == (4, 16, 16)
    assert config.sliding_windows == (None, None) and config.torch_dtype is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
config_keys = st.sampled_from([*BASE_CONFIG, "tie_word_embeddings", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
                               "rope_parameters", "rms_norm_eps", "sliding_window", "use_sliding_window",
                               "max_position_embeddings", "partial_rotary_factor", "dtype", "hidden_act"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(config_keys, json_values, max_size=6))
def test_any_malformed_config_gives_a_model_load_error(overrides):
    try:
        config = parse_hf_config({**BASE_CONFIG, **overrides})
    except ModelLoadError as exc:
        assert "\n" not in str(exc)
        return
    # anything accepted is internally consistent
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert 0 < config.rotary_dim <= config.head_dim
    assert len(config.sliding_windows) == config.num_hidden_layers


# ---------------------------------------------------------------- registry


def test_registry_resolves_exact_names_lazily_and_refuses_duplicates(model_registry):
    assert model_registry.architectures() == sorted(BUILTIN_MODELS)
    cls = model_registry.resolve("Qwen2ForCausalLM")
    assert cls.__name__ == "Qwen2ForCausalLM" and model_registry.resolve("Qwen2ForCausalLM") is cls
    with pytest.raises(UnknownArchitectureError, match="LlamaForCausalLM, .*Qwen2ForCausalLM"):
        model_registry.resolve("Qwen2ForCausal")  # a prefix is not a match
    with pytest.raises(ValueError, match="already registered"):
        flashllm_register_models(model_registry.register)
    with pytest.raises(ValueError, match="module:ClassName"):
        model_registry.register("OtherForCausalLM", "no_colon_here")


# ---------------------------------------------------------------- tensor-parallel weight slicing


@pytest.mark.parametrize("num_heads, num_kv_heads, tp_size", [(8, 4, 2), (8, 2, 4), (8, 1, 4), (4, 4, 4)])
def test_qkv_slices_give_each_rank_the_kv_heads_its_query_heads_read(ops, num_heads, num_kv_heads, tp_size):
    from flashllm.models.layers.linear import QKVParallelLinear

    hidden, head_dim = 16, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * head_dim, hidden, generator=gen) for n in (num_heads, num_kv_heads, num_kv_heads))
    heads_per_rank, group = num_heads // tp_size, num_heads // num_kv_heads
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, False, ops, torch.float32,
                                  torch.device("cpu"), tp_rank=rank, tp_size=tp_size)
        for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
        q_heads = range(rank * heads_per_rank, (rank + 1) * heads_per_rank)
        kv_heads = sorted({h // group for h in q_heads})  # GQA: query head h reads kv head h // group
        expected = [w[h * head_dim:(h + 1) * head_dim] for w, heads in ((q, q_heads), (k, kv_heads), (v, kv_heads))
                    for h in heads]
        assert torch.equal(layer.weight, torch.cat(expected))


def test_column_row_and_merged_slices_reassemble_the_full_weight(ops):
    from flashllm.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    down = torch.randn(6, 8, generator=gen)
    cpu = torch.device("cpu")
    merged = [MergedColumnParallelLinear(6, [8, 8], False, ops, torch.float32, cpu, r, 2) for r in range(2)]
    rows = [RowParallelLinear(8, 6, True, ops, torch.float32, cpu, r, 2) for r in range(2)]
    for layer in merged:
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
    for layer in rows:
        layer.weight.weight_loader(layer.weight, down)
        layer.bias.weight_loader(layer.bias, torch.arange(6.0))
    assert torch.equal(torch.cat([m.weight[:4] for m in merged]), gate)
    assert torch.equal(torch.cat([m.weight[4:] for m in merged]), up)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), down)
    assert all(torch.equal(r.bias, torch.arange(6.0)) for r in rows)


# ---------------------------------------------------------------- builders and the demo model


@pytest.mark.parametrize("arch, tied", [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True),
                                        ("Qwen3ForCausalLM", True)])
def test_random_full_shape_builder_writes_a_checkpoint_transformers_accepts(tmp_path, ops, model_registry,
                                                                             arch, tied):
    from transformers import AutoModelForCausalLM

    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[arch]
    config = {**BASE_CONFIG, "architectures": [arch], "model_type": model_type,
              "num_key_value_heads": 2, "tie_word_embeddings": tied, "dtype": "bfloat16", "vocab_size": 1000}
    model_dir = build_random_model_from_config(tmp_path, config, seed=3, max_shard_bytes=40_000)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    theirs, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    checkpoint = read_checkpoint(model_dir)
    assert ("lm_head.weight" in checkpoint) is not tied
    assert ("model.layers.0.self_attn.q_proj.bias" in checkpoint) is (arch == "Qwen2ForCausalLM")  # qkv bias
    assert ("model.layers.0.self_attn.q_norm.weight" in checkpoint) is (arch == "Qwen3ForCausalLM")
    embed = checkpoint["model.embed_tokens.weight"].float()
    assert embed.dtype == torch.float32 and abs(embed.std().item() - 0.02) < 0.002
    ours, _ = load(model_dir, ops, model_registry)
    for name, tensor in expected_params(ours, checkpoint).items():
        assert torch.equal(ours.get_parameter(name), tensor.float()), name


def test_tiny_model_vocabulary_is_its_tokenizers(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    model_dir = build_tiny_model(tmp_path, "qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert AutoConfig.from_pretrained(model_dir).vocab_size == len(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_demo_model_is_built_once_atomically_and_loads(tmp_path, ops, model_registry, monkeypatch):
    monkeypatch.setenv("FLASHLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = demo_model_dir()
    assert path == tmp_path / "cache" / "demo-v1"
    assert "meaningless" in (path / "README.md").read_text()
    assert [p.name for p in path.parent.iterdir()] == ["demo-v1"]  # no temp dirs left behind
    stamp = os.stat(path / "model.safetensors").st_mtime_ns
    assert demo_model_dir(tmp_path / "cache") == path
    assert os.stat(path / "model.safetensors").st_mtime_ns == stamp
    model, config = load(path, ops, model_registry)
    assert (config.hidden_size, config.num_hidden_layers) == (256, 4)
    rebuilt = demo_model_dir(tmp_path / "other")
    assert read_checkpoint(rebuilt).keys() == read_checkpoint(path).keys()
    ours, theirs = read_checkpoint(rebuilt), read_checkpoint(path)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_a_safetensors_header_quoting_control_characters_still_fails_in_one_line(tmp_path):
    # The safetensors library quotes the offending header value in its message (found by tests/fuzz):
    # a dtype holding a newline and an escape sequence must not break the one-line error.
    from flashllm.models.loader import _iter_tensors

    header = json.dumps({"w": {"dtype": "\n\x1b[2J", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(ModelLoadError) as excinfo:
        list(_iter_tensors({path: None}, False, set()))
    message = str(excinfo.value)
    assert message.isprintable() and "\\n" in message and "model.safetensors" in message
