"""Scale-out benchmark: plain `exactspec serve` vs Ray Serve with 1 and 2 replicas, and `batch` rows/s
in-process vs on Ray Data with 1 and 2 workers. All servers stay up side by side and the cells are
interleaved (rounds of plain / 1 replica / 2 replicas per concurrency), so drift on a shared machine
hits every configuration alike; medians over rounds.

    PYTHONPATH=src OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/bench_ray.py --rounds 2 --requests 8

The embedded SmolLM2-135M target, prompt-lookup drafts, gamma 4, greedy, `--max-tokens` per request.
The plain server and the 1-replica deployment each get 2 CPUs (2 torch threads); the 2-replica
deployment gets 1 CPU (1 thread) per replica, on the same 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

import exactspec
from exactspec.bench.peer import free_port
from exactspec.bench.workloads import load_workload
from exactspec.scale import batch, init_ray
from exactspec.scale.serve import REPLICA_HEADER, Replicas, application


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def replica_processes() -> list[tuple[int, str]]:
    """(pid, title) of this machine's Serve replica actors (processes titled ray::...Replica...)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::") and "Replica" in title:
            found.append((int(pid), title))
    return found


def wait_ready(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready")


def load(base: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """`len(prompts)` chat requests, `concurrency` at a time; requests/s, tokens/s, replicas seen."""
    def one(p: str) -> tuple[int, str | None]:
        r = httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
            "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], r.headers.get(REPLICA_HEADER)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, prompts))
    seconds = time.perf_counter() - start
    return {"requests_per_s": len(prompts) / seconds, "tokens_per_s": sum(t for t, _ in answers) / seconds,
            "replicas_seen": len({r for _, r in answers if r})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8, help="requests per cell")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--batch-lines", type=int, default=16)
    ap.add_argument("--json", metavar="FILE", help="also write the rows here")
    args = ap.parse_args()
    prompts = (load_workload("chat") + load_workload("grounded")) * 4
    rows: list[dict] = []

    plain_port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    t0 = time.perf_counter()
    plain = subprocess.Popen([sys.executable, "-m", "exactspec.cli", "serve", "--port", str(plain_port),
                              "--threads", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{plain_port}/health")
        ready = {"plain": time.perf_counter() - t0}
        memory = {"plain": rss_mib(plain.pid)}

        ray = init_ray(None, num_cpus=4)
        from ray import serve

        serve_port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
        bases = {"plain": f"http://127.0.0.1:{plain_port}"}
        for name, replicas in (("serve-1", Replicas(1, 2.0)), ("serve-2", Replicas(2, 1.0))):
            t0 = time.perf_counter()
            serve.run(application({"target": None, "draft": "prompt-lookup", "gamma": 4}, "smol", 16, replicas),
                      name=name, route_prefix=f"/{name}")
            ready[name] = time.perf_counter() - t0
            bases[name] = f"http://127.0.0.1:{serve_port}/{name}"
            seen = {pid for pids in memory.values() if isinstance(pids, dict) for pid in pids}
            memory[name] = {pid: rss_mib(pid) for pid, _ in replica_processes() if pid not in seen}
        memory = {name: list(m.values()) if isinstance(m, dict) else m for name, m in memory.items()}
        for base in bases.values():  # warm up every engine once
            load(base, prompts[:2], 2, 8)

        cells: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.rounds):
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                for name, base in bases.items():
                    cells.setdefault((name, concurrency), []).append(
                        load(base, prompts[:args.requests], concurrency, args.max_tokens))
        for (name, concurrency), runs in cells.items():
            rows.append({"kind": "serve", "config": name, "concurrency": concurrency,
                         "requests_per_s": statistics.median(r["requests_per_s"] for r in runs),
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                         "replicas_seen": max(r["replicas_seen"] for r in runs)})
        for name in bases:
            rows.append({"kind": "startup", "config": name, "ready_s": ready[name], "rss_mib": memory.get(name)})
        serve.delete("serve-1")
        serve.delete("serve-2")
    finally:
        plain.terminate()
        plain.wait(30)

    # batch: the same chat prompts as JSON lines; Ray Data times include starting the workers (model load)
    lines = [(i + 1, json.dumps({"id": i, "messages": [{"role": "user", "content": p}],
                                 "max_tokens": args.max_tokens, "temperature": 0}))
             for i, p in enumerate(prompts[:args.batch_lines])]
    torch.set_num_threads(2)
    engine = exactspec.load()
    for workers in (0, 1, 2):
        start, first = time.perf_counter(), None
        out = []
        outputs = (batch.run_local(engine, lines, 16, args.max_tokens) if workers == 0 else
                   batch.run_ray({"target": None, "draft": "prompt-lookup", "gamma": 4}, lines, 4, args.max_tokens,
                                 workers, cpus=2.0 / workers))
        for o in outputs:
            first = first or time.perf_counter() - start
            out.append(o)
        seconds = time.perf_counter() - start
        assert not any("error" in o for o in out)
        rows.append({"kind": "batch", "config": "in-process" if workers == 0 else f"ray-data-{workers}",
                     "lines": len(out), "seconds": seconds, "first_line_s": first, "rows_per_s": len(out) / seconds,
                     "tokens_per_s": sum(len(o["token_ids"]) for o in out) / seconds})
    ray.shutdown()
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
