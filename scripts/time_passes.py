"""The embedded model's pass times on this machine, as the llama.cpp adapter runs them: a 600-token
prefill (best of 3), then the median of 7 forwards of k tokens after 100 and after 1,000 tokens of
context. A quick check of what state a shared VM is in before timing anything else. `--loop K`
instead: the mean of k-token passes after 100 tokens, repeated for 4 s (one build against another,
process by process).

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/time_passes.py [--loop 4] [--target FILE.gguf]

`--target`: another GGUF under its own self-tested setting (ids spread over its vocabulary);
`--shaped gemma3|llama`: write (once, to /tmp/exactspec-shaped-NAME-q4_k_m.gguf) and time a random-weight
Q4_K_M file: Gemma 3 270M's shapes (scripts/bench_kquant_peer.py), or a 12-layer Llama whose every matrix
takes K-quants (tests/helpers/gguf_models.LLAMA_K).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from exactspec.embedded import embedded_model_path
from exactspec.models.llamacpp.numerics import load_self_tested

KS = (1, 2, 3, 4, 6, 8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loop", type=int, metavar="K", help="only: the mean k-token pass after 100 tokens, for 4 s")
    p.add_argument("--target", help="a GGUF file (default: the embedded model)")
    p.add_argument("--shaped", choices=("gemma3", "llama"), help="a random-weight Q4_K_M file of these shapes")
    args = p.parse_args()
    path = shaped(args.shaped) if args.shaped else args.target or embedded_model_path()
    lm = load_self_tested(path, n_ctx=None if path == embedded_model_path() else 4096)
    print(lm.identity)
    ids = [(i * 7919) % min(40000, lm.vocab_size - 200) + 100 for i in range(1200)]  # [1200] spread over the vocabulary
    if args.loop:
        return loop(lm, ids, args.loop)

    def prefill(n: int) -> float:
        lm.reset()
        t = time.perf_counter()
        lm.prefill(torch.tensor([ids[:n]]))
        return time.perf_counter() - t

    best = min(prefill(600) for _ in range(3))
    print(f"prefill 600 tokens: {best:.3f} s = {600 / best:.0f} tokens/s")
    for depth in (100, 1000):
        lm.reset()
        lm.prefill(torch.tensor([ids[:depth]]))
        row = [median_pass_ms(lm, ids, depth, k, 7) for k in KS]
        print(f"depth {depth}: T({','.join(map(str, KS))}) ms: " + " ".join(f"{t:.1f}" for t in row))


def median_pass_ms(lm, ids: list[int], depth: int, k: int, runs: int) -> float:
    """The median of `runs` forwards of ids[depth:depth + k] after the `depth` tokens already in the
    context (rolled back after each), in ms."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        lm.forward(torch.tensor([ids[depth:depth + k]]))
        times.append(time.perf_counter() - t)
        lm.truncate(depth)
    return statistics.median(times) * 1000


def shaped(name: str) -> str:
    path = f"/tmp/exactspec-shaped-{name}-q4_k_m.gguf"
    if not os.path.exists(path):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from tests.helpers.gguf_models import SHAPED, quantize, write_gguf

        source = write_gguf(name, path + ".f32", context=4096, **SHAPED[name])
        quantize(source, path, "Q4_K_M")
        os.remove(source)
    return path


def loop(lm, ids: list[int], k: int, depth: int = 100, seconds: float = 4.0) -> None:
    lm.reset()
    lm.prefill(torch.tensor([ids[:depth]]))
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        lm.forward_argmax(ids[depth:depth + k])  # as greedy decoding runs a pass: no logits copied out
        lm.truncate(depth)
        n += 1
    print(f"depth {depth}: {k}-token pass, mean of {n}: {(time.perf_counter() - start) / n * 1000:.2f} ms")


if __name__ == "__main__":
    main()
