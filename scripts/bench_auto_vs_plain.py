"""What `--gamma auto` costs or gains over `--gamma 0`, interleaved in ONE process on the default engine:
a workload's prompts (greedy, the bench's data files), auto and γ 0 alternated round by round (A B, B A,
...), each round's ratio of tokens/s printed. With --batch, every prompt is its own request (its own γ
policy, as a server's are) and all decode as one batch.

    .venv/bin/python scripts/bench_auto_vs_plain.py --workload chat --rounds 8
    .venv/bin/python scripts/bench_auto_vs_plain.py --workload edit --max-new-tokens 320
    .venv/bin/python scripts/bench_auto_vs_plain.py --workload chat --batch

Run it with the OpenMP environment the server would have (`env -u OMP_WAIT_POLICY`). To compare two
commits, run it from each (PYTHONPATH=that checkout's src) one after another, a few times alternated:
the machine drifts between minutes, the ratio within one process much less.
"""

from __future__ import annotations

import argparse
import statistics
import time

import exactspec
from exactspec.batching import Job, run_jobs
from exactspec.bench.workloads import load_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="chat", help="a prompt workload of the bench (chat, edit, grounded)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", action="store_true", help="every prompt its own request, all in one batch")
    args = p.parse_args()
    prompts = [[{"role": "user", "content": text}] for text in load_workload(args.workload)]
    engine = exactspec.load(gamma="auto", rows=len(prompts) if args.batch else 1)
    engine.set_prefix_cache(None)  # every round cold: no prompt from the round before

    def run(gamma: int | str) -> float:
        """Tokens/s of one pass over the prompts."""
        t0 = time.perf_counter()
        if args.batch:
            jobs = [[Job(engine.new_result(m), engine.request(args.max_new_tokens, None, gamma, None, temperature=0))]
                    for m in prompts]
            run_jobs(engine, jobs)
            tokens = sum(job.result.stats.emitted for group in jobs for job in group)
        else:
            tokens = sum(engine.generate(m, max_new_tokens=args.max_new_tokens, gamma=gamma, temperature=0).stats.emitted
                         for m in prompts)
        return tokens / (time.perf_counter() - t0)

    run(0), run("auto")  # warm-up: T(k) measured or read, pages touched
    ratios = []
    for i in range(args.rounds):
        order = (0, "auto") if i % 2 == 0 else ("auto", 0)
        speed = {gamma: run(gamma) for gamma in order}
        ratios.append(speed["auto"] / speed[0])
        print(f"round {i + 1}: gamma 0 {speed[0]:.1f} tok/s, auto {speed['auto']:.1f} tok/s, auto / gamma 0 {ratios[-1]:.3f}",
              flush=True)
    print(f"{args.workload}{' batched' if args.batch else ''}: auto / gamma 0, median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}] over {args.rounds} rounds")


if __name__ == "__main__":
    main()
