"""The model contract (models/base.py): what the loader demands of a registered architecture and its parsed config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from safetensors import safe_open

from flashllm.models.base import CausalLM
from flashllm.models.hf_config import MAX_NUM_PARAMETERS, ModelLoadError, parse_hf_config
from flashllm.models.loader import load_model
from flashllm.models.registry import ModelRegistry
from flashllm.testing.tiny_models import build_tiny_model

RAW = {"architectures": ["FakeForCausalLM"]}


@dataclass(frozen=True)
class FakeConfig:
    architecture: str = "FakeForCausalLM"
    vocab_size: int = 100
    head_dim: int = 16
    max_position_embeddings: int = 256
    torch_dtype: torch.dtype | None = None
    quantization: Any = None
    bos_token_id: Any = None
    eos_token_id: Any = 2
    tie_word_embeddings: bool = False
    raw: dict[str, Any] = field(default_factory=dict)
    num_parameters: int = 10_000


def registry_parsing_into(config: Any) -> ModelRegistry:
    """A registry whose FakeForCausalLM parses every config.json into `config` and must never be built."""

    class Fake(CausalLM):
        @classmethod
        def parse_config(cls, raw: dict[str, Any], source: str) -> Any:
            return config

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("the model was constructed although its config is invalid")

    return ModelRegistry.from_targets({"FakeForCausalLM": Fake})


def test_a_valid_parsed_config_is_returned_as_the_architecture_made_it() -> None:
    config = FakeConfig()
    assert parse_hf_config(RAW, registry_parsing_into(config)) is config


def test_a_registered_class_without_parse_config_is_refused_naming_the_contract() -> None:
    class NotAContractModel(torch.nn.Module):
        pass

    registry = ModelRegistry.from_targets({"FakeForCausalLM": NotAContractModel})
    with pytest.raises(ModelLoadError, match="NotAContractModel.*no parse_config.*flashllm.models.base.CausalLM"):
        parse_hf_config(RAW, registry)


def test_a_parsed_config_without_the_generic_fields_is_refused_listing_them() -> None:
    @dataclass
    class Partial:
        architecture: str = "FakeForCausalLM"
        vocab_size: int = 100

    with pytest.raises(ModelLoadError) as excinfo:
        parse_hf_config(RAW, registry_parsing_into(Partial()))
    message = str(excinfo.value)
    assert "without head_dim, max_position_embeddings, torch_dtype" in message and "num_parameters" in message
    assert "vocab_size," not in message.split("must provide")[0]  # the present fields are not reported missing


@pytest.mark.parametrize("changes, fragment", [
    ({"architecture": "OtherForCausalLM"}, "returned architecture='OtherForCausalLM'"),
    ({"vocab_size": 10**9}, "vocab_size=1000000000 exceeds"),
    ({"vocab_size": 0}, "vocab_size=0 must be a positive int"),
    ({"head_dim": 4096}, "head_dim=4096 exceeds"),
    ({"max_position_embeddings": "long"}, "max_position_embeddings='long' must be a positive int"),
    ({"num_parameters": MAX_NUM_PARAMETERS + 1}, "parameters, above"),
    ({"num_parameters": 1.5}, "num_parameters=1.5 must be a non-negative int"),
    ({"torch_dtype": torch.float64}, "torch_dtype=torch.float64 must be one of"),
    ({"quantization": {"quant_method": "gptq"}}, "must be a CheckpointQuant or None"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be a bool"),
    ({"eos_token_id": -1}, "eos_token_id=-1 must be a token id"),
])
def test_generic_bounds_hold_for_any_architecture_before_it_is_built(tmp_path, ops, changes, fragment) -> None:
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    (model_dir / "config.json").write_text('{"architectures": ["FakeForCausalLM"]}')
    registry = registry_parsing_into(dataclasses.replace(FakeConfig(), **changes))
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(model_dir, ops, torch.float32, "cpu", registry, progress=False)
    assert fragment in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_an_architecture_missing_a_contract_method_cannot_be_built() -> None:
    class NoLogits(CausalLM):
        @classmethod
        def parse_config(cls, raw: dict[str, Any], source: str) -> Any:
            return FakeConfig()

        def forward(self, input_ids, positions, kv_caches, attn_metadata):
            return input_ids

        def kv_cache_shape(self) -> tuple[int, int, int]:
            return 1, 1, 16

    with pytest.raises(TypeError, match="compute_logits"):
        NoLogits(FakeConfig(), None, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("tp_rank, tp_size", [(2, 2), (-1, 2), (0, 0)])
def test_the_rank_must_lie_inside_the_tensor_parallel_group(model_registry, ops, tmp_path, tp_rank, tp_size) -> None:
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    with pytest.raises(ValueError, match=f"tp_rank={tp_rank}, tp_size={tp_size}"):
        load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False, tp_rank=tp_rank,
                   tp_size=tp_size)


def test_load_model_builds_and_fills_the_shard_of_the_rank_it_is_given(model_registry, ops, tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer=False)
    full, config = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    rank1, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False, tp_rank=1, tp_size=2)
    assert (rank1.tp_rank, rank1.tp_size) == (1, 2)
    num_layers, num_kv_heads, head_dim = full.kv_cache_shape()
    assert rank1.kv_cache_shape() == (num_layers, num_kv_heads // 2, head_dim)
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    half_vocab, half_inter = -(-config.vocab_size // 2), down.shape[1] // 2
    rows = rank1.model.embed_tokens.weight[: config.vocab_size - half_vocab]
    assert torch.equal(rows, embedding[half_vocab:])
    assert torch.equal(rank1.model.layers[0].mlp.down_proj.weight, down[:, half_inter:])  # row-parallel: input half
