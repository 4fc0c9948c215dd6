"""Property fuzzing of what reads untrusted input: config.json, tokenizer_config.json, chat templates, safetensors
headers, GGUF files, tool calls.

10,000 examples each at the default size (FLASHLLM_FUZZ_EXAMPLES x 67). Each parser may only
answer with its documented error (ModelLoadError, ChatTemplateError) or a result that satisfies
its contract; any other exception, a hang past hypothesis' deadline or a multi-line error fails.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import tracemalloc
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashllm.models.chat_template import ChatTemplateError, render_chat
from flashllm.models.errors import ModelLoadError
from flashllm.models.gguf import open_gguf
from flashllm.models.gguf.config import gguf_config_dict
from flashllm.models.gguf.reader import SUPPORTED_TYPE_NAMES
from flashllm.models.gguf.tokenizer import build_gguf_tokenizer
from flashllm.models.hf_config import parse_hf_config
from flashllm.models.loader import _iter_tensors
from flashllm.models.tokenizer import load_chat_template, load_tokenizer
from flashllm.serving.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from flashllm.testing.gguf_files import quantize_rows
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


@dataclass(frozen=True)
class GGUFSeed:
    """A small valid GGUF file and where its header's numbers lie: (byte offset, width) of every count,
    length, value type, scalar value, tensor dimension, tensor type and data offset."""

    data: bytes
    slots: list[tuple[int, int]]
    arrays: list[int]  # where each metadata array's item type lies (its uint64 length follows)
    header_end: int  # where the tensor data starts: mutations before it hit the structure


@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory: pytest.TempPathFactory) -> GGUFSeed:
    """Written with the gguf package's writer, as tests/models/test_gguf_refusals.py writes its small
    files: every value kind the reader decodes (strings, ints, floats, a bool, arrays of strings and
    ints) and float and block-quantized tensors; small, so that most mutations land in the header."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("fuzz-gguf") / "seed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, 32),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, 64),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 1),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_tokenizer_model, "gpt2"), (writer.add_tokenizer_pre, "gpt-2"),
                       (writer.add_token_merges, ["a b", "ab c"]), (writer.add_eos_token_id, 1),
                       (writer.add_add_bos_token, False), (writer.add_chat_template, "{{ messages }}")):
        add(value)
    tokens = ["<s>", "</s>", "a", "b", "c", "ab", "abc", " "]
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, *[1] * (len(tokens) - 2)])  # CONTROL, then NORMAL
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", quantize_rows(rng.standard_normal((32, 32), dtype=np.float32), "Q8_0"),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_k.weight", rng.standard_normal((16, 32)).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    reader = gguf.GGUFReader(str(path))
    base = reader.data.__array_interface__["data"][0]
    parts = [part for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]
             for part in field.parts if part.dtype != np.uint8]  # uint8 parts are string bytes
    slots = sorted({(part.__array_interface__["data"][0] - base, part.itemsize) for part in parts})
    arrays = [field.parts[3].__array_interface__["data"][0] - base for field in reader.fields.values()
              if field.types[0] == gguf.GGUFValueType.ARRAY]
    return GGUFSeed(data, slots, arrays, int(reader.data_offset))


def _interesting(width: int, file_size: int) -> st.SearchStrategy[int]:
    """Values for a `width`-byte little-endian slot: edges, sizes near the file's, and anything."""
    top = (1 << (8 * width)) - 1
    edges = [0, 1, 2, 4, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 1 << 15, 1 << 16, (1 << 31) - 1, 1 << 31,
             (1 << 32) - 1, 1 << 32, 1 << 40, 1 << 62, 1 << 63, top, file_size // 8, file_size // 4, file_size // 2,
             file_size - 1, file_size, file_size + 1]
    return st.sampled_from([e & top for e in edges]) | st.integers(0, top)


@st.composite
def mutated_gguf(draw: st.DrawFn, seed: GGUFSeed) -> bytes:
    """The seed with header numbers rewritten, header bytes overwritten, and maybe cut short (each kind
    rare enough that a good share of the files still parse and reach the config and tokenizer)."""
    data = bytearray(seed.data)
    for offset, width in draw(st.lists(st.sampled_from(seed.slots), max_size=3)):
        data[offset:offset + width] = draw(_interesting(width, len(data))).to_bytes(width, "little")
    if draw(st.integers(0, 3)) == 0:  # an array retyped, its length up to what the rest of the file holds
        offset = draw(st.sampled_from(seed.arrays))
        item_type = draw(st.integers(0, 13))
        length = draw(st.integers(0, len(data) - offset - 12) | _interesting(8, len(data)))
        data[offset:offset + 12] = struct.pack("<IQ", item_type, length)
    if draw(st.integers(0, 3)) == 0:
        offset = draw(st.integers(0, seed.header_end - 1))
        junk = draw(st.binary(min_size=1, max_size=8))
        data[offset:offset + len(junk)] = junk
    if draw(st.integers(0, 3)) == 0:
        data = data[:draw(st.integers(0, len(data)))]
    return bytes(data)


# What reading a file may allocate: the gguf package's reader builds two numpy views (~1.5 KB) per
# string of 8 or more bytes, so up to ~200 bytes per byte of a file that is all short strings; past
# that a count or length was believed before it was checked, or numbers got a view each (~700 bytes
# for one byte of uint8 or bool).
GGUF_PEAK_BASE = 1 << 20
GGUF_PEAK_PER_BYTE = 256


def _read_gguf(path: Path) -> None:
    """What loading does with a GGUF file before any weight: open, decode every metadata value, map
    the tensors, map the config and build the tokenizer."""
    gf = open_gguf(path)
    for key in gf.keys():
        gf.get(key)
    for tensor in gf.tensors.values():  # GGUFFile's promise: inside the file, a type flashllm loads
        assert tensor.data.nbytes == tensor.n_bytes and tensor.data_offset + tensor.n_bytes <= gf.size, tensor.name
        assert tensor.tensor_type.name in SUPPORTED_TYPE_NAMES, f"{tensor.name} is {tensor.tensor_type.name}"
    gguf_config_dict(gf)
    build_gguf_tokenizer(gf)


@FUZZ
@given(data=st.data())
def test_gguf_reader(gguf_seed: GGUFSeed, data: st.DataObject) -> None:
    blob = data.draw(mutated_gguf(gguf_seed))
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.gguf"
        path.write_bytes(blob)
        tracemalloc.start()
        try:
            _read_gguf(path)
        except ModelLoadError as exc:
            assert "\n" not in str(exc) and str(exc)
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
    assert peak < GGUF_PEAK_BASE + GGUF_PEAK_PER_BYTE * len(blob), f"reading a {len(blob)}-byte file allocated {peak} bytes"


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
