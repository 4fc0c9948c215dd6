"""Cohere (Command R / R+, Aya Expanse) and Cohere 2 (Command R7B, Command A): config.json read as transformers'
CohereConfig / Cohere2Config read it, Command R+'s per-head q / k LayerNorms and a logit_scale that is not a power of
two against transformers through the engine, the fast paths the models declare, GPTQ / AWQ checkpoints against their
float twins, tensor-parallel ranks as one rank, and the refusals. The tiny presets' paged-forward and engine parity
with transformers run in test_parity_forward.py and test_engine_parity.py with the other presets."""

from __future__ import annotations

import json

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.registry.fusions import DECODER_STACK, LM_HEAD, DecoderStackFusion, LMHeadFusion, declared
from flashllm.testing.gguf_files import two_ranks_decode_as_one
from flashllm.testing.parity import check_engine_greedy_against, random_tokens
from flashllm.testing.tiny_models import build_tiny_model

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}
COHERE = {"architectures": ["CohereForCausalLM"], "model_type": "cohere", **SIZES}
COHERE2 = {"architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", **SIZES}
R_PLUS = {"use_qk_norm": True, "logit_scale": 0.8333333333333334, "tie_word_embeddings": False}  # Command R+'s


def _rope_theta(theirs) -> float:
    return theirs.rope_parameters["rope_theta"]


@pytest.mark.parametrize("changes", [
    {}, {**R_PLUS, "rope_theta": 75000000.0, "layer_norm_eps": 1e-6, "attention_bias": True, "head_dim": 32},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, {"rms_norm_eps": 0.5, "sliding_window": 16},
])
def test_a_cohere_config_reads_as_transformers_reads_it(changes) -> None:
    """CohereConfig's defaults where config.json is silent (RoPE base 500000, tied embeddings, logits x 0.0625,
    eps 1e-5, 8192 positions); the LayerNorms' eps is `layer_norm_eps` whatever rms_norm_eps says, and a
    sliding_window is ignored, as transformers' Cohere has none."""
    from transformers import CohereConfig

    ours, theirs = parse_hf_config({**COHERE, **changes}), CohereConfig(**{**COHERE, **changes})
    assert ours.rms_norm_eps == theirs.layer_norm_eps
    assert ours.logit_scale == theirs.logit_scale
    assert (ours.use_qk_norm, ours.tie_word_embeddings, ours.attention_bias) == (
        theirs.use_qk_norm, theirs.tie_word_embeddings, theirs.attention_bias)
    assert ours.rope_theta == _rope_theta(theirs)
    assert ours.head_dim == getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)
    assert (ours.max_position_embeddings, ours.bos_token_id, ours.eos_token_id) == (
        theirs.max_position_embeddings, theirs.bos_token_id, theirs.eos_token_id)
    assert ours.rope_interleaved and ours.sliding_windows == (None,) * 8 and all(ours.rope_layers)
    assert not ours.qk_norm and not ours.mlp_bias  # Llama's RMS head norms are not Cohere's


@pytest.mark.parametrize("changes", [
    {}, {"sliding_window_pattern": 2, "sliding_window": 16, "rope_theta": 50000.0},
    {"layer_types": ["full_attention", "sliding_attention"] * 4, "head_dim": 32, "use_qk_norm": True},
])
def test_a_cohere2_config_reads_as_transformers_reads_it(changes) -> None:
    """Sliding layers from layer_types, else from the legacy pattern (three sliding, then a full one, by default):
    only the sliding layers rotate. RoPE base 10000 by default (not Cohere's 500000); no q / k norms."""
    from transformers import Cohere2Config

    ours, theirs = parse_hf_config({**COHERE2, **changes}), Cohere2Config(**{**COHERE2, **changes})
    window = theirs.sliding_window
    assert ours.sliding_windows == tuple(window if t == "sliding_attention" else None for t in theirs.layer_types)
    assert ours.rope_layers == tuple(t == "sliding_attention" for t in theirs.layer_types)
    assert (ours.rope_theta, ours.head_dim, ours.logit_scale, ours.tie_word_embeddings) == (
        _rope_theta(theirs), theirs.head_dim, theirs.logit_scale, theirs.tie_word_embeddings)
    assert ours.rms_norm_eps == theirs.layer_norm_eps and not ours.use_qk_norm


