"""Tokenizer loading, EOS ids, and sandboxed chat templates (vs transformers where it applies)."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import SecurityError
from transformers import PreTrainedTokenizerFast

from flashllm.models.builtin_templates import BUILTIN_TEMPLATES
from flashllm.models.chat_template import (
    MAX_RENDERED_CHARS,
    MAX_TEMPLATE_BYTES,
    ChatTemplate,
    ChatTemplateError,
    render_chat,
    validate_messages,
)
from flashllm.models.tokenizer import eos_token_ids, load_chat_template, load_tokenizer
from flashllm.testing.timing import time_limit
from flashllm.testing.tokenizer import train_tokenizer

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! 你好 😀"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "  What is 2+2? "},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out)
    return out


# ---------------------------------------------------------------- loading


def test_load_tokenizer_round_trips_like_the_trained_one(tok_dir: Path, tmp_path: Path) -> None:
    trained = train_tokenizer(tmp_path)
    loaded = load_tokenizer(tok_dir)
    assert loaded.is_fast
    text = "Hello 你好 👨‍👩‍👧 <|im_start|>user"
    assert loaded.encode(text) == trained.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.eos_token_id == trained.eos_token_id == trained.convert_tokens_to_ids("<|endoftext|>")


def test_bare_tokenizer_json_is_wrapped_with_config_special_tokens(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    bare = load_tokenizer(tmp_path)
    assert isinstance(bare, PreTrainedTokenizerFast) and bare.eos_token is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>"]}))
    wrapped = load_tokenizer(tmp_path)
    assert wrapped.eos_token_id == wrapped.convert_tokens_to_ids("<|im_end|>")
    assert wrapped.convert_tokens_to_ids("<|im_start|>") in wrapped.all_special_ids
    ids = wrapped.encode("a<|im_start|>b")
    assert wrapped.decode(ids, skip_special_tokens=True) == "ab"


def test_remote_code_tokenizers_are_refused_without_running_anything(tok_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "EvilTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    with pytest.raises(ValueError, match="remote_code"):
        load_tokenizer(tmp_path)
    assert not marker.exists()


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(("configured", "expected_extra"), [
    (None, []), (7, [7]), ([7, 0, 9, 7], [7, 9]), ([], []),
])
def test_eos_token_ids_union(tok_dir: Path, configured: object, expected_extra: list[int]) -> None:
    tok = load_tokenizer(tok_dir)
    config = None if configured is None else {"eos_token_id": configured}
    ids = eos_token_ids(tok, config)
    assert ids == [tok.eos_token_id] + [i for i in expected_extra if i != tok.eos_token_id]
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids(tok, {"eos_token_id": "2"})


# ---------------------------------------------------------------- builtin templates


def _expected(name: str, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The published formats, written out by hand."""
    if name == "chatml":
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")
    if name == "qwen":  # Qwen-Chat's make_context: ChatML with a default system turn
        has_system = messages[0]["role"] == "system"
        default = [] if has_system else [{"role": "system", "content": "You are a helpful assistant."}]
        return _expected("chatml", default + messages, add_generation_prompt)
    if name == "chatglm3":
        out = "[gMASK]sop" + "".join(f"<|{m['role']}|>\n {m['content']}" for m in messages)
        return out + ("<|assistant|>" if add_generation_prompt else "")
    if name == "glm-4":  # GLM-4's build_chat_input: role token, then "\n" and the text (no space, unlike ChatGLM3)
        out = "[gMASK]<sop>" + "".join(f"<|{m['role']}|>\n{m['content']}" for m in messages)
        return out + ("<|assistant|>" if add_generation_prompt else "")
    if name == "chatglm2":  # numbered rounds; the answer prompt belongs to the user turn
        return "[gMASK]sop" + "".join(
            f"[Round {i // 2 + 1}]\n\n问：{m['content']}\n\n答：" if m["role"] == "user" else f"{m['content']}\n\n"
            for i, m in enumerate(messages))
    if name == "baichuan-2":  # Baichuan2's build_chat_input: system text, then <reserved_106> user / <reserved_107>
        out = "".join(m["content"] if m["role"] == "system" else
                      ("<reserved_106>" if m["role"] == "user" else "<reserved_107>") + m["content"] for m in messages)
        return out + ("<reserved_107>" if add_generation_prompt and messages[-1]["role"] != "assistant" else "")
    if name == "llama-3":
        out = "<|begin_of_text|>" + "".join(
            f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>" for m in messages)
        return out + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")
    system, turns = (messages[0]["content"], messages[1:]) if messages[0]["role"] == "system" else (None, messages)
    out = ""
    for i, m in enumerate(turns):
        if m["role"] == "user":
            content = m["content"].strip()
            if i == 0 and system is not None:
                content = f"<<SYS>>\n{system.strip()}\n<</SYS>>\n\n{content}"
            out += f"<s>[INST] {content} [/INST]"
        else:
            out += f" {m['content'].strip()} </s>"
    return out


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_builtin_templates_render_the_published_format(name: str, add_generation_prompt: bool) -> None:
    for messages in (CHAT, CHAT[1:], CHAT[:2]):
        if name == "chatglm2" and messages[0]["role"] == "system":
            messages = messages[1:]  # ChatGLM2's format has no system role
        got = render_chat(name, messages, add_generation_prompt=add_generation_prompt)
        assert got == _expected(name, messages, add_generation_prompt)


def test_llama2_rejects_turns_that_do_not_alternate() -> None:
    with pytest.raises(ChatTemplateError, match="alternate user and assistant"):
        render_chat("llama-2", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


message_lists = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool"]),
    "content": st.text(alphabet=st.characters(codec="utf-8"), max_size=30)
    | st.sampled_from(["{{ 7 * 7 }}", "{% raw %}", "<|im_end|>", ""]),
}), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=message_lists, add_generation_prompt=st.booleans(), with_tools=st.booleans())
def test_chatml_matches_transformers_apply_chat_template(hf_chatml: PreTrainedTokenizerFast, messages: list,
                                                         add_generation_prompt: bool, with_tools: bool) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    tools = [tool, tool] if with_tools else None
    expected = hf_chatml.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    template = ChatTemplate.builtin("chatml", eos_token=hf_chatml.eos_token)
    assert template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt) == expected


