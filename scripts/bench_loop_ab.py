"""A/B speed of the decode loop between two commits, interleaved in ONE run: at B = 1, and batched.

Each commit is checked out into a temporary worktree and served by a worker process (PYTHONPATH = that
worktree's src) that loads the engine once per backend and runs what `exactspec bench` runs for a row
(`bench.runner.exactspec_method`: prefill + decode of one prompt, timed), or, with `--batch B`, what
`exactspec generate --num-samples B` runs (`Engine.generate_batch(prompt, n=B)`: B rows of one batch,
prefill + decode, timed; B = 1 stays the one-prompt path). The driver sends every run to
every worker back to back, the worker order rotating run by run, so machine noise (other jobs on the
cores) falls on both commits alike. A second worker on the OLD commit ("old'") measures the noise band:
old'/old is what a ratio looks like when nothing changed. Every worker gets the same request sequence,
so auto γ learns the same things in each; at T = 0 (and at T = 1 with a fixed γ: same uniforms) the
outputs of both commits must be identical, and the script says where they are not.

    .venv/bin/python scripts/bench_loop_ab.py OLD NEW [--backends torch,llama.cpp] [--workloads grounded,edit]
        [--temperatures 0,1] [--gammas 4,auto] [--drafters prompt-lookup,auto] [--batch 1,4,8] [--prompts 2] [--reps 2] [--max-new-tokens 48]
        [--json FILE]

`--workloads selfconsistency --temperatures 0.7 --batch 8` runs the self-consistency prompts (sent from
this checkout's workload file, so an OLD commit without it runs them too) as n = 8 samples per batch.

Ratios are NEW tokens/s over OLD tokens/s per row (prompts summed within a repetition, then the median
over repetitions); > 1 means NEW is faster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import json, os, sys, time
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # anything else the libraries print goes to stderr
from exactspec.bench.runner import exactspec_method
from exactspec.bench.workloads import load_cases
from exactspec.engine import load  # these names exist in every commit compared (a755351 on)
from exactspec import SamplingParams  # the public name: the same in every commit

engines, prompts, texts = {}, {}, {}
for line in sys.stdin:
    req = json.loads(line)
    backend = req["backend"]
    if backend not in engines:
        engine = engines[backend] = load(backend=backend, threads=req["threads"], dtype=req["dtype"])
        engine.cost_model("prompt-lookup")  # auto γ's T(k): measured once, outside every timing
    engine = engines[backend]
    key = (backend, req["workload"])
    if key not in prompts:
        texts[key] = req.get("texts") or [c.prompt for c in load_cases(req["workload"])]
        prompts[key] = [engine.encode(text) for text in texts[key]]
    if req.get("batch", 1) > 1:  # B rows of one batch: the prompt's B samples (seeds seed .. seed + B - 1)
        t = time.perf_counter()
        results, _ = engine.generate_batch(texts[key][req["prompt"]], n=req["batch"], max_new_tokens=req["max_new_tokens"],
                                           seed=req["seed"], gamma=req["gamma"], draft=req["drafter"],
                                           temperature=req["temperature"])
        seconds, ids = time.perf_counter() - t, [r.token_ids for r in results]
        out.write(json.dumps({"tokens": sum(map(len, ids)), "seconds": seconds, "ids": ids}) + "\n")
        continue
    method = exactspec_method(engine, req["drafter"], req["gamma"])
    ids, seconds, _ = method.run(prompts[key][req["prompt"]], SamplingParams(temperature=req["temperature"]),
                                 req["max_new_tokens"], req["seed"], None)
    out.write(json.dumps({"tokens": len(ids), "seconds": seconds, "ids": ids}) + "\n")
"""


class Worker:
    def __init__(self, name: str, src: str, code: str = WORKER):
        self.name = name
        # parked OpenMP threads: a worker waiting for its turn must not spin on the cores the running one
        # needs (libgomp's spin-then-park made every run several times slower with three workers on 2 cores)
        env = {**os.environ, "PYTHONPATH": src, "TQDM_DISABLE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def run(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died (see its stderr above)")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def checkout(repo: str, commit: str, where: str) -> str:
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "-q", where, commit], check=True)
    return os.path.join(where, "src")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--backends", default="torch,llama.cpp")
    p.add_argument("--workloads", default="grounded,edit")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--gammas", default="4,auto", help="comma list of γ (integers or auto)")
    p.add_argument("--drafters", default="prompt-lookup", help="comma list of drafters (names both commits know)")
    p.add_argument("--batch", default="1", help="comma list of batch sizes B: B > 1 runs generate_batch(n=B)")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-control", action="store_true", help="skip the old' worker (no noise band)")
    p.add_argument("--json", metavar="FILE", help="also write every run and the table as JSON")
    args = p.parse_args()
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="loop-ab-")
    trees = {"old": checkout(repo, args.old, os.path.join(tmp, "old")),
             "new": checkout(repo, args.new, os.path.join(tmp, "new"))}
    names = ["old", "new"] + ([] if args.no_control else ["old'"])
    workers = [Worker(n, trees[n.rstrip("'")]) for n in names]
    runs = []
    try:
        drive(workers, args, runs)
    except KeyboardInterrupt:
        print("interrupted: the table covers the runs done so far", file=sys.stderr)
    finally:
        for w in workers:
            w.close()
        for where in ("old", "new"):
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", os.path.join(tmp, where)])
    table = report(runs, names, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"old": args.old, "new": args.new, "table": table, "runs": runs}, f)
    return 0


