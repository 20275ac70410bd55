"""Routing benchmark: agent sessions on a 2-replica Ray Serve deployment, per routing policy.

    PYTHONPATH=src OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/bench_routing.py --rounds 2

For each routing (`serve --routing`: affinity, ray-prefix, load) the deployment is started afresh (2
replicas x 1 CPU, the embedded target on llama.cpp at 1 thread, prompt lookup, gamma 4, a prefix cache
each), then `--sessions` agent sessions run `--steps` steps, interleaved: every step sends all
sessions' next request at once, and each re-sends its whole conversation (system, task, then its
earlier answers and tool results) plus one new tool result. Reported per routing:

    cached share  over steps 2..N: cached_tokens / re-sent tokens (the previous step's prompt and
                  answer, in tokens), overall and for the worst session
    latency       per-step seconds, median over steps 2..N (and over step 1: nothing to reuse)
    moves         how often a session's step went to another replica than its previous step

Rounds use fresh sessions (their texts name the round), so no round finds another's prefixes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from exactspec.bench.peer import free_port
from exactspec.device import cpu_label
from exactspec.scale import init_ray
from exactspec.scale.serve import APP_NAME, REPLICA_HEADER, Replicas, application

TASKS = ["rename the function parse_args to read_options in cli.py", "add a unit test for the empty input case",
         "fix the off by one error in the pagination helper", "update the changelog for the next release",
         "make the retry loop stop after five attempts", "log the request id in every error message"]


def first_messages(session: int, round_: int) -> list[dict]:
    return [{"role": "system", "content": f"You are coding agent {session} (run {round_}). Work in small steps: "
                                          "say which file you read or change and why, then wait for the tool."},
            {"role": "user", "content": f"Task: {TASKS[session % len(TASKS)]}. The repository has src/, tests/ and "
                                        "docs/. Start by reading the file you need."}]


def tool_result(session: int, step: int) -> str:
    return (f"Tool output (step {step}): the file has {40 + 7 * step + session} lines; the relevant function is "
            f"at line {12 + step * 3}. Tests: {step} passed, 1 failed. Continue.")


def run_sessions(base: str, sessions: int, steps: int, max_tokens: int, round_: int) -> list[list[dict]]:
    """Interleaved agent sessions; per session, per step: replica, prompt/cached/completion tokens, seconds."""
    convs = [first_messages(s, round_) for s in range(sessions)]
    log: list[list[dict]] = [[] for _ in range(sessions)]

    def step(s: int) -> None:
        start = time.perf_counter()
        r = httpx.post(f"{base}/v1/chat/completions", timeout=600,
                       json={"messages": convs[s], "max_tokens": max_tokens, "temperature": 0})
        seconds = time.perf_counter() - start
        r.raise_for_status()
        body = r.json()
        usage = body["usage"]
        log[s].append(dict(replica=r.headers.get(REPLICA_HEADER), prompt=usage["prompt_tokens"],
                           cached=usage["prompt_tokens_details"]["cached_tokens"],
                           completion=usage["completion_tokens"], seconds=seconds))
        convs[s] = [*convs[s], {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                    {"role": "user", "content": tool_result(s, len(log[s]))}]

    with ThreadPoolExecutor(sessions) as pool:
        for _ in range(steps):
            list(pool.map(step, range(sessions)))
    return log


def summarize(logs: list[list[dict]]) -> dict:
    """Cached share of re-sent tokens (overall, worst session), step latencies, replica moves."""
    cached = resent = moves = 0
    worst, later, first = 1.0, [], []
    for session in logs:
        s_cached = s_resent = 0
        first.append(session[0]["seconds"])
        for prev, cur in zip(session, session[1:]):
            again = prev["prompt"] + prev["completion"]  # what this step re-sends, in tokens
            s_cached += min(cur["cached"], again)
            s_resent += again
            later.append(cur["seconds"])
            moves += cur["replica"] != prev["replica"]
        cached, resent = cached + s_cached, resent + s_resent
        worst = min(worst, s_cached / max(s_resent, 1))
    return dict(cached_share=cached / max(resent, 1), worst_session_share=worst,
                step_seconds_median=statistics.median(later), first_step_seconds_median=statistics.median(first),
                moves=moves, steps=len(later))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routings", default="affinity,load,ray-prefix")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="fresh sessions per routing, one after another")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-rows", type=int, default=4, help="rows (and ongoing requests) per replica")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()

    from ray import serve

    init_ray(None, 2)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    load_kwargs = dict(target=None, draft="prompt-lookup", gamma=4, threads=1, prefix_cache_mb=256, rows=args.max_rows)
    results = {}
    for routing in args.routings.split(","):
        started = time.perf_counter()
        serve.run(application(load_kwargs, "exactspec", args.max_rows, Replicas(2, 1.0, routing=routing)),
                  name=APP_NAME, route_prefix="/")
        ready = time.perf_counter() - started
        logs = [s for r in range(args.rounds)
                for s in run_sessions(f"http://127.0.0.1:{port}", args.sessions, args.steps, args.max_tokens, r)]
        results[routing] = {**summarize(logs), "ready_s": ready, "logs": logs}
        serve.delete(APP_NAME)
        print(f"[{routing}: {json.dumps({k: v for k, v in results[routing].items() if k != 'logs'})}]",
              file=sys.stderr)
    print(f"\n{cpu_label()}, {args.sessions} sessions x {args.steps} steps interleaved, {args.rounds} round(s), "
          f"2 replicas x 1 CPU (1 thread), embedded target on llama.cpp, {args.max_tokens} tokens per step")
    print("| routing | cached share of re-sent tokens (worst session) | step 2+ median s | step 1 median s | moves |")
    print("|---|---|---|---|---|")
    for routing, r in results.items():
        print(f"| {routing} | {r['cached_share']:.1%} ({r['worst_session_share']:.1%}) | "
              f"{r['step_seconds_median']:.2f} | {r['first_step_seconds_median']:.2f} | {r['moves']}/{r['steps']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_label(), args=vars(args), results=results), f, indent=1)
    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