@pytest.fixture(scope="module")
def hf_chatml(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return train_tokenizer(tmp_path_factory.mktemp("chatml"), chat_template=BUILTIN_TEMPLATES["chatml"][0])


@pytest.mark.parametrize("name", ["llama-2", "llama-3"])
def test_other_builtins_match_transformers(name: str, hf_chatml: PreTrainedTokenizerFast) -> None:
    source, _, _ = BUILTIN_TEMPLATES[name]
    expected = hf_chatml.apply_chat_template(CHAT, chat_template=source, tokenize=False, add_generation_prompt=True,
                                             bos_token="<s>", eos_token="</s>")
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.render(CHAT) == expected


# ---------------------------------------------------------------- template sources


def test_templates_come_from_the_directory_in_order(tmp_path: Path) -> None:
    assert load_chat_template(tmp_path) is None
    config = {"bos_token": {"content": "<B>"}, "eos_token": "<E>", "chat_template": [
        {"name": "default", "template": "D{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    msgs = [{"role": "user", "content": "x"}]
    assert load_chat_template(tmp_path).render(msgs) == "D<B>x<E>"
    assert load_chat_template(tmp_path, "tool_use").render(msgs, tools=[{}, {}]) == "T2"
    assert load_chat_template(tmp_path, "llama-3").render(msgs) == _expected("llama-3", msgs).replace(
        "<|begin_of_text|>", "<B>")  # a built-in, with the directory's bos token
    with pytest.raises(ChatTemplateError, match="no chat template named 'rag'"):
        load_chat_template(tmp_path, "rag")
    with pytest.raises(ChatTemplateError, match="letters, digits"):
        load_chat_template(tmp_path, "../../etc/passwd")
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template(tmp_path).render(msgs) == "J1"
    config["chat_template"] = "S"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).render(msgs) == "S"


HF_STYLE = """{% for message in messages %}
    {% if message.role == 'user' %}
U: {{ message.content }}
    {% else %}
{{ message.role | upper }}: {{ message.content }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
A:{% endif %}"""


def test_whitespace_control_matches_transformers(hf_chatml: PreTrainedTokenizerFast) -> None:
    expected = hf_chatml.apply_chat_template(CHAT, chat_template=HF_STYLE, tokenize=False, add_generation_prompt=True)
    assert render_chat(HF_STYLE, CHAT) == expected


def test_helpers_and_extra_variables_are_available() -> None:
    msgs = [{"role": "user", "content": "q"}]
    assert render_chat("{{ strftime_now('%Y') }}", msgs) == datetime.now().strftime("%Y")
    assert render_chat("{{ enable_thinking }}|{{ tools is none }}", msgs, enable_thinking=False) == "False|True"
    assert render_chat("{{ {'a': '中'} | tojson }}", msgs) == json.dumps({"a": "中"}, ensure_ascii=False)
    assert render_chat("{% for m in messages %}{% break %}{% endfor %}ok", msgs) == "ok"
    with pytest.raises(ChatTemplateError, match="only user turns"):
        render_chat("{{ raise_exception('only user turns') }}", msgs)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}")


# ---------------------------------------------------------------- sandbox


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{{ messages.append(1) }}",
    "{{ raise_exception.__globals__ }}",
])
def test_sandbox_blocks_attribute_escapes(source: str) -> None:
    with pytest.raises(SecurityError):
        render_chat(source, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% for i in range(10) %}{{ f(n) }}{% endfor %}{% endmacro %}{{ f(0) }}",
    "{% for x in [1] recursive %}{{ loop([1, 2]) }}{% endfor %}",
    "{% for i in range(99999) %}{% for m in messages * 1000 %}{% endfor %}{% endfor %}",
])
def test_templates_that_never_finish_are_stopped(source: str) -> None:
    outcome: list[BaseException | str] = []

    def run() -> None:
        try:
            outcome.append(render_chat(source, [{"role": "user", "content": "x"}] * 10))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)  # daemon: a hang must not block exit
    worker.start()
    worker.join(timeout=10)
    assert outcome, "the template was still rendering after 10 s"
    assert isinstance(outcome[0], SecurityError), outcome[0]


