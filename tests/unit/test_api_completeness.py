"""Serve flags (--quant_type/--quantization, --kv-cache-dtype, repeated --served-model-name, --device gpu),
quant_type a8w8c8, and AutoModel.generate with PaddleNLP's decode_strategy / num_beams."""

from __future__ import annotations

import argparse

import pytest

from flashllm.cli import serve as serve_cli
from flashllm.llm import engine_config


def _resolve(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    return serve_cli.resolve_options(parser.parse_args(["serve", *argv]), {})


@pytest.mark.parametrize("flag", ["--quant_type", "--quant-type", "--quantization"])
def test_serve_quant_type_spellings(flag: str) -> None:
    options = _resolve([flag, "weight_only_int8", "--kv_cache_dtype", "int8"])
    assert options["quant_type"] == "weight_only_int8" and options["kv_cache_dtype"] == "int8"
    assert _resolve([])["quant_type"] == "none"


def test_served_model_name_repeats() -> None:
    assert _resolve(["--served-model-name", "a", "--served-model-name", "b"])["served_model_name"] == ["a", "b"]


def test_a8w8c8_is_a8w8_with_a_static_int8_kv_cache() -> None:
    config = engine_config(None, quant_type="a8w8c8", cachekv_int8_type="dynamic")
    assert (config.quant.quant_type, config.cache.kv_cache_dtype, config.cache.cachekv_int8_type) == \
        ("a8w8", "int8", "static")
    with pytest.raises(ValueError, match="a8w8c8"):
        engine_config(None, quant_type="a8w8c8", kv_cache_dtype="fp8")


def test_device_gpu_means_cuda() -> None:
    from flashllm.registry.plugins import make_plugin_manager
    from flashllm.registry.resolve import DeviceSelectionError, select_device

    try:
        selection = select_device("gpu", plugins=make_plugin_manager(load_entry_points=False))
    except DeviceSelectionError as exc:  # no GPU here: the error must speak of cuda, not an unknown "gpu"
        assert "'cuda'" in str(exc)
    else:
        assert selection.device.type == "cuda"


@pytest.fixture(scope="module")
def auto_model(tmp_path_factory: pytest.TempPathFactory):
    from flashllm.auto_model import AutoModel
    from flashllm.testing.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("paddle"), "llama", seed=2)
    return AutoModel.from_pretrained(str(path), dtype="float32", device="cpu", max_model_len=128)


def test_paddle_decode_strategies(auto_model) -> None:
    ids = [[5, 6, 7, 8], [9, 10]]
    greedy = auto_model.generate(ids, max_new_tokens=6, do_sample=False)
    assert auto_model.generate(ids, decode_strategy="greedy_search", max_new_tokens=6) == greedy
    sampled = auto_model.generate(ids, decode_strategy="sampling", top_p=0.9, temperature=0.7, seed=3,
                                  max_new_tokens=6)
    assert sampled == auto_model.generate(ids, do_sample=True, top_p=0.9, temperature=0.7, seed=3, max_new_tokens=6)
    beams = auto_model.generate(ids, decode_strategy="beam_search", num_beams=3, max_new_tokens=6,
                                num_return_sequences=2)
    expected = auto_model.llm.beam_search(ids, beam_width=3, max_tokens=6)
    assert beams == [list(c.token_ids) for o in expected for c in o.outputs[:2]]
    assert auto_model.generate(ids, decode_strategy="beam_search", num_beams=1, max_new_tokens=6) == greedy
    with pytest.raises(ValueError, match="decode_strategy"):
        auto_model.generate(ids, decode_strategy="contrastive")


def test_every_served_model_name_is_accepted() -> None:
    from types import SimpleNamespace

    from flashllm.serving.openai_api import check_model
    from flashllm.serving.protocol import APIError

    ctx = SimpleNamespace(model_name="main", model_aliases=("alias",), loras={})
    assert check_model(ctx, "main") is None and check_model(ctx, "alias") is None
    with pytest.raises(APIError, match="not served"):
        check_model(ctx, "other")
