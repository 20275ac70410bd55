"""Token vs block verification on the tiny random Llama pair: accepted drafts per target call, measured
(not timed; not a test).

Block verification (Sun et al., ICLR 2025; `verification="block"`, speculative/verify.py) is exact like
the token rule, and per block never accepts fewer drafts in expectation. This script measures how many
more it accepts where drafts are partly right: the test suite's tiny random Llama pair (vocab 8; target
2 layers, draft 1 layer; conftest.py), a draft model, T = 1, γ = 2/4/6, GENERATIONS generations of
LENGTH tokens per rule, same seeds. On real models, tokens/s and tokens per target call side by side:

    exactspec bench --verification token,block --drafters bigram [--draft-model PATH] --temperatures 1

Tokens per target call = emitted tokens / target forwards (a lone generation: one forward per iteration).
Both rules see the same seeds, but they consume the uniforms differently, so the samples differ (each is
an exact sample of the target). ~15 s on 2 CPU cores.

    .venv/bin/python scripts/bench_block_verification.py [--generations 80] [--length 24]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests/

from exactspec.drafters.model import ModelDrafter
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.speculative.loop import decode
from exactspec.speculative.sampling import SamplingParams
from exactspec.stats import Stats

PROMPT = [0, 3, 5, 2, 7, 1, 4]


def tiny_llama(seed: int, sharpness: float = 8.0, layers: int = 2):
    """The test suite's tiny random Llama (tests/helpers/device_checks.py), on the CPU."""
    from tests.helpers.device_checks import tiny_llama as make

    return make(seed, "cpu", vocab=8, sharpness=sharpness, layers=layers)


def tiny(generations: int, length: int) -> None:
    torch.set_num_threads(1)
    target = FastLlamaLM(tiny_llama(0), set(), capacity=64)
    draft = FastLlamaLM(tiny_llama(1, sharpness=4.0, layers=1), set(), capacity=64)
    print(f"tiny random Llama pair (vocab 8), draft model, T = 1, {generations} generations x {length} tokens")
    print("| γ | token: tokens/call | block: tokens/call | gain |")
    print("|---|---|---|---|")
    for gamma in (2, 4, 6):
        per = {}
        for rule in ("token", "block"):
            stats = Stats()
            for g in range(generations):
                gen = torch.Generator().manual_seed(1000 + g)
                list(decode(target, ModelDrafter(draft), PROMPT, SamplingParams(verification=rule), gamma, length, gen,
                            stats=stats, stop_on_eos=False))
            per[rule] = stats.tokens_per_target_call
        print(f"| {gamma} | {per['token']:.3f} | {per['block']:.3f} | {100 * (per['block'] / per['token'] - 1):+.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--generations", type=int, default=80)
    ap.add_argument("--length", type=int, default=24)
    args = ap.parse_args()
    tiny(args.generations, args.length)


if __name__ == "__main__":
    main()
