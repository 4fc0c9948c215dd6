"""Request fields that constrain the output (response_format, guided_*, forced tool calls) to a StructuredOutput."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from flashllm.sampling_params import StructuredOutput
from flashllm.serving.protocol import APIError
from flashllm.serving.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from flashllm.serving.tool_parsers import MISTRAL_TOOL_CALLS
from flashllm.structured.tags import tag_grammar

# generated JSON follows json.dumps' layout inside tool calls too (see flashllm.structured.compiler)
# a function declared without parameters takes none (OpenAI's reading): its arguments are {}
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _spec(param: str, **field: Any) -> StructuredOutput:
    try:
        return StructuredOutput(**field)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_structured_output") from None


def from_request(req: Any) -> tuple[StructuredOutput | None, str | None]:
    """(constraint, the field it came from) of a completions or chat request; 400 when several are set."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema (a JSON schema object)",
                           param="response_format", code="invalid_structured_output")
        schema = dict(fmt.json_schema.schema_)
        if not fmt.json_schema.strict:
            # not strict: keywords the grammar engine does not implement are ignored instead of refused
            schema["x-guidance"] = {**schema.get("x-guidance", {}), "lenient": True}
        found.append(("response_format", {"json": schema}))
    for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, {field: value}))
    if len(found) > 1:
        raise APIError(400, f"{' and '.join(n for n, _ in found)} each constrain the output; send only one",
                       param=found[1][0], code="invalid_structured_output")
    if not found:
        return None, None
    param, field = found[0]
    return _spec(param, **field), param


def _hermes_calls(parallel: bool, tokenizer: Any) -> str:
    return (f"start: call{' (NL call)*' if parallel else ''}\nNL: {json.dumps(chr(10))}\n"
            f"call: {json.dumps(TOOL_CALL_OPEN + chr(10))} body {json.dumps(chr(10) + TOOL_CALL_CLOSE)}\n")


def _llama3_calls(parallel: bool, tokenizer: Any) -> str:
    return f"start: body{' (SEP body)*' if parallel else ''}\nSEP: \"; \"\n"


def _mistral_calls(parallel: bool, tokenizer: Any) -> str:
    marker = tag_grammar(tokenizer, MISTRAL_TOOL_CALLS)
    return f"start: {marker} \" \"? \"[\" body{' (SEP body)*' if parallel else ''} \"]\"\nSEP: \", \"\n"


_CALLS_GRAMMARS = {"hermes": _hermes_calls, "llama3_json": _llama3_calls, "mistral": _mistral_calls}


def tool_call_constraint(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool, parser: str = "hermes",
                         tokenizer: Any = None) -> StructuredOutput | None:
    """The grammar of tool calls in the `parser` format (serving/tool_parsers.py) calling the given tools, for
    tool_choice "required" or a named function; None for "auto"/"none" (the output stays free). Each call's
    JSON names one of the tools with arguments valid for its `parameters` schema; one call, or several with
    parallel_tool_calls. hermes: `<tool_call>` blocks on their own lines; llama3_json: `{"name", "parameters"}`
    objects separated by "; "; mistral: `[TOOL_CALLS]` and a JSON array (the marker as the tokenizer's token
    when it has one)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
    elif tool_choice == "required":
        chosen = tools
    else:
        return None
    if parser not in _CALLS_GRAMMARS:
        raise APIError(400, f"tool_choice {'required' if tool_choice == 'required' else 'naming a function'} is not "
                       f"supported with --tool-call-parser {parser} (its calls have no grammar here); send "
                       "tool_choice auto", param="tool_choice")
    arguments_key = "parameters" if parser == "llama3_json" else "arguments"
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
              "properties": {"name": {"const": t["function"]["name"]},
                             arguments_key: t["function"].get("parameters") or _NO_ARGUMENTS}}
             for t in chosen]
    body = {"anyOf": calls, "x-guidance": _JSON_LAYOUT}
    try:
        body_text = json.dumps(body)
    except (TypeError, ValueError, RecursionError):
        raise APIError(400, "tools: a function's parameters are not a JSON schema", param="tools") from None
    grammar = _CALLS_GRAMMARS[parser](parallel, tokenizer) + f"body: %json {body_text}\n"
    return _spec("tools", grammar=grammar)


async def precompile(ctx: Any, spec: StructuredOutput | None, param: str | None) -> None:
    """Compile the constraint off the event loop and the engine thread (the engine's cache keeps it), so a bad
    one is a 400 before the request is queued and a slow one delays only its own request."""
    if spec is None:
        return
    compiler = getattr(ctx.engine.engine, "grammars", None)
    if compiler is None:
        raise APIError(400, "structured output (response_format, guided_*, forced tool calls) needs the paged "
                       "engine; restart the server without --mode static", param=param,
                       code="invalid_structured_output")
    try:
        await asyncio.to_thread(compiler.compile, spec)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_structured_output") from None
