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


def test_metrics_report_acceptance() -> None:
    from flashllm.serving.async_engine import EngineStats
    from flashllm.serving.metrics import ServerMetrics

    stats = EngineStats(spec_rounds=10, spec_drafted=40, spec_accepted=30, spec_emitted=40)
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'flashllm:spec_decode_acceptance_rate{model_name="m"} 0.75' in text
    assert 'flashllm:spec_decode_mean_accepted_length{model_name="m"} 4.0' in text
    assert 'flashllm:spec_decode_num_draft_tokens{model_name="m"} 40.0' in text
