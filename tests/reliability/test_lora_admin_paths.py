"""The LoRA admin routes refuse paths that cannot be resolved with a 403 naming the path, never a 500."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest


@pytest.fixture
def client(tmp_path: Path):  # noqa: ANN201 (starlette's TestClient, imported lazily)
    from starlette.testclient import TestClient

    from flashllm.serving.app import create_app
    from flashllm.serving.lora_api import LoRARoutes

    (tmp_path / "adapters").mkdir()
    ctx = SimpleNamespace(loras={}, model_name="m")
    app = create_app(ctx, api_keys=["k"])  # type: ignore[arg-type]
    LoRARoutes(ctx, admin_keys=True, allowed_dirs=[str(tmp_path / "adapters")]).install(app)  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def _loop(root: Path) -> str:
    (root / "a").symlink_to(root / "b")
    (root / "b").symlink_to(root / "a")
    return str(root / "a")


@pytest.mark.parametrize("make_path", [lambda root: str(root / "adapters" / "x\x00y"), _loop],
                         ids=["NUL byte", "symlink loop"])
def test_an_unresolvable_adapter_path_is_a_403_not_a_500(client, tmp_path: Path, make_path) -> None:  # noqa: ANN001
    path = make_path(tmp_path)
    reply = client.post("/v1/load_lora_adapter", headers={"Authorization": "Bearer k"},
                        json={"lora_name": "a", "lora_path": path})
    assert reply.status_code == 403, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("permission_error", "lora_path", "path_not_allowed")
    # the caller's own path, and nothing of where a loop's links lead or of the server's code
    message = error["message"].replace(repr(path)[1:-1], "PATH")
    assert "cannot be resolved" in message and str(tmp_path) not in message and "Traceback" not in message
