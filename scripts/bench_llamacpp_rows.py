#!/usr/bin/env python3
"""Batched rows on llama.cpp against the one-row path: n samples of one prompt (T = 0.7), B different
chat prompts and B edit prompts (T = 0), decoded as rows of one batch vs one after another on the same engine; plain
(gamma 0) and the default (prompt lookup, gamma auto); repetitions interleave the methods. First it
measures the ceiling batching has on this CPU: a step of B rows needs B rows of logits, so plain batched
decoding gains at most B·T(1)/T(B rows) over one row, however it is scheduled.

    .venv/bin/python scripts/bench_llamacpp_rows.py --rows 8 --reps 3 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import statistics
import time

import exactspec
from exactspec.bench.workloads import load_workload
from exactspec.device import cpu_label
from exactspec.autogamma.measure import measure_target


def decode_ceiling(lm, rows: int, context: int = 40, reps: int = 25) -> tuple[float, float]:
    """Median ms of one row's one-token step (auto γ's own T(1) measurement) and of one step of `rows`
    rows x 1 token (every row's logits), each at a `context`-token prefix; the cache is left empty."""
    one = measure_target(lm, max_k=1, context=context, reps=reps)[0] * 1000
    prompt = list(range(100, 100 + context))
    lm.reset(rows)
    lm.forward_ragged([prompt] * rows, logits=False)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        lm.forward_ragged([[7]] * rows)
        times.append(time.perf_counter() - t)
        lm.truncate_rows([context] * rows)
    lm.reset(1)
    return one, statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cases", default="samples,chat,edit", help="which of: samples (n samples of one chat prompt), "
                   "chat (--rows chat prompts), edit (--rows edit prompts: copies)")
    args = p.parse_args()
    engine = exactspec.load(rows=args.rows, threads=args.threads)
    print(f"{cpu_label()}; backend {engine.backend}; rows {engine.target.max_rows} "
          f"(batched: {engine.target.batched}); {engine.runtime()['greedy_identity']}")
    if engine.target.batched:
        one, many = decode_ceiling(engine.target, engine.target.max_rows)
        B = engine.target.max_rows
        print(f"T(1) {one:.1f} ms, one step of {B} rows {many:.1f} ms: plain batched decoding gains at most "
              f"{B * one / many:.2f}x over one row here (prefill and finished rows take more of it)")
    chats = load_workload("chat")
    edits = load_workload("edit")
    cases = {"samples": ("n samples, T=0.7", [chats[0]], args.rows, 0.7),
             "chat": (f"{args.rows} chat prompts, T=0", [chats[i % len(chats)] for i in range(args.rows)], 1, 0.0),
             "edit": (f"{args.rows} edit prompts, T=0", [edits[i % len(edits)] for i in range(args.rows)], 1, 0.0)}
    cases = {cases[c][0]: cases[c][1:] for c in args.cases.split(",")}
    for name, (prompts, n, temperature) in cases.items():
        kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, seed=0)
        methods = {}
        for gamma in (0, "auto"):
            methods[f"batched γ={gamma}"] = lambda g=gamma: engine.generate_batch(prompts, n=n, gamma=g, **kwargs)[0]
            methods[f"one after another γ={gamma}"] = lambda g=gamma: [
                engine.generate(q, gamma=g, **{**kwargs, "seed": j}) for q in prompts for j in range(n)]
        tps = {m: [] for m in methods}
        for rep in range(args.reps):
            order = list(methods)[rep % len(methods):] + list(methods)[:rep % len(methods)]
            for m in order:
                t = time.perf_counter()
                results = methods[m]()
                tps[m].append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - t))
        base = statistics.median(tps["one after another γ=0"])
        print(f"\n{name}: tokens/s (median of {args.reps}), vs one after another plain")
        for m, values in tps.items():
            print(f"  {m:28s} {statistics.median(values):7.1f}   {statistics.median(values) / base:.2f}×")


if __name__ == "__main__":
    main()
