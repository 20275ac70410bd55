"""The peer bench: `exactspec serve` against llama.cpp's own `llama-server` on the same GGUF, threads,
machine, requests and client, so a figure says what a user gains over the engine they already run.

Every row is its OWN server process (llama-server plain, one per `spec` flag set, exactspec with
`--gamma 0`, exactspec's defaults), all started anew for each workload on loopback with the same
environment (printed: OpenMP's waiting policy alone moved llama.cpp 2.5x here). So nothing a row
cached (prefix cache, drafter store, llama-server's slots) comes from another row or workload:

    cold   round 1: every server sees the workload's requests for the first time (with
           `cold` > 1, every server is started that many times, one cold round each), each
           exactspec start on an empty prefix-cache folder (a fresh process on an empty disk)
    warm   the rounds after the last cold one: the same requests again (a replay: prefix caches
           hold the earlier rounds)

Rounds alternate the rows' order (A B C D, D C B A, ...) so the machine's drift cancels; each ratio
is computed from the figures printed beside it (tokens / seconds summed over the phase's rounds), and
the spread of the per-round ratios is printed with it. Requests go through ONE plain HTTP client
(OpenAI chat completions, greedy). Workloads (the bench's data files):

    agent       workloads/agent.json's sessions one after another, each step continuing from the
                server's OWN answers (as an agent does)
    long-agent  3 of those sessions interleaved round-robin behind a ~3.3k-token system prompt of 15
                tool specifications (workloads/long-agent.json), streamed: per-step latency (p50, p90,
                mean; first steps and later ones apart) and time to first token
    edit, chat  their prompts, one request at a time
    short       answers of a few tokens (a tool name, yes / no, a number), one request at a time:
                where nothing is copied, what the defaults cost over `--gamma 0` per request
    concurrent  the chat prompts 8 at a time (llama-server gets --parallel 8)
    join        an edit answer streams; just after its first token the long-agent prompt arrives
                (llama-server gets --parallel 2): the stream's worst gap between two tokens, the
                joining prompt's TTFT, and how long the two overlapped

Per row: tokens/s (the servers' own `usage`), the ratio to llama-server plain, cached prompt tokens
(both servers' own count), and whether its texts equal its own plain row's: the exactness column.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources

from ..errors import ExactSpecError
from .workloads import load_workload

WORKLOADS = ("agent", "long-agent", "edit", "chat", "short", "concurrent", "join")
MAX_TOKENS = {"edit": 320, "chat": 96, "short": 16, "concurrent": 96, "join": 320}  # agent, long-agent: the workload's own
PARALLEL = {"concurrent": 8, "join": 2}  # llama-server slots the workload needs (ours batches without)
LATENCY = ("long-agent", "join")  # streamed workloads, reported by latency
SPEC = ("--spec-default",)  # llama-server's own speculation rows
ENV_KEYS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_PROC_BIND")
CONTEXT = 8192  # per server (llama-server: per slot), room for long-agent's prompt and history


@dataclass
class Server:
    """One row: a server process, the extra body fields its requests carry, the row whose texts it must equal."""

    name: str
    argv: list[str]
    plain: str
    extra: dict = field(default_factory=dict)
    port: int = 0
    process: subprocess.Popen | None = None
    log: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Call:
    """One request as the client saw it."""

    text: str
    tokens: int  # completion tokens (the server's usage; streamed without usage: content chunks)
    seconds: float  # request to last byte
    ttft: float | None = None  # streamed: request to first content
    max_gap: float | None = None  # streamed: longest wait between two content chunks
    cached: int = 0  # prompt tokens the server took from its cache (its own count)
    started: float = 0.0  # perf_counter() when the request was sent


@dataclass
class Round:
    seconds: float  # wall time of the round
    calls: list[Call]

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.calls)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(llama_server: str, gguf: str, threads: int, spec: tuple[str, ...] = SPEC,
            peer_args: list[str] | None = None, exactspec_args: list[str] | None = None,
            no_repack: bool = False) -> list[Server]:
    """llama-server plain, one llama-server per `spec` flag set, exactspec plain and exactspec defaults.
    `no_repack`: llama-server keeps the GGUF's weight layout: where its repacked AMX kernels crash
    (`repack_crashes`) or our adapter's probe turned repacking off."""
    base = [llama_server, "-m", gguf, "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1",
            *(["--no-repack"] if no_repack else []), *(peer_args or [])]
    out = [Server("llama-server", base, "llama-server")]
    out += [Server(f"llama-server {flags}", base + flags.split(), "llama-server") for flags in spec]
    ours = [sys.executable, "-m", "exactspec.cli", "serve", "--target", gguf, "--threads", str(threads),
            "--ctx-size", str(CONTEXT), *(exactspec_args or [])]
    out += [Server("exactspec plain", ours + ["--gamma", "0"], "exactspec plain"),
            Server("exactspec", ours, "exactspec plain")]
    return out


