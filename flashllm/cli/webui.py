"""`flashllm webui --url URL`: a browser chat page for any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("webui", help="chat in the browser with an OpenAI-compatible server (needs flashllm[ui])")
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1",
                        help="API root of the server, ending in /v1 (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("FLASHLLM_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (env FLASHLLM_API_KEY)")
    parser.add_argument("--model", default=None, help="model name in the API (default: the first of GET /models)")
    parser.add_argument("--host", default="127.0.0.1", help="address the page listens on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=7860, help="port the page listens on (default: %(default)s)")


def resolve_model(url: str, api_key: str | None, model: str | None) -> str:
    """`model` when given, else the first model the server lists; raises APIError when it lists none."""
    from flashllm.serving.webui import APIError, list_models

    if model:
        return model
    models = list_models(url, api_key)
    if not models:
        raise APIError(f"{url}/models lists no model; pass one with --model")
    return models[0]


def run(args: argparse.Namespace) -> int:
    from flashllm.serving.webui import APIError, build_webui, import_gradio

    try:
        import_gradio()
        model = resolve_model(args.url, args.api_key, args.model)
    except (ImportError, APIError) as exc:
        print(f"flashllm webui: {exc}", file=sys.stderr)
        return 1
    if args.api_key and args.host not in LOOPBACK_HOSTS:
        print(f"flashllm webui: warning: anyone who reaches {args.host}:{args.port} chats with the server "
              "under your API key", file=sys.stderr)
    demo = build_webui(args.url, model, args.api_key)
    print(f"chat with {model} at {args.url}: open http://{args.host}:{args.port}/", flush=True)
    demo.launch(server_name=args.host, server_port=args.port, show_error=True, quiet=True)
    return 0
