"""`flashllm run-batch -i requests.jsonl -o results.jsonl [MODEL]`: an OpenAI batch file answered offline by the
server's own routes (flashllm/serving/batch.py), with serve's engine flags."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from tqdm.auto import tqdm

from flashllm.cli import serve


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("run-batch", help="answer an OpenAI batch file (JSONL of /v1/chat/completions, "
                                              "/v1/completions, /v1/embeddings and /v1/responses requests) "
                                              "offline")
    parser.add_argument("-i", "--input-file", "--input_file", dest="input_file", required=True,
                        help="the batch: one {custom_id, method, url, body} request a line ('-': standard input)")
    parser.add_argument("-o", "--output-file", "--output_file", dest="output_file", required=True,
                        help="the answers, a line each in input order ('-': standard output); a file is written "
                             "beside it and renamed when the batch is done")
    parser.add_argument("--max-concurrency", "--max_concurrency", dest="max_concurrency", type=int, default=None,
                        help="requests in flight at once (default: twice --max-num-seqs)")
    serve.add_server_arguments(parser, listener=False)


def run(args: argparse.Namespace) -> int:
    options = serve.resolve_options(args)
    concurrency = args.max_concurrency if args.max_concurrency is not None else 2 * options["max_num_seqs"]
    if concurrency < 1:
        raise SystemExit(f"flashllm run-batch: --max-concurrency must be at least 1, got {concurrency}")
    if args.input_file != "-" and not Path(args.input_file).is_file():
        raise SystemExit(f"flashllm run-batch: the input file {args.input_file} does not exist")
    if args.output_file != "-" and not Path(args.output_file).resolve().parent.is_dir():
        raise SystemExit(f"flashllm run-batch: the output file's directory {Path(args.output_file).parent} "
                         "does not exist")
    from flashllm.serving.batch import run_batch
    from flashllm.serving.server import build_server

    built = build_server(options)
    built.engine.start()
    try:
        with _input(args.input_file) as lines, _output(args.output_file) as out, \
                tqdm(total=_count_lines(args.input_file), desc="run-batch", unit="req", disable=None) as bar:
            def write(line: str) -> None:
                out.write(line + "\n")
                bar.update(1)

            summary = asyncio.run(run_batch(built.app, lines, write, concurrency, options["max_body_bytes"]))
            if built.engine.error is not None:
                raise _EngineFailed(built.engine.error)
    except _EngineFailed as failed:
        print(f"flashllm run-batch: the engine failed, no output written: {failed}", file=sys.stderr)
        return 1
    finally:
        built.engine.stop()
    print(f"flashllm run-batch: {summary} -> {args.output_file}", file=sys.stderr)
    return 0


def _count_lines(path: str) -> int | None:
    """The requests a batch file holds (its non-blank lines), for the progress bar; None for standard input."""
    if path == "-":
        return None
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


class _EngineFailed(Exception):
    """The engine stopped under the batch: its answers past that point are errors, so none are kept."""


@contextlib.contextmanager
def _input(path: str) -> Iterator[TextIO]:
    if path == "-":
        yield sys.stdin
        return
    with open(path, encoding="utf-8") as f:
        yield f


@contextlib.contextmanager
def _output(path: str) -> Iterator[TextIO]:
    """Standard output, or a temporary file beside `path` renamed to it when the block ends without an error
    (so a path holds a whole batch's answers or what it held before)."""
    if path == "-":
        yield sys.stdout
        return
    target = Path(path).resolve()
    fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
