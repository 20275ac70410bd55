"""The one decode loop (CLI, Python API and server all use it): propose -> score -> verify -> commit.

Invariant: the target's KV cache holds context[:-1]. Each iteration feeds [context[-1], *drafts]
(γ+1 tokens) in ONE target forward, which yields the γ+1 target distributions the verifier needs;
then the cache is truncated to the accepted prefix. γ = 0 (or an empty proposal) is a plain
autoregressive step through the very same path — our own baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from .costmodel import AutoGamma
from .drafters.base import Drafter
from .errors import ExactSpecError
from .models.base import CausalLM
from .sampling import SamplingParams, warp
from .stats import Stats
from .verify import verify, verify_greedy

Verifier = Callable[..., tuple[torch.Tensor, torch.Tensor]]


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
) -> Iterator[int]:
    """Yield generated token ids as they are accepted. Stops at EOS (yielded), max_new_tokens or the
    context limit; the caller may stop early (stop strings) by closing the iterator.
    `gamma` is a fixed number of drafts per iteration, or an AutoGamma policy asked before each one."""
    if not prompt_ids:
        raise ExactSpecError("the prompt is empty")
    if len(prompt_ids) >= target.max_length:
        raise ExactSpecError(f"prompt of {len(prompt_ids)} tokens does not fit the {target.max_length}-token context")
    stats = stats if stats is not None else Stats()
    t0 = time.perf_counter()
    target.reset()
    if len(prompt_ids) > 1:
        target.forward(torch.tensor([prompt_ids[:-1]], dtype=torch.long))
    stats.prefill_s += time.perf_counter() - t0

    context = list(prompt_ids)
    produced = 0
    t_start, decode_base = time.perf_counter(), stats.decode_s
    while produced < max_new_tokens and len(context) < target.max_length:
        # Each iteration emits up to k+1 tokens: never draft past max_new_tokens or the context.
        want = gamma.next_gamma() if isinstance(gamma, AutoGamma) else gamma
        k = min(want, max_new_tokens - produced - 1, target.max_length - len(context) - 1)
        t = time.perf_counter()
        proposal = drafter.propose(context, k, params, generator) if (drafter and k > 0) else None
        draft_ids = proposal.ids[:k] if proposal is not None else torch.zeros(0, dtype=torch.long)
        draft_probs = proposal.probs[:k] if proposal is not None and proposal.probs is not None else None
        t_verify = time.perf_counter()
        stats.draft_s += t_verify - t

        feed = torch.cat([torch.tensor([context[-1]]), draft_ids])[None]  # [1, k+1]
        logits = target.forward(feed)  # [1, k+1, V]
        if params.greedy and verifier is verify:  # same outputs, no [k+1, V] one-hot tensors
            tokens, num_accepted = verify_greedy(draft_ids[None], logits.argmax(-1))
        else:
            tokens, num_accepted = verifier(
                draft_ids[None], None if draft_probs is None else draft_probs[None], warp(logits, params), generator
            )
        n = int(num_accepted[0])
        target.truncate(len(context) + n)
        stats.verify_s += time.perf_counter() - t_verify
        if drafter is not None and len(draft_ids):
            drafter.observe(len(draft_ids), n)
            if isinstance(gamma, AutoGamma):
                gamma.observe(len(draft_ids), n, t_verify - t)

        emitted = tokens[0, : n + 1].tolist()[: max_new_tokens - produced]
        eos_at = next((i for i, tok in enumerate(emitted) if stop_on_eos and tok in target.eos_token_ids), None)
        if eos_at is not None:
            emitted = emitted[: eos_at + 1]
        stats.record(len(draft_ids), n, len(emitted))
        context += emitted
        produced += len(emitted)
        stats.decode_s = decode_base + time.perf_counter() - t_start
        yield from emitted
        if eos_at is not None:
            return
