"""``attnkit serve``: an OpenAI-compatible HTTP server for decoders and sentence encoders.

``attnkit serve MODEL [MODEL ...]`` loads each model (a Hugging Face decoder folder, a ``.gguf``
file or a sentence-transformers encoder folder), gives each decoder a continuous-batching engine
(:mod:`attnkit.serving.engine`) and serves them with uvicorn at ``--host``:``--port``
(:mod:`attnkit.serving.app`): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/models``, ``/health`` and ``/metrics``. Requests name a model by its folder's name (a GGUF
file's stem), or by ``--name`` (one per model, in order).

``--api-key`` (or the ``ATTNKIT_API_KEY`` variable) makes ``/v1`` requests need it. SIGTERM or
Ctrl-C stops taking requests, lets running ones finish for ``--shutdown-timeout`` seconds,
cancels the rest and exits with 0.

Needs the ``serve`` extra (``fastapi``, ``uvicorn``, ``prometheus-client``, ``xgrammar``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from attnkit.commands.options import add_dtype_option, add_quantize_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``parser``."""
    parser.add_argument(
        "models",
        type=Path,
        nargs="+",
        metavar="MODEL",
        help="decoder folder, .gguf file or sentence-transformers encoder folder",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="key /v1 requests must send as 'Authorization: Bearer KEY' (default: the "
        "ATTNKIT_API_KEY variable; none when unset)",
    )
    parser.add_argument(
        "--name",
        nargs="+",
        default=None,
        help="the names requests give the models, one per MODEL (default: folder names)",
    )
    add_dtype_option(parser, "decoder parameter dtype (float32)")
    add_quantize_option(parser, "weight-only quantization of the decoders' linears (default: none)")
    parser.add_argument(
        "--max-batch", type=int, default=16, help="most requests running at once per model (16)"
    )
    parser.add_argument(
        "--kv-cache-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="tokens the KV cache pool of each decoder holds (default: the engine's choice)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="request bodies larger than this are refused with 413 (default 4 MiB)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests may take to finish after SIGTERM (10)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (info)",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Reject bad option values before loading anything (one line, exit status 2)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.kv_cache_size is not None and args.kv_cache_size < 1:
        raise ValueError(f"--kv-cache-size must be >= 1, got {args.kv_cache_size}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.name is not None and len(args.name) != len(args.models):
        raise ValueError(
            f"--name gives {len(args.name)} names for {len(args.models)} models; give one each"
        )
    for path in args.models:
        if not path.exists():
            raise FileNotFoundError(f"model {path} does not exist")


def run(args: argparse.Namespace) -> int:
    """Load the models and serve them until SIGTERM or Ctrl-C."""
    check_arguments(args)
    import torch
    import uvicorn

    from attnkit.serving.app import DEFAULT_MAX_REQUEST_BYTES, build_app
    from attnkit.serving.models import ModelRegistry, load_model

    api_key = args.api_key if args.api_key is not None else os.environ.get("ATTNKIT_API_KEY")
    names = args.name or [None] * len(args.models)
    registry = ModelRegistry()
    for path, name in zip(args.models, names, strict=True):
        print(f"attnkit serve: loading {path}", file=sys.stderr)
        registry.add(
            load_model(
                path,
                name=name,
                dtype=getattr(torch, args.dtype),
                quantize=args.quantize,
                max_batch=args.max_batch,
                kv_cache_tokens=args.kv_cache_size,
            )
        )
    app = build_app(
        registry,
        api_key=api_key or None,
        max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
    )
    print(
        f"attnkit serve: {', '.join(registry.models)} at http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    _server_class()(config).run()
    return 0


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, exiting with 0 after a SIGTERM or Ctrl-C: stopping is what those
        signals ask for, so the graceful shutdown is the end (uvicorn re-raises them after it)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list) and sig in (signal.SIGTERM, signal.SIGINT):
                while sig in captured:
                    captured.remove(sig)

    return Server
