"""Baichuan / Baichuan2 without weights: the config rules on the published checkpoints' fields, the
Baichuan2 chat format, and the tokenizer built from tokenizer.model without the checkpoint's code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashllm.models.hf_config import ModelLoadError, parse_hf_config

# --- config.json rules, on the published checkpoints' fields ------------------------------------

def _published(hidden: int, layers: int, vocab: int, **fields) -> dict:
    return {"architectures": ["BaichuanForCausalLM"], "model_type": "baichuan", "hidden_act": "silu",
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
            "intermediate_size": 11008 if hidden == 4096 else 13696, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "vocab_size": vocab, **fields}


BAICHUAN_7B = {**_published(4096, 32, 64000, max_position_embeddings=4096), "architectures": ["BaiChuanForCausalLM"]}
BAICHUAN_13B = _published(5120, 40, 64000, model_max_length=4096)
BAICHUAN2_7B = _published(4096, 32, 125696, max_position_embeddings=4096, model_max_length=4096, z_loss_weight=0)
BAICHUAN2_13B = _published(5120, 40, 125696, model_max_length=4096, tokenizer_class="BaichuanTokenizer")


@pytest.mark.parametrize(("raw", "position", "norm_head"), [
    (BAICHUAN_7B, "rope", False), (BAICHUAN_13B, "alibi", False),
    (BAICHUAN2_7B, "rope", True), (BAICHUAN2_13B, "alibi", True),
], ids=["Baichuan-7B", "Baichuan-13B", "Baichuan2-7B", "Baichuan2-13B"])
def test_published_configs_get_their_position_encoding_and_head(raw, position, norm_head) -> None:
    config = parse_hf_config(raw)
    assert (config.position_embedding, config.norm_head, config.alibi) == (position, norm_head, position == "alibi")
    assert config.max_position_embeddings == 4096 and config.num_key_value_heads == config.num_attention_heads


@pytest.mark.parametrize(("raw", "match"), [
    ({**BAICHUAN_13B, "max_position_embeddings": 4096}, "shape of the published alibi checkpoints"),
    ({**BAICHUAN2_7B, "max_position_embeddings": None, "model_max_length": None}, "neither max_position_embeddings"),
    ({k: v for k, v in BAICHUAN2_7B.items() if k not in ("max_position_embeddings", "model_max_length")},
     "neither max_position_embeddings"),
    ({**BAICHUAN_13B, "position_embedding": "learned"}, "position_embedding='learned'"),
    ({**BAICHUAN_13B, "num_key_value_heads": 8}, "num_key_value_heads=8 differs"),
    ({**BAICHUAN2_7B, "tie_word_embeddings": True}, "normalizes its rows"),
    ({**BAICHUAN_13B, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "ALiBi, which has no rotary"),
    ({**BAICHUAN2_13B, "quantization_config": {"quant_method": "gptq", "bits": 3}}, "bits=3 is not supported"),
])
def test_configs_flashllm_cannot_run_are_refused_in_one_line(raw, match) -> None:
    with pytest.raises(ModelLoadError, match=match) as info:
        parse_hf_config(raw)
    assert "\n" not in str(info.value)


def test_a_declared_position_embedding_settles_an_ambiguous_config() -> None:
    raw = {**BAICHUAN_13B, "max_position_embeddings": 4096, "position_embedding": "alibi"}
    assert parse_hf_config(raw).alibi
    assert not parse_hf_config({**BAICHUAN_13B, "position_embedding": "rope"}).alibi


# --- the Baichuan2 chat format --------------------------------------------------------------------

def test_the_baichuan2_chat_format_renders_as_build_chat_input_builds_it() -> None:
    """System text first, <reserved_106> before each user turn, <reserved_107> before each assistant turn
    and once more to prompt the answer (Baichuan2-Chat's generation_utils.build_chat_input)."""
    from flashllm.models.chat_template import ChatTemplate

    template = ChatTemplate.builtin("baichuan-2")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    assert template.render(messages) == "Be brief.<reserved_106>Hi<reserved_107>Hello!<reserved_106>2+2?<reserved_107>"
    assert template.render(messages, add_generation_prompt=False).endswith("<reserved_106>2+2?")
    assert template.render(messages[1:3]) == "<reserved_106>Hi<reserved_107>Hello!"  # the assistant continues
    assert (template.bos_token, template.eos_token) == ("", "</s>")


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
    [{"role": "user", "content": "a"}, {"role": "tool", "content": "{}"}],
])
def test_the_baichuan2_chat_format_refuses_what_it_cannot_write(messages) -> None:
    from flashllm.models.chat_template import ChatTemplate, ChatTemplateError

    with pytest.raises(ChatTemplateError, match="baichuan-2"):
        ChatTemplate.builtin("baichuan-2").render(messages)


