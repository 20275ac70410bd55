"""The llama.cpp numerics self-test's candidates side by side (models/llamacpp/numerics.py), interleaved
in ONE process: for each cache type / one-token threads / n_ubatch, whether blocks equal one-token steps
(max |logits| difference after a 300- and a 1,000-token context, blocks of 8 and 70), the median
one-token step, and a 1,000-token prefill. Medians over rounds; the CPU and OpenMP setting printed.

    .venv/bin/python scripts/bench_llamacpp_numerics.py [--target FILE.gguf] [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from exactspec.device import cpu_label
from exactspec.embedded import embedded_model_path
from exactspec.models.llamacpp.adapter import load_llama_cpp
from exactspec.models.llamacpp.numerics import BLOCK, CANDIDATES, LONG, block_vs_steps


def measure(lm, ids: list[int]) -> tuple[float, float, float]:
    """(max diff over contexts 300 / 1000 and blocks BLOCK / LONG, median step ms, prefill-1000 seconds)."""
    diffs, steps = [], []
    for context in (300, 1000):
        for k in (BLOCK, LONG):
            diff, seconds, _ = block_vs_steps(lm, ids[: context + k], context)
            diffs.append(diff)
            steps += seconds
    lm.reset()
    start = time.perf_counter()
    lm.prefill(torch.tensor([ids[:1000]]))
    prefill = time.perf_counter() - start
    lm.reset()
    return max(diffs), statistics.median(steps) * 1e3, prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = args.target or embedded_model_path()
    print(f"CPU: {cpu_label()}; threads {args.threads}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    models = {}
    for setting in CANDIDATES:
        lm = load_llama_cpp(path, n_ctx=2048, threads=args.threads, **setting.llama_kwargs())
        if setting.single_threads:
            lm.set_single_threads(setting.single_threads)
        models[setting] = lm
    ids = torch.randint(0, 49152, (1000 + LONG,), generator=torch.Generator().manual_seed(0)).tolist()
    results = {s: [] for s in models}
    for _ in range(args.rounds):
        for setting, lm in models.items():  # interleaved: machine noise falls on every candidate alike
            results[setting].append(measure(lm, ids))
    print("| setting | blocks vs steps, max diff | one-token step ms | prefill 1000 tokens s |")
    print("|---|---|---|---|")
    for setting, runs in results.items():
        diff = max(r[0] for r in runs)
        step = statistics.median(r[1] for r in runs)
        prefill = statistics.median(r[2] for r in runs)
        print(f"| {setting.describe(args.threads)} | {diff:.3g} | {step:.2f} | {prefill:.2f} |")


if __name__ == "__main__":
    main()
