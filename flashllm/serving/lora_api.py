"""Multi-LoRA over HTTP: --lora-modules at start, and runtime load / unload behind the API key."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from flashllm.lora import LoRAError, LoRARequest
from flashllm.lora.manager import MAX_NAME_CHARS, check_allowed
from flashllm.serving.app import read_body
from flashllm.serving.generation import ServerContext
from flashllm.serving.protocol import APIError

MAX_SERVED_LORAS = 256  # adapter names one server answers to (their device slots are --max-loras)
MAX_ADMIN_BODY_BYTES = 16 << 10
MAX_PATH_CHARS = 4096


def parse_lora_modules(specs: Sequence[str]) -> list[tuple[str, str]]:
    """`name=DIR` strings -> [(name, DIR)]; ValueError naming the bad one."""
    modules = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=DIR with a name of at most {MAX_NAME_CHARS} "
                             "characters")
        modules.append((name, path))
    names = [n for n, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names must be unique; got {names}")
    return modules


class LoRARoutes:
    """The served adapter names (ctx.loras) and the admin endpoints that change them."""

    def __init__(self, ctx: ServerContext, admin_keys: bool, allowed_dirs: Sequence[str]) -> None:
        self.ctx, self.admin_keys, self.allowed_dirs = ctx, admin_keys, list(allowed_dirs)
        self._ids = itertools.count(1)

    def register_startup(self, engine: Any, modules: Sequence[tuple[str, str]]) -> None:
        """Load --lora-modules before the server starts (the engine thread is not running yet); raises on a bad one."""
        for name, path in modules:
            if name == self.ctx.model_name:
                raise ValueError(f"--lora-modules name {name!r} is the served model's name; pick another")
            request = LoRARequest(name, next(self._ids), str(Path(path).resolve()))
            engine.add_lora(request, pinned=True)
            self.ctx.loras[name] = request

    def install(self, app: FastAPI) -> None:
        app.add_api_route("/v1/load_lora_adapter", self.load, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", self.unload, methods=["POST"])

    async def _body(self, request: Request) -> dict[str, Any]:
        if not self.admin_keys:
            raise APIError(403, "loading adapters at runtime needs the server started with --api-key (the admin "
                           "endpoints are never open)", "permission_error", code="admin_disabled")
        try:
            data = json.loads(await read_body(request, MAX_ADMIN_BODY_BYTES))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise APIError(400, "the body must be a JSON object") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        name = data.get("lora_name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise APIError(400, f"lora_name must be a non-empty string of at most {MAX_NAME_CHARS} characters",
                           param="lora_name")
        return data

    async def load(self, request: Request) -> Response:
        """POST {"lora_name", "lora_path"}: 200 once the adapter is read and checked; 400 with the reason if not."""
        data = await self._body(request)
        name, path = data["lora_name"], data.get("lora_path")
        if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH_CHARS:
            raise APIError(400, "lora_path must be a directory path string", param="lora_path")
        if not self.allowed_dirs:
            raise APIError(403, "runtime loading reads adapters only under --allowed-lora-dir, which is not set",
                           "permission_error", param="lora_path", code="path_not_allowed")
        if name in self.ctx.loras or name == self.ctx.model_name:
            raise APIError(400, f"an adapter or model named {name!r} is already served; unload it first",
                           param="lora_name", code="lora_exists")
        if len(self.ctx.loras) >= MAX_SERVED_LORAS:
            raise APIError(400, f"this server already serves {MAX_SERVED_LORAS} adapters; unload one first",
                           code="too_many_adapters")
        try:
            real = check_allowed(path, self.allowed_dirs)
        except LoRAError as exc:
            raise APIError(403, str(exc), "permission_error", param="lora_path", code="path_not_allowed") from None
        lora = LoRARequest(name, next(self._ids), str(real))
        try:
            await self.ctx.engine.call(lambda engine: engine.add_lora(lora))
        except (LoRAError, ValueError) as exc:
            raise APIError(400, f"the adapter could not be loaded: {exc}", param="lora_path",
                           code="invalid_adapter") from None
        self.ctx.loras[name] = lora
        return JSONResponse({"status": "ok", "lora_name": name})

    async def unload(self, request: Request) -> Response:
        """POST {"lora_name"}: 200 when unloaded; 404 for an unknown name; 409 while requests still use it."""
        name = (await self._body(request))["lora_name"]
        lora = self.ctx.loras.get(name)
        if lora is None:
            raise APIError(404, f"no adapter named {name!r} is served", param="lora_name", code="model_not_found")
        del self.ctx.loras[name]  # new requests stop selecting it before the engine forgets it
        try:
            await self.ctx.engine.call(lambda engine: engine.remove_lora(lora.lora_int_id))
        except ValueError as exc:
            self.ctx.loras[name] = lora
            raise APIError(409, str(exc), code="adapter_in_use") from None
        return JSONResponse({"status": "ok", "lora_name": name})