# --- the tokenizer: tokenizer.model through sentencepiece, never tokenization_baichuan.py ------------

@pytest.mark.parametrize(("tokenizer_class", "add_bos"), [("BaichuanTokenizer", False), ("BaiChuanTokenizer", True)])
def test_the_tokenizer_is_built_from_tokenizer_model_without_its_code(tmp_path, tokenizer_class, add_bos) -> None:
    import sentencepiece

    from flashllm.models.chat_template import ChatTemplate
    from flashllm.models.tokenizer import load_tokenizer
    from flashllm.testing.sentencepiece_model import train_sentencepiece_model

    model = train_sentencepiece_model(tmp_path / "tokenizer.model", vocab_size=1000,
                                      user_defined_symbols=["<reserved_106>", "<reserved_107>"])
    marker = tmp_path / "remote-code-ran"
    (tmp_path / "tokenization_baichuan.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": tokenizer_class, "auto_map": {"AutoTokenizer": ["tokenization_baichuan.X", None]},
        "add_bos_token": add_bos, "add_eos_token": False, "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<unk>"}))
    tok = load_tokenizer(tmp_path)
    own = sentencepiece.SentencePieceProcessor(model_file=str(model))
    prompt = ChatTemplate.builtin("baichuan-2").render([{"role": "user", "content": "hello world"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    # as the checkpoint's tokenizer: the whole text through sentencepiece, the reserved tokens one piece each
    assert ids == own.encode(prompt)
    assert [ids.count(own.piece_to_id(t)) for t in ("<reserved_106>", "<reserved_107>")] == [1, 1]
    assert tok.decode(ids) == prompt and tok.eos_token_id == own.eos_id() == 2
    assert tok.encode("hello") == [own.bos_id()] * add_bos + own.encode("hello")
    assert not marker.exists()


def _baichuan_chat_dir(root: Path, generation: dict) -> Path:
    """Baichuan2-Chat's tokenizer files without a chat template: tokenizer.model, its tokenizer_config.json
    and generation_config.json naming the turn markers' ids (user_token_id / assistant_token_id)."""
    from flashllm.testing.sentencepiece_model import train_sentencepiece_model

    train_sentencepiece_model(root / "tokenizer.model", vocab_size=1000,
                              user_defined_symbols=["<reserved_105>", "<reserved_106>", "<reserved_107>"])
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BaichuanTokenizer", "add_bos_token": False, "add_eos_token": False}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **generation}))
    return root


def test_a_baichuan_chat_checkpoint_gets_the_baichuan2_format_and_its_turn_ids(tmp_path) -> None:
    """generation_config.json's user_token_id / assistant_token_id pick the built-in format, and the
    rendered prompt encodes to the ids build_chat_input appends: the system text, then per turn the
    marker id followed by the turn's text, the assistant marker last."""
    import sentencepiece

    from flashllm.models.tokenizer import load_chat_template, load_tokenizer

    sp = sentencepiece.SentencePieceProcessor(model_file=str(_baichuan_chat_dir(tmp_path, {}) / "tokenizer.model"))
    user, assistant = sp.piece_to_id("<reserved_106>"), sp.piece_to_id("<reserved_107>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"user_token_id": user,
                                                                 "assistant_token_id": assistant}))
    template = load_chat_template(tmp_path)
    assert template is not None and template.name == "baichuan-2"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How are you?"},
                {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "And the weather"}]
    ids = load_tokenizer(tmp_path).encode(template.render(messages), add_special_tokens=True)
    expected = [*sp.encode("Be brief."), user, *sp.encode("How are you?"), assistant, *sp.encode("Fine."),
                user, *sp.encode("And the weather"), assistant]
    assert ids == expected
    (tmp_path / "generation_config.json").write_text(json.dumps({"user_token_id": user}))
    assert load_chat_template(tmp_path) is None  # one marker alone is not Baichuan's chat format


@pytest.mark.parametrize("bad", [5000, -1, "195", True])
def test_a_turn_marker_id_outside_the_tokenizer_is_refused_in_one_line(tmp_path, bad) -> None:
    from flashllm.models.tokenizer import load_tokenizer

    _baichuan_chat_dir(tmp_path, {"user_token_id": bad, "assistant_token_id": 4})
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(tmp_path)
    assert f"user_token_id={bad!r}" in str(info.value) and "\n" not in str(info.value)