def argv_for(server: Server, workload: str) -> list[str]:
    """The server's command line for `workload`: llama-server gets the slots it needs, each of CONTEXT tokens."""
    if not server.name.startswith("llama-server"):
        return server.argv
    slots = PARALLEL.get(workload, 1)
    return server.argv + ["--parallel", str(slots), "-c", str(CONTEXT * slots)]


def start(server: Server, workload: str, log_dir: str, timeout_s: float = 600, empty_disk: bool = True) -> None:
    """Start the server's process on a free port and wait for its /health (its log goes to log_dir). An
    exactspec server starts on an empty prefix-cache folder of its own: cold is a fresh process on an
    empty disk, never a restart that finds an earlier start's snapshots (bench_restart.py measures that)."""
    server.port = free_port()
    name = f"{server.name}-{workload}".replace(" ", "_").replace("-", "")
    server.log = open(os.path.join(log_dir, name + ".log"), "w")
    empty = [] if server.name.startswith("llama-server") or not empty_disk else [
        "--prefix-cache-dir", tempfile.mkdtemp(dir=log_dir, prefix=f"{name}-prefix-")]
    server.process = subprocess.Popen(argv_for(server, workload) + empty + ["--port", str(server.port)],
                                      stdout=server.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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


def repack_crashes(llama_server: str, gguf: str, threads: int, log_dir: str) -> bool:
    """Whether this llama-server dies decoding `gguf` with its weights repacked (its default): a stock
    build by GCC 12 loads an empty AMX tile configuration, and its first multi-row product raises SIGILL
    (scripts/llama_cpp_patches/11-*). Probed on CPUs that advertise AMX only: the binary itself, one short
    chat request; the peer bench then runs it with --no-repack."""
    from ..models.llamacpp.runtime import cpu_has_amx

    if not cpu_has_amx():
        return False
    probe = Server("llama-server repack probe", [llama_server, "-m", gguf, "-t", str(threads), "--host", "127.0.0.1"],
                   "llama-server")
    try:
        start(probe, "probe", log_dir)
        chat(probe.url, [{"role": "user", "content": "Count from one to twenty, in words, one per line."}], 2, {})
    except (ExactSpecError, OSError):
        pass  # a crash mid-request (the connection drops) or at start: its exit code says which
    try:
        code = probe.process.wait(timeout=5) if probe.process is not None else None
    except subprocess.TimeoutExpired:
        code = None  # still serving: it decoded
    finally:
        stop(probe)
    return code is not None and code < 0


def stop(server: Server) -> None:
    if server.process is not None and server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
    if server.log is not None:
        server.log.close()
    server.process = server.log = None


def _cached(answer: dict) -> int:
    """Prompt tokens served from the cache: OpenAI's usage field (ours), else llama-server's timings."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"] or 0)
    return int((answer.get("timings") or {}).get("cache_n", 0) or 0)


def chat(url: str, messages: list[dict], max_tokens: int, extra: dict, stream: bool = False,
         first: threading.Event | None = None) -> Call:
    """One greedy chat completion (streamed: TTFT and the longest gap between content chunks; `first` is
    set at the first content)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0, **extra}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=900) as r:
            if not stream:
                answer = json.loads(r.read())
                return Call(answer["choices"][0]["message"]["content"] or "", int(answer["usage"]["completion_tokens"]),
                            time.perf_counter() - t0, cached=_cached(answer), started=t0)
            return _read_stream(r, t0, first)
    except urllib.error.HTTPError as e:  # e.g. llama-server's slots too small for the prompt
        raise ExactSpecError(f"{url} answered {e.code}: {e.read().decode(errors='replace')[:300]}") from None


def _read_stream(response, t0: float, first: threading.Event | None = None) -> Call:
    """Server-sent chat chunks -> the Call (usage from the last chunk that carries one)."""
    text, chunks, times, last = [], 0, [], {}
    for line in response:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        last = chunk if chunk.get("usage") else last
        delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
        if delta.get("content"):
            times.append(time.perf_counter())
            if first is not None:
                first.set()
            text.append(delta["content"])
            chunks += 1
    seconds = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(times, times[1:])]
    tokens = int((last.get("usage") or {}).get("completion_tokens") or chunks)
    return Call("".join(text), tokens, seconds, times[0] - t0 if times else None, max(gaps, default=0.0),
                _cached(last), t0)


