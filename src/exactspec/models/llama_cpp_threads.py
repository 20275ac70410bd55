"""How many threads llama.cpp's one-token steps may use, measured at load: the most that keeps them
bit for bit equal to multi-token blocks (the verification calls) on this CPU.

Why: with two threads, llama.cpp's CPU flash attention splits a single query's keys across the
threads once the context passes ~256 tokens and adds the parts in another order than a block of
queries does. Measured 2026-12-01 on an Intel Xeon with AMX (llama-cpp-python 0.3.36, the embedded
Q4_1 GGUF, n_ubatch 32): block vs one-token logits 0.86 apart at 256 tokens and 0.97 at 300, greedy
choices flipped, with weight repacking on or off; an AMD EPYC had stayed bit-equal to 665 tokens.
One-token steps on ONE thread (blocks keep them all) were bit-equal at every context tried. So at
load: score a block of BLOCK tokens and the same tokens one at a time, past that boundary, with the
configured threads; if they differ, again with one thread for one-token steps; keep the first that is
bit-equal, or, if neither is, the configured threads and the verdict that greedy identity rests on
tolerance. The verdict is cached per CPU, model file, library version and settings (one prefill of
CONTEXT tokens, a few seconds, once per machine).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from .. import progress
from ..cachedir import cache_dir, file_identity, machine_key, write_atomic

VERSION = 1  # bump when the test changes: old cache entries are then ignored
CONTEXT = 300  # tokens before the block: past the 256-key point where the split was seen
BLOCK = 8


@dataclass
class Verdict:
    single_threads: int  # threads of one-token steps (blocks use the adapter's `threads`)
    exact: bool  # one-token steps bit-equal to blocks with them
    max_diff: float  # of the configured threads' trial
    cached: bool = False

    def describe(self) -> str:
        if not self.exact:
            return f"by tolerance (llama.cpp's blocks differ from one-token steps by up to {self.max_diff:.3g} here)"
        how = "" if self.max_diff == 0 else f", one-token steps on {self.single_threads} thread(s)"
        return f"bit-exact (self-test: blocks equal one-token steps{how})"


def block_vs_steps(lm, ids: list[int], context: int) -> float:
    """Max |logits| difference between scoring ids[context:] as one block and one token at a time,
    after the same prefill (0.0: bit-equal); the adapter is reset afterwards."""
    lm.reset()
    lm.prefill(torch.tensor([ids[:context]]))
    block = lm.forward(torch.tensor([ids[context:]]))[0]  # [BLOCK, V]
    lm.truncate(context)
    steps = torch.cat([lm.forward(torch.tensor([[t]]))[0] for t in ids[context:]])  # [BLOCK, V]
    lm.reset()
    return float((block - steps).abs().max())


def choose_threads(lm) -> Verdict:
    """Set `lm`'s one-token thread count from the cache or by the test (module docstring)."""
    path = cache_dir("llamacpp-threads") / f"{_key(lm)}.json"
    if path.exists():
        try:
            verdict = Verdict(**{**json.loads(path.read_text()), "cached": True})
            lm.set_single_threads(verdict.single_threads)
            return verdict
        except (ValueError, TypeError):
            pass  # an unreadable entry is measured again
    context = max(1, min(CONTEXT, lm.max_length - BLOCK - 1))
    ids = torch.randint(0, lm.vocab_size, (context + BLOCK,), generator=torch.Generator().manual_seed(0)).tolist()
    with progress.timed("llama.cpp thread self-test"):
        diff = block_vs_steps(lm, ids, context)
        verdict = Verdict(lm.threads, diff == 0.0, diff)
        if diff and lm.threads > 1:
            lm.set_single_threads(1)
            if block_vs_steps(lm, ids, context) == 0.0:
                verdict = Verdict(1, True, diff)
            else:
                lm.set_single_threads(lm.threads)
    write_atomic(path, json.dumps({k: v for k, v in asdict(verdict).items() if k != "cached"}))
    return verdict


def _key(lm) -> str:
    """CPU (machine_key) + llama-cpp-python version + the adapter's settings + the model file."""
    import llama_cpp

    settings = json.dumps({k: v for k, v in lm.context_kwargs().items() if k != "n_threads"}, sort_keys=True, default=str)
    return machine_key(VERSION, llama_cpp.__version__, settings, f"repack={lm.repack}", file_identity(lm.path))
