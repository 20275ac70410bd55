"""The defaults against `--gamma 0` on a workload, fresh and after mixed traffic, as one server process
would meet them: what auto γ learned on earlier requests (acceptance by match length, probe gaps, T(k)
refinement) must not misprice the request at hand.

Per round, for each configuration (the defaults, γ 0; their order alternates round by round), one fresh
engine per state, in this process: FRESH times the workload's prompts on a new engine; MIXED first
serves a history (agent steps, then chat, untimed) and then times the same prompts. Each prompt is its
own request, greedy, prefix cache off (no prompt is shared between the history and the workload).
Printed: tokens/s per round and the median ratio defaults / γ 0 with its spread, fresh and mixed.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/bench_mixed.py --workloads edit,paraphrase,translate --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import exactspec
from exactspec.bench.agent import TOOL_PREFIX, load_agent_workload, opening
from exactspec.bench.workloads import load_workload


def history(engine, agent_steps: int, chats: int) -> None:
    """Agent sessions' steps (their recorded tool outputs, the model's own answers), then chat prompts."""
    work = load_agent_workload()
    done = 0
    for transcript in work["transcripts"]:
        messages = opening(work, transcript)
        for tool in transcript["steps"]:
            if done == agent_steps:
                break
            messages.append({"role": "user", "content": TOOL_PREFIX + tool})
            out = engine.generate(messages, max_new_tokens=work["max_new_tokens"], temperature=0)
            messages.append({"role": "assistant", "content": out.text})
            done += 1
    for prompt in load_workload("chat")[:chats]:
        engine.generate([{"role": "user", "content": prompt}], max_new_tokens=64, temperature=0)


def timed(engine, prompts: list[str], max_new_tokens: int, work: dict | None = None) -> float:
    """Tokens/s of the prompts, one request each; `work` adds up their target calls, drafts and accepts."""
    t0, tokens = time.perf_counter(), 0
    for prompt in prompts:
        stats = engine.generate([{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens,
                                temperature=0).stats
        tokens += stats.emitted
        if work is not None:
            for name in ("target_calls", "proposed", "accepted"):
                work[name] = work.get(name, 0) + getattr(stats, name)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="edit,paraphrase,translate")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--agent-steps", type=int, default=12)
    p.add_argument("--chats", type=int, default=3)
    args = p.parse_args()
    env = {k: os.environ.get(k, "") for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs; env {env}; exactspec {exactspec.__version__}", flush=True)
    for workload in args.workloads.split(","):
        prompts = load_workload(workload)
        timed(exactspec.load(gamma=0), prompts, args.max_new_tokens)  # warm-up: pages, allocator, caches
        ratios = {"fresh": [], "mixed": []}
        work: dict = {}
        for r in range(args.rounds):
            speed = {}
            for gamma in (("auto", 0) if r % 2 == 0 else (0, "auto")):
                for state in ("fresh", "mixed"):
                    engine = exactspec.load(gamma=gamma)
                    if state == "mixed":
                        history(engine, args.agent_steps, args.chats)
                    speed[gamma, state] = timed(engine, prompts, args.max_new_tokens,
                                                work.setdefault(f"{gamma}/{state}", {}))
                    del engine
            for state in ratios:
                ratios[state].append(speed["auto", state] / speed[0, state])
            print(json.dumps({"workload": workload, "round": r, **{f"{g}/{s}": round(v, 1) for (g, s), v in speed.items()},
                              "ratio_fresh": round(ratios["fresh"][-1], 3), "ratio_mixed": round(ratios["mixed"][-1], 3)}),
                  flush=True)
        print(f"{workload}: defaults / gamma 0, fresh median {statistics.median(ratios['fresh']):.3f} "
              f"[{min(ratios['fresh']):.3f}-{max(ratios['fresh']):.3f}], after mixed traffic median "
              f"{statistics.median(ratios['mixed']):.3f} [{min(ratios['mixed']):.3f}-{max(ratios['mixed']):.3f}] "
              f"over {args.rounds} rounds; work (all rounds): {json.dumps(work)}", flush=True)


if __name__ == "__main__":
    main()