# --- workloads ---------------------------------------------------------------------------------------
def long_agent() -> dict:
    """long-agent: agent.json's first sessions behind a system prompt of tool specifications."""
    from .agent import load_agent_workload  # imports torch: not at the CLI's start

    spec = json.loads(resources.files(__package__).joinpath("workloads", "long-agent.json").read_text())
    system = spec["preamble"] + "\n\n# Tools\n" + "\n".join(json.dumps(t, indent=1) for t in spec["tools"])
    sessions = load_agent_workload()["transcripts"][: spec["sessions"]]
    return {"system": system, "max_new_tokens": spec["max_new_tokens"], "transcripts": sessions}


def interleaved_steps(work: dict) -> list[tuple[int, str]]:
    """(session index, tool output) of every step of the work's transcripts, round-robin: every session's
    first step, then every second, ... (as concurrent agents reach a server)."""
    transcripts = work["transcripts"]
    return [(i, t["steps"][k]) for k in range(max(len(t["steps"]) for t in transcripts))
            for i, t in enumerate(transcripts) if k < len(t["steps"])]


def run_workload(url: str, workload: str, extra: dict) -> Round:
    """One round of a workload against one server."""
    from .agent import TOOL_PREFIX, load_agent_workload, opening

    start_s, calls = time.perf_counter(), []
    if workload in ("agent", "long-agent"):
        work = load_agent_workload() if workload == "agent" else long_agent()
        sessions = [opening(work, t) for t in work["transcripts"]]
        steps = interleaved_steps(work)
        if workload == "agent":  # one session after another
            steps.sort(key=lambda step: step[0])
        for i, tool in steps:
            sessions[i].append({"role": "user", "content": TOOL_PREFIX + tool})
            call = chat(url, sessions[i], work["max_new_tokens"], extra, stream=workload == "long-agent")
            sessions[i].append({"role": "assistant", "content": call.text})
            calls.append(call)
    elif workload == "join":
        calls = join(url, extra)
    else:
        prompts = load_workload("chat" if workload == "concurrent" else workload)
        one = lambda p: chat(url, [{"role": "user", "content": p}], MAX_TOKENS[workload], extra)  # noqa: E731
        with ThreadPoolExecutor(PARALLEL.get(workload, 1)) as pool:
            calls = list(pool.map(one, prompts))
    return Round(time.perf_counter() - start_s, calls)


def join(url: str, extra: dict, delay_s: float = 0.3) -> list[Call]:
    """An edit answer (long copies: seconds of output) streams; `delay_s` after its first token, the
    long-agent prompt (system + first task) joins -> [the stream's Call (its max_gap), the joining
    prompt's Call (its ttft)]. `overlap_s` (table_rows) says how long the stream ran beside the join."""
    from .agent import opening

    work = long_agent()
    out: list[Call | None] = [None, None]
    streaming = threading.Event()

    def stream() -> None:
        prompt = load_workload("edit")[0]
        out[0] = chat(url, [{"role": "user", "content": prompt}], MAX_TOKENS["join"], extra, stream=True,
                      first=streaming)

    thread = threading.Thread(target=stream)
    thread.start()
    streaming.wait(timeout=600)
    time.sleep(delay_s)
    out[1] = chat(url, opening(work, work["transcripts"][0])[:2], 16, extra, stream=True)
    thread.join()
    return out


def run_peer_bench(servers_: list[Server], workloads: list[str], rounds: int, log_dir: str = ".",
                   say=print, cold: int = 1) -> list[dict]:
    """Per workload: `cold` times, start every server anew and run one round (cold: no request seen
    before); on the last start, `rounds` - 1 rounds more (warm: a replay). The rows' order alternates
    round by round; -> the bench's JSON rows (workload, temperature, method, drafter, gamma, tokens_per_s,
    phase, ...). One cold round is one sample of a VM's drift: `cold` > 1 averages it out."""
    out = []
    for workload in workloads:
        results: dict[str, list[Round]] = {s.name: [] for s in servers_}
        k = 0  # rounds run so far
        for launch in range(cold):
            try:
                for server in servers_:
                    say(f"{workload}: starting {server.name}: {' '.join(argv_for(server, workload))}")
                    start(server, workload, log_dir)
                for _ in range(1 if launch < cold - 1 else rounds):
                    for server in (servers_ if k % 2 == 0 else servers_[::-1]):
                        done = run_workload(server.url, workload, server.extra)
                        results[server.name].append(done)
                        say(f"{workload} round {k + 1} ({'cold' if k < cold else 'warm'}): {server.name}: "
                            f"{done.seconds:.2f} s, {done.tokens / done.seconds:.1f} tok/s")
                    k += 1
            finally:
                for server in servers_:
                    stop(server)
        out += table_rows(servers_, workload, results, cold)
    return out