@pytest.mark.parametrize(("raw", "fragment"), [
    ({**COHERE2, "sliding_window": None}, "sliding_window is null"),
    ({**COHERE2, "sliding_window_pattern": "LLLG"}, "sliding_window_pattern='LLLG'"),
    ({**COHERE2, "layer_types": ["sliding_attention"] * 3}, "expected 8 entries"),
    ({**COHERE, "partial_rotary_factor": 0.5}, "Cohere rotates whole heads"),
    ({**COHERE, "logit_scale": -1.0}, "logit_scale=-1.0 must be a finite positive number"),
    ({**COHERE, "hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
])
def test_what_transformers_would_not_run_as_cohere_is_refused_in_one_line(raw, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config(raw)
    assert "\n" not in str(info.value)


def _llm(model_dir, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
    return LLM(str(model_dir), **{**options, **kw})


def test_command_r_plus_head_norms_and_logit_scale_match_transformers(tmp_path) -> None:
    """use_qk_norm (a LayerNorm scale row per head), logits x 5/6 (no LM-head fast path then: the engine runs
    compute_logits), untied head, biased projections: greedy tokens and every logits row as transformers'."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path, "cohere", seed=5, tokenizer=False, attention_bias=True, **R_PLUS)
    llm = _llm(model_dir)
    model = llm.engine.parts.model
    assert tuple(model.model.layers[0].self_attn.q_norm.weight.shape) == (4, 16)
    assert tuple(model.model.layers[0].self_attn.k_norm.weight.shape) == (2, 16)
    assert declared(model, LM_HEAD, LMHeadFusion) is None
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_engine_greedy_against(llm, hf, [random_tokens(n, 256, seed=n) for n in (3, 40, 70)], 8)


@pytest.mark.parametrize("preset", ["cohere", "cohere2"])
def test_the_lm_head_is_offered_with_the_inverse_scale_and_the_decoder_stack_never(preset, tmp_path) -> None:
    """logit_scale 0.25 is a power of two: the LM head's record divides by 4. The parallel block is not the record
    of Llama's block, so no decoder-stack path is offered."""
    llm = _llm(build_tiny_model(tmp_path, preset, seed=1, tokenizer=False))
    model = llm.engine.parts.model
    assert declared(model, DECODER_STACK, DecoderStackFusion) is None
    head = declared(model, LM_HEAD, LMHeadFusion)
    assert head.logits_scale == 4.0 and head.tied
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(model.compute_logits(hidden), model.lm_head(hidden) / head.logits_scale, rtol=0, atol=0)


def test_cohere2_rotates_only_its_sliding_layers(tmp_path) -> None:
    from flashllm.models.layers.rotary import RotaryEmbedding
    from flashllm.models.smollm3 import NoPositionEmbedding

    model = _llm(build_tiny_model(tmp_path, "cohere2", seed=1, tokenizer=False)).engine.parts.model
    kinds = [(type(layer.self_attn.rotary_emb), layer.self_attn.attn.sliding_window) for layer in model.model.layers]
    assert kinds == [(RotaryEmbedding, 8), (NoPositionEmbedding, None)] * 2


@pytest.mark.parametrize("qconfig", [
    {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True, "checkpoint_format": "gptq"},
    {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
], ids=["gptq", "awq"])
def test_a_prequantized_checkpoint_matches_its_float_twin(qconfig, tmp_path, ops, model_registry, paged_driver):
    """GPTQ / AWQ packed q / k / v / o and gate / up / down load into Llama's quantizable linears (the norms, the
    per-head q / k scales and the tied head stay float): the dequantized float weights' logits."""
    from safetensors.torch import load_file, save_file

    from flashllm.models.loader import load_model
    from flashllm.testing.packed_quant import quantize_linear

    float_dir = build_tiny_model(tmp_path / "float", "cohere", seed=5, tokenizer=False, use_qk_norm=True)
    quant, twin = {}, {}
    for name, tensor in load_file(float_dir / "model.safetensors").items():
        if not name.endswith("_proj.weight"):
            quant[name] = twin[name] = tensor
            continue
        packed, twin[name] = quantize_linear(tensor, qconfig)
        quant.update({f"{name.removesuffix('.weight')}.{key}": value for key, value in packed.items()})
    config = json.loads((float_dir / "config.json").read_text())
    logits = []
    for kind, tensors, extra in (("quant", quant, {"quantization_config": qconfig}), ("twin", twin, {})):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(tensors, tmp_path / kind / "model.safetensors")
        model, _ = load_model(tmp_path / kind, ops, torch.float32, "cpu", model_registry, progress=False)
        assert (model.model.layers[0].mlp.down_proj.weight is None) == (kind == "quant")
        driver = paged_driver(model, 16, 16)
        logits += driver.step([(driver.add_sequence(), random_tokens(70, 256, seed=9))])
    torch.testing.assert_close(logits[0], logits[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("preset", "changes"), [
    ("cohere", {"use_qk_norm": True}),  # each rank loads its two query heads' and one key head's scale rows
    ("cohere", {"use_qk_norm": True, "num_key_value_heads": 1}),  # the one key head, its row, on both ranks
    ("cohere2", {}),
], ids=["qk-norm", "qk-norm-replicated-kv", "cohere2"])
def test_two_tensor_parallel_ranks_give_one_rank_s_tokens(preset, changes, tmp_path) -> None:
    model_dir = build_tiny_model(tmp_path / preset, preset, seed=2, tokenizer=False, **changes)
    two_ranks_decode_as_one([PROMPT, [7, 3, 250]], model_dir)
