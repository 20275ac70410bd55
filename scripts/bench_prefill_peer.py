#!/usr/bin/env python3
"""Prefill against llama-server: one chat request of a ~N-token user message (random common words, a
new seed per round), one token back, timed from request to answer, after a one-word warm-up request;
prompt tokens per second as each server counts them (its usage). exactspec serve (its defaults, an empty
prefix-cache folder) and llama-server (its defaults), the embedded model, each a fresh process per round,
rows alternated; the ratio of the summed rates.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/bench_prefill_peer.py LLAMA_SERVER [--tokens 3072] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.request

from exactspec.bench.peer import Server, environment, start, stop
from exactspec.embedded import embedded_model_path
from bench_cli_turns import WORDS  # scripts/, beside this one

CONTEXT = 8192


def ask(url: str, text: str) -> tuple[int, float]:
    """(prompt tokens, seconds) of one non-streamed chat request for one token."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=1800) as response:
        answer = json.load(response)
    return answer["usage"]["prompt_tokens"], time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_server")
    parser.add_argument("--tokens", type=int, default=3072, help="about this many prompt tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    gguf, t = embedded_model_path(), str(args.threads)
    rows = [Server("exactspec", [sys.executable, "-m", "exactspec.cli", "serve", "--target", gguf, "--threads", t,
                                 "--ctx-size", str(CONTEXT)], ""),
            Server("llama-server", [args.llama_server, "-m", gguf, "-t", t, "-tb", t, "--host", "127.0.0.1",
                                    "-c", str(CONTEXT)], "")]
    rates: dict[str, list[float]] = {row.name: [] for row in rows}
    print(environment(), file=sys.stderr)
    with tempfile.TemporaryDirectory() as logs:
        for r in range(args.rounds):
            rng = random.Random(r)
            text = " ".join(rng.choice(WORDS) for _ in range(args.tokens - 30))  # about a token a word
            for row in rows if r % 2 == 0 else rows[::-1]:
                start(row, "prefill", logs)
                try:
                    ask(row.url, "Hello")
                    tokens, seconds = ask(row.url, text)
                finally:
                    stop(row)
                rates[row.name].append(tokens / seconds)
                print(f"round {r + 1} {row.name}: {tokens} prompt tokens in {seconds:.2f} s = "
                      f"{tokens / seconds:.0f} tokens/s", file=sys.stderr)
    ours, peer = sum(rates["exactspec"]), sum(rates["llama-server"])
    print(f"prefill, {args.rounds} rounds: exactspec {ours / args.rounds:.0f} tokens/s, llama-server "
          f"{peer / args.rounds:.0f} tokens/s: {ours / peer:.2f}x")


if __name__ == "__main__":
    main()
