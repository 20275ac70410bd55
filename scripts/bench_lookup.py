"""Time one prompt-lookup proposal at a long history: an old commit's drafter (read from git) vs this tree's.

The history is the agent workload's text tokenized and repeated with small edits until it holds N
tokens (what an agent re-sends); each measured proposal first appends one committed token, as the
decode loop does, so the incremental index pays its upkeep too.

    .venv/bin/python scripts/bench_lookup.py [--old a755351] [--tokens 1000,8000,32000] [--proposals 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import time
import types

from exactspec.bench.agent import load_agent_workload
from exactspec.device import cpu_label
from exactspec.drafters.suffix import PromptLookupDrafter, SuffixDrafter
from exactspec.drafters.suffix_index import SuffixIndex
from exactspec.models.torch_hf import load_tokenizer
from exactspec.embedded import embedded_model_path
from exactspec.speculative.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def old_drafter(commit: str):
    """PromptLookupDrafter as it was at `commit` (its module executed from git)."""
    source = subprocess.run(["git", "show", f"{commit}:src/exactspec/drafters/ngram.py"], capture_output=True,
                            text=True, check=True).stdout
    module = types.ModuleType("old_ngram", None)
    module.__package__ = "exactspec.drafters"
    exec(compile(source, f"{commit}:ngram.py", "exec"), module.__dict__)
    return module.PromptLookupDrafter()


def history(tokens: int) -> list[int]:
    tok = load_tokenizer(embedded_model_path())
    work = load_agent_workload()
    text = work["system"] + "".join(s for t in work["transcripts"] for s in [t["task"], *t["steps"]])
    ids, rng, out = tok.encode(text), random.Random(0), []
    while len(out) < tokens:
        out += [rng.randrange(49152) if rng.random() < 0.02 else t for t in ids]
    return out[:tokens]


def per_proposal(drafter, context: list[int], proposals: int) -> float:
    """Median seconds of (append one token, propose 16) over the last `proposals` positions."""
    start = len(context) - proposals
    grown = context[:start]
    drafter.propose(grown, 16, GREEDY, None)  # the prompt: indexed once, not timed
    times = []
    for token in context[start:]:
        t = time.perf_counter()
        grown.append(token)
        drafter.propose(grown, 16, GREEDY, None)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="a755351")
    ap.add_argument("--tokens", default="1000,8000,32000")
    ap.add_argument("--proposals", type=int, default=200)
    args = ap.parse_args()
    print(f"CPU: {cpu_label()}; one proposal = append 1 token + propose 16")
    for n in [int(x) for x in args.tokens.split(",")]:
        context = history(n)
        old = per_proposal(old_drafter(args.old), context, args.proposals)
        new = per_proposal(PromptLookupDrafter(), context, args.proposals)
        store = SuffixIndex(budget_mb=64)
        writer = SuffixDrafter(store)
        writer.propose(context, 1, GREEDY, None)  # the whole history in the store as well
        both = per_proposal(SuffixDrafter(store), context, args.proposals)
        print(f"history {n:>6} tokens: old scan {old * 1e3:8.3f} ms   index {new * 1e3:6.3f} ms   "
              f"index + store {both * 1e3:6.3f} ms   ({old / new:,.0f}x)")


if __name__ == "__main__":
    main()