def prompt_texts(workload: str) -> list[str] | None:
    """The prompts of a workload the OLD commit may not have (sent with each request); None: its own."""
    if workload != "selfconsistency":
        return None
    from exactspec.bench.selfconsistency import load_selfconsistency

    return load_selfconsistency()["prompts"]


def drive(workers: list[Worker], args, runs: list[dict]) -> None:
    """Every (rep, backend, workload, prompt, T, γ, B) run on every worker, back to back, order rotating."""
    gammas = [g if g == "auto" else int(g) for g in args.gammas.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    drafters = args.drafters.split(",")
    grid = list(itertools.product(range(args.reps), args.backends.split(","), args.workloads.split(","),
                                  range(args.prompts), temperatures, gammas, batches, drafters))
    for backend, workload in itertools.product(args.backends.split(","), args.workloads.split(",")):
        for batch, drafter in itertools.product(sorted({1, max(batches)}), drafters):
            warm = dict(backend=backend, workload=workload, prompt=0, temperature=0.0, gamma=gammas[0],
                        drafter=drafter, max_new_tokens=8, seed=0, threads=args.threads, dtype=args.dtype,
                        batch=batch, texts=prompt_texts(workload))
            for w in workers:  # load, measure T(k), first prefill (and first batch): outside every timing
                w.run(warm)
    start = time.perf_counter()
    for i, (rep, backend, workload, prompt, temperature, gamma, batch, drafter) in enumerate(grid):
        request = dict(backend=backend, workload=workload, prompt=prompt, temperature=temperature, gamma=gamma,
                       drafter=drafter, max_new_tokens=args.max_new_tokens, seed=1000 * rep + prompt,
                       threads=args.threads, dtype=args.dtype, batch=batch, texts=prompt_texts(workload))
        for w in workers[i % len(workers):] + workers[: i % len(workers)]:
            runs.append({**{k: v for k, v in request.items() if k != "texts"}, "rep": rep, "worker": w.name,
                         **w.run(request)})
        if i % 10 == 9:
            print(f"  {i + 1}/{len(grid)} runs x {len(workers)} workers, {time.perf_counter() - start:.0f} s",
                  file=sys.stderr)


def report(runs: list[dict], names: list[str], args) -> list[dict]:
    """Per row: tokens/s of each worker (median over reps of prompts summed), NEW/OLD and OLD'/OLD."""
    rows = {}
    for r in runs:
        key = (r["backend"], r["workload"], r["temperature"], str(r["gamma"]), r["batch"], r["drafter"])
        cell = rows.setdefault(key, {}).setdefault(r["worker"], {}).setdefault(r["rep"], [0, 0.0])
        cell[0] += r["tokens"]
        cell[1] += r["seconds"]
    identical = {}
    for r in runs:  # NEW's tokens == OLD's, run by run
        if r["worker"] == "new":
            same_run = ("backend", "workload", "temperature", "gamma", "batch", "drafter", "prompt", "rep")
            old = next((o for o in runs if o["worker"] == "old" and all(o[k] == r[k] for k in same_run)), None)
            if old is None:  # interrupted before OLD's run of this one
                continue
            key = (r["backend"], r["workload"], r["temperature"], str(r["gamma"]), r["batch"], r["drafter"])
            identical[key] = identical.get(key, True) and old["ids"] == r["ids"]
    table = []
    control_head = "" if "old'" not in names else "  " + "old'/old".rjust(8)
    print(f"\n{'backend':9s} {'workload':8s} {'T':>3s} {'γ':>4s} {'B':>2s} {'drafter':13s}  " + "  ".join(f"{n + ' tok/s':>11s}" for n in names)
          + f"  {'new/old':>8s}" + control_head + "  same tokens")
    for key, cells in rows.items():
        if any(n not in cells for n in names):
            continue
        tps = {n: {rep: t / s for rep, (t, s) in cells[n].items()} for n in names}
        reps = [rep for rep in tps["old"] if all(rep in tps[n] for n in names)]
        ratio = statistics.median(tps["new"][rep] / tps["old"][rep] for rep in reps)
        control = statistics.median(tps["old'"][rep] / tps["old"][rep] for rep in reps) if "old'" in names else None
        row = dict(backend=key[0], workload=key[1], temperature=key[2], gamma=key[3], batch=key[4], drafter=key[5],
                   tokens_per_s={n: statistics.median(tps[n].values()) for n in names}, new_over_old=ratio,
                   control_over_old=control, identical=identical.get(key, True))
        table.append(row)
        print(f"{key[0]:9s} {key[1]:8s} {key[2]:3g} {key[3]:>4s} {key[4]:2d} {key[5]:13s}  "
              + "  ".join(f"{row['tokens_per_s'][n]:11.1f}" for n in names) + f"  {ratio:8.3f}"
              + ("" if control is None else f"  {control:8.3f}") + f"  {'yes' if row['identical'] else 'NO'}")
    ratios = [r["new_over_old"] for r in table]
    print(f"\nnew/old: geometric mean {statistics.geometric_mean(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}")
    if "old'" in names:
        controls = [r["control_over_old"] for r in table]
        print(f"noise band (old'/old, same commit): geometric mean {statistics.geometric_mean(controls):.3f}, "
              f"range {min(controls):.3f}-{max(controls):.3f}")
    return table


if __name__ == "__main__":
    sys.exit(main())
