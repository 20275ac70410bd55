"""What `--gamma auto` costs or gains over `--gamma 0`, interleaved in ONE process on the default engine:
a workload's prompts (greedy, the bench's data files), auto and γ 0 alternated round by round (A B, B A,
...), each round's ratio of tokens/s printed. With --batch, every prompt is its own request (its own γ
policy, as a server's are) and all decode as one batch.

    .venv/bin/python scripts/bench_auto_vs_plain.py --workload chat --rounds 8
    .venv/bin/python scripts/bench_auto_vs_plain.py --workload edit --max-new-tokens 320
    .venv/bin/python scripts/bench_auto_vs_plain.py --workload chat --batch
    .venv/bin/python scripts/bench_auto_vs_plain.py --prompt "Rewrite in the past tense: I walk home." --rounds 300

`--prompt`: one prompt instead of a workload, decode time alone (what `--compare` times; the prefill is
the same on both sides), through `generate_batch` as `exactspec generate` decodes. Each round's
difference auto - γ 0 is printed at the end as a mean with its standard error and a 10%-trimmed mean: a
five-token answer's runs vary by ±10% here, and 300 rounds resolve ~0.1 ms a request.

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
from exactspec.cli import warm_up_compare
from exactspec.bench.workloads import load_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="chat", help="a prompt workload of the bench (chat, edit, grounded)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", action="store_true", help="every prompt its own request, all in one batch")
    p.add_argument("--prompt", help="one prompt instead of a workload: decode time alone, differences per request")
    args = p.parse_args()
    if args.prompt is not None:
        return one_prompt(args.prompt, args.max_new_tokens, args.rounds)
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


def one_prompt(prompt: str, max_new_tokens: int, rounds: int) -> None:
    """`--prompt`: decode seconds of one prompt, auto and γ 0 alternated (A B, B A, ...), paired by round."""
    engine = exactspec.load(gamma="auto")

    def decode_s(gamma: int | str) -> float:
        return engine.generate_batch(prompt, n=1, gamma=gamma, max_new_tokens=max_new_tokens, temperature=0)[1].decode_s

    warm_up_compare(engine, prompt, None)  # as --compare warms up: T(k), then four tokens with each γ
    plain, diffs = [], []
    for i in range(rounds):
        seconds = {gamma: decode_s(gamma) for gamma in ((0, "auto") if i % 2 == 0 else ("auto", 0))}
        plain.append(seconds[0])
        diffs.append(seconds["auto"] - seconds[0])
    trim = sorted(diffs)[rounds // 10: rounds - rounds // 10]
    mean, se = statistics.mean(diffs), statistics.stdev(diffs) / rounds ** 0.5
    base = statistics.median(plain)
    print(f"gamma 0 decodes in {base * 1e3:.2f} ms (median); auto - gamma 0 per request: mean {mean * 1e6:.0f} us "
          f"(standard error {se * 1e6:.0f}), trimmed mean {statistics.mean(trim) * 1e6:.0f} us; auto / gamma 0 "
          f"~{base / (base + statistics.mean(trim)):.4f}x over {rounds} rounds")


if __name__ == "__main__":
    main()
