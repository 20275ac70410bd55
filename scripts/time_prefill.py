"""One build's prefill and verification passes on the embedded model, under one fixed setting (f16 cache,
tiled prefill: the one the self-test picks on a quiet Zen 4), so that two builds compare on equal terms:
an N-token prefill (best of 3), then the median of 9 passes of k tokens after 500 tokens of context.
Another build: unzip its wheel and point LLAMA_CPP_LIB_PATH at its llama_cpp/lib; alternate the two.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/time_prefill.py [--tokens 1024] [--threads 1]
    env -u OMP_WAIT_POLICY LLAMA_CPP_LIB_PATH=/tmp/old/llama_cpp/lib .venv/bin/python scripts/time_prefill.py
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from exactspec.embedded import embedded_model_path
from exactspec.models.llamacpp.adapter import load_llama_cpp
from exactspec.models.llamacpp.numerics import TILE, Setting
from time_passes import median_pass_ms  # scripts/, beside this one

DEPTH = 500
KS = (1, 4, 8, 16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    setting = Setting("f16", "f16", 0, 512, TILE, pad=False)
    lm = load_llama_cpp(embedded_model_path(), n_ctx=max(4096, args.tokens + 64), threads=args.threads,
                        **setting.llama_kwargs())
    ids = [(i * 7919) % 40000 + 100 for i in range(max(args.tokens, DEPTH + max(KS)))]  # spread over the vocabulary
    best = float("inf")
    for _ in range(3):
        lm.reset()
        start = time.perf_counter()
        lm.prefill(torch.tensor([ids[:args.tokens]]))
        best = min(best, time.perf_counter() - start)
    lm.reset()
    lm.prefill(torch.tensor([ids[:DEPTH]]))
    medians = {k: median_pass_ms(lm, ids, DEPTH, k, 9) for k in KS}
    build = os.environ.get("LLAMA_CPP_LIB_PATH", "installed build")
    print(f"{build}: prefill {args.tokens} tokens on {args.threads} thread(s): {args.tokens / best:.0f} tokens/s; "
          f"at depth {DEPTH} T(k) ms " + " ".join(f"{k}: {t:.1f}" for k, t in medians.items()))


if __name__ == "__main__":
    main()
