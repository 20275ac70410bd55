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
from .constraints import TargetLaw
from .device import device_of
from .drafters.base import Drafter, Proposal
from .errors import ExactSpecError
from .models.base import CausalLM
from .models.prefix_cache import prefill_prompt, remember
from .sampling import LawError, SamplingParams, bad_laws, warp
from .stats import Stats
from .verify import accept_greedy, accept_greedy_lenient, verify
from .verify_torch import verify_on_device

# (draft ids [γ], draft probs [γ, V] | None, target probs [γ+1, V], generator[, lenience=L]) -> emitted tokens
Verifier = Callable[..., list[int]]


def argmax_forward(target: CausalLM, new_ids: list[int]) -> list[int]:
    """`target.forward`, then the argmax at each new position: through the adapter's own
    `forward_argmax` where it has one (llama.cpp reads its logits in place)."""
    if hasattr(target, "forward_argmax"):
        return target.forward_argmax(new_ids)
    logits = target.forward(torch.tensor([new_ids]))[0]  # [k, V]
    return logits.argmax(-1).tolist() if logits.device.type != "cpu" else logits.numpy().argmax(-1).tolist()


def copying(drafter: Drafter | None, gamma: int | AutoGamma) -> bool:
    """Auto γ cuts the proposals after drafting: a copying drafter under auto."""
    return isinstance(gamma, AutoGamma) and getattr(drafter, "copies", False)


def budget(drafter: Drafter | None, gamma: int | AutoGamma, rows: int = 1) -> int:
    """How many drafts the drafter may propose this iteration: a fixed γ; under auto, auto's γ for a
    batch of `rows` (chosen before drafting), or for a copying drafter all auto may use (cut afterwards
    by `AutoGamma.choose`, once the match length is known)."""
    if copying(drafter, gamma):
        return gamma.max_gamma
    return gamma.next_gamma(rows) if isinstance(gamma, AutoGamma) else gamma


def draft(drafter: Drafter | None, k: int, context: list[int], room: int, params: SamplingParams,
          generator: torch.Generator | None, law: TargetLaw | None = None) -> tuple[Proposal | None, int]:
    """-> (proposal | None, how many grammar-forced tokens lead it). With a law: the canonical tokens of
    the text the grammar forces (at most `room`, outside the drafter's budget k), then up to k of the
    drafter's from there."""
    if law is None:
        proposal = drafter.propose(context, min(k, room), params, generator) if drafter is not None and k > 0 else None
        return (proposal if proposal is not None and len(proposal) else None), 0
    forced = law.forced(room)
    k = min(k, room - len(forced))
    proposal = law.join(forced, drafter.propose(context + forced, k, params, generator, law=law)
                        if drafter is not None and k > 0 else None)
    return (proposal if proposal is not None and len(proposal) else None), len(forced)


