"""One generation as a batch of one through the decode loop (decode_batch.py): the public `decode`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .constraints import TargetLaw
from .costmodel import AutoGamma
from .decode_batch import BatchDecoder, Row
from .drafters.base import Drafter
from .models.base import CausalLM
from .models.prefix_cache import remember
from .sampling import SamplingParams
from .stats import Stats
from .verify import verify

# (draft ids [γ], draft probs [γ, V] | None, target probs [γ+1, V], generator[, lenience=L]) -> emitted tokens
Verifier = Callable[..., list[int]]


def decode(
    target: CausalLM,
    drafter: Drafter | None,
    prompt_ids: list[int],
    params: SamplingParams,
    gamma: int | AutoGamma,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    stats: Stats | None = None,
    stop_on_eos: bool = True,
    verifier: Verifier = verify,
    law: TargetLaw | None = None,
) -> Iterator[int]:
    """Yield generated token ids as they are accepted. Stops at EOS (yielded), max_new_tokens or the
    context limit; the caller may stop early (stop strings) by closing the iterator.
    `gamma` is a fixed number of drafts per iteration, or an AutoGamma policy asked at each one.
    `law` (constraints.py): the per-position transform (grammar, penalties, logprobs) of `params`'
    law, applied to target and drafts alike; it also proposes grammar-forced tokens.
    `verifier`: the speculative-sampling rule (tests inject broken ones as negative controls)."""
    row = Row(0, prompt_ids, drafter, params, gamma, max_new_tokens, generator,
              stats if stats is not None else Stats(), law)
    decoder = BatchDecoder(target, stop_on_eos, verifier)
    decoder.start([row])
    try:
        while decoder.rows and max_new_tokens > 0:
            for _, tokens in decoder.step():
                yield from tokens
    except GeneratorExit:  # the caller stopped early (stop string, client gone): the cache is consistent
        remember(target, row.context, len(prompt_ids))
        raise
