"""Apertus (Llama's block with per-head q / k RMSNorms and an ungated xIELU MLP of learned per-layer scalars):
config.json read as transformers' ApertusConfig reads it (its llama3 RoPE default included), xIELU equal to
transformers' Python XIELUActivation, the variants and checkpoint scalars against transformers, and tensor
parallelism. The tiny preset's paged-forward and engine parity with transformers run in test_parity_forward.py and
test_engine_parity.py with the other presets."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashllm.llm import LLM
from flashllm.models.apertus import XIELU
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
RAW = {"architectures": ["ApertusForCausalLM"], "model_type": "apertus", "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("changes", [
    {}, {"rope_scaling": dict(LLAMA3), "rope_theta": 12000000.0, "num_key_value_heads": 2, "rms_norm_eps": 1e-6},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": True, "tie_word_embeddings": True},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 700.0, "head_dim": 32},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}, "max_position_embeddings": 4096},
])
def test_config_reads_as_transformers_reads_it(changes) -> None:
    from transformers import ApertusConfig

    ours, theirs = parse_hf_config({**RAW, **changes}), ApertusConfig(**{**RAW, **changes})
    rope = theirs.rope_parameters
    assert ours.rope_theta == rope["rope_theta"]
    assert ours.rope_scaling == (None if rope["rope_type"] == "default" else {
        key: value for key, value in rope.items() if key not in ("rope_theta", "type")})
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    for field in ("num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
                  "max_position_embeddings", "bos_token_id", "eos_token_id", "hidden_act"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.qk_norm and not ours.mlp_bias


def test_fields_left_out_take_transformers_defaults() -> None:
    from transformers import ApertusConfig

    ours, theirs = parse_hf_config({"architectures": ["ApertusForCausalLM"], "model_type": "apertus"}), ApertusConfig()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
                  "tie_word_embeddings", "hidden_act", "attention_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 12000000.0
    assert ours.rope_scaling == {**LLAMA3}


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"rope_theta": 500.0}, "rope_theta=500.0 without rope_parameters"),
    ({"hidden_act": "silu"}, "hidden_act='silu' is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"rope_scaling": [1, 2]}, "must be an object or null"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "float checkpoints only"),
])
def test_what_it_cannot_run_is_refused(changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment):
        parse_hf_config({**RAW, **changes})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xielu_is_transformers_python_xielu(dtype) -> None:
    """Bit for bit, both branches and the eps kink, with learned scalars away from their initial values."""
    from transformers.activations import XIELUActivation

    theirs = XIELUActivation(dtype=dtype)
    ours = XIELU(dtype, torch.device("cpu"))
    values = {"alpha_p": torch.tensor([0.37]), "alpha_n": torch.tensor([-0.9]), "beta": torch.tensor(0.45),
              "eps": torch.tensor(-2e-6)}
    with torch.no_grad():
        for name, value in values.items():
            getattr(theirs, name).copy_(value)
            getattr(ours, name).weight_loader(getattr(ours, name), value.reshape(1))  # either stored shape loads
    x = torch.cat([torch.randn(4, 96, generator=torch.Generator().manual_seed(0)) * 3,
                   torch.tensor([[0.0, -1e-7, -2e-6, -3e-6, 1e-7]]).repeat(4, 4)], dim=1).to(dtype)
    assert torch.equal(ours(x), theirs._xielu_python(x))


def _rescaled_scalars(model_dir) -> None:
    """Rewrite the checkpoint's xIELU beta / eps (left at their initial 0.5 / -1e-6 by the tiny builder)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(".act_fn.beta"):
            tensors[name] = torch.tensor(0.3)
        elif name.endswith(".act_fn.eps"):
            tensors[name] = torch.tensor(-0.05)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("changes", [
    {"attention_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 4},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "head_dim": 32},
    {"rescaled": True},
])
def test_variants_match_transformers(changes, tmp_path) -> None:
    """The preset has GQA under llama3 RoPE, no biases, an untied head; biased q / k / v / o under a tied head,
    plain RoPE with head_dim past hidden / heads, and checkpoint beta / eps away from their initial values, against
    transformers."""
    from transformers import AutoModelForCausalLM

    changes = dict(changes)
    rescaled = changes.pop("rescaled", False)
    model_dir = build_tiny_model(tmp_path, "apertus", seed=5, tokenizer=False, **changes)
    if rescaled:
        _rescaled_scalars(model_dir)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    model = llm.engine.parts.model
    act = model.model.layers[1].mlp.act_fn
    assert act.beta.item() == pytest.approx(0.3 if rescaled else 0.5)
    assert (model.model.layers[0].self_attn.o_proj.bias is not None) == changes.get("attention_bias", False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40)], 8)


def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(tmp_path) -> None:
    """Each rank applies xIELU to its slice of the intermediate features, with the layer's scalars replicated."""
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], build_tiny_model(tmp_path / "apertus", "apertus", seed=2,
                                                                      tokenizer=False))
