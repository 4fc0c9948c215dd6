"""ChatGLM2/3 (GLM-4) checkpoints and transformers' GlmForCausalLM: flashllm against transformers' GLM.

The reference is transformers' own GlmForCausalLM (partial, interleaved rotary; qkv bias; fused
gate_up). Its tensors are written once as they are and once renamed into the ChatGLM2/3 layout
(q, k, v concatenated into query_key_value, gate_up_proj as dense_h_to_4h, ChatGLM's config fields),
following ChatGLM's published checkpoints; both must give transformers' logits and greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flashllm.llm import LLM
from flashllm.models.chatglm import ChatGLMForConditionalGeneration, GlmForCausalLM
from flashllm.models.chatglm_config import parse_chatglm_config
from flashllm.models.hf_config import ModelLoadError, parse_hf_config
from flashllm.models.loader import load_model
from flashllm.registry.fusions import DECODER_STACK, LM_HEAD
from flashllm.sampling_params import SamplingParams
from flashllm.testing.glm import EPS, FFN, GROUPS, HEAD_DIM, HEADS, HIDDEN, LAYERS, ROPE_RATIO, SEQ, VOCAB, build_glm
from flashllm.testing.parity import (
    assert_rows_match,
    check_chunked_prefill_beside_a_decode,
    check_varlen_prefill_and_decode,
    hf_greedy,
    random_tokens,
)
from flashllm.testing.parity import record_logits as _record_logits
from flashllm.testing.sentencepiece_model import train_sentencepiece_model

PROMPT_LENGTHS = (1, 7, 63, 64, 65, 200)
STEPS = 32
ATOL = 1e-4


def chatglm_config(**overrides) -> dict:
    """A ChatGLM2/3-style config.json (field names as chatglm3-6b's) for the tiny shapes above."""
    config = {
        "architectures": ["ChatGLMModel"], "model_type": "chatglm",
        "auto_map": {"AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration"},
        "num_layers": LAYERS, "hidden_size": HIDDEN, "ffn_hidden_size": FFN, "kv_channels": HEAD_DIM,
        "num_attention_heads": HEADS, "multi_query_attention": True, "multi_query_group_num": GROUPS,
        "padded_vocab_size": VOCAB, "seq_length": SEQ, "layernorm_epsilon": EPS, "rmsnorm": True,
        "add_qkv_bias": True, "add_bias_linear": False, "apply_residual_connection_post_layernorm": False,
        "post_layer_norm": True, "original_rope": True, "rope_ratio": ROPE_RATIO, "fp32_residual_connection": False,
        "torch_dtype": "float32", "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


def to_chatglm_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' GLM tensors under ChatGLM2/3's names: q, k, v rows concatenated (with their
    biases) into query_key_value, gate_up_proj (gate rows first) as dense_h_to_4h."""
    out = {
        "transformer.embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": state["model.norm.weight"],
        "transformer.output_layer.weight": state["lm_head.weight"],
        # ChatGLM checkpoints carry the rope frequencies; the model rebuilds them from the config
        "transformer.rotary_pos_emb.inv_freq": torch.full((HEAD_DIM // 4,), float("nan")),
    }
    for i in range(LAYERS):
        src, dst = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{dst}{norm}.weight"] = state[f"{src}{norm}.weight"]
        for kind in ("weight", "bias"):
            out[f"{dst}self_attention.query_key_value.{kind}"] = torch.cat(
                [state[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv"])
        out[f"{dst}self_attention.dense.weight"] = state[f"{src}self_attn.o_proj.weight"]
        out[f"{dst}mlp.dense_h_to_4h.weight"] = state[f"{src}mlp.gate_up_proj.weight"]
        out[f"{dst}mlp.dense_4h_to_h.weight"] = state[f"{src}mlp.down_proj.weight"]
    return {name: t.contiguous() for name, t in out.items()}


def write_chatglm_dir(out_dir: Path, hf_model, **config_overrides) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(chatglm_config(**config_overrides), indent=2))
    save_file(to_chatglm_layout(hf_model.state_dict()), out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """(transformers GlmForCausalLM, its own directory, the same weights in the ChatGLM layout)."""
    hf_model = build_glm(seed=7)
    glm_dir = tmp_path_factory.mktemp("glm")
    hf_model.save_pretrained(glm_dir)
    return hf_model, glm_dir, write_chatglm_dir(tmp_path_factory.mktemp("chatglm"), hf_model)


# ---------------------------------------------------------------- forward over a paged cache


@pytest.mark.parametrize("layout", ["chatglm", "glm"])
def test_varlen_prefill_and_decode_match_transformers(layout, glm, ops, model_registry, paged_driver):
    hf_model, glm_dir, chatglm_dir = glm
    ours, config = load_model(chatglm_dir if layout == "chatglm" else glm_dir, ops, torch.float32, "cpu",
                              model_registry, progress=False)
    assert type(ours) is (ChatGLMForConditionalGeneration if layout == "chatglm" else GlmForCausalLM)
    assert (config.rotary_dim, config.rope_theta) == (HEAD_DIM // 2, 10000.0 * ROPE_RATIO)
    driver = paged_driver(ours, block_size=16, num_blocks=64, seed=3)
    prompts = [random_tokens(n, VOCAB, seed=100 + n) for n in PROMPT_LENGTHS]
    check_varlen_prefill_and_decode(driver, hf_model, prompts, ATOL)


def test_chunked_prefill_beside_a_decode_matches_transformers(glm, ops, model_registry, paged_driver):
    hf_model, _, chatglm_dir = glm
    ours, _ = load_model(chatglm_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    driver = paged_driver(ours, block_size=16, num_blocks=32, seed=5)
    check_chunked_prefill_beside_a_decode(driver, hf_model, VOCAB, ATOL)


def test_fusions_describe_half_of_each_head_turning_in_pairs(glm, ops, model_registry):
    _, _, chatglm_dir = glm
    ours, _ = load_model(chatglm_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert ours.kv_cache_shape() == (LAYERS, GROUPS, HEAD_DIM)
    stack = ours.fusions()[DECODER_STACK]
    assert (stack.rotary.rotary_dim, stack.rotary.is_neox) == (HEAD_DIM // 2, False)
    assert (stack.num_heads, stack.num_kv_heads, stack.head_dim, stack.intermediate_size) == (HEADS, GROUPS, HEAD_DIM, FFN)
    assert all(layer.qkv_proj.bias is not None and layer.o_proj.bias is None for layer in stack.layers)
    assert set(ours.fusions()) == {LM_HEAD, DECODER_STACK}


def test_without_a_final_norm_no_decoder_stack_is_declared(tmp_path, glm, ops, model_registry):
    hf_model, _, _ = glm
    model_dir = write_chatglm_dir(tmp_path, hf_model, post_layer_norm=False)
    state = to_chatglm_layout(hf_model.state_dict())
    del state["transformer.encoder.final_layernorm.weight"]
    save_file(state, model_dir / "model.safetensors")
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert ours.transformer.encoder.final_layernorm is None and set(ours.fusions()) == {LM_HEAD}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_ranks_load_their_heads_of_the_fused_tensors(glm, ops, tp_size):
    """Each rank's query_key_value holds its query heads and its key/value group (replicated when
    there are fewer groups than ranks); dense_h_to_4h its slice of gate then its slice of up."""
    hf_model, _, chatglm_dir = glm
    config = parse_chatglm_config(chatglm_config(), "config.json")
    state = hf_model.state_dict()
    q, k, v = (state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    gate, up = state["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    heads, rows = HEADS // tp_size, FFN // tp_size
    for rank in range(tp_size):
        model = ChatGLMForConditionalGeneration(config, ops, torch.float32, torch.device("cpu"), rank, tp_size)
        model.load_weights(to_chatglm_layout(state).items())
        layer = model.transformer.encoder.layers[1]
        group = rank * GROUPS // tp_size
        expected_qkv = torch.cat([q[rank * heads * HEAD_DIM:(rank + 1) * heads * HEAD_DIM],
                                  k[group * HEAD_DIM:(group + 1) * HEAD_DIM], v[group * HEAD_DIM:(group + 1) * HEAD_DIM]])
        torch.testing.assert_close(layer.self_attention.query_key_value.weight.data, expected_qkv, rtol=0, atol=0)
        expected_mlp = torch.cat([gate[rank * rows:(rank + 1) * rows], up[rank * rows:(rank + 1) * rows]])
        torch.testing.assert_close(layer.mlp.dense_h_to_4h.weight.data, expected_mlp, rtol=0, atol=0)


# ---------------------------------------------------------------- the whole engine


def _check_tokens_and_logits(hf_model, prompts, outputs, rows) -> None:
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens, logits = hf_greedy(hf_model, prompt, STEPS)
        assert output.outputs[0].token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert_rows_match(rows, prompt, tokens, logits, STEPS, atol=ATOL)


def _llm(model_dir: Path, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=16, max_model_len=SEQ, num_kv_blocks=128)
    return LLM(str(model_dir), **{**options, **kw})


def test_engine_greedy_tokens_and_logits_match_transformers(glm):
    hf_model, _, chatglm_dir = glm
    llm = _llm(chatglm_dir)
    rows = _record_logits(llm)
    prompts = [random_tokens(n, VOCAB, seed=n) for n in PROMPT_LENGTHS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    _check_tokens_and_logits(hf_model, prompts, outputs, rows)


def test_engine_chunked_prefill_and_prefix_cache_hits_match_transformers(glm):
    hf_model, _, chatglm_dir = glm
    llm = _llm(chatglm_dir, max_num_batched_tokens=48)
    shared = random_tokens(100, VOCAB, seed=11)
    prompts = [shared + random_tokens(n, VOCAB, seed=12 + n) for n in (3, 40)] + [random_tokens(65, VOCAB, seed=13)]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    first = llm.generate(prompts[:1], params)  # caches the shared blocks (greedy steps through the cpu screen)
    assert first[0].outputs[0].token_ids == hf_greedy(hf_model, prompts[0], STEPS)[0]
    rows = _record_logits(llm)
    outputs = llm.generate(prompts, params)
    assert all(o.metrics.num_cached_tokens >= 96 for o in outputs[:2])  # 6 full blocks of 16 hit
    _check_tokens_and_logits(hf_model, prompts, outputs, rows)


def test_the_cpu_fused_decode_step_takes_the_glm_block_and_gives_transformers_tokens(glm, monkeypatch):
    """The cpu backend's one-call decode step (and greedy screen) run from what the model declares:
    partial interleaved rotary included, the tokens are transformers' ones."""
    from flashllm.backends.cpu import decode_stack, greedy_screen, native

    if native.library() is None:
        pytest.skip(f"cpu native kernels: {native.unavailable_reason()}")
    hf_model, _, chatglm_dir = glm
    fused_steps: list[bool] = []
    real = decode_stack.FusedDecode.__call__
    monkeypatch.setattr(decode_stack.FusedDecode, "__call__", lambda self, *a: fused_steps.append(True) or real(self, *a))
    llm = _llm(chatglm_dir)
    assert decode_stack.build(llm.engine.parts.model) is not None
    prompts = [random_tokens(n, VOCAB, seed=40 + n) for n in (1, 63, 65)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, STEPS)[0]
    assert fused_steps and greedy_screen.kept(llm.engine.parts.model) is not None


def test_chat_through_the_checkpoints_sentencepiece_tokenizer(tmp_path):
    """A ChatGLM3 directory with tokenizer.model and ChatGLMTokenizer's config but no chat template (its
    first revisions): chat prompts take the chatglm3 format (named by _name_or_path) and start with
    [gMASK] sop <|user|>, text prompts with [gMASK] sop; generation stops at eos and at <|user|> and
    <|observation|> as ChatGLM3's chat() does; the greedy tokens are transformers' ones."""
    hf_model = build_glm(seed=9, vocab_size=1024)  # room for the tokenizer's ~800 pieces and 9 specials
    model_dir = write_chatglm_dir(tmp_path, hf_model, padded_vocab_size=1024, _name_or_path="THUDM/chatglm3-6b")
    train_sentencepiece_model(model_dir / "tokenizer.model")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ChatGLMTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]}}))
    llm = _llm(model_dir)
    tok = llm.tokenizer
    pieces = tok.sp.get_piece_size()  # ChatGLM's specials follow the pieces: ... <|user|> is the 7th, <|observation|> 9th
    assert llm.engine.parts.eos_token_ids == [tok.sp.eos_id(), pieces + 6, pieces + 8]
    prefix = [tok.convert_tokens_to_ids(t) for t in ("[gMASK]", "sop")]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (chat,) = llm.chat([{"role": "user", "content": "Hello"}], params)
    assert chat.prompt_token_ids[:3] == [*prefix, tok.convert_tokens_to_ids("<|user|>")]
    assert chat.prompt_token_ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert chat.outputs[0].token_ids == hf_greedy(hf_model, list(chat.prompt_token_ids), 8)[0]
    (plain,) = llm.generate("Hello", params)
    assert plain.prompt_token_ids == [*prefix, *tok.encode("Hello", add_special_tokens=False)]
    assert plain.outputs[0].text == tok.decode(plain.outputs[0].token_ids, skip_special_tokens=True)


