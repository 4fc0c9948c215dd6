"""DeepSeek-V2 / V3 against transformers' own classes (tiny random fp32 models built here): MLA logits over the
paged latent cache in both the absorbed and the naive form, greedy tokens and logits through the engine
(chunked prefill, prefix-cache hits) on the reference and cpu backends, the latent cache's size, configs refused."""

from __future__ import annotations

import pytest
import torch

from flashllm.llm import LLM
from flashllm.models.deepseek_moe import DeepseekMoE
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.sampling_params import SamplingParams
from flashllm.testing.deepseek import PRESETS, build_deepseek_model, raw_config
from flashllm.testing.loading import load_flashllm
from flashllm.testing.parity import LogitRecorder, assert_logits_close, hf_logits, random_tokens

ATOL = 1e-4
STEPS = 32
BLOCK = 16


@pytest.fixture(scope="module")
def ds_dirs(tmp_path_factory: pytest.TempPathFactory):
    return {p: build_deepseek_model(tmp_path_factory.mktemp(p), p, seed=5) for p in PRESETS}


@pytest.fixture(scope="module")
def hf_models(ds_dirs):
    from transformers import AutoModelForCausalLM

    return {p: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for p, d in ds_dirs.items()}


@pytest.fixture(scope="module")
def ours(ds_dirs, ops):
    return {p: load_flashllm(d, ops) for p, d in ds_dirs.items()}


def test_the_models_build_the_layers_the_config_asks_for(ours) -> None:
    v3 = ours["v3"]
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in v3.model.layers] == [False, True, True]
    assert v3.model.layers[1].mlp.gate.e_score_correction_bias is not None
    assert ours["v2"].model.layers[1].mlp.gate.e_score_correction_bias is None
    assert hasattr(ours["v2_lite"].model.layers[0].self_attn, "q_proj")  # q_lora_rank null: no bottleneck
    assert not hasattr(ours["v2"].model.layers[0].self_attn, "q_proj")
    assert v3.kv_cache_shape() == (3, 1, 32 + 8)  # kv_lora_rank + qk_rope_head_dim, one "head"
    assert v3.kv_caches_per_layer == 1
    lite = ours["glm4_moe_lite"]  # mlp_layer_types' two dense layers, then MoE with the choice bias
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in lite.model.layers] == [False, False, True, True]
    assert lite.model.layers[2].mlp.gate.e_score_correction_bias is not None


