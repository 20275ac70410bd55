"""A benchmark method: a name, its drafter and γ, and how it runs one prompt. Our own decoding loop
is one (`exactspec_method`); bench/runner.py adds Hugging Face's, bench/llamacpp.py llama.cpp's."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..engine import Engine, GenerationResult
from ..speculative.sampling import SamplingParams
from ..stats import Stats

# (prompt_ids, params, max_new_tokens, seed, response_format | None) -> (generated ids, seconds, stats)
RunFn = Callable[[list[int], SamplingParams, int, int, dict | None], tuple[list[int], float, Stats | None]]


@dataclass
class Method:
    method: str  # exactspec-plain | exactspec-spec | exactspec-plain-unconstrained | hf-* | llamacpp-*
    drafter: str | None
    gamma: int | str | None
    run: RunFn
    constrains: bool = False  # decodes under a case's response_format
    only_constrained: bool = False  # a row of constrained workloads alone
    verification: str | None = None  # our speculative rows: the verifier's rule, "token" or "block" (params.py)


def stops_at_eos(params: SamplingParams, response_format: dict | None) -> bool:
    """T = 0, or a constrained case (its schema ends the output): runs stop at EOS; else fixed length."""
    return params.greedy or response_format is not None


def fresh_store(engine: Engine) -> None:
    """Empty the engine's store of earlier outputs (same budget): every run of a workload starts without
    the other methods' answers to the same prompt (with the coupling, a seeded sample is the same text
    whatever the method, so a store holding it would copy the answer whole)."""
    store = engine.drafts.store
    if store is not None and store.tokens:
        engine.drafts.set_store(store.budget / 2**20)


def exactspec_method(engine: Engine, drafter: str | None, gamma: int | str, constrained: bool = True,
                     verification: str = "token") -> Method:
    """Our decoding loop; under a constrained workload's schema unless not `constrained`; its drafts
    verified by `verification`'s rule ("token" or "block": the bench's side-by-side of the two)."""
    def run(prompt_ids, params, max_new_tokens, seed, response_format=None):
        params = replace(params, verification=verification)
        stats, result = Stats(), GenerationResult("", [], prompt_ids, "length")
        fresh_store(engine)
        t = time.perf_counter()
        law = engine.make_law(result, params, response_format=response_format if constrained else None)
        ids = list(engine.stream_ids(prompt_ids, params, max_new_tokens, gamma, seed, stats, drafter or "none",
                                     stop_on_eos=stops_at_eos(params, response_format), law=law))
        return ids, time.perf_counter() - t, stats

    if not constrained:
        return Method("exactspec-plain-unconstrained", None, 0, run, only_constrained=True)
    if gamma == 0:
        return Method("exactspec-plain", None, gamma, run, constrains=True)
    return Method("exactspec-spec", drafter, gamma, run, constrains=True, verification=verification)
