"""A first start beside a CPU hog, then the hog gone: does the next start run at a quiet first start's
speed? (#57: the llama.cpp self-test's verdict and auto γ's T(k) are measured once per machine and
cached; one taken on a busy machine is kept provisional and measured again at a start that finds the
machine quiet.)

Every figure comes from a fresh process (`--child CACHE`): `exactspec.load()` with the defaults, its
self-test verdict and T(k) read from the cache folder CACHE or measured into it, then
- prefill: a ~600-token prompt (a different number in front each time, prefix cache off), best of 3,
  prompt tokens per second of prefill;
- agent: agent-repeat's first sessions, step by step (the model's own answers fed back), greedy,
  completion tokens per second of wall time (prefix cache off: each step prefills its history too).

The sequence: BUSY, a first start in a new cache folder while `--hogs` busy loops run (`--nice`, default
0: beside two busy loops at nice 19 the verdict and T(k) came out as a quiet start's, and nothing was
provisional), the hog stopped once it has loaded.
Then `--rounds` rounds alternated: NEXT (a start on BUSY's folder: the start after the busy one, and
every start after it) and QUIET (a first start in a new folder, nothing else running). Printed: each
start's figures and the start-up state of its measurements, then NEXT / QUIET per round and the median.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/bench_first_start.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AGENT_STEPS = 8


def child() -> None:
    """One start (its cache folder: $EXACTSPEC_CACHE): load, then the prefill and agent figures, as one
    JSON line."""
    t = time.perf_counter()
    import exactspec
    from exactspec.bench.agent import repeat_steps

    engine = exactspec.load()
    loaded = time.perf_counter() - t
    filler = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(50))
    prefill = []
    for rep in range(3):
        out = engine.generate(f"{rep * 7919} {filler}", max_new_tokens=1, temperature=0, chat_template=False)
        prefill.append(out.stats.prefill_tokens / out.stats.prefill_s)
    tokens, seconds, steps = 0, 0.0, repeat_steps(engine, AGENT_STEPS)
    while True:
        start = time.perf_counter()
        out = next(steps, None)
        if out is None:
            break
        seconds += time.perf_counter() - start
        tokens += out.stats.emitted
    print(json.dumps({"load_s": round(loaded, 1), "prefill_tok_s": round(max(prefill), 1),
                      "agent_tok_s": round(tokens / seconds, 1), "agent_tokens": tokens}), flush=True)


def start(cache: str, load_only: bool = False) -> dict | None:
    """A fresh process on `cache` (EXACTSPEC_CACHE); None when `load_only`. Prints the measurements the
    folder then holds as provisional (cachedir: a sidecar says why)."""
    env = {**os.environ, "EXACTSPEC_CACHE": cache}
    cmd = [sys.executable, "-c", "import exactspec; exactspec.load()"] if load_only else [sys.executable, __file__, "--child", cache]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"a start failed ({proc.returncode}): {proc.stderr[-2000:]}")
    for path in sorted(Path(cache).rglob("*.provisional")):
        print(f"    provisional: {path.parent.name}/{path.name}: {path.read_text().strip()[:160]}", flush=True)
    return None if load_only else json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy loops beside the first start")
    p.add_argument("--nice", type=int, default=0, help="their nice level (a busy loop at 19 barely slows a nice-0 process)")
    p.add_argument("--child", metavar="CACHE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child()
    env = {k: os.environ.get(k, "") for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs; env {env}", flush=True)
    root = tempfile.mkdtemp(prefix="exactspec-first-start-")
    busy = os.path.join(root, "busy")
    hogs = [subprocess.Popen(["nice", "-n", str(args.nice), sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        t = time.perf_counter()
        start(busy, load_only=True)
        print(f"BUSY: first start beside {args.hogs} busy loops at nice {args.nice}, loaded in {time.perf_counter() - t:.0f} s", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    time.sleep(2.0)
    ratios = {"prefill_tok_s": [], "agent_tok_s": []}
    for r in range(args.rounds):
        got = {}
        for name in (("next", "quiet") if r % 2 == 0 else ("quiet", "next")):
            got[name] = start(busy if name == "next" else os.path.join(root, f"quiet{r}"))
            print(f"round {r} {name.upper()}: {json.dumps(got[name])}", flush=True)
        for key in ratios:
            ratios[key].append(got["next"][key] / got["quiet"][key])
        print(f"round {r}: NEXT / QUIET prefill {ratios['prefill_tok_s'][-1]:.3f}, agent {ratios['agent_tok_s'][-1]:.3f}", flush=True)
    print(f"NEXT / QUIET over {args.rounds} rounds: prefill median {statistics.median(ratios['prefill_tok_s']):.3f} "
          f"{[round(x, 3) for x in ratios['prefill_tok_s']]}, agent median {statistics.median(ratios['agent_tok_s']):.3f} "
          f"{[round(x, 3) for x in ratios['agent_tok_s']]}", flush=True)


if __name__ == "__main__":
    main()
