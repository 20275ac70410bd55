"""How often prompt lookup's copies are kept, by match length, free of auto γ's choices: each workload's
prompts answered greedily with γ 0, then every position of each answer looked up again (shortest 1, up
to 8 tokens) and its copy compared with what the answer wrote next. Prints per match-length bucket the
per-token α (kept tokens / (kept tokens + copies cut short), as `Acceptance` counts them) and how many
lookups found a copy of that length, next to the priors auto γ starts from (acceptance.COPY_PRIOR).

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/replay_acceptance.py --workloads chat,edit,short
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from exactspec.bench.workloads import load_workload
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.engine import load
from exactspec.autogamma.acceptance import BUCKET_EDGES, COPY_PRIOR, bucket
from exactspec.speculative.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def replay(prompt_ids: list[int], answer: list[int]) -> dict[int, list[int]]:
    """bucket -> [tokens kept, copies cut short, copies] over every position of `answer`."""
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    drafter = PromptLookupDrafter()
    drafter.read_prompt(prompt_ids)
    context = list(prompt_ids)
    for i, token in enumerate(answer):
        copy = drafter.propose(context, 8, GREEDY, None).tokens()
        if copy:
            kept = next((j for j, t in enumerate(copy) if i + j >= len(answer) or t != answer[i + j]), len(copy))
            c = counts[bucket(drafter.found.length)]
            c[0], c[1], c[2] = c[0] + kept, c[1] + (kept < len(copy)), c[2] + 1
        context.append(token)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="chat,edit,grounded,short,paraphrase,translate")
    p.add_argument("--prompts", type=int, default=6, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    engine = load(prefix_cache_mb=0)
    ends = [*(e - 1 for e in BUCKET_EDGES[1:]), None]
    edges = [f"{e}+" if end is None else str(e) if end == e else f"{e}-{end}" for e, end in zip(BUCKET_EDGES, ends)]
    print("prior      " + "  ".join(f"m{edge}: {a:.2f}" for edge, a in zip(edges, COPY_PRIOR)))
    for name in args.workloads.split(","):
        total: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        for prompt in load_workload(name)[: args.prompts]:
            result = engine.generate(prompt, max_new_tokens=args.max_new_tokens, gamma=0, temperature=0)
            for b, (kept, cut, copies) in replay(result.prompt_token_ids, result.token_ids).items():
                t = total[b]
                t[0], t[1], t[2] = t[0] + kept, t[1] + cut, t[2] + copies
        print(f"{name:10s} " + "  ".join(f"m{edges[b - 1]}: {k / max(k + c, 1):.2f} ({n})"
                                         for b, (k, c, n) in sorted(total.items())), flush=True)


if __name__ == "__main__":
    main()
