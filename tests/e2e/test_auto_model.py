"""AutoModel as PaddleNLP / transformers users call it: from_pretrained, generate, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashllm
from flashllm.auto_model import AutoModel, token_rows
from flashllm.models.builtin_templates import BUILTIN_TEMPLATES
from flashllm.models.chat_template import ChatTemplateError
from flashllm.sampling_params import SamplingParams
from flashllm.testing.tiny_models import build_tiny_model

ENGINE = dict(dtype="float32", device="cpu", block_size=16, max_model_len=256, num_kv_blocks=64)
STEPS = 4
EOS = 0  # the tiny tokenizer's <|endoftext|>
# What each published prompt format writes around a user turn "hello" (from the formats' docs).
BUILTIN_MARKERS = {
    "chatml": "<|im_start|>user\nhello<|im_end|>\n",
    "llama-2": "[INST] hello [/INST]",
    "llama-3": "<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>",
    "chatglm2": "[gMASK]sop[Round 1]\n\n问：hello\n\n答：",
    "chatglm3": "[gMASK]sop<|user|>\n hello<|assistant|>",
    "glm-4": "[gMASK]<sop><|user|>\nhello<|assistant|>",
    "qwen": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n",
    "baichuan-2": "<reserved_106>hello<reserved_107>",
}
# a template whose prompt is another's after a turn of its own (Qwen-Chat: ChatML after a default system turn)
CONTAINS = {"qwen": "chatml"}
CUSTOM = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}ANSWER:"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=5)


@pytest.fixture(scope="module")
def model(qwen_dir: Path) -> AutoModel:
    return AutoModel.from_pretrained(qwen_dir, **ENGINE)


@pytest.fixture(scope="module")
def llama_with_defaults(tmp_path_factory: pytest.TempPathFactory) -> AutoModel:
    """A model whose generation_config.json carries sampling defaults."""
    path = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=6)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(max_new_tokens=5, do_sample=True, temperature=0.7, top_p=0.8)
    (path / "generation_config.json").write_text(json.dumps(config))
    return AutoModel.from_pretrained(str(path), **ENGINE)


def _prompts(lengths=(3, 11, 20), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(hf_model, prompt: list[int], steps: int) -> list[int]:
    """Greedy by repeated full forwards, stopping after EOS like the engine does."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == EOS:
                break
    return ids[len(prompt):]


def test_greedy_generate_matches_llm_and_transformers(model: AutoModel, qwen_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = _prompts()
    out = model.generate(inputs=prompts, max_new_tokens=STEPS, do_sample=False)
    llm_out = model.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS))
    assert out == [o.outputs[0].token_ids for o in llm_out]
    hf_model = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    assert out == [_hf_greedy(hf_model, p, STEPS) for p in prompts]


def test_input_forms_agree(model: AutoModel) -> None:
    prompts = _prompts(seed=1)
    expected = model.generate(prompts, max_new_tokens=STEPS)
    assert model.generate(prompts[1], max_new_tokens=STEPS) == [expected[1]]
    assert model.generate(input_ids=torch.tensor(prompts[0]), max_new_tokens=STEPS) == [expected[0]]
    assert model.generate([torch.tensor(p) for p in prompts], max_new_tokens=STEPS) == expected


def test_left_padded_tensor_with_attention_mask_equals_unpadded(model: AutoModel) -> None:
    prompts = _prompts(lengths=(5, 9, 19), seed=2)
    width, pad = max(map(len, prompts)), 7
    left = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    right = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    left_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    expected = model.generate(prompts, max_new_tokens=STEPS)
    assert model.generate(inputs=left, attention_mask=left_mask, max_new_tokens=STEPS) == expected
    assert model.generate(right, attention_mask=left_mask.flip(1), max_new_tokens=STEPS) == expected
    assert model.generate(left, pad_token_id=pad, max_new_tokens=STEPS) == expected


