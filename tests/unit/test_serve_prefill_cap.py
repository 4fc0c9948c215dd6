"""`flashllm serve --max-prefill-tokens`: the CPU default and the flag reach the engine's scheduler."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from flashllm.config import CPU_SERVE_MAX_PREFILL_TOKENS
from flashllm.testing.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("prefill-cap"), "llama", seed=2, tokenizer=False)


def _options(argv: list[str], environ: dict[str, str] | None = None) -> dict:
    from flashllm.cli import serve

    sub = argparse.ArgumentParser().add_subparsers()
    serve.add_parser(sub)
    return serve.resolve_options(sub.choices["serve"].parse_args(argv), environ=environ or {})


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    ([], {}, CPU_SERVE_MAX_PREFILL_TOKENS),
    (["--max-prefill-tokens", "64"], {}, 64),
    ([], {"FLASHLLM_MAX_PREFILL_TOKENS": "96"}, 96),
])
def test_cpu_serving_caps_prompt_tokens_per_step(model_dir: Path, argv: list[str], environ: dict[str, str],
                                                 expected: int) -> None:
    from flashllm.serving import server

    options = _options([str(model_dir), "--device", "cpu", "--max-model-len", "128", "--num-kv-blocks", "16",
                        *argv], environ)
    engine = server._build_engine(options)
    assert engine.scheduler.config.max_prefill_tokens == expected
