"""EXAONE 4.0 GGUF files (`exaone4`), written by flashllm's llama.cpp exporter from tiny transformers Exaone4ForCausalLM
directories, load as llama.cpp runs them: full attention with RoPE everywhere (the 1.2B's layout), and at 64 layers
(the 32B's) three sliding layers of every four beside global layers without RoPE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from flashllm.bench.gguf_export import GGUFExportError, export_gguf  # noqa: E402
from flashllm.models.hf_config import ModelLoadError, load_hf_config  # noqa: E402
from flashllm.testing.gguf_files import (  # noqa: E402
    check_f32_file,
    check_q8_0_logits,
    exports,
    load_float_model,
    rewritten_copy,
)
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41, 8, 200, 77, 12, 1, 202, 64, 33, 7, 210, 150, 9, 60]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exaone4")
    return {"global": build_tiny_model(root / "global", "exaone4", seed=3, sliding_window=None,
                                       layer_types=["full_attention"] * 4),
            "hybrid": build_tiny_model(root / "hybrid", "exaone4", seed=4, num_hidden_layers=64)}


@pytest.fixture(scope="module")
def files(sources, tmp_path_factory):
    return exports(tmp_path_factory.mktemp("gguf"), sources)


@pytest.mark.parametrize("kind", ["global", "hybrid"])
def test_f32_gguf_equals_its_source_directory_and_transformers(kind, sources, files, ops, model_registry,
                                                                paged_driver):
    ours, expected = load_hf_config(files(kind, "f32")), load_hf_config(sources[kind])
    assert (ours.sliding_windows, ours.rope_layers) == (expected.sliding_windows, expected.rope_layers)
    check_f32_file(files(kind, "f32"), sources[kind], ops, model_registry, paged_driver, PROMPT)


def test_the_hybrid_file_slides_three_layers_of_four_and_rotates_only_those(files):
    config = load_hf_config(files("hybrid", "f32"))
    assert config.sliding_windows[:8] == (8, 8, 8, None) * 2
    assert config.rope_layers[:8] == (True, True, True, False) * 2


def test_q8_0_gguf_equals_the_directory_rounded_through_q8_0(sources, files, ops, model_registry, paged_driver,
                                                             tmp_path):
    ours = load_float_model(files("global", "q8_0"), ops, model_registry)
    check_q8_0_logits(ours, sources["global"], ops, model_registry, paged_driver, PROMPT, tmp_path / "rounded")


def test_what_llama_cpp_runs_otherwise_is_refused(files, tmp_path):
    windowed = rewritten_copy(files("global", "f32"), tmp_path / "windowed.gguf",
                              lambda tensors: ((n, np.array(t.data), t.tensor_type) for n, t in tensors.items()),
                              values={"exaone4.attention.sliding_window": 8})
    with pytest.raises(ModelLoadError, match="sliding_window is set on a 4-layer file"):
        load_hf_config(windowed)
    small_hybrid = build_tiny_model(tmp_path / "small", "exaone4", seed=1, tokenizer=False)
    with pytest.raises(GGUFExportError, match="llama.cpp slides only 64-layer files"):
        export_gguf(small_hybrid, tmp_path / "small.gguf")
