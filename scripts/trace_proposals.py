"""Every proposal of one generation under the defaults, with what was kept: where a copying drafter's
copies fail, token by token (pieces joined by `|`). Greedy, the embedded model unless --target.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/trace_proposals.py < examples/format-json.txt

Prints one line per proposal auto γ kept a width of: the context length, its last tokens, the drafted
tokens, how many were kept, the match length they were priced by; then the target calls.
"""

from __future__ import annotations

import argparse
import sys

import exactspec
from exactspec.drafters import suffix
from exactspec.autogamma import policy as auto_gamma


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="a local GGUF or Hugging Face directory (default: the embedded model)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    args = p.parse_args()
    prompt = sys.stdin.read()
    proposals, outcomes = [], []
    propose, observe = suffix.SuffixDrafter.propose, auto_gamma.AutoGamma.observe

    def traced_propose(self, context, k, params, generator, law=None):
        proposal = propose(self, context, k, params, generator, law)
        proposals.append((len(context), context[-6:], proposal.tokens()))
        return proposal

    def traced_observe(self, proposed, accepted, draft_s=None, match=None, kind=None):
        outcomes.append((proposals[-1], proposed, accepted, match))
        return observe(self, proposed, accepted, draft_s, match, kind)

    engine = exactspec.load(args.target, gamma="auto", prefix_cache_mb=0)
    suffix.SuffixDrafter.propose, auto_gamma.AutoGamma.observe = traced_propose, traced_observe
    result = engine.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0)

    def pieces(ids: list[int]) -> str:
        return repr("|".join(engine.tokenizer.decode([i]) for i in ids))

    for (at, tail, drafted), proposed, kept, match in outcomes:
        print(f"at {at}: after {pieces(tail)} drafted {proposed}, kept {kept}, match {match}: {pieces(drafted[:proposed])}")
    stats = result.stats.to_dict()
    print(f"{stats['emitted']} tokens in {stats['target_calls']} target calls; {stats['proposed']} drafted, {stats['accepted']} kept")


if __name__ == "__main__":
    main()