BIG = "y" * 50_000


@pytest.mark.parametrize(("source", "match"), [
    ("{% for i in range(100) %}{{ messages[0].content }}{% endfor %}", "output exceeds"),
    ("{{ 'x' * 1000000000 }}", "repeats a value"),
    ("{{ [messages[0].content] * 100 }}", "repeats a value"),
    ("{{ (['a'] * 1000) | join(messages[0].content) }}", "join would exceed"),
    ("{{ messages[0].content.join(['a'] * 1000) }}", "join would exceed"),
    ("{% set xs = [messages[0].content] * 15 %}{{ ''.join(xs) ~ ''.join(xs) }}", "value past"),
    ("{% set xs = [messages[0].content] * 20 %}{{ xs + xs + xs }}", "value past the"),
    ("{{ 2 ** 1000000 }}", "integer past 4096 bits"),
    ("{{ '%999999999d' % 1 }}", "format width"),
    ("{{ '{:>999999999}'.format(1) }}", "format width"),
    ("{{ '%s' | format(1) }}{{ '%999999999s' | format(1) }}", "format width"),
    ("{{ messages[0].content | replace('y', 'zzzzzzzzzzzzzzzzzzzzzzzz') }}", "replace would exceed"),
    ("{{ (messages[0].content | replace('y', '\n')) | indent(100) }}", "indent would exceed"),
    ("{{ messages[0].content.replace('y', messages[0].content) }}", "replace would exceed"),
    ("{{ 'a'.center(10000000) }}", "integer over"),
    ("{{ messages | tojson(indent=1000) }}", "indent 1000"),
    ("{{ messages | tojson(indent=1000000) }}", "integer over"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "value past"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "value past"),
])
def test_size_limits_fail_clearly_before_allocating(source: str, match: str) -> None:
    limit = time_limit(5.0)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(source, [{"role": "user", "content": BIG}])
    assert time.monotonic() - start < limit


def test_template_source_size_limit() -> None:
    with pytest.raises(ChatTemplateError, match="bytes"):
        ChatTemplate("x" * (MAX_TEMPLATE_BYTES + 1))
    ChatTemplate("x" * MAX_TEMPLATE_BYTES)  # exactly at the limit is fine


def test_output_at_the_limit_renders() -> None:
    text = "z" * (MAX_RENDERED_CHARS // 2)
    assert len(render_chat("{{ messages[0].content }}{{ messages[0].content }}",
                           [{"role": "user", "content": text}])) == MAX_RENDERED_CHARS


# ---------------------------------------------------------------- message validation


@pytest.mark.parametrize(("messages", "tools", "match"), [
    ([], None, "list of 1 to"),
    ("hello", None, "list of 1 to"),
    ([{"role": "root", "content": "x"}], None, "role is one of"),
    (["x"], None, "role is one of"),
    ([{"role": "user", "content": 3}], None, r"messages\[0\].content must be a string"),
    ([{"role": "user"}], None, "content must be a string"),
    ([{"role": "user", "content": "x"}] * 5000, None, "list of 1 to"),
    ([{"role": "user", "content": "x" * (MAX_RENDERED_CHARS + 1)}], None, "characters"),
    ([{"role": "user", "content": "x"}], {"name": "f"}, "tools must be a list"),
    ([{"role": "user", "content": "x", "extra": object()}], None, "plain JSON"),
])
def test_bad_messages_are_rejected_before_rendering(messages: object, tools: object, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        validate_messages(messages, tools)
    with pytest.raises(ChatTemplateError, match=match):
        render_chat("chatml", messages, tools=tools)  # type: ignore[arg-type]


def test_assistant_tool_call_without_content_is_valid() -> None:
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    messages = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "2"}]
    out = render_chat("chatml", messages)
    assert f"<tool_call>\n{json.dumps(call['function'], ensure_ascii=False)}\n</tool_call>" in out
    assert out.endswith("<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n")


def test_a_tokenizer_config_with_values_of_the_wrong_type_is_a_value_error(tmp_path) -> None:
    # Found by tests/fuzz: transformers raised TypeError / AttributeError from such files (a traceback at start-up).
    import json as _json

    from flashllm.models.tokenizer import load_tokenizer
    from flashllm.testing.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path, "qwen2", seed=2)
    for bad in ({"tokenizer_class": "Qwen2Tokenizer", "bos_token": ["<s>"]},
                {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": {"5": "x"}}):
        (model_dir / "tokenizer_config.json").write_text(_json.dumps(bad))
        with pytest.raises(ValueError, match="could not load the tokenizer") as excinfo:
            load_tokenizer(model_dir)
        assert "\n" not in str(excinfo.value)
