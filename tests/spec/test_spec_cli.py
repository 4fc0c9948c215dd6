"""Speculative decoding flags: PaddleNLP's and vLLM's spellings on generate, predict and serve, mapped to
LLM(speculative_config=...); tuning flags without a method are refused."""

from __future__ import annotations

import argparse

import pytest

from flashllm.cli import build_parser
from flashllm.cli.serve import resolve_options
from flashllm.cli.spec_flags import speculative_config
from flashllm.llm import engine_config


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--speculate_method", "inference_with_reference", "--speculate_max_draft_token_num", "5",
     "--speculate_max_ngram_size", "2"],
    ["generate", "hi", "--speculate-method", "inference_with_reference", "--num-speculative-tokens", "5",
     "--speculate-max-ngram-size", "2"],
    ["predict", "--speculate_method", "inference_with_reference", "--speculate_max_draft_token_num", "5",
     "--speculate_max_ngram_size", "2"],
])
def test_flags_become_the_speculative_config(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    config = speculative_config(args)
    assert config == {"method": "inference_with_reference", "num_speculative_tokens": 5, "max_ngram_size": 2}
    spec = engine_config(None, speculative_config=config).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.max_ngram_size) == ("inference_with_reference", 5, 2)


def test_a_draft_model_implies_its_method_and_no_flag_means_off() -> None:
    args = build_parser().parse_args(["generate", "hi", "--speculative-model", "/models/draft"])
    assert speculative_config(args) == {"model": "/models/draft"}
    assert engine_config(None, speculative_config=speculative_config(args)).speculative.method == "draft_model"
    assert speculative_config(build_parser().parse_args(["generate", "hi"])) is None
    with pytest.raises(ValueError, match="need --speculate_method"):
        speculative_config(argparse.Namespace(speculate_max_draft_token_num=3))


def test_the_draft_models_quantization_flags_reach_its_config() -> None:
    args = build_parser().parse_args(["generate", "hi", "--speculative-model", "/models/draft",
                                      "--speculative_quant_type", "weight_only_int4",
                                      "--speculative-weightonly-group-size", "64"])
    spec = engine_config(None, speculative_config=speculative_config(args)).speculative
    assert (spec.method, spec.quant_type, spec.group_size) == ("draft_model", "weight_only_int4", 64)


def test_serve_reads_the_flags_and_their_environment_variables() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--speculate_method", "ngram", "--speculate-max-draft-token-num", "3"])
    options = resolve_options(args, environ={"FLASHLLM_SPECULATE_MAX_NGRAM_SIZE": "4"})
    assert speculative_config(options) == {"method": "ngram", "num_speculative_tokens": 3, "max_ngram_size": 4}
    with pytest.raises(SystemExit, match="speculate"):
        resolve_options(parser.parse_args(["serve", "--mode", "static", "--speculate_method", "ngram"]), environ={})


VLLM_NGRAM = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


@pytest.mark.parametrize("argv", [["generate", "hi", "--speculative-config", VLLM_NGRAM],
                                  ["predict", "--speculative_config", VLLM_NGRAM],
                                  ["bench", "latency", "--speculative-config", VLLM_NGRAM]])
def test_vllms_speculative_config_json_flag(argv: list[str]) -> None:
    spec = engine_config(None, speculative_config=speculative_config(build_parser().parse_args(argv))).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.max_ngram_size, spec.min_ngram_size) == ("ngram", 5, 4, 2)


def test_the_json_flag_takes_a_draft_model_and_flags_add_keys_it_lacks() -> None:
    args = build_parser().parse_args(["generate", "hi", "--speculative-config",
                                      '{"model": "/models/draft", "quantization": "weight_only_int4"}',
                                      "--speculate_max_draft_token_num", "8"])
    spec = engine_config(None, speculative_config=speculative_config(args)).speculative
    assert (spec.method, spec.model, spec.quant_type, spec.num_speculative_tokens) == (
        "draft_model", "/models/draft", "weight_only_int4", 8)


@pytest.mark.parametrize(("argv", "error"), [
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', "--num-speculative-tokens", "6"],
     "gives num_speculative_tokens 4 and --speculate_max_draft_token_num gives 6"),
    (["--speculative-config", '{"prompt_lookup_max": 3, "speculate_max_ngram_size": 4, "method": "ngram"}'],
     "gives max_ngram_size twice"),
    (["--speculative-config", '{"num_speculative_tokens": 4}'], "need --speculate_method"),
])
def test_the_json_flag_refuses_disagreements_and_a_missing_method(argv: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        speculative_config(build_parser().parse_args(["generate", "hi", *argv]))


@pytest.mark.parametrize(("text", "error"), [("{method: ngram}", "not JSON"), ("[1, 2]", "expected a JSON object")])
def test_the_json_flag_must_hold_a_json_object(text: str, error: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--speculative-config", text])
    err = capsys.readouterr().err
    assert "speculative" in err and error in err


def test_unknown_keys_in_the_json_flag_are_named() -> None:
    with pytest.raises(TypeError, match=r"unknown --speculative-config keys \['draft_tensor_parallel_size'\]"):
        speculative_config(build_parser().parse_args(["generate", "hi", "--speculative-config",
                                                      '{"method": "ngram", "draft_tensor_parallel_size": 1}']))


def test_serve_takes_the_json_from_the_environment_and_as_a_yaml_mapping(tmp_path) -> None:
    parser = build_parser()
    options = resolve_options(parser.parse_args(["serve"]), environ={"FLASHLLM_SPECULATIVE_CONFIG": VLLM_NGRAM})
    assert speculative_config(options) == {"method": "ngram", "num_speculative_tokens": 5, "max_ngram_size": 4,
                                           "min_ngram_size": 2}
    config = tmp_path / "serve.yaml"
    config.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 3\n")
    options = resolve_options(parser.parse_args(["serve", "--config", str(config)]), environ={})
    assert speculative_config(options) == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit, match="not a valid speculative_config"):
        resolve_options(parser.parse_args(["serve"]), environ={"FLASHLLM_SPECULATIVE_CONFIG": "[3]"})


def test_metrics_report_acceptance() -> None:
    from flashllm.serving.async_engine import EngineStats
    from flashllm.serving.metrics import ServerMetrics

    stats = EngineStats(spec_rounds=10, spec_drafted=40, spec_accepted=30, spec_emitted=40)
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'flashllm:spec_decode_acceptance_rate{model_name="m"} 0.75' in text
    assert 'flashllm:spec_decode_mean_accepted_length{model_name="m"} 4.0' in text
    assert 'flashllm:spec_decode_num_draft_tokens{model_name="m"} 40.0' in text
