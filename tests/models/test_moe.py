"""Mixtral, Qwen2-MoE, Qwen3-MoE and GLM-4.5 against transformers' own classes (tiny random fp32 models built here): logits over
the paged cache, greedy tokens and logits through the engine (prefix-cache hits, chunked prefill), the
checkpoint layouts transformers writes, and configs refused at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.layers.moe import FusedMoE, SparseMoeBlock
from flashllm.models.loader import load_model
from flashllm.registry.fusions import DECODER_STACK, LM_HEAD
from flashllm.sampling_params import SamplingParams
from flashllm.testing.loading import load_flashllm
from flashllm.testing.parity import LogitRecorder, assert_logits_close, hf_logits, random_tokens
from flashllm.testing.tiny_moe import MOE_BASE as BASE
from flashllm.testing.tiny_moe import MOE_PRESETS as PRESETS
from flashllm.testing.tiny_moe import build_moe_model

ATOL = 1e-4
STEPS = 32
BLOCK = 16


def tensor_names(model_dir: Path) -> set[str]:
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {p: build_moe_model(tmp_path_factory.mktemp(p), p, seed=3) for p in PRESETS}


@pytest.fixture(scope="module")
def hf_models(moe_dirs):
    from transformers import AutoModelForCausalLM

    return {p: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for p, d in moe_dirs.items()}


@pytest.fixture(scope="module")
def ours(moe_dirs, ops):
    return {p: load_flashllm(d, ops) for p, d in moe_dirs.items()}


def test_the_checkpoints_carry_the_names_real_checkpoints_use(moe_dirs) -> None:
    """What the parity tests load is what Hugging Face checkpoints hold (transformers 5 converts back on save)."""
    mixtral, qwen = tensor_names(moe_dirs["mixtral"]), tensor_names(moe_dirs["qwen2_moe"])
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w1.weight",
            "model.layers.1.block_sparse_moe.experts.3.w3.weight",
            "model.layers.1.block_sparse_moe.experts.3.w2.weight"} <= mixtral
    assert {"model.layers.5.mlp.gate.weight", "model.layers.5.mlp.experts.7.gate_proj.weight",
            "model.layers.5.mlp.experts.7.down_proj.weight", "model.layers.5.mlp.shared_expert.up_proj.weight",
            "model.layers.5.mlp.shared_expert_gate.weight", "model.layers.3.mlp.gate_proj.weight"} <= qwen
    assert not any(name.startswith("model.layers.3.mlp.experts") for name in qwen)  # mlp_only_layers


def test_the_models_build_the_layers_the_config_asks_for(ours) -> None:
    qwen = ours["qwen2_moe"].model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in qwen] == [False, True, False, False, False, True]
    block = qwen[1].mlp
    assert (block.top_k, block.renormalize, block.shared_expert is not None) == (4, False, True)
    assert block.experts.w13_weight.shape == (8, 96, 64) and block.experts.w2_weight.shape == (8, 64, 48)
    mixtral = ours["mixtral"].model.layers[0].mlp
    assert (mixtral.top_k, mixtral.renormalize, mixtral.shared_expert) == (2, True, None)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_paged_forward_matches_transformers(preset, ours, hf_models, paged_driver) -> None:
    """A varlen prefill across block edges, decode steps together, then a prompt in chunks beside a decode."""
    model, theirs = ours[preset], hf_models[preset]
    vocab = model.config.vocab_size
    driver = paged_driver(model, block_size=BLOCK, num_blocks=96, seed=1)
    prompts = [random_tokens(n, vocab, seed=n) for n in (1, 15, 16, 17, 70)]
    seqs = [driver.add_sequence() for _ in prompts]
    outputs = driver.step(list(zip(seqs, prompts, strict=True)))
    for prompt, logits in zip(prompts, outputs, strict=True):
        assert_logits_close(logits, hf_logits(theirs, prompt))
    for _ in range(3):
        for prompt, logits in zip(prompts, outputs, strict=True):
            prompt.append(int(logits[-1].argmax()))
        outputs = driver.step([(seq, [prompt[-1]]) for seq, prompt in zip(seqs, prompts, strict=True)])
        for prompt, logits in zip(prompts, outputs, strict=True):
            assert_logits_close(logits, hf_logits(theirs, prompt)[-1:])
    long_prompt, chunked = random_tokens(90, vocab, seed=7), driver.add_sequence()
    for lo, hi in ((0, 33), (33, 90)):
        prompts[0].append(int(outputs[0][-1].argmax()))
        outputs = driver.step([(chunked, long_prompt[lo:hi]), (seqs[0], prompts[0][-1:])])
        assert_logits_close(outputs[0], hf_logits(theirs, long_prompt[:hi])[lo:hi])
        outputs = outputs[1:]
        assert_logits_close(outputs[0], hf_logits(theirs, prompts[0])[-1:])


def test_transformers_5_stacked_expert_tensors_load_the_same_model(tmp_path, ours, model_registry, ops) -> None:
    """save_original_format=False writes experts.gate_up_proj / experts.down_proj (and Mixtral's `mlp`):
    they load into the same weights as the per-expert tensors."""
    for preset in ("mixtral", "qwen2_moe", "glm4_moe"):
        stacked = build_moe_model(tmp_path / preset, preset, seed=3, original_format=False)
        names = tensor_names(stacked)
        assert any(name.endswith(".experts.gate_up_proj") for name in names)
        assert not any(".experts.0." in name for name in names)
        model, _ = load_model(stacked, ops, torch.float32, "cpu", model_registry, progress=False)
        for (name, ours_param), (_, stacked_param) in zip(ours[preset].state_dict().items(),
                                                          model.state_dict().items(), strict=True):
            torch.testing.assert_close(stacked_param, ours_param, atol=0, rtol=0, msg=name)


def test_moe_models_declare_their_moe_layers_in_the_decoder_stack_fusion(ours) -> None:
    for preset, model in ours.items():
        declared = model.fusions()
        assert LM_HEAD in declared and DECODER_STACK in declared
        sparse = model.config.sparse_layers
        layers = declared[DECODER_STACK].layers
        assert [layer.moe is not None for layer in layers] == list(sparse), preset
        for layer, block in zip(layers, model.model.layers, strict=True):
            if layer.moe is None:
                continue
            assert layer.gate_up_proj is None and layer.down_proj is None
            assert layer.moe.w13.data_ptr() == block.mlp.experts.w13_weight.data_ptr()
            assert (layer.moe.top_k, layer.moe.renormalize) == (block.mlp.top_k, model.config.norm_topk_prob)
            if isinstance(block.mlp, SparseMoeBlock):
                assert (layer.moe.shared_gate is None) == (model.config.shared_expert_intermediate_size == 0)
                assert (layer.moe.scoring, layer.moe.correction_bias) == ("softmax", None)
            else:  # GLM-4.5: DeepSeek-V3's routing, the shared experts added ungated
                assert (layer.moe.scoring, layer.moe.n_group, layer.moe.topk_group) == ("sigmoid", 2, 1)
                assert layer.moe.correction_bias.data_ptr() == block.mlp.gate.e_score_correction_bias.data_ptr()
                assert layer.moe.routed_scaling_factor == 1.5
                assert layer.moe.shared_gate is None and layer.moe.shared_gate_up is not None


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by full forwards (none of transformers' cache code): tokens, last logits."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):], hf_logits(model, ids)


@pytest.mark.parametrize("preset", ["mixtral", "qwen2_moe", "glm4_moe"])
def test_engine_greedy_tokens_and_logits_match_transformers(preset, moe_dirs, hf_models) -> None:
    """The engine on the cpu backend (its fused_moe kernel): 32 greedy tokens as transformers' and every
    logits row within 1e-4, with prompts across block edges, prefill chunks of 48 tokens and prefix-cache hits."""
    llm = LLM(str(moe_dirs[preset]), dtype="float32", device="cpu", block_size=BLOCK, max_model_len=512,
              num_kv_blocks=128, max_num_batched_tokens=48)
    assert llm.engine.parts.model.ops.sources["fused_moe"] == "cpu"
    theirs = hf_models[preset]
    vocab = theirs.config.vocab_size
    prompts = [random_tokens(n, vocab, seed=10 + n) for n in (1, 7, 63, 64, 65, 150)]
    prompts.append(prompts[-1][:96] + random_tokens(5, vocab, seed=99))  # shares 6 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    llm.generate(prompts[-2:-1], params)  # caches the shared blocks
    recorder = LogitRecorder(llm)
    outputs = llm.generate(prompts, params)
    assert outputs[-1].metrics.num_cached_tokens >= 96 and outputs[-2].metrics.num_cached_tokens >= 96
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logits = hf_greedy(theirs, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        full = prompt + tokens
        rows = [(ctx, row) for ctx, row in recorder.rows if ctx == full[: len(ctx)] and len(ctx) >= len(prompt)]
        assert len(rows) >= STEPS
        for ctx, row in rows:
            torch.testing.assert_close(row, logits[len(ctx) - 1], atol=ATOL, rtol=0)


def _raw(preset: str, **changes) -> dict:
    model_type, architecture, fields = PRESETS[preset]
    return {"architectures": [architecture], "model_type": model_type, **BASE, **fields, **changes}


@pytest.mark.parametrize("preset, changes, fragment", [
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_local_experts=4"),
    ("qwen2_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts=0 must be a positive int"),
    ("qwen2_moe", {"moe_intermediate_size": -4}, "moe_intermediate_size=-4 must be a positive int"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a positive int"),
    ("qwen2_moe", {"mlp_only_layers": [6]}, "mlp_only_layers=[6] must be a list of layer indices in 0..5"),
    ("qwen2_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob='yes' must be true or false"),
    ("qwen3_moe", {"attention_bias": "yes"}, "attention_bias='yes' must be true or false"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window=true without a layer_types list"),
    ("qwen2_moe", {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}},
     "group_size=32 does not divide moe_intermediate_size=48"),
])
def test_bad_moe_configs_are_refused_in_one_line_naming_the_field(preset, changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment.replace("[", r"\[").replace("]", r"\]")) as info:
        parse_hf_config(_raw(preset, **changes))
    assert "\n" not in str(info.value)


def test_parsed_configs_follow_transformers_defaults_and_layer_rules() -> None:
    qwen = parse_hf_config(_raw("qwen2_moe"))
    assert qwen.sparse_layers == (False, True, False, False, False, True)
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.norm_topk_prob, qwen.qkv_bias) == (8, 4, False, True)
    mixtral = parse_hf_config({k: v for k, v in _raw("mixtral").items()
                               if k not in ("num_local_experts", "num_experts_per_tok")})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (8, 2, True)
    assert mixtral.moe_intermediate_size == 96 and mixtral.qkv_bias is False
    # Qwen3-MoE: transformers' defaults where absent, never a shared expert, attention_bias on q, k, v and o
    bare = {k: v for k, v in _raw("qwen3_moe").items()
            if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")}
    qwen3 = parse_hf_config(bare)
    assert (qwen3.num_experts, qwen3.num_experts_per_tok, qwen3.moe_intermediate_size, qwen3.norm_topk_prob) == (
        128, 8, 768, False)
    assert qwen3.shared_expert_intermediate_size == 0 and qwen3.qk_norm and qwen3.qkv_bias is False
    assert qwen3.sparse_layers == (True, False, True) and qwen3.head_dim == 24
    biased = parse_hf_config({k: v for k, v in _raw("qwen3_moe", attention_bias=True, num_local_experts=6).items()
                              if k != "num_experts"})
    assert biased.qkv_bias is True and biased.num_experts == 6  # transformers 5 writes num_local_experts


def test_qwen3_moe_biases_both_projections_with_attention_bias(tmp_path, ops, paged_driver) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = build_moe_model(tmp_path, "qwen3_moe", seed=5, attention_bias=True)
    ours = load_flashllm(model_dir, ops)
    attn = ours.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = random_tokens(40, 256, seed=2)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=16, seed=2)
    (logits,) = driver.step([(driver.add_sequence(), tokens)])
    assert_logits_close(logits, hf_logits(theirs, tokens))


def test_a_missing_or_extra_expert_is_refused_at_load(tmp_path, moe_dirs, model_registry, ops) -> None:
    from safetensors.torch import load_file, save_file

    source = moe_dirs["mixtral"]
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    for name, edit in (("missing", lambda t: t.pop("model.layers.0.block_sparse_moe.experts.2.w3.weight")),
                       ("extra", lambda t: t.__setitem__("model.layers.0.block_sparse_moe.experts.4.w1.weight",
                                                         torch.zeros(96, 64)))):
        broken = dict(tensors)
        edit(broken)
        (tmp_path / name).mkdir()
        save_file(broken, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        fragment = "missing 1 tensor" if name == "missing" else "expert 4 is past the config's 4 experts"
        with pytest.raises(ModelLoadError, match=fragment):
            load_model(tmp_path / name, ops, torch.float32, "cpu", model_registry, progress=False)


def test_fused_moe_layers_are_what_the_experts_load_into(ours) -> None:
    experts = [m for m in ours["qwen2_moe"].modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and all(m.fully_loaded() == {"w13_weight", "w2_weight"} for m in experts)


def test_a_decode_token_streams_only_the_experts_it_is_routed_to(ours) -> None:
    from flashllm.models.weight_bytes import weight_bytes

    model = ours["qwen2_moe"]  # two MoE layers routing each token to 4 of 8 experts; an untied head
    counted = weight_bytes(model)
    experts = sum(m.experts.w13_weight.nbytes + m.experts.w2_weight.nbytes
                  for m in model.modules() if isinstance(m, SparseMoeBlock))
    assert counted.total - counted.streamed == model.model.embed_tokens.weight.nbytes + experts // 2


def test_the_moe_bench_shape_fits_8_gb_in_fp32_and_counts_the_active_experts(tmp_path, model_registry, ops) -> None:
    from flashllm.bench.shapes import _COMMON, SHAPES, flops_per_token
    from flashllm.testing.tiny_models import build_random_model_from_config

    shape = {**_COMMON, **SHAPES["qwen1.5-moe-scaled"]}
    assert parse_hf_config(shape).num_parameters * 4 < 8e9
    h, experts, top_k, inter, shared = 64, 6, 4, 32, 64  # the shape's routing, scaled down to build here
    small = {**shape, "hidden_size": h, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96,
             "num_hidden_layers": 2, "vocab_size": 256, "num_experts": experts, "num_experts_per_tok": top_k,
             "moe_intermediate_size": inter, "shared_expert_intermediate_size": shared}
    model_dir = build_random_model_from_config(tmp_path, small)
    model, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    per_layer = 4 * h * h + h * (experts + 3 * top_k * inter + 3 * shared)  # attention, router, k experts, shared
    assert flops_per_token(model_dir, 0) == 2.0 * (2 * per_layer + 256 * h)
    # transformers' batch-1 ceiling counts the same active weights; counted another way, from the loaded
    # tensors: what a step streams (the reference backend keeps no greedy-head copy), less the norms,
    # the qkv biases and the shared expert's one-column gate, which the matmul count leaves out
    from flashllm.bench.shapes import active_parameter_bytes
    from flashllm.models.weight_bytes import weight_bytes

    small = sum(p.nbytes for name, p in model.named_parameters() if any(s in name for s in ("norm", "bias", "expert_gate")))
    assert active_parameter_bytes(model_dir, 4) == 4 * (2 * per_layer + 256 * h) == weight_bytes(model).streamed - small


def test_two_tensor_parallel_ranks_give_transformers_greedy_tokens(moe_dirs, hf_models) -> None:
    """Each rank holds every expert's slice of the intermediate features (and of the shared expert and
    dense MLPs); the partial outputs are all-reduced over gloo."""
    theirs = hf_models["qwen2_moe"]
    prompts = [random_tokens(n, theirs.config.vocab_size, seed=30 + n) for n in (5, 40)]
    llm = LLM(str(moe_dirs["qwen2_moe"]), device="cpu", dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="mp", block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=16)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finally:
        llm.engine.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(theirs, prompt, 8)[0]


def test_w8a16_experts_are_int8_codes_whose_dequantized_weights_the_kernel_multiplies_by(moe_dirs, ours,
                                                                                          model_registry, ops) -> None:
    from flashllm.ops.fused_moe import fused_moe
    from flashllm.quant.spec import WeightQuantSpec

    quantized, _ = load_model(moe_dirs["qwen2_moe"], ops, torch.float32, "cpu", model_registry, progress=False,
                              quant=WeightQuantSpec("w8a16"))
    experts, floats = quantized.model.layers[1].mlp.experts, ours["qwen2_moe"].model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.int8 and experts.w13_scale.shape == (8, 96)
    assert experts.w2_weight.dtype == torch.int8 and experts.w2_scale.shape == (8, 64)
    for codes, scales, weight in ((experts.w13_weight, experts.w13_scale, floats.w13_weight),
                                  (experts.w2_weight, experts.w2_scale, floats.w2_weight)):
        dequantized = codes.float() * scales[..., None]
        assert bool(((dequantized - weight).abs() <= scales[..., None] * 0.5001).all())  # round to nearest
        assert bool((codes.abs().amax(dim=-1) == 127).all())  # each row's largest weight sets its scale
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = torch.softmax(torch.randn(6, 8, generator=torch.Generator().manual_seed(1)), -1).topk(4, -1)
    expected = fused_moe(x, experts.w13_weight.float() * experts.w13_scale[..., None],
                         experts.w2_weight.float() * experts.w2_scale[..., None], weights, ids)
    torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-5, rtol=1e-5)


def test_w8a16_experts_give_the_same_greedy_tokens_on_the_cpu_kernel_and_the_reference(moe_dirs) -> None:
    prompts = [random_tokens(n, 256, seed=40 + n) for n in (3, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "reference"):
        llm = LLM(str(moe_dirs["qwen2_moe"]), dtype="float32", device="cpu", backend=backend, block_size=BLOCK,
                  max_model_len=256, num_kv_blocks=64, quant_type="weight_only_int8")
        model = llm.engine.parts.model
        assert model.ops.sources["fused_moe"] == backend
        assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.int8
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["cpu"] == tokens["reference"]


@pytest.mark.parametrize("quant_type", ["weight_only_int8", "weight_only_int4"])
def test_integer_experts_on_two_tensor_parallel_ranks_give_one_rank_s_tokens_and_logprobs(moe_dirs, quant_type,
                                                                                          monkeypatch,
                                                                                          exact_w8_products) -> None:
    """w2's rows are split over the ranks' intermediate features: each rank's per-row scales come from
    the whole row's extreme (all-reduced), so two ranks quantize, and decode, as one does."""
    # the cpu int4 linear layers' default int8 activations are blocks a row-parallel split cuts differently;
    # the int8 attention and shared-expert layers' prompt products round activations to bf16 on AVX512-BF16
    # CPUs, which turns the all-reduce's order into rounding-sized steps (exact_w8_products keeps them fp32)
    monkeypatch.setenv("FLASHLLM_CPU_INT4_ACTIVATIONS", "fp32")
    prompts = [random_tokens(n, 256, seed=50 + n) for n in (6, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = []
    for tp in (1, 2):
        llm = LLM(str(moe_dirs["qwen2_moe"]), device="cpu", dtype="float32", tensor_parallel_size=tp,
                  distributed_executor_backend="mp" if tp > 1 else None, block_size=BLOCK, num_kv_blocks=64,
                  quant_type=quant_type)
        try:
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
        finally:
            llm.engine.shutdown()
    for (tokens1, logprobs1), (tokens2, logprobs2) in zip(*runs, strict=True):
        assert tokens2 == tokens1
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-4


def test_experts_left_in_float_under_another_scheme_say_so(moe_dirs, model_registry, ops, caplog,
                                                           monkeypatch) -> None:
    from flashllm.models.layers import moe
    from flashllm.quant.spec import WeightQuantSpec

    monkeypatch.setattr(moe, "_WARNED", set())  # once per process: start this test from none warned
    with caplog.at_level("WARNING", logger="flashllm.models.layers.moe"):
        model, _ = load_model(moe_dirs["mixtral"], ops, torch.float32, "cpu", model_registry, progress=False,
                              quant=WeightQuantSpec("a8w8"))
    assert model.model.layers[0].mlp.experts.w13_weight.dtype == torch.float32
    assert [r.getMessage() for r in caplog.records if "MoE experts stay" in r.getMessage()] == [
        "MoE experts stay in torch.float32 under a8w8: flashllm quantizes experts as w8a16 or symmetric w4a16 only"]


def test_w4a16_experts_are_packed_int4_codes_in_groups_whose_dequantized_weights_the_kernel_uses(
        moe_dirs, ours, model_registry, ops) -> None:
    from flashllm.ops.fused_moe import expert_weight, fused_moe
    from flashllm.ops.quant_matmul import unpack_int4
    from flashllm.quant.spec import WeightQuantSpec

    quantized, _ = load_model(moe_dirs["qwen2_moe"], ops, torch.float32, "cpu", model_registry, progress=False,
                              quant=WeightQuantSpec("w4a16", 16))
    experts, floats = quantized.model.layers[1].mlp.experts, ours["qwen2_moe"].model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.uint8 and experts.w13_weight.shape == (8, 96, 32)
    assert experts.w13_scale.shape == (8, 96, 4) and experts.w2_scale.shape == (8, 64, 3)  # groups of 16
    for codes, scales, weight in ((experts.w13_weight, experts.w13_scale, floats.w13_weight),
                                  (experts.w2_weight, experts.w2_scale, floats.w2_weight)):
        dequantized = torch.stack([expert_weight(codes, scales, e) for e in range(8)])
        step = scales.repeat_interleave(16, dim=-1)
        assert bool(((dequantized - weight).abs() <= step * 0.5001).all())  # round to nearest, per group
        signed = unpack_int4(codes).int() - 8
        assert bool((signed.abs().reshape(*scales.shape, 16).amax(dim=-1) == 7).all())  # each group's extreme
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = torch.softmax(torch.randn(6, 8, generator=torch.Generator().manual_seed(1)), -1).topk(4, -1)
    expected = fused_moe(x, torch.stack([expert_weight(experts.w13_weight, experts.w13_scale, e) for e in range(8)]),
                         torch.stack([expert_weight(experts.w2_weight, experts.w2_scale, e) for e in range(8)]),
                         weights, ids)
    torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-5, rtol=1e-5)
