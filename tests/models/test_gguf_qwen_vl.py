"""Qwen-VL language-model GGUF files (`qwen2vl`: Qwen2-VL, Qwen2.5-VL; `qwen3vl`: Qwen3-VL dense), written by
flashllm's llama.cpp exporter from tiny transformers vision-language directories, load text-only as llama.cpp runs
them: Qwen2's / Qwen3's decoder with the multimodal RoPE sections turning every pair by the text position (plain
RoPE), equal to the directory loaded by flashllm and to transformers' full vision-language model on text prompts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file  # noqa: E402

from flashllm.bench.gguf_export import export_gguf, gguf_tensor_name  # noqa: E402
from flashllm.models.gguf.qwen_vl import plain_rope_pairs  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config  # noqa: E402
from flashllm.models.text_only import LANGUAGE_PREFIXES, VISION_PREFIXES  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_q8_0_logits,
    exports,
    greedy_tokens,
    load_float_model,
    prompt_logits,
    rewritten_copy,
)
from flashllm.testing.tiny_models import TINY_TOKENIZER_VOCAB  # noqa: E402
from flashllm.testing.tiny_vlm import build_tiny_vlm  # noqa: E402
from flashllm.testing.tokenizer import train_tokenizer  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60, 420, 301]
# name -> (VLM preset, the Hub's layout (else transformers 5's), GGUF arch)
KINDS = {"qwen2_vl": ("qwen2_vl", True, "qwen2vl"), "qwen2_5_vl": ("qwen2_5_vl", False, "qwen2vl"),
         "qwen3_vl": ("qwen3_vl", True, "qwen3vl")}


def _vlm(out: Path, preset: str, seed: int, hub: bool, **text) -> Path:
    """A tiny VLM whose vocabulary holds a trained BPE tokenizer (the exporter writes its vocabulary)."""
    model_dir = build_tiny_vlm(out, preset, seed=seed, original_format=hub, vocab_size=TINY_TOKENIZER_VOCAB, **text)
    train_tokenizer(model_dir, TINY_TOKENIZER_VOCAB)
    return model_dir


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen_vl")
    return {name: _vlm(root / name, preset, seed, hub)
            for seed, (name, (preset, hub, _)) in enumerate(KINDS.items(), start=3)}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


def _language_model(model_dir: Path) -> dict[str, np.ndarray]:
    """The directory's language-model tensors under the converter's GGUF names (the vision tower dropped)."""
    out = {}
    for name, value in load_file(str(model_dir / "model.safetensors")).items():
        if name.startswith(VISION_PREFIXES):
            continue
        for prefix, ours in LANGUAGE_PREFIXES:
            name = ours + name[len(prefix):] if name.startswith(prefix) else name
        out[gguf_tensor_name(name)] = value.float().numpy()
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_file_holds_the_converter_s_names_and_metadata(kind, sources, files) -> None:
    reader = gguf.GGUFReader(files(kind, "f32"))
    arch = KINDS[kind][2]
    assert reader.fields["general.architecture"].contents() == arch
    stored = {t.name: np.array(t.data) for t in reader.tensors}
    expected = _language_model(sources[kind])
    config = load_hf_config(sources[kind])
    if config.tie_word_embeddings:
        expected.pop("output.weight", None)
    assert stored.keys() == expected.keys()
    for name, value in expected.items():
        assert np.array_equal(stored[name].reshape(value.shape), value), name
    assert ("blk.0.attn_q.bias" in stored) == (arch == "qwen2vl")
    assert ("blk.0.attn_q_norm.weight" in stored) == (arch == "qwen3vl")
    sections = reader.fields[f"{arch}.rope.dimension_sections"].contents()
    assert sections == [*config.raw["mrope_section"], 0]
    if arch == "qwen3vl":  # one deepstack layer in the tiny vision tower
        assert reader.fields["qwen3vl.n_deepstack_layers"].contents() == 1


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_gguf_file_loads_the_directory_s_config(kind, sources, files) -> None:
    ours, expected = load_hf_config(files(kind, "f32")), load_hf_config(sources[kind])
    assert ours.architecture == ("Qwen2ForCausalLM" if KINDS[kind][2] == "qwen2vl" else "Qwen3ForCausalLM")
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rotary_dim", "rope_theta", "rope_scaling", "vocab_size",
                  "tie_word_embeddings", "sliding_windows", "qk_norm", "max_position_embeddings"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF's eps is fp32


@pytest.mark.parametrize("kind", list(KINDS))
def test_f32_gguf_equals_its_directory_and_transformers_full_vlm(kind, sources, files, ops, model_registry,
                                                                  paged_driver) -> None:
    from transformers import AutoModelForImageTextToText

    ours = load_float_model(files(kind, "f32"), ops, model_registry)
    logits = prompt_logits(ours, paged_driver, PROMPT)
    directory = prompt_logits(load_float_model(sources[kind], ops, model_registry), paged_driver, PROMPT)
    torch.testing.assert_close(logits, directory, rtol=0, atol=1e-5)
    hf = AutoModelForImageTextToText.from_pretrained(sources[kind], dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([PROMPT])).logits[0]
        tokens = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    torch.testing.assert_close(logits, theirs, rtol=0, atol=1e-4)
    assert greedy_tokens(ours, paged_driver, PROMPT, 8) == tokens[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(kind, sources, files, ops, model_registry,
                                                             paged_driver, tmp_path) -> None:
    ours = load_float_model(files(kind, "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources[kind], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_only_sections_that_cover_every_pair_are_plain_rope_on_text() -> None:
    assert plain_rope_pairs([16, 24, 24, 0], 64, interleaved=False) == []  # Qwen2-VL / Qwen2.5-VL 7B
    assert plain_rope_pairs([16, 24, 20, 4], 64, interleaved=False) == [60, 61, 62, 63]
    assert plain_rope_pairs([11, 11, 10, 0], 32, interleaved=True) == []  # every pair within its span
    # the published Qwen3-VL layout: pairs 61 (height) and 62 (width) lie past 3 x 20 and fall to the extra position
    assert plain_rope_pairs([24, 20, 20, 0], 64, interleaved=True) == [61, 62]


def _copied(tensors):
    return ((name, np.array(tensor.data), tensor.tensor_type) for name, tensor in tensors.items())


@pytest.mark.parametrize(("kind", "values", "dropped", "fragment"), [
    ("qwen2_vl", {"qwen2vl.rope.dimension_sections": [2, 3, 2, 1]}, (), r"leaves rotary pairs \[7\]"),
    ("qwen2_vl", {}, ("rope.dimension_sections",), "needs four non-negative multimodal RoPE sections"),
    ("qwen3_vl", {"qwen3vl.n_deepstack_layers": 9}, (), "n_deepstack_layers is 9"),
])
def test_what_llama_cpp_runs_otherwise_is_refused_in_one_line(kind, values, dropped, fragment, files,
                                                               tmp_path) -> None:
    changed = rewritten_copy(files(kind, "f32"), tmp_path / "changed.gguf", _copied, values=values, dropped=dropped)
    with pytest.raises(ModelLoadError, match=fragment) as info:
        load_hf_config(changed)
    assert "\n" not in str(info.value)


def test_qwen3_vl_sections_leaving_pairs_to_llama_cpp_s_extra_position_run_as_transformers(tmp_path, ops,
                                                                                           model_registry,
                                                                                           paged_driver) -> None:
    """[8, 4, 4] over 16 pairs leaves pairs 13 and 14 past the height / width spans (as the published [24, 20, 20]
    leaves 61 and 62): the file exports and loads, and its logits are transformers' full VLM's, those pairs turned by
    the text position."""
    from transformers import AutoModelForImageTextToText

    model_dir = _vlm(tmp_path / "src", "qwen3_vl", 1, True,
                     rope_parameters={"rope_type": "default", "mrope_section": [8, 4, 4], "mrope_interleaved": True,
                                      "rope_theta": 100.0})  # a small base: pairs 13 and 14 turn ~0.02 rad a step
    assert plain_rope_pairs([8, 4, 4, 0], 16, interleaved=True) == [13, 14]
    path = export_gguf(model_dir, tmp_path / "out.gguf")
    logits = prompt_logits(load_float_model(path, ops, model_registry), paged_driver, PROMPT)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, theirs, rtol=0, atol=1e-4)
