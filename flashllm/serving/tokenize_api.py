"""POST /tokenize and /detokenize (vLLM's shapes): what the server's tokenizer and chat template make of a
prompt, counted the way the completion routes count it, and token ids back to text."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from flashllm.serving.generation import ServerContext
from flashllm.serving.openai_api import check_model, check_vocab, render_chat
from flashllm.serving.protocol import APIError, DetokenizeRequest, TokenizeRequest, parse_body


def _tokenizer(ctx: ServerContext, param: str) -> Any:
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer to tokenize with", param=param)
    return ctx.tokenizer


async def create_tokenize(ctx: ServerContext, http: HTTPRequest, body: bytes) -> Response:
    """{"count", "max_model_len", "tokens"} (and "token_strs" when asked): the ids a completion request with
    this prompt, or a chat request with these messages, would send to the model. Prompts longer than the
    context are counted, not refused: telling a client how far over it is is what this route is for."""
    req: TokenizeRequest = parse_body(TokenizeRequest, body)
    req.check()
    check_model(ctx, req.model)
    tokenizer = _tokenizer(ctx, "prompt" if req.prompt is not None else "messages")
    if req.messages is not None:
        ids = await render_chat(ctx, req.messages, req.tools, req.add_generation_prompt, req.chat_template_kwargs,
                                refuse_past_context=False, continue_final_message=req.continue_final_message)
    else:
        prompt = req.prompt
        ids = await asyncio.to_thread(lambda: list(tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)))
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if req.return_token_strs:
        reply["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(reply)


async def create_detokenize(ctx: ServerContext, http: HTTPRequest, body: bytes) -> Response:
    """{"prompt": text}: the ids decoded as the completion routes decode an echoed token-id prompt."""
    req: DetokenizeRequest = parse_body(DetokenizeRequest, body)
    check_model(ctx, req.model)
    tokenizer = _tokenizer(ctx, "tokens")
    check_vocab(ctx, [req.tokens], "tokens")
    if ctx.vocab_size is None and any(not 0 <= t < len(tokenizer) for t in req.tokens):
        raise APIError(400, f"tokens: token ids must be in [0, {len(tokenizer)})", param="tokens")
    text = await asyncio.to_thread(tokenizer.decode, req.tokens)
    return JSONResponse({"prompt": text})
