"""First-generation Qwen (QWenLMHeadModel) from its own checkpoint names: parity with transformers'
Qwen2 on the same weights renamed, and logn attention / dynamic NTK / partial rotary / biases
against a naive QWen forward written here from the published architecture."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from flashllm.core.builder import EngineConfigError
from flashllm.llm import LLM
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.loader import load_model
from flashllm.registry.fusions import DECODER_STACK
from flashllm.sampling_params import SamplingParams
from flashllm.testing.first_generation import qwen_tensors
from flashllm.testing.packed_quant import quantize_linear
from flashllm.testing.parity import assert_logits_close, assert_rows_match, hf_greedy, hf_logits, random_tokens
from flashllm.testing.parity import record_logits as _record_logits

VOCAB, HIDDEN, HEADS, LAYERS, MLP = 256, 64, 4, 2, 96  # MLP: each of w1 / w2 (QWen's intermediate_size // 2)
BLOCK, STEPS, ATOL = 16, 32, 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


def qwen_config(**overrides) -> dict:
    """A QWen config.json as the published checkpoints write it (auto_map included, and ignored)."""
    return {"architectures": ["QWenLMHeadModel"], "model_type": "qwen",
            "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                         "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
            "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
            "intermediate_size": 2 * MLP, "kv_channels": HIDDEN // HEADS, "layer_norm_epsilon": 1e-6,
            "rotary_emb_base": 10000, "rotary_pct": 1.0, "seq_length": 512, "max_position_embeddings": 512,
            "use_dynamic_ntk": False, "use_logn_attn": False, "vocab_size": VOCAB, "no_bias": True,
            "tie_word_embeddings": False, "bf16": False, "fp16": False, "fp32": False, **overrides}


def write_qwen_dir(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def qwen_tensors_from_qwen2(model) -> dict[str, torch.Tensor]:
    """transformers Qwen2 weights under QWen's names (flashllm.testing.first_generation.qwen_tensors)."""
    return qwen_tensors({k: v.detach().clone() for k, v in model.state_dict().items()}, LAYERS)


