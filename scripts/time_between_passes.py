"""What the decode loop's own work between two passes costs inside the next pass: the defaults and
`--gamma 0` on the chat prompts, alternated in one process, with every `llama_decode` timed apart from
the rest (`LlamaCppLM._run`), and optionally `--busy S` seconds of busy Python before each of γ 0's
passes (the loop's per-step work, simulated): whether work between passes slows the next one (on the
2-core VM of docs/drafters.md one run said so and three did not).

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/time_between_passes.py [--busy 0.0003] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import time

import exactspec
from exactspec.bench.workloads import load_workload
from exactspec.models.llamacpp import adapter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy", type=float, default=0.0, help="seconds of busy Python before each of gamma 0's passes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    args = p.parse_args()
    passes, seconds, current = collections.Counter(), collections.Counter(), [None]
    run = adapter.LlamaCppLM._run

    def timed_run(self, n, starts):
        if current[0] == 0 and args.busy:
            t = time.perf_counter()
            while time.perf_counter() - t < args.busy:
                pass
        t = time.perf_counter()
        run(self, n, starts)
        seconds[current[0], n] += time.perf_counter() - t
        passes[current[0], n] += 1

    adapter.LlamaCppLM._run = timed_run
    prompts = load_workload("chat")[:args.prompts]
    engines = {gamma: exactspec.load(gamma=gamma, rows=1, prefix_cache_mb=0) for gamma in ("auto", 0)}
    for gamma, engine in engines.items():  # warm-up: T(k) (measured once per machine), pages, caches
        engine.generate([{"role": "user", "content": prompts[0]}], max_new_tokens=16, temperature=0)
    passes.clear()
    seconds.clear()
    total = collections.Counter()
    for r in range(args.rounds):
        for gamma in (("auto", 0) if r % 2 == 0 else (0, "auto")):
            current[0] = gamma
            for prompt in prompts:
                t = time.perf_counter()
                engines[gamma].generate([{"role": "user", "content": prompt}], max_new_tokens=160, temperature=0)
                total[gamma] += time.perf_counter() - t
    print(f"time: defaults {total['auto']:.2f} s, gamma 0 {total[0]:.2f} s (defaults / gamma 0: {total['auto'] / total[0]:.3f})")
    for key in sorted(passes, key=str):
        if passes[key] >= 20:
            print(f"gamma {key[0]}, {key[1]}-token passes: {passes[key]}, mean {seconds[key] / passes[key] * 1000:.2f} ms")


if __name__ == "__main__":
    main()
