"""`flashllm serve` takes the model-shaping flags predict and generate take (--moe_quant_type, --quantize_lm_head,
--mla_use_matrix_absorption, --tokenizer) from the command line, FLASHLLM_<NAME> and --config, and hands them to the
engine."""

from __future__ import annotations

from typing import Any

import pytest

from flashllm.cli import build_parser
from flashllm.cli import serve as serve_cli


def _config(argv: list[str], environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    from flashllm.serving import server

    options = serve_cli.resolve_options(build_parser().parse_args(["serve", *argv]), environ)
    monkeypatch.setattr(server, "Engine", lambda config: config)
    return server._build_engine(options)


def test_defaults_leave_the_experts_head_and_attention_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config([], {}, monkeypatch)
    assert (config.quant.moe_quant_type, config.quant.quantize_lm_head, config.model.mla_use_matrix_absorption) == (
        None, False, True)


@pytest.mark.parametrize(("argv", "environ"), [
    (["--moe-quant-type", "weight_only_int4", "--quantize-lm-head", "--mla-use-matrix-absorption", "false"], {}),
    (["--moe_quant_type", "weight_only_int4", "--quantize_lm_head", "--mla_use_matrix_absorption", "0"], {}),
    ([], {"FLASHLLM_MOE_QUANT_TYPE": "weight_only_int4", "FLASHLLM_QUANTIZE_LM_HEAD": "true",
          "FLASHLLM_MLA_USE_MATRIX_ABSORPTION": "off"}),
])
def test_each_spelling_reaches_the_engine_config(argv: list[str], environ: dict[str, str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(["--quant-type", "weight_only_int8", *argv], environ, monkeypatch)
    assert (config.quant.moe_quant_type, config.quant.quantize_lm_head, config.model.mla_use_matrix_absorption) == (
        "weight_only_int4", True, False)


def test_the_config_file_sets_them_too(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("moe_quant_type: weight_only_int8\nquantize_lm_head: true\nmla_use_matrix_absorption: false\n")
    config = _config(["--config", str(path)], {}, monkeypatch)
    assert (config.quant.moe_quant_type, config.quant.quantize_lm_head, config.model.mla_use_matrix_absorption) == (
        "weight_only_int8", True, False)


@pytest.mark.parametrize("argv", [["--moe-quant-type", "weight_only_int8"], ["--quantize-lm-head"],
                                  ["--mla-use-matrix-absorption", "false"]])
def test_static_mode_refuses_them(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="configure the paged engine"):
        serve_cli.resolve_options(build_parser().parse_args(["serve", "--mode", "static", *argv]), {})


def test_a_wrong_boolean_is_refused_in_one_line() -> None:
    with pytest.raises(SystemExit, match="FLASHLLM_MLA_USE_MATRIX_ABSORPTION='maybe' is not a valid"):
        serve_cli.resolve_options(build_parser().parse_args(["serve"]), {"FLASHLLM_MLA_USE_MATRIX_ABSORPTION": "maybe"})


@pytest.mark.parametrize("argv", [["some/dir"], ["--model", "some/dir"], ["--model_name_or_path", "some/dir"],
                                  ["--model-name-or-path", "some/dir"], ["some/dir", "--model", "some/dir"]])
def test_the_model_is_positional_or_given_by_vllm_and_paddlenlp_flags(argv: list[str]) -> None:
    options = serve_cli.resolve_options(build_parser().parse_args(["serve", *argv]), {"FLASHLLM_MODEL": "other"})
    assert options["model"] == "some/dir"


def test_two_different_models_are_refused_in_one_line() -> None:
    with pytest.raises(SystemExit, match="two models given, 'a' and --model 'b'"):
        serve_cli.resolve_options(build_parser().parse_args(["serve", "a", "--model", "b"]), {})


def test_vllms_prefix_caching_and_remote_code_flags_are_understood() -> None:
    parse = build_parser().parse_args
    assert serve_cli.resolve_options(parse(["serve", "--no-enable-prefix-caching"]), {})["no_prefix_caching"] is True
    assert serve_cli.resolve_options(parse(["serve", "--enable-prefix-caching", "--trust-remote-code"]),
                                     {})["no_prefix_caching"] is False
    with pytest.raises(SystemExit, match="contradict"):
        serve_cli.resolve_options(parse(["serve", "--enable-prefix-caching", "--no-prefix-caching"]), {})


@pytest.mark.parametrize(("argv", "environ"), [(["--tokenizer", "/models/src"], {}),
                                               ([], {"FLASHLLM_TOKENIZER": "/models/src"})])
def test_the_tokenizer_apart_from_the_model_reaches_the_engine_config(argv: list[str], environ: dict[str, str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert _config([], {}, monkeypatch).model.tokenizer is None
    assert _config(argv, environ, monkeypatch).model.tokenizer == "/models/src"


def test_static_mode_refuses_a_tokenizer_apart_from_the_export() -> None:
    with pytest.raises(SystemExit, match="--tokenizer"):
        serve_cli.resolve_options(build_parser().parse_args(["serve", "--mode", "static", "--tokenizer", "x"]), {})
