"""llama.cpp's llama-server as the serving baseline: its answers on an exported GGUF agree with transformers,
and `bench serve | throughput --baseline llama.cpp` start it and read its OpenAI answers (the `baselines` session).

Skipped where no llama-server is found ($FLASHLLM_LLAMA_SERVER, PATH, or `python -m flashllm.bench.llamacpp_build`);
marked slow, so `nox -s baselines` (and `nox -s slow`) run it and the default run leaves it out.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flashllm.bench.llamacpp_server import LlamaServerUnavailable, find_llama_server


def _binary() -> Path | None:
    try:
        return find_llama_server()
    except LlamaServerUnavailable:
        return None


BINARY = _binary()
pytestmark = [
    pytest.mark.slow,  # about 40 s of servers: the `baselines` session runs it, the default run does not
    pytest.mark.skipif(BINARY is None, reason="no llama-server ($FLASHLLM_LLAMA_SERVER, PATH, or "
                                              "python -m flashllm.bench.llamacpp_build)"),
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed; pip install gguf"),
]


def transformers_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation each step, EOS ignored: the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """(model directory, API root) of a llama-server on the f32 GGUF of a tiny model."""
    from flashllm.bench.gguf_export import export_gguf
    from flashllm.bench.llamacpp_server import LlamaServerPlan, running_llama_server
    from flashllm.testing.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp(request.param)
    model_dir = build_tiny_model(root / "model", request.param, seed=3)
    gguf = export_gguf(model_dir, root / "model.gguf", "f32")
    assert BINARY is not None
    with running_llama_server(BINARY, LlamaServerPlan(gguf, parallel=2, ctx_per_slot=256, threads=2)) as server:
        yield model_dir, server.url


def test_llama_server_greedy_tokens_equal_transformers(served: tuple[Path, str]) -> None:
    from flashllm.models.tokenizer import load_tokenizer

    model_dir, url = served
    # llama.cpp's ignore_eos bans end-of-generation tokens outright; the oracle may pick one, after which
    # the two runs differ by design: compare up to it
    stops = set(load_tokenizer(model_dir).all_special_ids)
    rng = random.Random(7)
    base = url.removesuffix("/v1")
    compared = 0
    for length in (4, 19, 60):
        prompt = [rng.randrange(3, 500) for _ in range(length)]
        body = {"prompt": prompt, "n_predict": 8, "temperature": 0.0, "ignore_eos": True, "return_tokens": True,
                "cache_prompt": False}
        answer = httpx.post(f"{base}/completion", json=body, timeout=120).json()
        expected = transformers_greedy(model_dir, prompt, 8)
        cut = next((i for i, t in enumerate(expected) if t in stops), len(expected))
        assert len(answer["tokens"]) == 8 and answer["tokens"][:cut] == expected[:cut], length
        compared += cut
    assert compared >= 12  # most of the 24 tokens were compared


def test_llama_server_tokenizes_text_like_the_checkpoint(served: tuple[Path, str]) -> None:
    # the GGUF's vocabulary, merges and pre-tokenizer name reproduce the HF tokenizer's ids
    from flashllm.models.tokenizer import load_tokenizer

    model_dir, url = served
    tokenizer = load_tokenizer(model_dir)
    base = url.removesuffix("/v1")
    for text in ("Hello world, this is a test.", "  two  spaces\nand a newline 12345 don't", "numbers 3.14159!"):
        got = httpx.post(f"{base}/tokenize", json={"content": text}, timeout=30).json()["tokens"]
        assert got == tokenizer.encode(text, add_special_tokens=False), text


def test_openai_completions_answer_with_usage(served: tuple[Path, str]) -> None:
    _, url = served
    body = {"model": "llama.cpp", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 5, "temperature": 0.0,
            "ignore_eos": True}
    answer = httpx.post(f"{url}/completions", json=body, timeout=120).json()
    assert answer["usage"]["completion_tokens"] == 5 and answer["usage"]["prompt_tokens"] == 6
    assert answer["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"] == "llama.cpp"


# ---------------------------------------------------------------- through the bench commands

NUM, INPUT, OUTPUT = 6, (8, 24), (3, 9)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flashllm.testing.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("bench") / "qwen2", "qwen2", seed=0, max_position_embeddings=512)


def _asked_output(model_dir: Path) -> int:
    from flashllm.bench.workload import random_requests
    from flashllm.models.tokenizer import load_tokenizer

    return sum(r.output_len for r in random_requests(NUM, INPUT, OUTPUT, len(load_tokenizer(model_dir)), 0))


def test_bench_serve_runs_both_servers_on_the_same_requests(tiny: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.cli import main

    monkeypatch.setenv("FLASHLLM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(tiny), "--baseline", "llama.cpp", "--device", "cpu", "--dtype", "float32",
            "--max-model-len", "256", "--num-prompts", str(NUM), "--input-len", "{}:{}".format(*INPUT),
            "--output-len", "{}:{}".format(*OUTPUT), "--max-concurrency", "3", "--repeats", "2", "--no-progress",
            "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    assert set(record["engines"]) == {"flashllm[none]", "llama.cpp[f32]"} and record["repeats"] == 2
    asked = _asked_output(tiny)
    for name, engine in record["engines"].items():
        assert len(engine["runs"]) == 2, name
        for run in engine["runs"]:
            assert run["completed"] == NUM and run["failed"] == 0 and run["total_output_tokens"] == asked, name
            assert run["peak_rss_bytes"] > 10 << 20, name  # a server process's peak, read while it ran
            assert all(len(r["token_times_ms"]) >= 1 for r in run["requests"]), name
    command = record["engines"]["llama.cpp[f32]"]["command"]
    assert command[command.index("--parallel") + 1] == "3" and command[command.index("--ctx-size") + 1] == "768"
    assert record["output_throughput_speedups"]["flashllm[none] / llama.cpp[f32]"] > 0


def test_bench_throughput_baseline_is_llama_server(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.cli import main

    monkeypatch.setenv("FLASHLLM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(tiny), "--device", "cpu", "--num-prompts", str(NUM),
            "--input-len", "{}:{}".format(*INPUT), "--output-len", "{}:{}".format(*OUTPUT), "--max-num-seqs", "4",
            "--baseline", "llama.cpp", "--json", str(out)]
    assert main(argv) == 0
    record = json.loads(out.read_text())
    (llama,) = record["llama.cpp"]
    assert llama["engine"] == "llama-server" and llama["batch_size"] == 4  # min(--max-num-seqs, requests)
    assert llama["output_tokens"] == record["flashllm"]["output_tokens"] == _asked_output(tiny)
    assert llama["peak_rss_bytes"] > 10 << 20 and record["flashllm"]["peak_rss_bytes"] > 10 << 20
    assert record["speedup_vs_llama_cpp"] > 0


@pytest.mark.parametrize("preset, overrides", [
    ("qwen2_moe", {"decoder_sparse_step": 1, "mlp_only_layers": []}),  # llama.cpp's qwen2moe: every layer sparse
    ("mixtral", {}),
])
def test_moe_gguf_on_llama_server_gives_transformers_greedy_tokens(tmp_path: Path, preset: str, overrides: dict) -> None:
    """The MoE export (experts stacked, the shared expert's gate a vector, the expert counts) read by llama.cpp
    itself: its greedy tokens are transformers' on the same weights."""
    from flashllm.bench.gguf_export import export_gguf
    from flashllm.bench.llamacpp_server import LlamaServerPlan, running_llama_server
    from flashllm.testing.tiny_moe import build_moe_model
    from flashllm.testing.tokenizer import train_tokenizer

    model_dir = build_moe_model(tmp_path / "model", preset, seed=3, vocab_size=512, **overrides)
    train_tokenizer(model_dir, vocab_size=300)
    gguf = export_gguf(model_dir, tmp_path / "model.gguf", "f32")
    assert BINARY is not None
    rng = random.Random(11)
    with running_llama_server(BINARY, LlamaServerPlan(gguf, parallel=1, ctx_per_slot=256, threads=2)) as server:
        for length in (5, 40):
            prompt = [rng.randrange(3, 300) for _ in range(length)]
            body = {"prompt": prompt, "n_predict": 12, "temperature": 0.0, "ignore_eos": True, "return_tokens": True,
                    "cache_prompt": False}
            answer = httpx.post(f"{server.url.removesuffix('/v1')}/completion", json=body, timeout=120).json()
            assert answer["tokens"] == transformers_greedy(model_dir, prompt, 12), (preset, length)