def random_qwen_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of every tensor a QWen checkpoint of `config` holds (biases when no_bias is false)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, mlp = config["hidden_size"], config["intermediate_size"] // 2

    def rand(*shape, norm=False):
        return torch.randn(shape, generator=gen) * 0.1 + (1.0 if norm else 0.0)

    out = {"transformer.wte.weight": rand(config["vocab_size"], hidden),
           "transformer.ln_f.weight": rand(hidden, norm=True), "lm_head.weight": rand(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        out.update({p + "ln_1.weight": rand(hidden, norm=True), p + "ln_2.weight": rand(hidden, norm=True),
                    p + "attn.c_attn.weight": rand(3 * hidden, hidden), p + "attn.c_attn.bias": rand(3 * hidden),
                    p + "attn.c_proj.weight": rand(hidden, hidden), p + "mlp.w1.weight": rand(mlp, hidden),
                    p + "mlp.w2.weight": rand(mlp, hidden), p + "mlp.c_proj.weight": rand(hidden, mlp)})
        if not config["no_bias"]:
            out.update({p + "attn.c_proj.bias": rand(hidden), p + "mlp.w1.bias": rand(mlp),
                        p + "mlp.w2.bias": rand(mlp), p + "mlp.c_proj.bias": rand(hidden)})
    return out


def ntk_alpha(length: int, seq_length: int) -> float:
    """modeling_qwen.py's get_ntk_alpha: the RoPE base factor for a prompt of `length` tokens."""
    return max(2 ** math.ceil(math.log(length / seq_length, 2) + 1) - 1, 1)


def naive_qwen_logits(tensors: dict[str, torch.Tensor], config: dict, tokens: list[int],
                      prompt_len: int | None = None) -> torch.Tensor:
    """(len(tokens), V) logits of QWen's forward over the whole sequence, in float64, from the
    checkpoint tensors: RMSNorm, c_attn, neox RoPE over rotary_pct of the head (dynamic NTK: the
    base from `prompt_len`, default the whole sequence, as QWen's prefill picks it and its cached
    decode keeps it), logn query scaling past seq_length, causal softmax, c_proj, then
    c_proj(w1(x) * silu(w2(x)))."""
    t = {k: v.double() for k, v in tensors.items()}
    n, hidden, heads = len(tokens), config["hidden_size"], config["num_attention_heads"]
    dim, seq_length, eps = hidden // heads, config["seq_length"], config["layer_norm_epsilon"]
    rot = int(dim * config["rotary_pct"])
    alpha = ntk_alpha(prompt_len or n, seq_length) if config["use_dynamic_ntk"] else 1.0
    base = config["rotary_emb_base"] * alpha ** (rot / (rot - 2))
    angles = torch.arange(n, dtype=torch.float64)[:, None] / base ** (torch.arange(0, rot, 2).double() / rot)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1)[:, None] for f in (torch.cos, torch.sin))  # (n, 1, rot)
    logn = torch.tensor([math.log(i, seq_length) if config["use_logn_attn"] and i > seq_length else 1.0
                         for i in range(1, n + 1)], dtype=torch.float64)

    def rope(x):
        r, rest = x[..., :rot], x[..., rot:]
        half = torch.cat([-r[..., rot // 2:], r[..., :rot // 2]], dim=-1)
        return torch.cat([r * cos + half * sin, rest], dim=-1)

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * t[name + ".weight"]

    def linear(x, name):
        return x @ t[name + ".weight"].T + t.get(name + ".bias", 0.0)

    x = t["transformer.wte.weight"][torch.tensor(tokens)]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(config["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        q, k, v = (z.reshape(n, heads, dim) for z in linear(norm(x, p + "ln_1"), p + "attn.c_attn").split(hidden, -1))
        q, k = rope(q) * logn[:, None, None], rope(k)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + linear(torch.einsum("hqk,khd->qhd", probs, v).reshape(n, hidden), p + "attn.c_proj")
        h = norm(x, p + "ln_2")
        x = x + linear(linear(h, p + "mlp.w1") * F.silu(linear(h, p + "mlp.w2")), p + "mlp.c_proj")
    return linear(norm(x, "transformer.ln_f"), "lm_head")


# ---------------------------------------------------------------- parity with transformers' Qwen2


@pytest.fixture(scope="module")
def qwen2_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def qwen1_dir(tmp_path_factory, qwen2_model) -> Path:
    return write_qwen_dir(tmp_path_factory.mktemp("qwen1"), qwen_tensors_from_qwen2(qwen2_model), qwen_config())


def test_qwen_names_load_and_the_fused_decoder_stack_is_declared(qwen1_dir, ops, model_registry):
    model, config = load_model(qwen1_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert (config.architecture, config.intermediate_size, config.head_dim) == ("QWenLMHeadModel", MLP, HIDDEN // HEADS)
    assert model.kv_cache_shape() == (LAYERS, HEADS, HIDDEN // HEADS)
    assert DECODER_STACK in model.fusions()  # the plain architecture keeps the cpu fast paths


def test_prefill_over_blocks_matches_qwen2(qwen1_dir, qwen2_model, ops, model_registry, paged_driver):
    ours, _ = load_model(qwen1_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    driver = paged_driver(ours, block_size=BLOCK, num_blocks=64, seed=1)
    prompts = [random_tokens(n, VOCAB, seed=n) for n in (1, 7, 15, 16, 17, 63, 64, 65, 200)]
    for prompt, logits in zip(prompts, driver.step([(driver.add_sequence(), p) for p in prompts]), strict=True):
        assert_logits_close(logits, hf_logits(qwen2_model, prompt), ATOL)


def _llm(model_dir: Path, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, max_model_len=512, num_kv_blocks=128)
    return LLM(str(model_dir), **{**options, **kw})


def test_engine_greedy_tokens_and_logits_match_qwen2_with_chunked_prefill(qwen1_dir, qwen2_model):
    llm = _llm(qwen1_dir, max_num_batched_tokens=48)
    rows = _record_logits(llm)
    prompts = [random_tokens(n, VOCAB, seed=40 + n) for n in (1, 7, 63, 64, 65, 200)]
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        tokens, final = hf_greedy(qwen2_model, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert_rows_match(rows, prompt, tokens, final, STEPS, atol=ATOL)


def test_prefix_cache_hits_give_qwen2_tokens(qwen1_dir, qwen2_model):
    llm = _llm(qwen1_dir)
    shared = random_tokens(100, VOCAB, seed=50)
    prompts = [shared + random_tokens(n, VOCAB, seed=51 + n) for n in (3, 40)]
    llm.generate(prompts[:1], GREEDY)
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.metrics.num_cached_tokens >= 96 for o in outputs)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(qwen2_model, prompt, STEPS)[0]


def test_two_tensor_parallel_ranks_split_c_attn_and_give_qwen2s_tokens(qwen1_dir, qwen2_model):
    """Each rank narrows its q, k and v heads out of the fused c_attn rows (and halves of w1, w2)."""
    llm = _llm(qwen1_dir, tensor_parallel_size=2, distributed_executor_backend="mp", num_kv_blocks=32)
    try:  # the engine leaves this process's group when shut down: a later tensor-parallel test can join one
        assert llm.engine.parts.model.model.layers[0].self_attn.num_heads == HEADS // 2  # this rank's half
        prompts = [random_tokens(n, VOCAB, seed=70 + n) for n in (5, 40)]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
            assert output.outputs[0].token_ids == hf_greedy(qwen2_model, prompt, STEPS)[0][:8]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(("quant_type", "group_size", "max_rel"), [("weight_only_int8", -1, 0.05), ("w4a16", 32, 0.45)])
def test_weight_quantization_applies_to_the_qwen_layers(qwen1_dir, paged_driver, quant_type, group_size, max_rel):
    """--quant_type quantizes the layers c_attn, c_proj, w1, w2 and mlp.c_proj load into (the float
    logits are the reference; bounds as the Llama precision tests use)."""
    prompt = random_tokens(64, VOCAB, seed=60)

    def logits(llm: LLM) -> torch.Tensor:
        driver = paged_driver(llm.engine.parts.model, BLOCK, 8)
        return driver.step([(driver.add_sequence(), prompt)])[0]

    reference = logits(_llm(qwen1_dir, num_kv_blocks=32))
    llm = _llm(qwen1_dir, num_kv_blocks=32, quant_type=quant_type, group_size=group_size)
    assert llm.engine.parts.model.model.layers[0].self_attn.qkv_proj.qweight.scheme != "none"
    rel = float((logits(llm) - reference).norm() / reference.norm())
    assert 0 < rel <= max_rel, f"relative logit error {rel:.4f}"


# ---------------------------------------------------------------- QWen's own extensions, against the naive forward


def _naive_case(tmp_path: Path, ops, model_registry, seed: int, **overrides):
    config = qwen_config(**overrides)
    tensors = random_qwen_tensors(config, seed)
    model, parsed = load_model(write_qwen_dir(tmp_path, tensors, config), ops, torch.float32, "cpu",
                               model_registry, progress=False)
    return model, parsed, tensors, config


def test_the_naive_forward_is_qwen2s_on_mapped_weights(qwen2_model):
    """Checks the test's own reference against transformers before it judges anything else."""
    tokens = random_tokens(40, VOCAB, seed=2)
    naive = naive_qwen_logits(qwen_tensors_from_qwen2(qwen2_model), qwen_config(), tokens)
    assert_logits_close(naive, hf_logits(qwen2_model, tokens), ATOL)


def test_logn_attention_past_seq_length_matches_the_naive_forward(tmp_path, ops, model_registry, paged_driver):
    model, parsed, tensors, config = _naive_case(tmp_path, ops, model_registry, seed=5, use_logn_attn=True,
                                                 seq_length=16)
    assert parsed.max_position_embeddings == 512 and DECODER_STACK not in model.fusions()
    prompt = random_tokens(40, VOCAB, seed=6)
    plain = naive_qwen_logits(tensors, {**config, "use_logn_attn": False}, prompt)
    assert (plain[-1] - naive_qwen_logits(tensors, config, prompt)[-1]).abs().max() > 1e-3  # logn matters here
    driver = paged_driver(model, block_size=BLOCK, num_blocks=16, seed=7)
    seq = driver.add_sequence()
    (logits,) = driver.step([(seq, prompt[:9])])  # positions below seq_length, then past it
    assert_logits_close(logits, naive_qwen_logits(tensors, config, prompt[:9]), ATOL)
    (logits,) = driver.step([(seq, prompt[9:])])
    assert_logits_close(logits, naive_qwen_logits(tensors, config, prompt)[9:], ATOL)
    for _ in range(4):  # decode steps
        prompt.append(int(logits[-1].argmax()))
        (logits,) = driver.step([(seq, prompt[-1:])])
        assert_logits_close(logits, naive_qwen_logits(tensors, config, prompt)[-1:], ATOL)


NTK = {"use_dynamic_ntk": True, "use_logn_attn": True, "seq_length": 32}


@pytest.fixture(scope="module")
def ntk_case(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """A QWen directory with dynamic NTK and logn past seq_length=32 (context 512), rotary over half the head."""
    config = qwen_config(**NTK, rotary_pct=0.5, no_bias=False)
    tensors = random_qwen_tensors(config, seed=8)
    return write_qwen_dir(tmp_path_factory.mktemp("qwen1-ntk"), tensors, config), tensors, config


def _naive_greedy(tensors, config, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens by full recompute with the prompt's alpha, and the logits over prompt + tokens."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(naive_qwen_logits(tensors, config, ids, len(prompt))[-1].argmax()))
    return ids[len(prompt):], naive_qwen_logits(tensors, config, ids, len(prompt)).float()


def test_ntk_tables_follow_qwens_alpha_formula():
    from flashllm.models.qwen import ntk_table

    for seq_length in (1, 32, 2048, 8192):
        for length in [*range(1, 9 * seq_length), 32 * seq_length, 32 * seq_length + 1]:
            assert 2 ** (ntk_table(length, seq_length) + 1) - 1 == ntk_alpha(length, seq_length)


def test_dynamic_ntk_runs_past_seq_length_with_each_prompts_alpha(ntk_case):
    """Context past seq_length: prompts of alpha 1 (decoding across seq_length), 3, 7 and 15 batched
    together with chunked prefill; greedy tokens and every logits row equal the naive forward that
    rotates by the prompt length's base (and the oracle tells that apart from a per-step base)."""
    model_dir, tensors, config = ntk_case
    llm = _llm(model_dir, max_num_batched_tokens=48)
    assert llm.engine.parts.model.reads_prompt_lens and DECODER_STACK not in llm.engine.parts.model.fusions()
    rows = _record_logits(llm)
    prompts = [random_tokens(n, VOCAB, seed=90 + n) for n in (20, 33, 64, 65, 150)]
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        tokens, final = _naive_greedy(tensors, config, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert_rows_match(rows, prompt, tokens, final.float(), STEPS, atol=ATOL)
    # a base recomputed from the current length at each step would score the last step otherwise
    prompt = prompts[2] + llm.generate(prompts[2:3], GREEDY)[0].outputs[0].token_ids
    assert (naive_qwen_logits(tensors, config, prompt, 64)[-1]
            - naive_qwen_logits(tensors, config, prompt)[-1]).abs().max() > 1e-3


def test_dynamic_ntk_prefix_cache_shares_blocks_within_one_alpha_only(ntk_case):
    model_dir, tensors, config = ntk_case
    llm = _llm(model_dir)
    shared = random_tokens(48, VOCAB, seed=80)
    first, same_alpha, other_alpha = (shared + random_tokens(n, VOCAB, seed=81 + n) for n in (10, 5, 20))  # 58, 53, 68
    short = [random_tokens(16, VOCAB, seed=85) + random_tokens(n, VOCAB, seed=86 + n) for n in (4, 12)]  # 20, 28: alpha 1
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([first, short[0]], params)
    outputs = llm.generate([same_alpha, other_alpha, short[1]], params)
    assert [o.metrics.num_cached_tokens for o in outputs] == [48, 0, 16]
    for prompt, output in zip([same_alpha, other_alpha, short[1]], outputs, strict=True):
        assert output.outputs[0].token_ids == _naive_greedy(tensors, config, prompt, 8)[0]


def test_dynamic_ntk_preempted_sequences_recompute_with_their_prompts_alpha(ntk_case):
    model_dir, tensors, config = ntk_case
    llm = _llm(model_dir, num_kv_blocks=24, max_model_len=160, enable_prefix_caching=False)
    prompts = [random_tokens(n, VOCAB, seed=100 + n) for n in (60, 70, 90, 100)]
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == _naive_greedy(tensors, config, prompt, STEPS)[0]


def test_dynamic_ntk_under_two_tensor_parallel_ranks(ntk_case):
    """The other rank receives each step's prompt lengths with its inputs (core/parallel.py)."""
    model_dir, tensors, config = ntk_case
    llm = _llm(model_dir, tensor_parallel_size=2, distributed_executor_backend="mp", num_kv_blocks=32,
               max_model_len=256)
    try:
        prompts = [random_tokens(n, VOCAB, seed=110 + n) for n in (28, 60)]  # decodes cross 32 and 64
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
            assert output.outputs[0].token_ids == _naive_greedy(tensors, config, prompt, 8)[0]
    finally:
        llm.engine.shutdown()


def test_the_context_reaches_max_position_embeddings_under_dynamic_ntk(tmp_path):
    parsed = parse_hf_config(qwen_config(**NTK))
    assert (parsed.max_position_embeddings, parsed.seq_length) == (512, 32)
    write_qwen_dir(tmp_path, random_qwen_tensors(qwen_config(**NTK), seed=3), qwen_config(**NTK))
    with pytest.raises(EngineConfigError, match="exceeds the model's max_position_embeddings 512"):
        _llm(tmp_path, max_model_len=1024)


def test_partial_rotary_and_biases_match_the_naive_forward(tmp_path, ops, model_registry, paged_driver):
    model, _, tensors, config = _naive_case(tmp_path, ops, model_registry, seed=12, rotary_pct=0.5, no_bias=False,
                                            rotary_emb_base=500)
    prompt = random_tokens(37, VOCAB, seed=13)
    driver = paged_driver(model, block_size=BLOCK, num_blocks=8, seed=14)
    (logits,) = driver.step([(driver.add_sequence(), prompt)])
    assert_logits_close(logits, naive_qwen_logits(tensors, config, prompt), ATOL)


# ---------------------------------------------------------------- GPTQ / AWQ checkpoints (Qwen-7B-Chat-Int4 / -Int8)

QUANTIZED = {
    # Qwen-7B-Chat-Int4's settings (its groups are 128 input features; this model's inputs are 64 and 96)
    "gptq-int4": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
                  "static_groups": False, "true_sequential": True, "damp_percent": 0.01},
    "gptq-int8-act-order": {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": True, "sym": True},
    "awq-int4": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
}
QWEN_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.w1", "mlp.w2", "mlp.c_proj")


def quantized_qwen(config: dict, tensors: dict[str, torch.Tensor], qconfig: dict, seed: int
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the checkpoint's tensors with every decoder linear packed as `qconfig` says, c_attn quantized whole as
    the published checkpoints quantize it; the float tensors those integers stand for). w1 and w2 read one
    input, so under act order they share its order, as GPTQ's shared Hessian gives them."""
    gen = torch.Generator().manual_seed(seed)
    packed, twin = dict(tensors), dict(tensors)
    for i in range(config["num_hidden_layers"]):
        orders = {}
        for linear in QWEN_LINEARS:
            name = f"transformer.h.{i}.{linear}"
            weight = packed.pop(f"{name}.weight")
            source = "mlp.w" if linear in ("mlp.w1", "mlp.w2") else linear
            if source not in orders:
                k = weight.shape[1]
                orders[source] = torch.randperm(k, generator=gen) if qconfig.get("desc_act") else torch.arange(k)
            layer, twin[f"{name}.weight"] = quantize_linear(weight, qconfig, orders[source])
            packed.update({f"{name}.{suffix}": t for suffix, t in layer.items()})
    return packed, twin


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_a_quantized_checkpoint_computes_its_dequantized_weights(case, tmp_path, ops, model_registry, paged_driver):
    """c_attn's packed tensors are cut into q, k and v along their output features (whole packed words):
    logits of prompts over blocks and of decode steps equal the naive forward on the dequantized weights."""
    config = qwen_config(no_bias=False)
    packed, twin = quantized_qwen(config, random_qwen_tensors(config, seed=21), QUANTIZED[case], seed=22)
    quant_dir = write_qwen_dir(tmp_path, packed, {**config, "quantization_config": QUANTIZED[case]})
    model, parsed = load_model(quant_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert parsed.quantization.method == QUANTIZED[case]["quant_method"]
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.qweight.scheme == ("w8a16" if QUANTIZED[case]["bits"] == 8 else "w4a16")
    driver = paged_driver(model, block_size=BLOCK, num_blocks=16, seed=23)
    prompts = [random_tokens(n, VOCAB, seed=24 + n) for n in (37, 5)]
    seqs = [driver.add_sequence() for _ in prompts]
    new_tokens = [list(p) for p in prompts]
    for _ in range(4):  # the prompts, then three decode steps of both sequences
        for prompt, logits in zip(prompts, driver.step(list(zip(seqs, new_tokens, strict=True))), strict=True):
            assert_logits_close(logits, naive_qwen_logits(twin, config, prompt)[-len(logits):], ATOL)
            prompt.append(int(logits[-1].argmax()))
        new_tokens = [prompt[-1:] for prompt in prompts]


def test_a_quantized_c_attn_of_the_wrong_width_is_refused_naming_the_tensor(tmp_path, ops, model_registry):
    config = qwen_config()
    packed, _ = quantized_qwen(config, random_qwen_tensors(config, seed=1), QUANTIZED["gptq-int4"], seed=2)
    packed["transformer.h.0.attn.c_attn.scales"] = packed["transformer.h.0.attn.c_attn.scales"][:, :-8]
    quant_dir = write_qwen_dir(tmp_path, packed, {**config, "quantization_config": QUANTIZED["gptq-int4"]})
    with pytest.raises(ModelLoadError, match=r"transformer\.h\.0\.attn\.c_attn\.scales.*expected 192 along"):
        load_model(quant_dir, ops, torch.float32, "cpu", model_registry, progress=False)


# ---------------------------------------------------------------- configs and checkpoints refused in one line


@pytest.mark.parametrize(("overrides", "field"), [
    ({"kv_channels": 8}, "kv_channels=8"),
    ({"intermediate_size": 191}, "intermediate_size=191"),
    ({"hidden_size": 66}, "hidden_size=66"),
    ({"rotary_pct": 0.03}, "rotary_pct=0.03"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ({"scale_attn_weights": False}, "scale_attn_weights"),
    ({"bf16": True, "fp16": True}, "bf16, fp16"),
    ({"use_logn_attn": "yes"}, "use_logn_attn"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "bits": 4}}, "quant_method='bitsandbytes'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 48}}, "group_size=48"),
])
def test_an_inconsistent_config_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config(qwen_config(**overrides))
    assert field in str(info.value) and "\n" not in str(info.value)


def test_defaults_follow_qwens_config_class():
    raw = {k: v for k, v in qwen_config().items()
           if k not in ("use_dynamic_ntk", "use_logn_attn", "seq_length", "max_position_embeddings", "no_bias")}
    parsed = parse_hf_config(raw)
    assert (parsed.use_dynamic_ntk, parsed.use_logn_attn, parsed.seq_length, parsed.max_position_embeddings,
            parsed.mlp_bias) == (True, True, 8192, 8192, False)


def test_a_c_attn_of_the_wrong_size_is_refused_naming_the_tensor(tmp_path, ops, model_registry):
    config = qwen_config()
    tensors = random_qwen_tensors(config, seed=1)
    tensors["transformer.h.1.attn.c_attn.weight"] = tensors["transformer.h.1.attn.c_attn.weight"][:-4]
    with pytest.raises(ModelLoadError, match=r"transformer\.h\.1\.attn\.c_attn\.weight.*192 rows"):
        load_model(write_qwen_dir(tmp_path, tensors, config), ops, torch.float32, "cpu", model_registry,
                   progress=False)


# ---------------------------------------------------------------- the engine with QWen's own tokenizer files


def test_the_engine_runs_a_qwen_directory_with_its_tiktoken_tokenizer_and_chat_format(tmp_path):
    """A byte-only qwen.tiktoken (rank = byte value) makes the expected prompt ids plain to write down."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    config = qwen_config(vocab_size=256 + 208 + 8)  # padded past the tokenizer, as Qwen's 151936 is
    write_qwen_dir(tmp_path, random_qwen_tensors(config, seed=0), config)
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    (tmp_path / "qwen.tiktoken").write_text("\n".join(lines) + "\n")
    remote = {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}
    tokenizer_config = {"tokenizer_class": "QWenTokenizer", "auto_map": remote}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"chat_format": "chatml", "eos_token_id": 256}))
    llm = _llm(tmp_path, max_model_len=128, num_kv_blocks=16)
    assert sorted(llm.engine.parts.eos_token_ids) == [256, 257, 258]  # endoftext, im_start, im_end
    out = llm.chat([{"role": "user", "content": "héllo"}], SamplingParams(temperature=0.0, max_tokens=4))[0]
    expected = [257, *b"system\nYou are a helpful assistant.", 258, *b"\n", 257, *b"user\n", *"héllo".encode(), 258,
                *b"\n", 257, *b"assistant\n"]
    assert out.prompt_token_ids == expected
    assert llm.tokenizer.decode(expected, skip_special_tokens=True) == (
        "system\nYou are a helpful assistant.\nuser\nhéllo\nassistant\n")
    assert llm.tokenizer.convert_ids_to_tokens([256, 257, 258]) == specials
