"""`exactspec serve`: load the engine once and serve it over HTTP with uvicorn. (The top-level CLI adds
the Ray Serve options and sends `--replicas` to scale/: nothing here knows of Ray.)"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from ..errors import ExactSpecError
from ..speculative.params import PREFILL_CHUNK

STOP_GRACE_S = 0.5  # on SIGTERM, how long open requests (streams) get before they are cancelled


def add_serve_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` on the CLI's subparsers; its handler is `args.func`."""
    from ..cli_common import add_model_args, add_prefix_cache_args  # the model options `load_engine` reads

    p = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/chat/completions, /v1/completions, /v1/responses (OpenAI Responses), "
                    "/v1/messages (Anthropic Messages), /v1/models, /health and /metrics. "
                    "One worker thread runs the model; concurrent requests (and a request's n samples) "
                    "decode as rows of one batch, new requests joining between iterations.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--max-rows", type=int, default=16, metavar="N",
                   help="most samples decoded together in one batch (default 16; 1 = one at a time)")
    add_prefix_cache_args(p, "recent conversations (prompt + answer)")
    p.add_argument("--responses-store-mb", type=float, default=256.0, metavar="MIB",
                   help="most MiB of stored Responses (store: true, for previous_response_id), least recently "
                        "used dropped first (default 256)")
    p.add_argument("--max-tokens-default", type=int, default=2048, metavar="N",
                   help="token budget of a request that gives no max_tokens (default 2048; 0 = the rest of the "
                        "context); reported by /v1/models")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                   help=f"prompt tokens prefilled per iteration while other requests decode (default "
                        f"{PREFILL_CHUNK}: a long prompt joining delays each running stream's next token by about "
                        f"one chunk's prefill, not its whole prompt's; 0 = prefill each prompt whole). Outputs "
                        f"are identical either way")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key on every request but /health (Authorization: Bearer KEY or x-api-key: "
                        "KEY); also read from $EXACTSPEC_API_KEY. Without one, anyone who reaches the port can use "
                        "the model")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the key from the first line of FILE (keeps it out of the process list)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="model id reported by /v1/models and in responses (default: the target's file name)")
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    """Check the options, load the engine, then serve until interrupted."""
    from ..cli_common import load_engine, prefix_cache_kwargs, warm_up

    check_serve_args(args)
    import uvicorn

    from .auth import read_key

    api_key = read_key(args.api_key, args.api_key_file)

    from .app import create_app

    engine = load_engine(args, **prefix_cache_kwargs(args), rows=args.max_rows, prefill_chunk=args.prefill_chunk)
    warm_up(engine)  # before uvicorn starts: /health answers only once the engine is ready
    from .families import tool_format

    tools = tool_format(getattr(engine.tokenizer, "chat_template", None))
    template = (f"chat template {engine.template_source}" if engine.template_source != "none"
                else "no chat template (chat requests are refused: --chat-template NAME|FILE gives one)")
    print(f"exactspec: serving on {engine.hardware}; {engine.context_line()}; {template}; tools in the {tools} format; "
          f"greedy identity {engine.runtime()['greedy_identity']}; "
          f"{'an API key is required' if api_key else 'no API key'}", file=sys.stderr, flush=True)
    if api_key is None and not loopback(args.host):
        print(f"exactspec: warning: serving on {args.host} without an API key: anyone who reaches this port can "
              "use the model (--api-key-file FILE)", file=sys.stderr, flush=True)
    app = create_app(engine, model_name(args), args.max_rows, max_tokens_default=args.max_tokens_default or None,
                     api_key=api_key, responses_store_mb=args.responses_store_mb)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=STOP_GRACE_S)
    if any(t.name == "exactspec-worker" and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        os._exit(0)  # still inside one llama.cpp call (a prefill chunk): no interpreter teardown under it
    return 0


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse bad options and a missing server extra before anything loads (γ parsed in place)."""
    from ..speculative.params import check_gamma

    args.gamma = check_gamma(args.gamma)
    if args.max_rows < 1:
        raise ExactSpecError(f"--max-rows must be >= 1, got {args.max_rows}")
    if not 0 < args.port < 65536:
        raise ExactSpecError(f"--port must be in 1..65535, got {args.port}")
    if args.prefill_chunk < 0:
        raise ExactSpecError(f"--prefill-chunk must be >= 0, got {args.prefill_chunk}")
    if args.responses_store_mb <= 0:
        raise ExactSpecError(f"--responses-store-mb must be > 0, got {args.responses_store_mb}")
    if args.max_tokens_default < 0:
        raise ExactSpecError(f"--max-tokens-default must be >= 0, got {args.max_tokens_default}")
    from ..cli_common import prefix_cache_kwargs

    prefix_cache_kwargs(args)
    try:  # imported here only to refuse a missing extra now, before the slow load
        import uvicorn  # noqa: F401

        from .app import create_app  # noqa: F401
    except ImportError as e:
        raise ExactSpecError(f"the server needs its extra dependencies ({e.name} is missing): "
                             "pip install 'exactspec[server]'") from None


def loopback(host: str) -> bool:
    """Whether `host` binds this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def model_name(args: argparse.Namespace) -> str:
    """--model-name, else the target's name (`default_model_name`)."""
    return args.model_name or default_model_name(args.target)


def default_model_name(target: str | None) -> str:
    """The target's file or directory name without `.gguf` (the embedded model's when `target` is None)."""
    from ..embedded import FILE

    name = os.path.basename(os.path.normpath(target)) if target else FILE
    return name.removesuffix(".gguf")
