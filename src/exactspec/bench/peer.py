"""The peer bench: `exactspec serve` against llama.cpp's own `llama-server` on the same GGUF, threads,
machine, requests and client, so a figure says what a user gains over the engine they already run.

Both servers are started here on loopback, each as its own process with the same environment (printed:
OpenMP's waiting policy alone moved llama.cpp 2.5x on this project's machines), and kept up for the
whole run; the requests go through ONE plain HTTP client (OpenAI chat completions, greedy, non-streamed),
to one server at a time, rounds interleaving the servers (the order rotating per round). Rows:

    llama-server                  plain decoding (the reference of every ratio)
    llama-server <flags>          each of `spec` (its own speculation, e.g. --spec-default), one process each
    exactspec plain               our server, requests with gamma 0
    exactspec                     our server's defaults (its drafter, gamma auto)

Workloads (the bench's data files): `agent` (each transcript of workloads/agent.json replayed step by
step, every server continuing from its OWN answers, as an agent would), `edit` and `chat` (their prompts,
one request each); `concurrent` sends the chat prompts `concurrency` at a time (llama-server then needs
--parallel N slots, given in `peer_args`). Per row: seconds per workload round, completion tokens/s
(the servers' own `usage`), the ratio to llama-server plain, and whether its texts equal its own plain
row's (llama-server's speculation against llama-server plain, ours against ours): the exactness column.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import ExactSpecError
from .workloads import load_workload

WORKLOADS = ("agent", "edit", "chat", "concurrent")
MAX_TOKENS = {"agent": None, "edit": 320, "chat": 96, "concurrent": 96}  # agent: the workload's own budget
SPEC = ("--spec-default", "--spec-type ngram-simple")  # llama-server's own speculation rows
ENV_KEYS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_PROC_BIND")


@dataclass
class Server:
    """A server process and the request variants it answers as rows (row name -> extra body fields)."""

    name: str
    argv: list[str]
    rows: dict[str, dict]
    plain: str  # the row whose texts the others must equal
    port: int = 0
    process: subprocess.Popen | None = None
    log: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Result:
    seconds: list[float] = field(default_factory=list)  # per round
    tokens: list[int] = field(default_factory=list)
    texts: list[list[str]] = field(default_factory=list)  # per round, in request order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(llama_server: str, gguf: str, threads: int, spec: tuple[str, ...] = SPEC,
            peer_args: list[str] | None = None, exactspec_args: list[str] | None = None) -> list[Server]:
    """llama-server plain, one llama-server per `spec` flag set, and one exactspec server (two rows)."""
    base = [llama_server, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", "4096", "--host", "127.0.0.1",
            *(peer_args or [])]
    out = [Server("llama-server", base, {"llama-server": {}}, "llama-server")]
    for flags in spec:
        name = f"llama-server {flags}"
        out.append(Server(name, base + flags.split(), {name: {}}, "llama-server"))
    ours = [sys.executable, "-m", "exactspec.cli", "serve", "--target", gguf, "--threads", str(threads),
            *(exactspec_args or [])]
    out.append(Server("exactspec", ours, {"exactspec plain": {"gamma": 0}, "exactspec": {}}, "exactspec plain"))
    return out


def start(server: Server, log_dir: str, timeout_s: float = 600) -> None:
    """Start the server's process on a free port and wait for its /health (its log goes to log_dir)."""
    server.port = free_port()
    port_flag = ["--port", str(server.port)]
    server.log = open(os.path.join(log_dir, server.name.replace(" ", "_").replace("-", "") + ".log"), "w")
    server.process = subprocess.Popen(server.argv + port_flag, stdout=server.log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ExactSpecError(f"{server.name} exited with code {server.process.returncode} (log: {server.log.name})")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise ExactSpecError(f"{server.name} did not answer /health within {timeout_s:.0f} s (log: {server.log.name})")


def stop(server: Server) -> None:
    if server.process is not None and server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
    if server.log is not None:
        server.log.close()


def chat(url: str, messages: list[dict], max_tokens: int, extra: dict) -> tuple[str, int]:
    """One greedy chat completion -> (text, completion tokens as the server counts them)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0, **extra}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:  # e.g. llama-server's slots too small for the prompt (-c / --parallel)
        raise ExactSpecError(f"{url} answered {e.code}: {e.read().decode(errors='replace')[:300]}") from None
    return answer["choices"][0]["message"]["content"] or "", int(answer["usage"]["completion_tokens"])


def run_workload(url: str, workload: str, extra: dict, concurrency: int) -> tuple[float, int, list[str]]:
    """One round of a workload against one server row -> (seconds, completion tokens, texts)."""
    start_s, texts, tokens = time.perf_counter(), [], 0
    if workload == "agent":
        from .agent import TOOL_PREFIX, load_agent_workload, opening  # imports torch: not at the CLI's start

        work = load_agent_workload()
        for transcript in work["transcripts"]:
            messages = opening(work, transcript)
            for tool in transcript["steps"]:
                messages.append({"role": "user", "content": TOOL_PREFIX + tool})
                text, n = chat(url, messages, work["max_new_tokens"], extra)
                messages.append({"role": "assistant", "content": text})
                texts.append(text)
                tokens += n
    else:
        prompts = load_workload("chat" if workload == "concurrent" else workload)
        one = lambda p: chat(url, [{"role": "user", "content": p}], MAX_TOKENS[workload], extra)  # noqa: E731
        with ThreadPoolExecutor(concurrency if workload == "concurrent" else 1) as pool:
            for text, n in pool.map(one, prompts):
                texts.append(text)
                tokens += n
    return time.perf_counter() - start_s, tokens, texts


def run_peer_bench(servers_: list[Server], workloads: list[str], rounds: int, concurrency: int = 8,
                   log_dir: str = ".", say=print) -> list[dict]:
    """Start every server, run `rounds` interleaved rounds of every workload on every row, stop them
    -> the bench's JSON rows (workload, temperature, method, drafter, gamma, tokens_per_s, ...)."""
    results: dict[tuple[str, str], Result] = {}
    try:
        for server in servers_:
            say(f"starting {server.name}: {' '.join(server.argv)}")
            start(server, log_dir)
        rows = [(server, row, extra) for server in servers_ for row, extra in server.rows.items()]
        for workload in workloads:
            for r in range(rounds):
                order = rows[r % len(rows):] + rows[:r % len(rows)]
                for server, row, extra in order:
                    seconds, tokens, texts = run_workload(server.url, workload, extra, concurrency)
                    res = results.setdefault((workload, row), Result())
                    res.seconds.append(seconds)
                    res.tokens.append(tokens)
                    res.texts.append(texts)
                    say(f"{workload} round {r + 1}: {row}: {seconds:.2f} s, {tokens / seconds:.1f} tok/s")
    finally:
        for server in servers_:
            stop(server)
    return table_rows(servers_, workloads, results)


def table_rows(servers_: list[Server], workloads: list[str], results: dict) -> list[dict]:
    out = []
    for workload in workloads:
        reference = results[(workload, "llama-server")]
        for server in servers_:
            plain = results[(workload, server.plain)]
            for row, extra in server.rows.items():
                res = results[(workload, row)]
                tps = [t / s for t, s in zip(res.tokens, res.seconds)]
                ratios = [a / (t / s) for a, t, s in zip(tps, reference.tokens, reference.seconds)]
                out.append({"workload": workload, "temperature": 0.0, "method": row,
                            "drafter": None if row in ("llama-server", "exactspec plain") else "default",
                            "gamma": extra.get("gamma", "default"), "tokens_per_s": statistics.median(tps),
                            "seconds": statistics.median(res.seconds), "tokens": res.tokens[-1],
                            "vs_llama_server_plain": statistics.median(ratios),
                            "same_text_as_own_plain": all(t == plain.texts[0] for t in res.texts),
                            "same_text_as_llama_server": all(t == reference.texts[0] for t in res.texts)})
    return out


def environment() -> str:
    """The OpenMP settings both servers inherit (unset = libgomp's default: spin, then sleep)."""
    return ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in ENV_KEYS)


def peer_table(rows: list[dict]) -> str:
    lines = ["| workload | server | seconds | tokens/s | vs llama-server plain | same text as its own plain |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['method']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['vs_llama_server_plain']:.2f}× | {'yes' if r['same_text_as_own_plain'] else '**no**'} |")
    return "\n".join(lines)
