"""A/B of agent-repeat step latency between two commits, interleaved in ONE run.

`agent-repeat` (bench/workloads/agent-repeat.json) replays many agent sessions of the same task kinds
as a server sees them: each step re-sends the conversation so far and waits for a short answer. A
method keeps its prefix cache (and, where the commit has one, its store) from session to session, so
one "run" is every session of the workload in order, from empty caches. Each commit is served by a
worker process (bench_loop_ab.Worker, PYTHONPATH = that commit's src); the transcripts come from the
driver (the NEW commit's workload file), so an OLD commit without the file replays the same steps.
Every run goes to the workers back to back, the order rotating run by run.

    .venv/bin/python scripts/bench_agent_ab.py OLD NEW --methods old:auto,new:auto,new:prompt-lookup
        [--backend torch] [--reps 3] [--temperature 0] [--json FILE]

A method is WORKER:DRAFTER[:GAMMA] (γ default auto; DRAFTER "none" with γ 0 is plain decoding, and
"llamacpp-cache" is llama-cpp-python's own completion API with its prompt cache, on the same GGUF).
Reported per method: step latency p50 / p90 over every step of every repetition, and p50 against the
first method's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from bench_loop_ab import Worker, checkout  # noqa: E402

WORKER = r"""
import json, os, sys, time
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
from exactspec.engine import load

engines = {}
for line in sys.stdin:
    req = json.loads(line)
    if req["backend"] not in engines:
        engines[req["backend"]] = load(backend=req["backend"])
        engines[req["backend"]].cost_model()  # auto γ's T(k): measured once, outside every timing
    engine, w = engines[req["backend"]], req["workload"]
    if req["drafter"] == "llamacpp-cache":  # llama-cpp-python's completion API and prompt cache
        from exactspec.bench.agent import llamacpp_cache_agent_method
        from exactspec.embedded import embedded_model_path
        from exactspec.speculative.sampling import SamplingParams
        method = llamacpp_cache_agent_method(engine, embedded_model_path(), req["cache_mb"], None)
        method.begin()
        def step(messages, seed):
            s = method.step(messages, SamplingParams(temperature=req["temperature"]), w["max_new_tokens"], seed)
            return s.latency_s, s.text
    else:
        engine.set_prefix_cache(req["cache_mb"])  # empty caches (and store, where the commit has one)
        if hasattr(engine, "drafts"):
            engine.drafts.set_store(req["store_mb"])
        def step(messages, seed):
            t, result = time.perf_counter(), engine.new_result(messages)
            for _ in engine.stream(messages, w["max_new_tokens"], seed=seed, gamma=req["gamma"],
                                   draft=req["drafter"], temperature=req["temperature"], result=result):
                pass
            return time.perf_counter() - t, result.text
    latencies = []
    for j, session in enumerate(w["transcripts"]):
        messages = [{"role": "system", "content": w["system"]}, {"role": "user", "content": session["task"]},
                    {"role": "assistant", "content": "I will use the tools step by step."}]
        for i, tool in enumerate(session["steps"]):
            messages.append({"role": "user", "content": "Tool output:\n" + tool})
            latency, text = step(messages, 100 * j + i)
            latencies.append(latency)
            messages.append({"role": "assistant", "content": text})
    out.write(json.dumps({"latencies": latencies}) + "\n")
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--methods", default="old:auto,new:auto,new:prompt-lookup,new:suffix")
    p.add_argument("--backend", default="torch")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cache-mb", type=float, default=256)
    p.add_argument("--store-mb", type=float, default=64)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    from exactspec.bench.agent import load_agent_repeat  # the NEW commit's workload, sent to both workers

    workload = load_agent_repeat()
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="agent-ab-")
    trees = {"old": checkout(repo, args.old, os.path.join(tmp, "old")),
             "new": checkout(repo, args.new, os.path.join(tmp, "new"))}
    workers = {n: Worker(n, trees[n], WORKER) for n in trees}
    methods = []
    for spec in args.methods.split(","):
        worker, drafter, *gamma = spec.split(":")
        gamma = gamma[0] if gamma else "auto"
        methods.append(dict(name=spec, worker=worker, drafter=drafter, gamma=gamma if gamma == "auto" else int(gamma)))
    latencies = {m["name"]: [] for m in methods}
    try:
        for rep in range(args.reps):
            shift = rep % len(methods)
            for m in methods[shift:] + methods[:shift]:
                request = dict(backend=args.backend, workload=workload, drafter=m["drafter"], gamma=m["gamma"],
                               temperature=args.temperature, cache_mb=args.cache_mb, store_mb=args.store_mb)
                latencies[m["name"]] += workers[m["worker"]].run(request)["latencies"]
            print(f"  repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
        for where in trees:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", os.path.join(tmp, where)])
    base = statistics.median(latencies[methods[0]["name"]])
    print(f"\nagent-repeat, {args.backend}, T = {args.temperature:g}, {args.reps} repetitions "
          f"(old {args.old}, new {args.new})")
    print(f"{'method':28s} {'steps':>5s} {'p50 s':>7s} {'p90 s':>7s} {'p50 vs ' + methods[0]['name']:>24s}")
    table = []
    for m in methods:
        xs = sorted(latencies[m["name"]])
        if not xs:
            continue
        p50, p90 = statistics.median(xs), xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        table.append(dict(method=m["name"], steps=len(xs), p50_s=p50, p90_s=p90, speedup_p50=base / p50))
        print(f"{m['name']:28s} {len(xs):5d} {p50:7.3f} {p90:7.3f} {base / p50:23.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"old": args.old, "new": args.new, "table": table, "latencies": latencies}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
