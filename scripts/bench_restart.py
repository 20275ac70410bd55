"""A restart beside a long agent session: how long the first step after it takes, with the prefix cache on
disk and without, against a warm step. Real servers (`exactspec serve`), real HTTP, one process each.

Per round: a server with a fresh disk folder serves long-agent's first session step (cold: the ~3.3k-token
tool-spec system prompt is prefilled) and then the second session's first step (warm: the system prompt's
KV is reused from memory); it is stopped and started again on the same folder, and serves the third
session's first step (after a restart: the system prompt from disk); then a server with
`--prefix-cache-dir none` serves that step once more (a restart without the disk cache). Time to first
token (streamed) and the whole step are reported per round, and the medians.

    .venv/bin/python scripts/bench_restart.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from exactspec.bench.agent import TOOL_PREFIX, opening
from exactspec.bench.peer import free_port, long_agent


def start(folder: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exactspec.cli", "serve", "--port", str(port), "--ctx-size", "8192",
                             "--prefix-cache-dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(proc.stderr.read())
            time.sleep(0.5)
    raise SystemExit("the server did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # a graceful stop: uvicorn's shutdown, the disk writes flushed
    proc.wait(timeout=120)


def step(url: str, messages: list[dict], max_tokens: int) -> tuple[float, float, int]:
    """-> (time to first token, whole step, prompt tokens reused) of one streamed chat request."""
    body = json.dumps({"model": "exactspec", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0, first, cached = time.perf_counter(), None, 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    return first or 0.0, time.perf_counter() - t0, cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    work = long_agent()
    firsts = [opening(work, t) + [{"role": "user", "content": TOOL_PREFIX + t["steps"][0]}] for t in work["transcripts"]]
    n = work["max_new_tokens"]
    env = {k: os.environ.get(k, "") for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; env {env}", flush=True)
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as folder:
            proc, url = start(folder)
            cold = step(url, firsts[0], n)
            warm = step(url, firsts[1], n)
            stop(proc)
            proc, url = start(folder)
            restarted = step(url, firsts[2], n)
            stop(proc)
        proc, url = start("none")
        without = step(url, firsts[2], n)
        stop(proc)
        rows.append({"cold": cold, "warm": warm, "restart_disk": restarted, "restart_no_disk": without})
        print(json.dumps({"round": r, **{k: [round(v[0], 3), round(v[1], 3), v[2]] for k, v in rows[-1].items()}}),
              flush=True)
    for i, what in ((0, "ttft_s"), (1, "step_s")):
        med = {k: statistics.median(row[k][i] for row in rows) for k in rows[0]}
        print(f"median {what}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items())
              + f"; restart/warm {med['restart_disk'] / med['warm']:.2f}x (disk), "
                f"{med['restart_no_disk'] / med['warm']:.2f}x (no disk)")


if __name__ == "__main__":
    main()