def test_a_glm4_checkpoint_chats_through_its_tiktoken_tokenizer(tmp_path):
    """GLM-4's layout: a tiktoken rank file named tokenizer.model under ChatGLM4Tokenizer, no template
    shipped: chat prompts take the glm-4 format ([gMASK] <sop> <|user|> ... <|assistant|>), generation
    stops at <|endoftext|>, <|user|> and <|observation|>, and the greedy tokens are transformers' ones."""
    from flashllm.testing.corpus import CORPUS
    from flashllm.testing.tiktoken_files import train_ranks, write_rank_file

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    ranks = train_ranks(CORPUS, pattern, num_merges=200)
    hf_model = build_glm(seed=11, vocab_size=512)  # the ~456 ranks and GLM-4's 14 specials
    model_dir = write_chatglm_dir(tmp_path, hf_model, padded_vocab_size=512, eos_token_id=[len(ranks)])
    write_rank_file(model_dir / "tokenizer.model", ranks)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ChatGLM4Tokenizer", "eos_token": "<|endoftext|>",
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]}}))
    llm = _llm(model_dir)
    tok, n = llm.tokenizer, len(ranks)
    assert sorted(llm.engine.parts.eos_token_ids) == [n, n + 7, n + 9]  # endoftext, <|user|>, <|observation|>
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (chat,) = llm.chat([{"role": "user", "content": "Hello"}], params)
    assert chat.prompt_token_ids == [n + 2, n + 4, n + 7, *tok.encode("\nHello", add_special_tokens=False), n + 8]
    assert chat.outputs[0].token_ids == hf_greedy(hf_model, list(chat.prompt_token_ids), 8)[0]
    (plain,) = llm.generate("Hello", params)
    assert plain.prompt_token_ids == [n + 2, n + 4, *tok.encode("Hello", add_special_tokens=False)]


