"""Property fuzzing of what reads untrusted input: config.json, tokenizer_config.json, chat templates, safetensors
headers, tool calls.

10,000 examples each at the default size (FLASHLLM_FUZZ_EXAMPLES x 67). Each parser may only
answer with its documented error (ModelLoadError, ChatTemplateError) or a result that satisfies
its contract; any other exception, a hang past hypothesis' deadline or a multi-line error fails.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashllm.models.chat_template import ChatTemplateError, render_chat
from flashllm.models.errors import ModelLoadError
from flashllm.models.hf_config import parse_hf_config
from flashllm.models.loader import _iter_tensors
from flashllm.models.tokenizer import load_chat_template, load_tokenizer
from flashllm.serving.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from flashllm.testing.tiny_models import build_tiny_model

EXAMPLES = int(os.environ.get("FLASHLLM_FUZZ_EXAMPLES", "150")) * 67
FUZZ = settings(max_examples=EXAMPLES, deadline=timedelta(seconds=5), derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=16,
)
BASE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
               "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
CONFIG_KEYS = [*BASE_CONFIG, "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "sliding_window",
               "tie_word_embeddings", "torch_dtype", "quantization_config", "hidden_act", "auto_map",
               "partial_rotary_factor", "bos_token_id", "eos_token_id", "layer_types"]


@FUZZ
@given(st.dictionaries(st.sampled_from(CONFIG_KEYS), json_values, max_size=8), st.booleans())
def test_config_parser(overrides: dict[str, object], drop_base: bool) -> None:
    raw = overrides if drop_base else {**BASE_CONFIG, **overrides}
    try:
        config = parse_hf_config(raw)
    except ModelLoadError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    assert config.num_hidden_layers >= 1 and config.vocab_size >= 1


TEMPLATE_PIECES = ["{{ ", " }}", "{% ", " %}", "{# ", " #}", "messages", "message", "['content']", ".content",
                   "for message in messages", "endfor", "if ", "endif", "else", "loop.index", " ~ ", " + ",
                   "| upper", "| tojson", "| length", "raise_exception('x')", "range(", "9999999", ")", "(",
                   "'a' * ", "namespace(", "set ", " = ", "x", ".__class__", "bos_token", "add_generation_prompt",
                   "\n", "<|im_start|>", "strftime_now('%Y')", "[", "]", "{", "}", "|", "'", '"']


@FUZZ
@given(st.lists(st.sampled_from(TEMPLATE_PIECES) | st.text(max_size=6), max_size=24).map("".join),
       st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                       "content": st.text(max_size=40)}), max_size=4))
def test_chat_template_renderer(source: str, messages: list[dict[str, str]]) -> None:
    try:
        rendered = render_chat(source, messages)
    except ChatTemplateError as exc:
        assert str(exc)
        return
    assert isinstance(rendered, str)


def _safetensors_bytes(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


header_json = st.dictionaries(
    st.sampled_from(["w", "b", "__metadata__", "x.y"]),
    st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "F64", "BOOL", "XX", ""]),
                           "shape": st.lists(st.integers(-2, 2**40), max_size=3),
                           "data_offsets": st.lists(st.integers(-2, 2**40), max_size=3)}) | json_values,
    max_size=3,
).map(lambda d: json.dumps(d).encode())


@FUZZ
@given(st.one_of(header_json, st.binary(max_size=64)), st.binary(max_size=64), st.integers(0, 3))
def test_safetensors_header_reader(header: bytes, data: bytes, length_lie: int) -> None:
    blob = _safetensors_bytes(header, data)
    if length_lie:  # a length prefix that points past, inside or far beyond the header
        blob = struct.pack("<Q", [0, len(header) + 7, 2**62][length_lie - 1]) + blob[8:]
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.safetensors"
        path.write_bytes(blob)
        try:
            for _name, tensor in _iter_tensors({path: None}, False, set()):
                assert tensor is not None
        except ModelLoadError as exc:
            assert "\n" not in str(exc)


names = st.sampled_from(["f", "get_weather", "g_2", "h-3"])
call_blocks = st.builds(lambda n, a: json.dumps({"name": n, "arguments": a}), names, json_values)
pieces = st.sampled_from([TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "{", "}", '"', "\n", " ", "<tool", "_call>"]) \
    | st.text(max_size=10) | call_blocks


@FUZZ
@given(st.lists(pieces, max_size=20).map("".join), st.sampled_from([None, ["f", "get_weather"]]))
def test_tool_call_parser(text: str, tool_names: list[str] | None) -> None:
    parsed = parse_tool_calls(text, tool_names)
    for call in parsed.tool_calls:
        assert tool_names is None or call.name in tool_names
        assert isinstance(json.loads(call.arguments), dict) and call.name
    assert parsed.content is None or parsed.content.strip() == parsed.content


TOKENIZER_KEYS = ["bos_token", "eos_token", "unk_token", "pad_token", "additional_special_tokens",
                  "extra_special_tokens", "clean_up_tokenization_spaces", "chat_template", "tokenizer_class",
                  "model_max_length", "added_tokens_decoder", "auto_map"]
token_values = json_values | st.sampled_from(["<|im_end|>", "", "\n", {"content": "<s>"}, {"content": 5},
                                              [{"name": "default", "template": "{{ 1 }}"}], "PreTrainedTokenizerFast",
                                              "Qwen2Tokenizer", "LlamaTokenizer", "NoSuchTokenizer"])


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("fuzz-tokenizer"), "qwen2", seed=2)
    return (model_dir / "tokenizer.json").read_bytes()


@FUZZ
@given(config=st.dictionaries(st.sampled_from(TOKENIZER_KEYS), token_values, max_size=6) | json_values)
def test_tokenizer_config_reader(tokenizer_json: bytes, config: object) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "tokenizer.json").write_bytes(tokenizer_json)
        (root / "tokenizer_config.json").write_text(json.dumps(config))
        for load in (load_tokenizer, load_chat_template):
            try:
                result = load(root)
            except (ValueError, ModelLoadError) as exc:  # ChatTemplateError is a ValueError
                assert str(exc)
                continue
            assert result is None or load is load_tokenizer or isinstance(result.source, str)
