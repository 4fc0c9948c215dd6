"""StableLM (biased LayerNorms, q / k / v biases, RoPE over a quarter of each head): config.json read as transformers'
StableLmConfig reads it, StableLM 2 12B's parallel residual and per-head q / k LayerNorms (one checkpoint tensor per
head) against transformers, and tensor parallelism. The tiny preset's paged-forward and engine parity with
transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.block import ParallelBlock
from flashllm.models.layers.norm import HeadLayerNorm
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
# num_key_value_heads given: StableLmConfig's default is 32 whatever the head count (the published configs all set it;
# flashllm reads an absent one as the head count)
RAW = {"architectures": ["StableLmForCausalLM"], "model_type": "stablelm", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}
TWELVE_B = {"use_parallel_residual": True, "qk_layernorm": True}  # StableLM 2 12B's options


@pytest.mark.parametrize("changes", [{}, {"use_qkv_bias": True, "layer_norm_eps": 1e-3, "num_key_value_heads": 2},
                                     {"partial_rotary_factor": 0.5, "tie_word_embeddings": True, **TWELVE_B}])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import StableLmConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), StableLmConfig(**{**RAW, **changes})
    assert ours.rms_norm_eps == theirs.layer_norm_eps and ours.attention_bias == theirs.use_qkv_bias
    assert ours.rotary_dim == int(ours.head_dim * theirs.rope_parameters["partial_rotary_factor"])
    assert (ours.num_key_value_heads, ours.max_position_embeddings, ours.tie_word_embeddings) == (
        theirs.num_key_value_heads, theirs.max_position_embeddings, theirs.tie_word_embeddings)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"qk_layernorm": "yes"}, "qk_layernorm='yes' must be true or false"),
    ({"head_dim": 32}, "is not hidden_size=64"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.fixture(scope="module")
def twelve_b(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("stablelm12b"), "stablelm", seed=5, tokenizer=False, **TWELVE_B)


def test_the_parallel_residual_and_per_head_norms_match_transformers(twelve_b) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(twelve_b), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    layer = llm.engine.parts.model.model.layers[0]
    assert isinstance(layer, ParallelBlock) and not hasattr(layer, "post_attention_layernorm")
    assert type(layer.self_attn.q_norm) is HeadLayerNorm and layer.self_attn.k_norm.weight.shape == (2, 16)
    hf = AutoModelForCausalLM.from_pretrained(twelve_b, dtype=torch.float32).eval()
    torch.testing.assert_close(layer.self_attn.k_norm.weight, torch.stack(
        [norm.weight for norm in hf.model.layers[0].self_attn.k_layernorm.norms]).detach())
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


@pytest.mark.parametrize("variant", ["stablelm", "12b"])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(variant, twelve_b, tmp_path) -> None:
    """Each rank keeps its heads' rows of the per-head norms."""
    model_dir = twelve_b if variant == "12b" else build_tiny_model(tmp_path / "s", "stablelm", seed=2, tokenizer=False)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)


def test_a_missing_head_norm_is_refused(twelve_b, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(twelve_b, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_layernorm.norms.3.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="3 of the 4 per-head q_layernorm tensors"):
        LLM(str(broken), dtype="float32", device="cpu", block_size=16, max_model_len=64, num_kv_blocks=16)