def test_a_glm_4_7_flash_config_takes_transformers_defaults_for_what_it_leaves_out() -> None:
    """Glm4MoeLiteConfig's own defaults (not DeepSeek's) for the sizes and routing a config.json leaves out, one
    dense layer before the MoE ones when it names no mlp_layer_types; compared with transformers' parsed config."""
    from transformers import AutoConfig

    left_out = ("q_lora_rank", "qk_nope_head_dim", "v_head_dim", "max_position_embeddings", "rms_norm_eps",
                "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "routed_scaling_factor",
                "mlp_layer_types", "n_group", "topk_group", "n_shared_experts", "kv_lora_rank", "qk_rope_head_dim")
    raw = {k: v for k, v in raw_config("glm4_moe_lite").items() if k not in left_out}
    theirs = AutoConfig.for_model(**raw)
    ours = parse_hf_config(raw)
    for field in (f for f in left_out if f != "mlp_layer_types"):
        assert getattr(ours, field) == pytest.approx(getattr(theirs, field)), field
    assert ours.first_k_dense_replace == theirs.mlp_layer_types.index("sparse") == 1


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "naive"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_paged_forward_matches_transformers(preset, absorbed, ours, hf_models, paged_driver) -> None:
    """A varlen prefill across block edges, decode steps together, then a prompt in chunks beside a decode."""
    model, theirs = ours[preset], hf_models[preset]
    model.set_matrix_absorption(absorbed)
    try:
        vocab = model.config.vocab_size
        driver = paged_driver(model, block_size=BLOCK, num_blocks=64, seed=1)
        prompts = [random_tokens(n, vocab, seed=n) for n in (1, 16, 17, 50)]
        seqs = [driver.add_sequence() for _ in prompts]
        outputs = driver.step(list(zip(seqs, prompts, strict=True)))
        for prompt, logits in zip(prompts, outputs, strict=True):
            assert_logits_close(logits, hf_logits(theirs, prompt))
        for _ in range(2):
            for prompt, logits in zip(prompts, outputs, strict=True):
                prompt.append(int(logits[-1].argmax()))
            outputs = driver.step([(seq, [prompt[-1]]) for seq, prompt in zip(seqs, prompts, strict=True)])
            for prompt, logits in zip(prompts, outputs, strict=True):
                assert_logits_close(logits, hf_logits(theirs, prompt)[-1:])
        long_prompt, chunked = random_tokens(70, vocab, seed=7), driver.add_sequence()
        for lo, hi in ((0, 33), (33, 70)):
            prompts[0].append(int(outputs[0][-1].argmax()))
            outputs = driver.step([(chunked, long_prompt[lo:hi]), (seqs[0], prompts[0][-1:])])
            assert_logits_close(outputs[0], hf_logits(theirs, long_prompt[:hi])[lo:hi])
            outputs = outputs[1:]
            assert_logits_close(outputs[0], hf_logits(theirs, prompts[0])[-1:])
    finally:
        model.set_matrix_absorption(True)


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by full forwards (none of transformers' cache code): tokens, last logits."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):], hf_logits(model, ids)


@pytest.mark.parametrize("preset, backend, absorbed", [
    ("v3", "cpu", True), ("v2_lite", "reference", False), ("glm4_moe_lite", "cpu", True),
    pytest.param("v2", "cpu", False, marks=pytest.mark.slow), pytest.param("v3", "reference", True, marks=pytest.mark.slow),
    pytest.param("v3_neox", "cpu", False, marks=pytest.mark.slow),
])
def test_engine_greedy_tokens_and_logits_match_transformers(preset, backend, absorbed, ds_dirs, hf_models) -> None:
    """32 greedy tokens as transformers' and every logits row within 1e-4, with prompts across block edges,
    prefill chunks of 48 tokens and prefix-cache hits."""
    llm = LLM(str(ds_dirs[preset]), dtype="float32", device="cpu", backend=backend, block_size=BLOCK,
              max_model_len=256, num_kv_blocks=96, max_num_batched_tokens=48, mla_use_matrix_absorption=absorbed)
    model = llm.engine.parts.model
    assert model.ops.sources["latent_attention"] == backend
    assert model.model.layers[0].self_attn.absorbed is absorbed
    theirs = hf_models[preset]
    prompts = [random_tokens(n, 256, seed=10 + n) for n in (1, 15, 16, 17, 100)]
    prompts.append(prompts[-1][:64] + random_tokens(5, 256, seed=99))  # shares 4 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    llm.generate(prompts[-2:-1], params)  # caches the shared blocks
    recorder = LogitRecorder(llm)
    outputs = llm.generate(prompts, params)
    assert outputs[-1].metrics.num_cached_tokens >= 64
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logits = hf_greedy(theirs, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        full = prompt + tokens
        rows = [(ctx, row) for ctx, row in recorder.rows if ctx == full[: len(ctx)] and len(ctx) >= len(prompt)]
        assert len(rows) >= STEPS
        for ctx, row in rows:
            torch.testing.assert_close(row, logits[len(ctx) - 1], atol=ATOL, rtol=0)


def test_the_latent_cache_is_sized_by_latent_bytes_per_token(ds_dirs) -> None:
    """--kv-cache-memory buys (kv_lora_rank + qk_rope_head_dim) fp32 values per token and layer, one tensor a layer."""
    layers, width = 3, 32 + 8
    per_block = layers * BLOCK * width * 4  # one latent row per token; no separate K and V
    budget = 37 * per_block + per_block // 2
    llm = LLM(str(ds_dirs["v3"]), dtype="float32", device="cpu", block_size=BLOCK, max_model_len=256,
              kv_cache_memory=budget)
    assert llm.engine.parts.num_blocks == 37
    caches = llm.engine.runner.kv_caches
    assert len(caches) == layers and all(len(layer) == 1 for layer in caches)
    assert tuple(caches[0][0].shape) == (37, BLOCK, 1, width)
    assert llm.engine.runner.kv_cache_bytes() == 37 * per_block


def test_a_quantized_kv_cache_is_refused_for_the_latent_cache(ds_dirs) -> None:
    from flashllm.core.builder import EngineConfigError

    with pytest.raises(EngineConfigError, match="one latent cache per layer"):
        LLM(str(ds_dirs["v2"]), dtype="float32", device="cpu", block_size=BLOCK, max_model_len=256,
            num_kv_blocks=32, kv_cache_dtype="int8")


@pytest.mark.parametrize("preset, changes, fragment", [
    ("v2", {"num_key_value_heads": 2}, "num_key_value_heads=2 differs from num_attention_heads=4"),
    ("v2", {"norm_topk_prob": True}, "norm_topk_prob=true for DeepseekV2ForCausalLM"),
    ("v2", {"n_group": 3}, "n_group=3, topk_group=2 do not fit n_routed_experts=8"),
    ("v3", {"n_group": 8}, "n_group=8, topk_group=2 do not fit"),  # V3 needs two experts a group
    ("v3", {"topk_method": "greedy"}, "topk_method='greedy' with scoring_func='sigmoid'"),
    ("v2", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid' is not what DeepseekV2ForCausalLM routes by"),
    ("v2", {"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even"),
    ("v2", {"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ("v3", {"first_k_dense_replace": 9}, "first_k_dense_replace=9 must be an int in 0..3"),
    ("v2", {"moe_intermediate_size": 0}, "moe_intermediate_size=0 must be a positive int"),
    ("v3", {"routed_scaling_factor": -1.0}, "routed_scaling_factor=-1.0 must be a finite positive number"),
    ("v2", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    ("v3", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config=.* is not supported"),
    ("glm4_moe_lite", {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
     "expected 4 entries, 'dense' ones followed by 'sparse' ones"),
    ("glm4_moe_lite", {"first_k_dense_replace": 1}, "first_k_dense_replace=1 but mlp_layer_types makes 2 layer"),
    ("glm4_moe_lite", {"partial_rotary_factor": 0.5}, "partial_rotary_factor turns 4 of qk_rope_head_dim=8"),
])
def test_bad_configs_are_refused_in_one_line_naming_the_field(preset, changes, fragment) -> None:
    with pytest.raises(ModelLoadError, match=fragment) as info:
        parse_hf_config(raw_config(preset, **changes))
    assert "\n" not in str(info.value)


def test_softmax_scale_carries_yarn_s_mscale_squared() -> None:
    """(Dn + R)^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2, as DeepSeek's YaRN corrects the softmax."""
    import math

    config = parse_hf_config(raw_config("v3"))
    mscale = 0.1 * 0.8 * math.log(4.0) + 1.0
    assert config.softmax_scale == pytest.approx((16 + 8) ** -0.5 * mscale**2, rel=1e-12)
    assert parse_hf_config(raw_config("v2_lite")).softmax_scale == pytest.approx((16 + 8) ** -0.5, rel=1e-12)


def test_a_decode_token_streams_only_the_experts_it_is_routed_to(ours) -> None:
    from flashllm.models.weight_bytes import weight_bytes

    model = ours["v3"]  # two MoE layers routing each token to 2 of 8 experts; an untied head
    counted = weight_bytes(model)
    experts = sum(m.experts.w13_weight.nbytes + m.experts.w2_weight.nbytes
                  for m in model.modules() if isinstance(m, DeepseekMoE))
    assert counted.total - counted.streamed == model.model.embed_tokens.weight.nbytes + experts * 6 // 8


def test_two_tensor_parallel_ranks_give_transformers_greedy_tokens(ds_dirs, hf_models) -> None:
    """MLA heads split over the ranks (q_b_proj / kv_b_proj by head, o_proj by input), the latent cache whole on
    each rank; every rank holds every expert's slice of the intermediate features; partial sums all-reduced
    over gloo."""
    theirs = hf_models["v3"]
    prompts = [random_tokens(n, 256, seed=30 + n) for n in (5, 40)]
    llm = LLM(str(ds_dirs["v3"]), device="cpu", dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="mp", block_size=BLOCK, num_kv_blocks=32, max_num_batched_tokens=16)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finally:
        llm.engine.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(theirs, prompt, 8)[0]


def test_the_bench_shape_fits_8_gb_in_fp32_and_its_random_checkpoint_loads(tmp_path, model_registry, ops) -> None:
    from flashllm.bench.shapes import _COMMON, SHAPES, flops_per_token
    from flashllm.models.loader import load_model
    from flashllm.testing.tiny_models import build_random_model_from_config

    shape = {**_COMMON, **SHAPES["deepseek-v2-lite-scaled"]}
    assert parse_hf_config(shape).num_parameters * 4 < 8e9
    small = {**shape, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 256,
             "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "moe_intermediate_size": 32}
    model_dir = build_random_model_from_config(tmp_path, small)
    model, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert isinstance(model.model.layers[1].mlp, DeepseekMoE) and not isinstance(model.model.layers[0].mlp, DeepseekMoE)
    # per layer: q_proj, kv_a, o_proj; layer 0 dense, layer 1 router + 6 routed + 2 shared experts; the head;
    # absorbed attention at context 10: W_UK and W_UV per head, then 10 x (L + R + L) per head
    attn = 64 * 4 * 24 + 64 * 40 + 4 * 16 * 64
    params = 2 * attn + 3 * 64 * 96 + 64 * 8 + 3 * 64 * 32 * 8 + 256 * 64
    assert flops_per_token(model_dir, 10) == 2.0 * (params + 2 * (4 * 32 * 32 + 4 * (40 + 32) * 10))
