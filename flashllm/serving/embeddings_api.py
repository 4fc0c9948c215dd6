"""POST /v1/embeddings (OpenAI's shape): each input's pooled last hidden state, as LLM.embed computes it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from typing import Any

import numpy as np
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from flashllm.sampling_params import SamplingParams
from flashllm.serving.generation import Generation, ServerContext
from flashllm.serving.openai_api import check_model, check_priority, max_tokens_for, tokenize_prompts
from flashllm.serving.protocol import APIError, EmbeddingRequest, parse_body, prompt_list


async def create_embedding(ctx: ServerContext, http: HTTPRequest, body: bytes) -> Response:
    """{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}: floats, or
    with encoding_format "base64" the little-endian float32 bytes in base64, as OpenAI's API sends them."""
    req: EmbeddingRequest = parse_body(EmbeddingRequest, body)
    lora = check_model(ctx, req.model)
    pooling = _pooling(ctx, req.dimensions)
    keep = req.truncate_prompt_tokens  # with it, a text past the context may still keep its last tokens
    prompts = [p[-keep:] if keep else p for p in
               await tokenize_prompts(ctx, prompt_list(req.input), "input", refuse_past_context=keep is None)]
    max_tokens_for(ctx, prompts, 1, 1, "input", "input")  # a prompt must leave room for the one token run after it
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, pooling=pooling)
    gen = Generation(ctx, prompts, params, lora, priority=check_priority(ctx, req.priority))
    gen.reserve()
    try:
        finals = await gen.final_outputs(http)
    except asyncio.CancelledError:
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(o.embedding or [], req.encoding_format)}
            for i, o in enumerate(finals)]
    tokens = sum(len(p) for p in prompts)
    return JSONResponse({"object": "list", "data": data, "model": gen.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _pooling(ctx: ServerContext, dimensions: int | None) -> Any:
    if not ctx.engine.paged:
        raise APIError(400, "embeddings need the paged engine; restart the server without --mode static", param="input")
    if ctx.pooling is None:
        raise APIError(400, f"this model cannot embed: {ctx.pooling_error}", param="model")
    if dimensions is not None and ctx.embedding_size is not None and dimensions > ctx.embedding_size:
        raise APIError(400, f"dimensions ({dimensions}) must be at most the model's {ctx.embedding_size} features",
                       param="dimensions")
    return dataclasses.replace(ctx.pooling, dimensions=dimensions)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