def test_tokenizer_batch_encoding_with_left_padding(model: AutoModel) -> None:
    texts = ["The quick brown fox", "Hello"]
    tokenizer, side = model.tokenizer, model.tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        batch = tokenizer(texts, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    assert (batch["attention_mask"] == 0).any(), "the test needs a padded batch"
    unpadded = [tokenizer(t).input_ids for t in texts]
    assert model.generate(batch, max_new_tokens=STEPS) == model.generate(unpadded, max_new_tokens=STEPS)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 1000), min_size=1, max_size=12), min_size=1, max_size=5),
       left=st.booleans(), as_tensor=st.booleans())
def test_token_rows_removes_exactly_the_padding(rows: list[list[int]], left: bool, as_tensor: bool) -> None:
    width = max(map(len, rows))
    padded = [[0] * (width - len(r)) + r if left else r + [0] * (width - len(r)) for r in rows]
    mask = [[int(i >= width - len(r)) if left else int(i < len(r)) for i in range(width)] for r in rows]
    if as_tensor:
        padded, mask = torch.tensor(padded), torch.tensor(mask)
    assert token_rows(padded, mask) == rows
    if left:
        assert token_rows(padded, pad_token_id=0) == rows


@pytest.mark.parametrize("inputs, mask, error, words", [
    ([[1, 2, 3]], [[1, 0, 1]], ValueError, "between real tokens"),
    ([[1, 2, 3]], [[1, 1]], ValueError, "same shape"),
    ([[1, 2], [3, 4]], [[1, 1]], ValueError, "rows"),
    ([[5, 6]], [[0, 0]], ValueError, "no tokens"),
    (torch.tensor([[1.0, 2.0]]), None, TypeError, "integers"),
    ("hello", None, TypeError, "tokenize"),
    ([], None, ValueError, "empty"),
    (None, None, TypeError, "needs inputs"),
])
def test_bad_inputs_are_rejected_with_a_reason(inputs, mask, error, words: str) -> None:
    with pytest.raises(error, match=words):
        token_rows(inputs, mask)


def test_seeded_sampling_is_reproducible_and_samples(model: AutoModel) -> None:
    prompts = _prompts(lengths=(4, 9), seed=3)
    knobs = dict(max_new_tokens=6, do_sample=True, top_p=0.95, temperature=1.5, top_k=0,
                 repetition_penalty=1.0)
    first = model.generate(inputs=prompts, seed=11, **knobs)
    assert model.generate(inputs=prompts, seed=11, **knobs) == first
    assert model.generate(inputs=prompts, seed=12, **knobs) != first
    greedy = model.generate(inputs=prompts, max_new_tokens=6, do_sample=False)
    assert first != greedy
    # top_k=1 keeps only the argmax, so sampling must reproduce greedy decoding.
    assert model.generate(inputs=prompts, max_new_tokens=6, do_sample=True, top_k=1, seed=5) == greedy


def test_num_return_sequences_rows_follow_input_order(model: AutoModel) -> None:
    prompts = _prompts(lengths=(4, 9), seed=4)
    knobs = dict(max_new_tokens=5, do_sample=True, seed=3, num_return_sequences=2)
    both = model.generate(prompts, **knobs)
    assert len(both) == 4
    assert both[:2] == model.generate(prompts[0], **knobs)
    assert both[2:] == model.generate(prompts[1], **knobs)


def test_hf_names_map_to_sampling_params(model: AutoModel) -> None:
    greedy = model.sampling_params(do_sample=False, temperature=0.9, top_k=5)
    assert greedy.is_greedy
    sampled = model.sampling_params(do_sample=True, temperature=0.95, top_p=0.7, top_k=0,
                                    repetition_penalty=1.1, seed=9, max_new_tokens=100, eos_token_id=[3, 4])
    assert (sampled.temperature, sampled.top_p, sampled.repetition_penalty, sampled.seed) == (0.95, 0.7, 1.1, 9)
    assert sampled.top_k == -1, "top_k=0 must switch top-k filtering off"
    assert sampled.max_tokens == 100 and sampled.stop_token_ids == [3, 4]
    assert model.sampling_params(eos_token_id=7).stop_token_ids == [7]
    assert model.sampling_params().max_tokens == 20 and model.sampling_params().is_greedy
    with pytest.raises(ValueError, match="temperature > 0"):
        model.sampling_params(do_sample=True, temperature=0.0)


