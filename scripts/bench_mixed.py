"""The defaults against `--gamma 0` on a workload, fresh and after mixed traffic, as one server process
would meet them: what auto γ learned on earlier requests (acceptance by match length, probe gaps, T(k)
refinement) must not misprice the request at hand.

Per round and state, each configuration (the defaults, γ 0) on a fresh engine of its own, in this process:
FRESH times the workload's prompts on new engines; MIXED first serves each engine a history (agent steps,
then chat, untimed) and then times the same prompts. The two engines' requests alternate one by one (A B,
B A, ...; who starts alternates every two rounds), each timed alone: blocks timed one after the other met
machines tens of percent apart here. Who is LOADED first alternates round by round: of several engines in
one process, the one loaded while no other existed ran its one-token steps 3-6% slower than the others
(docs/benchmarks.md, "Several engines in one process"), and the defaults, always loaded first, lost ~5%.
Each prompt is its own request, greedy, prefix cache off. No prompt or tool output is shared between the
history and the workload: its agent steps are agent-repeat's sessions (the same kinds of task as
agent.json's, other values), its chats the LAST chat prompts (the batch times the others). Except:
- long-agent: the peer bench's 3 agent sessions interleaved behind a ~3.3k-token tool-spec system prompt,
  step by step, with a 256 MiB in-memory prefix cache (as a server holds one; the history fills it too);
- batch: the chat prompts the history does not send, as ONE batch (generate_batch: every prompt its own
  row and γ, one view of the acceptance), the engine loaded with a row per prompt; one request per
  configuration and round, so its rounds spread widest.
Printed: tokens/s per round and the median ratio defaults / γ 0 with its spread, fresh and mixed.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/bench_mixed.py --workloads edit,paraphrase,translate --rounds 3
    env -u OMP_WAIT_POLICY .venv/bin/python scripts/bench_mixed.py --workloads long-agent,batch --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time

import exactspec
from exactspec.bench.agent import TOOL_PREFIX, opening, repeat_steps
from exactspec.bench.peer import interleaved_steps, long_agent
from exactspec.bench.workloads import load_workload

PREFIX_CACHE_MB = 256  # long-agent: the system prompt is reused across its sessions' steps, as in a server


def history(engine, agent_steps: int, chats: int) -> None:
    """Agent sessions' steps (agent-repeat's recorded tool outputs, the model's own answers), then the last
    `chats` chat prompts."""
    for _ in repeat_steps(engine, agent_steps):
        pass
    chat = load_workload("chat")
    for prompt in chat[len(chat) - chats:]:
        engine.generate([{"role": "user", "content": prompt}], max_new_tokens=64, temperature=0)


def chat_requests(engine, prompts: list[str], max_new_tokens: int, work: dict | None = None):
    """The prompts, one request each: yields each request's tokens (`work` adds up target calls, drafts
    and accepts)."""
    for prompt in prompts:
        stats = engine.generate([{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens,
                                temperature=0).stats
        add_work(work, stats)
        yield stats.emitted


def long_agent_requests(engine, work: dict | None = None):
    """The long-agent sessions' steps, interleaved round-robin (peer.py's order): yields each step's tokens."""
    spec = long_agent()
    sessions = [opening(spec, t) for t in spec["transcripts"]]
    for i, tool in interleaved_steps(spec):
        sessions[i].append({"role": "user", "content": TOOL_PREFIX + tool})
        out = engine.generate(sessions[i], max_new_tokens=spec["max_new_tokens"], temperature=0)
        sessions[i].append({"role": "assistant", "content": out.text})
        add_work(work, out.stats)
        yield out.stats.emitted


def batch_requests(engine, prompts: list[str], max_new_tokens: int, work: dict | None = None):
    """The prompts decoded as one batch: yields its tokens."""
    results, stats = engine.generate_batch(prompts, max_new_tokens=max_new_tokens, temperature=0)
    add_work(work, stats)
    yield sum(r.stats.emitted for r in results)


def add_work(work: dict | None, stats) -> None:
    if work is not None:
        for name in ("target_calls", "proposed", "accepted"):
            work[name] = work.get(name, 0) + getattr(stats, name)


def requests(workload: str, gamma, mixed: bool, args, work: dict | None = None):
    """One configuration in one state: a fresh engine, its history if mixed (untimed, here), then the
    workload's requests, one per `next` (each yields its tokens)."""
    if workload == "batch":  # the chat prompts the history does not send
        chat = load_workload("chat")
        prompts = chat[:len(chat) - args.chats]
    else:
        prompts = load_workload(workload) if workload != "long-agent" else []
    engine = exactspec.load(gamma=gamma, rows=len(prompts) if workload == "batch" else 1,
                            prefix_cache_mb=PREFIX_CACHE_MB if workload == "long-agent" else 0)
    if mixed:
        history(engine, args.agent_steps, args.chats)
    if workload == "long-agent":
        return long_agent_requests(engine, work)
    if workload == "batch":
        return batch_requests(engine, prompts, args.max_new_tokens, work)
    return chat_requests(engine, prompts, args.max_new_tokens, work)


def alternated(configs: dict, first: int) -> dict:
    """Tokens/s of each configuration's requests (`configs`: name -> its `requests`), request by request
    alternated between them (A B, B A, ...; `first` picks who starts), each request timed alone: this VM's
    speed drifts by tens of percent within a minute, and a configuration timed as one block after the
    other's met another machine."""
    names, seconds, tokens = list(configs), dict.fromkeys(configs, 0.0), dict.fromkeys(configs, 0)
    for i in itertools.count():
        done = 0
        for name in (names if (i + first) % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            got = next(configs[name], None)
            seconds[name] += time.perf_counter() - start
            if got is None:
                done += 1
            else:
                tokens[name] += got
        if done == len(names):
            return {name: tokens[name] / seconds[name] for name in names}


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
        # warm-up: pages, allocator, caches; T(k) re-measured if provisional
        alternated({gamma: requests(workload, gamma, False, args) for gamma in ("auto", 0)}, 0)
        ratios = {"fresh": [], "mixed": []}
        work: dict = {}
        for r in range(args.rounds):
            speed = {}
            for state in ("fresh", "mixed"):
                order = ("auto", 0) if r % 2 == 0 else (0, "auto")  # who is loaded first (the module docstring)
                configs = {gamma: requests(workload, gamma, state == "mixed", args, work.setdefault(f"{gamma}/{state}", {}))
                           for gamma in order}
                speed.update({(gamma, state): v for gamma, v in alternated(configs, r // 2).items()})
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