def _phase(rounds: list[Round]) -> dict:
    """Figures of some rounds of one row: tokens/s from the sums, latency from every call."""
    calls = [c for r in rounds for c in r.calls]
    seconds = sum(r.seconds for r in rounds)
    latency = sorted(c.seconds for c in calls)
    ttfts = sorted(c.ttft for c in calls if c.ttft is not None)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None  # noqa: E731
    return {"tokens_per_s": sum(r.tokens for r in rounds) / seconds, "seconds": seconds / len(rounds),
            "tokens": sum(r.tokens for r in rounds), "cached_tokens": sum(c.cached for c in calls),
            "step_latency_mean_s": statistics.mean(latency), "step_latency_p50_s": q(latency, 0.5),
            "step_latency_p90_s": q(latency, 0.9), "ttft_p50_s": q(ttfts, 0.5), "ttft_p90_s": q(ttfts, 0.9)}


def table_rows(servers_: list[Server], workload: str, results: dict[str, list[Round]], cold: int = 1) -> list[dict]:
    """Two rows per server (cold: the first `cold` rounds, each after a fresh start; warm: the rest, when
    there are more rounds), each ratio from the figures beside it and its spread over the rounds."""
    reference = results["llama-server"]
    phases = [("cold", slice(0, cold))] + ([("warm", slice(cold, None))] if len(reference) > cold else [])
    out = []
    for phase, rounds in phases:
        ref = _phase(reference[rounds])
        for server in servers_:
            mine, plain = results[server.name], results[server.plain]
            row = _phase(mine[rounds])
            per_round = [(m.tokens / m.seconds) / (r.tokens / r.seconds) for m, r in zip(mine[rounds], reference[rounds])]
            row |= {"workload": workload, "temperature": 0.0, "method": server.name, "phase": phase,
                    "drafter": None if server.name in ("llama-server", "exactspec plain") else "default",
                    "gamma": server.extra.get("gamma", 0 if server.name.endswith("plain") else "default"),
                    "vs_llama_server_plain": row["tokens_per_s"] / ref["tokens_per_s"],
                    "ratio_range": [min(per_round), max(per_round)],
                    "latency_vs_llama_server": row["step_latency_mean_s"] / ref["step_latency_mean_s"],
                    "same_text_as_own_plain": all([c.text for c in m.calls] == [c.text for c in plain[0].calls]
                                                  for m in mine),
                    "same_text_as_llama_server": all([c.text for c in m.calls] == [c.text for c in reference[0].calls]
                                                     for m in mine)}
            if workload == "join":  # overlap: how long the stream ran while the joiner waited for its first token
                row |= {"stream_max_gap_s": max(m.calls[0].max_gap for m in mine[rounds]),
                        "join_ttft_s": statistics.mean(m.calls[1].ttft for m in mine[rounds]),
                        "overlap_s": min(min(m.calls[0].started + m.calls[0].seconds, m.calls[1].started
                                             + m.calls[1].ttft) - m.calls[1].started for m in mine[rounds])}
            out.append(row)
    return out


def environment() -> str:
    """The OpenMP settings both servers inherit (unset = libgomp's default: spin, then sleep)."""
    return ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in ENV_KEYS)


def peer_table(rows: list[dict]) -> str:
    """Throughput workloads by tokens/s, latency ones (long-agent, join) by seconds; ratios to
    llama-server plain in the same phase, the per-round spread in brackets."""
    lines = ["| workload | phase | server | tokens/s | vs llama-server plain [rounds] | cached prompt tokens | "
             "same text as its own plain |", "|---|---|---|---|---|---|---|"]
    timed = ["", "| workload | phase | server | step p50 / p90 s | mean step s (vs llama-server) | TTFT p50 s | "
             "worst gap s (overlap s) | same text as its own plain |", "|---|---|---|---|---|---|---|---|"]
    f = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
    for r in rows:
        same = "yes" if r["same_text_as_own_plain"] else "**no**"
        if r["workload"] in LATENCY:
            gap = f"{f(r['stream_max_gap_s'])} ({f(r['overlap_s'])})" if "stream_max_gap_s" in r else "–"
            ttft = r.get("join_ttft_s", r["ttft_p50_s"])
            timed.append(f"| {r['workload']} | {r['phase']} | {r['method']} | {f(r['step_latency_p50_s'])} / "
                         f"{f(r['step_latency_p90_s'])} | {f(r['step_latency_mean_s'])} "
                         f"({r['latency_vs_llama_server']:.2f}×) | {f(ttft)} | {gap} | {same} |")
        else:
            lo, hi = r["ratio_range"]
            lines.append(f"| {r['workload']} | {r['phase']} | {r['method']} | {r['tokens_per_s']:.1f} | "
                         f"{r['vs_llama_server_plain']:.2f}× [{lo:.2f}–{hi:.2f}] | {r['cached_tokens']} | {same} |")
    return "\n".join(lines + (timed if len(timed) > 3 else []))
