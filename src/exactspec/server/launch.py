"""`exactspec launch codex|claude`: a coding-agent CLI against a local `exactspec serve`, in one command.

Starts a server (or reuses the one already answering on `--port` with the same key), writes the CLI's
settings from that server's real context into a private folder (0700) -- Codex: a model provider with
`wire_api = "responses"` and `model_context_window`; Claude Code: `ANTHROPIC_BASE_URL`, the key, the
auto-compact window and the max context tokens -- and runs the CLI with the arguments after `--`. The
server it started stops when the CLI exits. A CLI that is not installed is refused in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from ..cachedir import cache_dir
from ..errors import ExactSpecError

CLIS = {"codex": "@openai/codex", "claude": "@anthropic-ai/claude-code"}
CONTEXT = 32768  # the embedded model's 8,192 tokens hold neither CLI's first prompt: YaRN past them
START_S = 900.0  # a first start measures the engine (the self-test) before /health answers


def add_launch_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "launch", help="run Codex CLI or Claude Code against a local exactspec server",
        description="Start (or reuse) a local `exactspec serve` and run a coding-agent CLI against it, its "
                    "settings written from the server's real context into a private folder. Arguments after "
                    "`--` go to the CLI, e.g. `exactspec launch codex -- exec \"fix the tests\"`.",
        usage="exactspec launch {claude,codex} [--target F] [--port P] [--ctx-size N] [-- CLI ARGS ...]")
    p.add_argument("cli", choices=sorted(CLIS), help="the agent CLI (installed with npm: `npm i -g PACKAGE`)")
    p.add_argument("--target", default=None, help="GGUF or model directory (default: the embedded model)")
    p.add_argument("--port", type=int, default=8000, help="the local server's port (reused if one answers there)")
    p.add_argument("--ctx-size", type=int, default=CONTEXT, metavar="N",
                   help=f"context per row of a server this starts (default {CONTEXT}: the CLIs' first prompts "
                        "are 9-22k tokens; past the model's training context llama.cpp scales positions by YaRN)")
    p.set_defaults(func=cmd_launch, cli_args=[])
    return p


def split_passed(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """`launch`'s own arguments and those after its `--`, which go to the CLI untouched (argparse would read
    the CLI's options as its own); other commands' arguments as they are, None."""
    if "launch" not in argv or "--" not in argv or argv.index("--") < argv.index("launch"):
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def cmd_launch(args: argparse.Namespace) -> int:
    binary = shutil.which(args.cli)
    if binary is None:
        raise ExactSpecError(f"{args.cli} is not installed (npm install -g {CLIS[args.cli]}), or not on PATH")
    passed = list(args.cli_args)
    home = tempfile.mkdtemp(prefix=f"{args.cli}-", dir=cache_dir("launch"))  # 0700; not under /tmp (Codex refuses
    # to put its helpers there)
    key = os.environ.get("EXACTSPEC_API_KEY") or secrets.token_urlsafe(24)
    base, server = f"http://127.0.0.1:{args.port}", None
    try:
        context = served_context(base, key)
        if context is None:
            server = start_server(args, home, key)
            context = served_context(base, key)
        env = {**os.environ, **(codex_settings(home, base, key, context) if args.cli == "codex"
                                else claude_settings(base, key, context))}
        return subprocess.run([binary, *passed], env=env).returncode
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)


def served_context(base: str, key: str) -> int | None:
    """The context per row of the server answering at `base` with `key`, or None where none does."""
    request = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as r:
            model = json.load(r)["data"][0]
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise ExactSpecError(f"a server at {base} wants another API key: set EXACTSPEC_API_KEY to it, or "
                                 "choose another --port") from None
        return None
    except (OSError, ValueError, KeyError, IndexError):
        return None
    return int(model["exactspec"]["context"])


def start_server(args: argparse.Namespace, home: str, key: str) -> subprocess.Popen:
    key_file = os.path.join(home, "key")
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(key)
    argv = [sys.executable, "-m", "exactspec.cli", "serve", "--port", str(args.port), "--api-key-file", key_file,
            "--ctx-size", str(args.ctx_size), "--max-rows", "4", *(["--target", args.target] if args.target else [])]
    print(f"exactspec: starting {' '.join(argv[2:])} (log: {home}/serve.log)", file=sys.stderr, flush=True)
    log = open(os.path.join(home, "serve.log"), "w")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ExactSpecError(f"the server exited with code {server.returncode}: see {home}/serve.log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=5):
                return server
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise ExactSpecError(f"the server did not answer within {START_S:.0f} s: see {home}/serve.log")


def codex_settings(home: str, base: str, key: str, context: int) -> dict[str, str]:
    """CODEX_HOME with a provider for the server: the Responses wire, the key from the environment."""
    with open(os.path.join(home, "config.toml"), "w") as f:
        f.write(f'model = "exactspec"\nmodel_provider = "exactspec"\nmodel_context_window = {context}\n\n'
                f'[model_providers.exactspec]\nname = "exactspec"\nbase_url = "{base}/v1"\n'
                'wire_api = "responses"\nenv_key = "EXACTSPEC_API_KEY"\n')
    return {"CODEX_HOME": home, "EXACTSPEC_API_KEY": key}


def claude_settings(base: str, key: str, context: int) -> dict[str, str]:
    """Claude Code's environment for the server: its address and key, and the window it has."""
    return {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": key, "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(context),
            "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(context), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