# ---------------------------------------------------------------- configs refused in one line


def _refusal(raw: dict) -> str:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config(raw)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_inconsistent_group_counts_are_refused():
    message = _refusal(chatglm_config(num_attention_heads=6, multi_query_group_num=4))
    assert "num_attention_heads=6" in message and "multi_query_group_num=4" in message
    glm_raw = {"architectures": ["GlmForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 256}
    assert "num_key_value_heads=3" in _refusal(glm_raw)


@pytest.mark.parametrize("overrides, expected", [
    ({"position_encoding_2d": True, "inner_hidden_size": 16384}, "first-generation ChatGLM-6B"),
    ({"padded_vocab_size": None, "ffn_hidden_size": None, "vocab_size": 130528}, "first-generation ChatGLM-6B"),
    ({"vision_config": {"hidden_size": 1792}}, "GLM-4V"),
    ({"quantization_bit": 4}, "--quant_type"),
    ({"rmsnorm": False}, "rmsnorm=false"),
    ({"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm=true"),
    ({"kv_channels": 18}, "kv_channels=18"),
    ({"pre_seq_len": 128}, "P-tuning v2"),
    ({"interleaved_qkv": True}, "interleaved_qkv=true"),
    ({"fp32_residual_connection": True}, "fp32_residual_connection=true"),
])
def test_unsupported_chatglm_configs_are_refused(overrides, expected):
    raw = {k: v for k, v in chatglm_config(**overrides).items() if v is not None}
    message = _refusal(raw)
    assert expected in message
    if "first-generation" in expected:
        assert "ChatGLM2-6B, ChatGLM3-6B and GLM-4" in message  # says what is supported


def test_each_chatglm_architecture_name_loads_the_same_model(tmp_path, glm, ops, model_registry):
    hf_model, _, _ = glm
    model_dir = write_chatglm_dir(tmp_path, hf_model, architectures=["ChatGLMForConditionalGeneration"])
    ours, _ = load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
    assert type(ours) is ChatGLMForConditionalGeneration


def test_a_checkpoint_missing_a_fused_tensor_is_named(tmp_path, glm, ops, model_registry):
    hf_model, _, _ = glm
    model_dir = write_chatglm_dir(tmp_path, hf_model)
    state = to_chatglm_layout(hf_model.state_dict())
    del state["transformer.encoder.layers.1.mlp.dense_h_to_4h.weight"]
    save_file(state, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*layers\.1\.mlp\.dense_h_to_4h\.weight"):
        load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path, glm, ops, model_registry):
    hf_model, _, _ = glm
    model_dir = write_chatglm_dir(tmp_path, hf_model)
    state = to_chatglm_layout(hf_model.state_dict())
    name = "transformer.encoder.layers.0.self_attention.query_key_value.weight"
    state[name] = state[name][:-HEAD_DIM].contiguous()  # one key/value head short
    save_file(state, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{name}.*expected 128 rows \(64 \+ 32 \+ 32\)"):
        load_model(model_dir, ops, torch.float32, "cpu", model_registry, progress=False)
