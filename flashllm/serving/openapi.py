"""The server's OpenAPI 3.1 description, built from the request models, for fuzzers and clients (not served)."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from flashllm.lora.manager import MAX_NAME_CHARS
from flashllm.serving.lora_api import MAX_PATH_CHARS
from flashllm.serving.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from flashllm.serving.responses_api import ResponsesRequest

_REF = "#/components/schemas/{model}"
_ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string", "minLength": 1},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0}
                         for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH = {"type": ["string", "null"]}


def _completion(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "usage": _USAGE,
                           "choices": {"type": "array", "minItems": 1, "items": choice}}}


_TEXT_CHOICE = {"type": "object", "required": ["index", "text", "finish_reason"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                               "finish_reason": _FINISH, "logprobs": {"type": ["object", "null"]}}}
_CHAT_CHOICE = {"type": "object", "required": ["index", "message", "finish_reason"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "finish_reason": _FINISH,
                               "message": {"type": "object", "required": ["role", "content"],
                                           "properties": {"role": {"const": "assistant"},
                                                          "content": {"type": ["string", "null"]}}}}}
_MODELS = {"type": "object", "required": ["object", "data"],
           "properties": {"object": {"const": "list"}, "data": {"type": "array", "minItems": 1, "items": {
               "type": "object", "required": ["id", "object", "created", "owned_by"],
               "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                              "owned_by": {"type": "string"}}}}}}
_TOKENIZED = {"type": "object", "required": ["count", "max_model_len", "tokens"],
              "properties": {"count": {"type": "integer", "minimum": 0},
                             "max_model_len": {"type": "integer", "minimum": 1},
                             "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                             "token_strs": {"type": "array", "items": {"type": "string"}}}}
_DETOKENIZED = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
_RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
             "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                            "created_at": {"type": "integer"}, "model": {"type": "string"},
                            "status": {"enum": ["completed", "incomplete"]},
                            "output": {"type": "array", "minItems": 1, "items": {
                                "type": "object", "required": ["type", "id"],
                                "properties": {"type": {"enum": ["message", "function_call", "reasoning"]},
                                               "id": {"type": "string"}}}},
                            "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
                                      "properties": {k: {"type": "integer", "minimum": 0} for k in
                                                     ("input_tokens", "output_tokens", "total_tokens")}}}}
_DELETED = {"type": "object", "required": ["id", "object", "deleted"],
            "properties": {"id": {"type": "string"}, "object": {"const": "response.deleted"}, "deleted": {"const": True}}}
_VERSION = {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}
_STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
# What every POST route may answer besides 200: validation (400), unknown model (404), timeout (408),
# body size (413), media type (415), full queue / draining / failed engine (503)
_POST_ERRORS = {"400": "invalid request", "404": "unknown model", "408": "request timeout",
                "413": "body too large", "415": "not application/json", "503": "busy, draining or failed"}


# The LoRA admin routes (serve --enable-lora; serving/lora_api.py): 400 bad body, name taken or adapter
# unreadable; 403 no --api-key, or a path outside --allowed-lora-dir; 404 unknown name; 409 still in use
_ADMIN_NAME = {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS}
_ADMIN_LOAD = {"type": "object", "required": ["lora_name", "lora_path"],
               "properties": {"lora_name": _ADMIN_NAME,
                              "lora_path": {"type": "string", "minLength": 1, "maxLength": MAX_PATH_CHARS}}}
_ADMIN_UNLOAD = {"type": "object", "required": ["lora_name"], "properties": {"lora_name": _ADMIN_NAME}}
_ADMIN_OK = {"type": "object", "required": ["status", "lora_name"],
             "properties": {"status": {"const": "ok"}, "lora_name": {"type": "string"}}}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _post(request_ref: dict[str, Any], reply: dict[str, Any], summary: str, stream: bool = True) -> dict[str, Any]:
    ok = _json(reply, "the whole reply (stream false)" if stream else summary)
    if stream:  # one schema per server-sent event (stream true): a JSON chunk, an error object or [DONE]
        ok["content"]["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                         "properties": {"data": {"type": "string", "minLength": 1}}}}
    responses = {"200": ok, **{code: _json({"$ref": "#/components/schemas/Error"}, text)
                               for code, text in _POST_ERRORS.items()}}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": request_ref}}}, "responses": responses}}


def _get(schema: dict[str, Any], summary: str, unavailable: bool = False) -> dict[str, Any]:
    responses = {"200": _json(schema, summary)}
    if unavailable:
        responses["503"] = _json(_STATUS, "failed or draining")
    return {"get": {"summary": summary, "responses": responses}}


def _stored(summary: str, ok: dict[str, Any]) -> dict[str, Any]:
    """An operation on one stored response, by the id in its path: `ok`, or 404 when none is stored under it."""
    return {"summary": summary, "parameters": [{"name": "response_id", "in": "path", "required": True,
                                                "schema": {"type": "string", "minLength": 1}}],
            "responses": {"200": ok, "404": _json({"$ref": "#/components/schemas/Error"}, "not stored")}}


def _admin(request: dict[str, Any], errors: dict[str, str], summary: str) -> dict[str, Any]:
    responses = {"200": _json(_ADMIN_OK, summary),
                 **{code: _json({"$ref": "#/components/schemas/Error"}, text) for code, text in errors.items()}}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": request}}}, "responses": responses}}


def openapi_schema(lora_admin: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the routes create_app serves, request bodies from the pydantic models.

    The request schemas state each field's type and bounds; the server also refuses some schema-valid
    bodies with 400 (prompt plus max_tokens past the context, min_tokens above max_tokens, ...).
    `lora_admin` adds the adapter load / unload routes of `serve --enable-lora`.
    """
    models = [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
              (TokenizeRequest, "validation"), (DetokenizeRequest, "validation"), (ResponsesRequest, "validation")]
    refs, defs = models_json_schema(models, ref_template=_REF)
    schemas = {**defs.get("$defs", {}), "Error": _ERROR}
    paths = {
        "/v1/completions": _post(refs[(CompletionRequest, "validation")],
                                 _completion("text_completion", _TEXT_CHOICE), "text completion"),
        "/v1/chat/completions": _post(refs[(ChatCompletionRequest, "validation")],
                                      _completion("chat.completion", _CHAT_CHOICE), "chat completion"),
        "/tokenize": _post(refs[(TokenizeRequest, "validation")], _TOKENIZED,
                           "a prompt or chat as the model's token ids", stream=False),
        "/detokenize": _post(refs[(DetokenizeRequest, "validation")], _DETOKENIZED, "token ids as text",
                             stream=False),
        "/v1/responses": _post(refs[(ResponsesRequest, "validation")], _RESPONSE, "a response (OpenAI's Responses API)"),
        "/v1/responses/{response_id}": {
            "get": _stored("a stored response", _json(_RESPONSE, "the response as it was answered")),
            "delete": _stored("forget a stored response", _json(_DELETED, "forgotten"))},
        "/v1/models": _get(_MODELS, "the served model"),
        "/version": _get(_VERSION, "flashllm's version"),
        "/health": _get(_STATUS, "liveness", unavailable=True),
        "/ready": _get(_STATUS, "readiness", unavailable=True),
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
            "description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    if lora_admin:
        paths["/v1/load_lora_adapter"] = _admin(_ADMIN_LOAD, {
            "400": "bad body, name taken or adapter unreadable", "403": "no --api-key, or outside --allowed-lora-dir",
            "413": "body too large"}, "load an adapter")
        paths["/v1/unload_lora_adapter"] = _admin(_ADMIN_UNLOAD, {
            "400": "bad body", "403": "no --api-key", "404": "no such adapter", "409": "requests still use it",
            "413": "body too large"}, "unload an adapter")
    return {
        "openapi": "3.1.0",
        "info": {"title": "flashllm", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