def propose(drafter: Drafter | None, gamma: int | AutoGamma, context: list[int], room: int,
            params: SamplingParams, generator: torch.Generator | None, law: TargetLaw | None = None):
    """-> (proposal | None, draft ids [k], grammar-forced tokens leading them) for one iteration with at
    most `room` drafts. γ = 0 is plain decoding (no drafts, forced or not); see `budget` for the
    drafter's share, and a copying drafter's proposal is cut to the prefix its match length makes
    worth verifying."""
    if room <= 0 or (not isinstance(gamma, AutoGamma) and gamma <= 0) or (drafter is None and law is None):
        return None, [], 0
    proposal, forced = draft(drafter, budget(drafter, gamma), context, room, params, generator, law)
    if proposal is not None and copying(drafter, gamma):
        proposal = proposal.head(forced + gamma.choose([(proposal.match, len(proposal) - forced)]))
    drafts = proposal.ids.tolist() if proposal is not None else []
    return (proposal if drafts else None), drafts, forced


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
    `gamma` is a fixed number of drafts per iteration, or an AutoGamma policy asked at each one (see `propose`).
    `law` (constraints.py): the per-position transform (grammar, penalties, logprobs) of `params`'
    law, applied to target and drafts alike; it also proposes grammar-forced tokens."""
    if not prompt_ids:
        raise ExactSpecError("the prompt is empty")
    if len(prompt_ids) >= target.max_length:
        raise ExactSpecError(f"prompt of {len(prompt_ids)} tokens does not fit the {target.max_length}-token context")
    stats = stats if stats is not None else Stats()
    stats.lenience = min(stats.lenience, params.lenience)
    if verifier is verify and device_of(target).type != "cpu" and params.lenience == 1:
        verifier = verify_on_device  # same rule, same uniforms; the laws stay on the device
    t0 = time.perf_counter()
    reused = prefill_prompt(target, prompt_ids[:-1])  # through the adapter's prefix cache, if any
    stats.cached_tokens += reused
    stats.prefill_tokens += len(prompt_ids) - 1 - reused
    stats.prefill_s += time.perf_counter() - t0

    context = list(prompt_ids)
    try:
        yield from _loop(target, drafter, context, params, gamma, max_new_tokens, generator, stats, stop_on_eos,
                         verifier, law)
    except GeneratorExit:  # the caller stopped early (stop string, client gone): the cache is consistent
        remember(target, context, len(prompt_ids))
        raise
    remember(target, context, len(prompt_ids))


def _loop(target, drafter, context, params, gamma, max_new_tokens, generator, stats, stop_on_eos, verifier, law):
    """`decode`'s iterations; `context` grows in place."""
    lenient = {} if params.lenience == 1 else {"lenience": params.lenience}  # lossy, opt-in (see verify.py)
    produced = 0
    t_start, decode_base = time.perf_counter(), stats.decode_s
    while produced < max_new_tokens and len(context) < target.max_length:
        # Each iteration emits up to k+1 tokens: never draft past max_new_tokens or the context.
        room = min(max_new_tokens - produced - 1, target.max_length - len(context) - 1)
        t = time.perf_counter()
        proposal, drafts, forced = propose(drafter, gamma, context, room, params, generator, law)
        t_verify = time.perf_counter()
        stats.draft_s += t_verify - t

        feed = [context[-1], *drafts]
        trivial = law is None or law.trivial
        if params.greedy and verifier in (verify, verify_on_device) and not lenient and trivial:  # no [k'+1, V] arrays
            emitted = accept_greedy(drafts, argmax_forward(target, feed))
        elif params.greedy and verifier in (verify, verify_on_device) and not lenient and law is not None and law.greedy_fast:
            emitted = law.greedy(target.forward(torch.tensor([feed]))[0], drafts)  # masks only where needed
        elif params.greedy and verifier is verify and law is None:  # lenient greedy compares the un-warped target law
            emitted = accept_greedy_lenient(drafts, target.forward(torch.tensor([feed]))[0].softmax(-1).cpu(),
                                            params.lenience)
        else:
            logits = target.forward(torch.tensor([feed]))[0]  # [k'+1, V]
            target_probs = warp(logits, params) if law is None else law.probs(logits, drafts)
            if len(bad_laws(target_probs)):
                raise LawError()
            draft_probs = proposal.probs[: len(drafts)] if proposal is not None and proposal.probs is not None else None
            if verifier is verify:  # the NumPy verifier reads host memory (no copy on the CPU)
                target_probs, draft_probs = target_probs.cpu(), None if draft_probs is None else draft_probs.cpu()
            emitted = verifier(drafts, draft_probs, target_probs, generator, **lenient)
        n = len(emitted) - 1  # accepted drafts
        target.truncate(len(context) + n)
        t_done = time.perf_counter()
        stats.verify_s += t_done - t_verify
        if isinstance(gamma, AutoGamma):
            gamma.observe_step(len(feed), t_done - t_verify)
        if drafter is not None and len(drafts) > forced:  # the drafter's own part (after the forced tokens)
            drafter.observe(len(drafts) - forced, max(0, n - forced))
            if isinstance(gamma, AutoGamma):
                gamma.observe(len(drafts) - forced, max(0, n - forced), t_verify - t, proposal.match)

        emitted = emitted[: max_new_tokens - produced]
        eos_at = next((i for i, tok in enumerate(emitted) if stop_on_eos and tok in target.eos_token_ids), None)
        if eos_at is not None:
            emitted = emitted[: eos_at + 1]
        if law is not None:
            law.commit(emitted, min(n, len(emitted)))
        stats.record(len(drafts), n, len(emitted), drafter.name if drafter is not None else None, forced, min(forced, n))
        context += emitted
        produced += len(emitted)
        stats.decode_s = decode_base + time.perf_counter() - t_start
        yield from emitted
        if eos_at is not None:
            return
