"""`flashllm serve --enable-lora` on 127.0.0.1 driven by the openai client: adapters by model name,
streaming, 404 for unknown names, runtime load / unload behind the API key, corrupt adapters refused."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("peft")

import httpx  # noqa: E402

from flashllm import LLM, SamplingParams  # noqa: E402
from flashllm.testing.server import ServerProcess, running_server  # noqa: E402
from flashllm.testing.tiny_lora import build_peft_adapter  # noqa: E402
from flashllm.testing.tiny_models import build_tiny_model  # noqa: E402

KEY = "test-key"
PROMPT = "The colour of the sky is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
ENGINE = ["--max-model-len", "256", "--block-size", "16", "--num-kv-blocks", "96", "--max-num-seqs", "8",
          "--dtype", "float32", "--device", "cpu"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-serve")
    base = build_tiny_model(root / "base", "qwen2", seed=5)
    allowed = root / "allowed"
    made = {"base": base, "allowed": allowed}
    for i, name in enumerate(("sql", "chat", "late")):
        made[name] = build_peft_adapter(base, (allowed if name == "late" else root) / name, r=8, alpha=16,
                                        seed=40 + i, std=0.2)
    corrupt = allowed / "corrupt"
    shutil.copytree(made["late"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    made["corrupt"] = corrupt
    return made


@pytest.fixture(scope="module")
def server(dirs) -> Iterator[ServerProcess]:
    args = [str(dirs["base"]), *ENGINE, "--enable-lora", "--lora-modules", f"sql={dirs['sql']}",
            f"chat={dirs['chat']}", "--max-loras", "2", "--max-lora-rank", "8", "--api-key", KEY,
            "--allowed-lora-dir", str(dirs["allowed"])]
    with running_server(args) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def _merged_text(dirs, adapter: str | None, chat: bool = False) -> str:
    """What the adapter merged at load (--lora_path, checked against peft in test_lora_merge) answers."""
    llm = LLM(str(dirs["base"]), lora_path=None if adapter is None else str(dirs[adapter]), dtype="float32",
              device="cpu", max_model_len=256, block_size=16, num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.chat(MESSAGES, params)[0] if chat else llm.generate(PROMPT, params)[0]
    return out.text


def _complete(client, model: str) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=12,
                                      extra_body={"ignore_eos": True})
    assert reply.model == model
    return reply.choices[0].text


def test_models_lists_base_and_adapters(client, dirs) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == dirs["base"].name and set(ids[1:]) == {"sql", "chat"}


def test_model_name_selects_the_adapter(client, dirs) -> None:
    texts = {name: _complete(client, name) for name in ("sql", "chat", dirs["base"].name)}
    assert texts["sql"] == _merged_text(dirs, "sql")
    assert texts["chat"] == _merged_text(dirs, "chat")
    assert texts[dirs["base"].name] == _merged_text(dirs, None)
    assert len(set(texts.values())) == 3


def test_streaming_chat_with_an_adapter(client, dirs) -> None:
    stream = client.chat.completions.create(model="chat", messages=MESSAGES, temperature=0, max_tokens=12,
                                            stream=True, extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == _merged_text(dirs, "chat", chat=True)


def test_unknown_adapter_is_404_in_openai_shape(client, server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "nope" in info.value.body["message"]


def _admin(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/{path}", json=body, headers=headers, timeout=60)


def test_runtime_load_and_unload(client, server, dirs) -> None:
    late = {"lora_name": "late", "lora_path": str(dirs["late"])}
    assert _admin(server, "load_lora_adapter", late, key=None).status_code == 401
    outside = _admin(server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(dirs["sql"])})
    assert outside.status_code == 403 and outside.json()["error"]["code"] == "path_not_allowed"
    bad = _admin(server, "load_lora_adapter", {"lora_name": "bad", "lora_path": str(dirs["corrupt"])})
    assert bad.status_code == 400 and "safetensors" in bad.json()["error"]["message"]
    assert _complete(client, "sql") == _merged_text(dirs, "sql")  # still serving after the refusal
    assert _admin(server, "load_lora_adapter", late).status_code == 200
    assert _admin(server, "load_lora_adapter", late).status_code == 400  # already served
    assert "late" in [m.id for m in client.models.list().data]
    assert _complete(client, "late") == _merged_text(dirs, "late")
    assert _admin(server, "unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert _admin(server, "unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
