"""Phi-3 against transformers' own Phi3ForCausalLM: LongRoPE's short and long factor sets (prompts on both sides
of original_max_position_embeddings, decodes crossing it, chunked prefill, prefix-cache keys), partial rotary,
the fused checkpoint projections, and config.json's refusals. The plain preset (fused projections, sliding
window) runs through tests/models/test_parity_forward.py and test_engine_parity.py with the other families."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.phi3 import LongRopeStack
from flashllm.sampling_params import SamplingParams
from flashllm.testing.parity import LogitRecorder, assert_rows_match, hf_greedy, hf_logits, random_tokens
from flashllm.testing.tiny_models import PRESETS, TINY_BASE, build_tiny_model

ORIGINAL = 64  # the phi3-longrope preset's original_max_position_embeddings
TINY_BASE_VOCAB = 256  # build_tiny_model's vocabulary without a tokenizer
STEPS = 24
ATOL = 1e-4


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("phi3-longrope"), "phi3-longrope", seed=4, tokenizer=False)


@pytest.fixture(scope="module")
def hf_longrope(longrope_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(longrope_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_cached_forward_greedy(hf_model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding through transformers' forward with its KV cache, one token a call, without generate()
    (whose Phi-3 prepare_inputs_for_generation drops the cache where the sequence first passes the original
    length, re-encoding it with the long set): the factor set then follows each call's largest position, as
    flashllm's per-token rule does. Returns the new tokens and (len(prompt) + steps - 1, V) rows indexed like a
    full forward's (row i scores the first i + 1 tokens)."""
    cache_arg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    out = hf_model(torch.tensor([prompt]), use_cache=True)
    rows, tokens = list(out.logits[0].float()), []
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        if len(tokens) == steps:
            break
        cache = out.get("cache", out.get("past_key_values"))
        out = hf_model(torch.tensor([tokens[-1:]]), use_cache=True, **{cache_arg: cache})
        rows.append(out.logits[0, -1].float())
    return tokens, torch.stack(rows)


def _llm(model_dir: Path, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=16, max_model_len=512, num_kv_blocks=96)
    return LLM(str(model_dir), **{**options, **kw})


def _check(llm: LLM, hf_model, prompts: list[list[int]], steps: int = STEPS, reference=hf_greedy) -> list:
    recorder = LogitRecorder(llm)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, rows = reference(hf_model, prompt, steps)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert_rows_match(recorder.rows, prompt, tokens, rows, steps, atol=ATOL)
    return outputs


@pytest.mark.parametrize("backend", [None, "reference"])
def test_sequences_on_one_side_of_the_original_length_match_transformers(backend, longrope_dir, hf_longrope):
    """One batch: sequences that stay within 64 tokens (short set) and prompts longer than 64 (long set from
    position 0), with 48-token prefill chunks (the 150-token prompt is long from its first chunk): every
    logits row equals transformers' full forward over the sequence so far (what its generate() computes)."""
    llm = _llm(longrope_dir, max_num_batched_tokens=48, **({} if backend is None else {"backend": backend}))
    assert isinstance(llm.engine.parts.model.model, LongRopeStack)
    prompts = [random_tokens(n, TINY_BASE_VOCAB, seed=n) for n in (7, 40, 65, 150)]
    _check(llm, hf_longrope, prompts)


def test_sequences_crossing_the_original_length_keep_their_cached_keys(longrope_dir, hf_longrope):
    """Prompts of 50, 63 and 64 tokens decoding past 64: tokens at positions >= 64 take the long set over keys
    cached with the short one, as transformers' forward with its KV cache computes (not generate(), which
    re-encodes the sequence there: docs/models.md#phi-3-longrope)."""
    prompts = [random_tokens(n, TINY_BASE_VOCAB, seed=n) for n in (50, 63, 64)]
    _check(_llm(longrope_dir), hf_longrope, prompts, reference=hf_cached_forward_greedy)


def test_the_two_factor_sets_differ_where_it_matters(hf_longrope):
    """The fixture would hide a wrong set choice if the sets gave the same logits: they do not."""
    prompt = random_tokens(80, TINY_BASE_VOCAB, seed=1)
    long_rows = hf_logits(hf_longrope, prompt)[:ORIGINAL]
    short_rows = hf_logits(hf_longrope, prompt[:ORIGINAL])
    assert (long_rows - short_rows).abs().max() > 1e-2


def test_a_long_prompt_does_not_reuse_a_short_prompts_cached_blocks(longrope_dir, hf_longrope):
    """The first 48 tokens of a 100-token prompt were cached, short-rotated, by a 50-token prompt; the long
    prompt rotates them by the long set, so it must recompute them (prefix_cache_salt), while two long prompts
    share their blocks."""
    llm = _llm(longrope_dir)
    base = random_tokens(100, TINY_BASE_VOCAB, seed=2)
    _check(llm, hf_longrope, [base[:50]], steps=2)
    (long_run,) = _check(llm, hf_longrope, [base], steps=4)
    assert long_run.metrics.num_cached_tokens == 0
    (again,) = _check(llm, hf_longrope, [base[:90] + [5, 6]], steps=4)
    assert again.metrics.num_cached_tokens >= 80