def test_default_lengths_come_from_generation_config(model: AutoModel, llama_with_defaults: AutoModel) -> None:
    prompt = _prompts(lengths=(6,), seed=5)
    (out,) = model.generate(prompt)
    assert len(out) == 20 or (out[-1] == EOS and len(out) < 20)
    defaults = llama_with_defaults.sampling_params()
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p) == (5, 0.7, 0.8)
    assert llama_with_defaults.sampling_params(do_sample=False).is_greedy
    assert llama_with_defaults.sampling_params(max_new_tokens=3).max_tokens == 3
    (out,) = llama_with_defaults.generate(prompt, seed=1)
    assert len(out) == 5 or (out[-1] == EOS and len(out) < 5)


@pytest.mark.parametrize("name", sorted(BUILTIN_MARKERS))
def test_builtin_chat_templates_render_their_format(model: AutoModel, name: str) -> None:
    model.set_chat_template(name)
    try:
        text = model.render_chat([{"role": "user", "content": "hello"}])
    finally:
        model.set_chat_template(None)
    assert BUILTIN_MARKERS[name] in text
    for other, marker in BUILTIN_MARKERS.items():
        if other not in (name, CONTAINS.get(name)):
            assert marker not in text


def test_every_builtin_template_has_a_marker_here() -> None:
    assert set(BUILTIN_TEMPLATES) == set(BUILTIN_MARKERS)


def test_custom_template_string_and_file(model: AutoModel, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    expected = "<system>Be brief.</system><user>hi</user>ANSWER:"
    default = model.render_chat(messages)
    assert default.endswith("<|im_start|>assistant\n")  # the tiny model's own chatml template
    path = tmp_path / "mine.jinja"
    path.write_text(CUSTOM, encoding="utf-8")
    try:
        for template in (CUSTOM, path, str(path)):
            model.set_chat_template(template)
            assert model.render_chat(messages) == expected
    finally:
        model.set_chat_template(None)
    assert model.render_chat(messages) == default


def test_chat_generates_from_the_stored_template(model: AutoModel) -> None:
    expected_prompt = "<user>What is 2+2?</user>ANSWER:"
    ids = model.tokenizer.encode(expected_prompt, add_special_tokens=False)
    (reply_ids,) = model.generate(ids, max_new_tokens=STEPS, do_sample=False)
    model.set_chat_template(CUSTOM)
    try:
        reply = model.chat([{"role": "user", "content": "What is 2+2?"}], max_new_tokens=STEPS)
        assert reply == model.chat("What is 2+2?", max_new_tokens=STEPS)
    finally:
        model.set_chat_template(None)
    assert reply == model.tokenizer.decode(reply_ids, skip_special_tokens=True)


def test_unknown_template_name_lists_the_builtins(model: AutoModel, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError) as info:
        model.set_chat_template("llama-7")
    assert all(name in str(info.value) for name in BUILTIN_TEMPLATES)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model.set_chat_template(str(tmp_path / "absent.jinja"))


def test_unknown_kwargs_are_named(model: AutoModel) -> None:
    with pytest.raises(TypeError) as info:
        model.generate([1, 2, 3], max_new_tokens=2, beams=4, early_stop=True)
    assert "beams" in str(info.value) and "early_stop" in str(info.value)
    with pytest.raises(TypeError, match="max_new_tokens"):
        model.generate([1, 2, 3], max_length=8)
    with pytest.raises(TypeError, match="temprature"):
        model.chat("hi", temprature=0.5)
    with pytest.raises(TypeError, match="not both"):
        model.generate([1, 2], input_ids=[3, 4])


def test_facade_exposes_the_llm(model: AutoModel, qwen_dir: Path) -> None:
    assert flashllm.AutoModel is AutoModel
    assert model.tokenizer is model.llm.tokenizer
    assert model.llm.engine.parts.model_dir == qwen_dir
    with pytest.raises(TypeError, match="unknown LLM options"):
        AutoModel.from_pretrained(qwen_dir, use_flash_attention=True)