def test_a_preempted_sequence_recomputes_as_before(longrope_dir, hf_longrope):
    """Sequences preempted and recomputed (prompts past 64, and one crossing 64 while decoding) give the
    logits they would have given without preemption."""
    llm = _llm(longrope_dir, num_kv_blocks=32, max_model_len=256, enable_prefix_caching=False)
    prompts = [random_tokens(n, TINY_BASE_VOCAB, seed=30 + n) for n in (66, 90, 70, 60, 100, 80)]
    # (on one side of 64 throughout, the cached forward is transformers' full forward too)
    _check(llm, hf_longrope, prompts, reference=hf_cached_forward_greedy)
    assert llm.engine.scheduler.num_preemptions > 0


def _raw(preset: str = "phi3-longrope", **overrides) -> dict:
    architecture, fields = PRESETS[preset]
    return copy.deepcopy({**TINY_BASE, **fields, "vocab_size": TINY_BASE_VOCAB, "architectures": [architecture],
                          "model_type": "phi3", **overrides})


def test_config_fields_are_read_as_transformers_reads_them():
    from transformers import Phi3Config

    config = parse_hf_config(_raw(rope_scaling={**_raw()["rope_scaling"], "type": "su", "rope_type": None,
                                                "original_max_position_embeddings": 4096}))
    assert config.rope_scaling["rope_type"] == "longrope"
    # the top-level original_max_position_embeddings wins over the rope dict's, as in transformers
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    assert config.rotary_dim == 12 and not config.attention_bias and not config.mlp_bias
    # the rope dict's partial_rotary_factor wins over the top-level one, as in transformers
    in_dict = _raw(partial_rotary_factor=0.5, rope_scaling={**_raw()["rope_scaling"], "partial_rotary_factor": 0.75})
    assert parse_hf_config(in_dict).rotary_dim == 12
    bare = parse_hf_config({k: v for k, v in _raw("phi3").items() if k not in ("max_position_embeddings",
                                                                                 "sliding_window")})
    assert bare.max_position_embeddings == Phi3Config().max_position_embeddings
    assert bare.sliding_windows == (None, None) and bare.rope_scaling is None
    assert parse_hf_config(_raw("phi3", sliding_window=512)).sliding_windows == (None, None)  # covers every position
    assert parse_hf_config(_raw("phi3", sliding_window=511)).sliding_windows == (511, 511)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 5, "long_factor": [1.0] * 6}},
     "short_factor must be a list of rotary_dim / 2 = 6 positive numbers"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 6}}, "needs 'long_factor'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [0.0] * 6}},
     "long_factor must be"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"sliding_window": 0}, "sliding_window=0"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor=0.1"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_bad_fields_are_refused_in_one_line(overrides, match):
    with pytest.raises(ModelLoadError, match=match) as info:
        parse_hf_config(_raw(**overrides))
    assert "\n" not in str(info.value)


def test_a_fused_tensor_of_the_wrong_size_is_refused(tmp_path, ops, model_registry):
    from safetensors.torch import load_file, save_file

    from flashllm.models.loader import load_model

    model_dir = build_tiny_model(tmp_path, "phi3", seed=1, tokenizer=False, num_hidden_layers=1)
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"qkv_proj\.weight' has shape \(112, 64\); expected 128"):
        load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)


@pytest.mark.parametrize("qconfig", [
    {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False, "checkpoint_format": "gptq"},
    {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
], ids=["gptq", "awq"])
def test_prequantized_fused_projections_match_their_float_twin(qconfig, tmp_path, ops, model_registry, paged_driver):
    """GPTQ / AWQ Phi-3 checkpoints quantize qkv_proj and gate_up_proj as single linears: their packed tensors
    are cut into q, k, v (gate, up) along the output features, giving the dequantized float weights' logits."""
    import json

    from safetensors.torch import load_file, save_file

    from flashllm.models.layers.linear import LinearBase
    from flashllm.models.loader import load_model
    from flashllm.testing.packed_quant import quantize_linear

    float_dir = build_tiny_model(tmp_path / "float", "phi3", seed=5, tokenizer=False)
    quant, twin = {}, {}
    gen = torch.Generator().manual_seed(0)
    for name, tensor in load_file(float_dir / "model.safetensors").items():
        if not name.endswith((".qkv_proj.weight", ".o_proj.weight", ".gate_up_proj.weight", ".down_proj.weight")):
            quant[name] = twin[name] = tensor
            continue
        order = torch.randperm(tensor.shape[1], generator=gen) if qconfig.get("desc_act") else None
        packed, twin[name] = quantize_linear(tensor, qconfig, order)
        quant.update({f"{name.removesuffix('.weight')}.{key}": value for key, value in packed.items()})
    config = json.loads((float_dir / "config.json").read_text())
    logits = []
    for kind, tensors, extra in (("quant", quant, {"quantization_config": qconfig}), ("twin", twin, {})):
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(tensors, tmp_path / kind / "model.safetensors")
        model, _ = load_model(tmp_path / kind, ops, torch.float32, "cpu", model_registry, progress=False)
        linears = [m for m in model.modules() if isinstance(m, LinearBase)]
        assert all((m.weight is None) == (kind == "quant") for m in linears)
        driver = paged_driver(model, 16, 16)
        logits += driver.step([(driver.add_sequence(), random_tokens(70, TINY_BASE_VOCAB, seed=9))])
    torch.testing.assert_close(logits[0], logits[1], atol=2e-5, rtol=1e-4)
