"""The exact-law checks: the loop's output law enumerated on tiny table models (exact_law.py) for every
drafter, warp, grammar and penalty, compared with the target's within a tolerance; auto γ's traced runs."""

from __future__ import annotations

import torch

from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.speculative.law import Penalties
from exactspec.speculative.loop import decode
from exactspec.speculative.sampling import SamplingParams, warp

from .exact_law import (
    TableLM,
    distance,
)

POINT_TOL = 1e-12  # point-mass drafts: float64 rounding only


SAMPLED_TOL = 1e-7  # sampled drafts: the float32 laws' sums (module docstring)


PROMPT = [0, 1, 2, 0, 1]


def target_and_draft(vocab: int, sharpness: float = 1.0) -> tuple[TableLM, TableLM]:
    return TableLM(0, vocab, sharpness), TableLM(1, vocab, 0.8 * sharpness)


def drafter_factory(name: str, vocab: int, draft: TableLM):
    return {"model": lambda: ModelDrafter(draft), "bigram": lambda: NGramDrafter(vocab, 2),
            "prompt-lookup": PromptLookupDrafter, "none": lambda: None}[name]


def first_tokens(target, make_drafter, prompt, params, gamma, n, max_new=16, make_law=None):
    """A run for `enumerate_law`: the first n tokens of a fresh generation (it goes on drafting γ per
    iteration past n; the generation is closed once n tokens are out)."""
    def run():
        out = []
        law = make_law() if make_law is not None else None
        for token in decode(target, make_drafter(), prompt, params, gamma, max_new, law=law):
            out.append(token)
            if len(out) >= n:
                break
        return tuple(out[:n])
    return run


def check(law: dict, oracle: dict, tol: float) -> float:
    assert abs(sum(law.values()) - 1) < 1e-12, "the enumerated measures do not sum to 1"
    gap = distance(law, oracle)
    assert gap <= tol, f"the loop's law differs from the target's by {gap:.3e} (tolerance {tol:.0e})"
    return gap


def penalised(prompt: list[int], pen: Penalties, params: SamplingParams, vocab: int):
    """The oracle's law at a position: logits + bias, repetition over prompt + generated, frequency and
    presence over the generated tokens (law.py's conventions), then the warp."""
    def law_at(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        x = logits.float() + torch.tensor([pen.logit_bias.get(t, 0.0) for t in range(vocab)])
        seen = torch.tensor([t in set(prompt) | set(generated) for t in range(vocab)])
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab).float()
        if pen.repetition_penalty != 1:
            x = torch.where(seen, torch.where(x > 0, x / pen.repetition_penalty, x * pen.repetition_penalty), x)
        x = x - pen.frequency_penalty * counts - pen.presence_penalty * (counts > 0).float()
        return warp(x[None], params)[0]
    return law_at


class TokenGrammar:
    """A grammar over token ids, behind grammar.Matcher's interface: no token repeats the one before it,
    and token 0 must be followed by token 1 (a forced token, proposed as a point-mass draft)."""

    def __init__(self, vocab: int, prompt_last: int) -> None:
        self.vocab_size, self.path = vocab, [prompt_last]

    def _allowed(self, last: int) -> list[bool]:
        return [t == 1 for t in range(self.vocab_size)] if last == 0 else [t != last for t in range(self.vocab_size)]

    def mask(self) -> torch.Tensor:
        return torch.tensor(self._allowed(self.path[-1]))

    def valid_prefix(self, tokens: list[int]) -> int:
        last = self.path[-1]
        for i, t in enumerate(tokens):
            if not self._allowed(last)[t]:
                return i
            last = t
        return len(tokens)

    def masks_along(self, drafts: list[int]):
        n = self.valid_prefix(drafts)
        masks, consumed = [self.mask()], self.consume(drafts[:n])
        for i in range(n):
            masks.append(torch.tensor(self._allowed(drafts[i])))
        self.rollback(consumed)
        return n, masks

    def forced(self) -> list[int]:
        return [1] if self.path[-1] == 0 else []

    def commit(self, tokens: list[int]) -> None:
        assert self.valid_prefix(tokens) == len(tokens), f"emitted tokens {tokens} break the grammar"
        self.consume(tokens)

    def consume(self, tokens: list[int]) -> int:
        self.path += tokens
        return len(tokens)

    def rollback(self, consumed: int) -> None:
        if consumed:
            del self.path[-consumed:]

    @property
    def done(self) -> bool:
        return False


def grammar_oracle(grammar_vocab: int, prompt: list[int], params: SamplingParams):
    def law_at(logits: torch.Tensor, generated: list[int]) -> torch.Tensor:
        allowed = torch.tensor(TokenGrammar(grammar_vocab, (prompt + generated)[-1])._allowed((prompt + generated)[-1]))
        return warp(logits.float().masked_fill(~allowed, float("-inf"))[None], params)[0]
    return law_at

from collections.abc import Callable
from dataclasses import dataclass, field

from exactspec.autogamma.policy import AutoGamma
from exactspec.autogamma.costs import CostModel, DepthCosts
from exactspec.speculative.loop import decode
from exactspec.stats import Stats

from .exact_law import TableLM


@dataclass
class Traced(Stats):
    """Stats that also keep, per iteration, (drafts verified, the drafter that made them, tokens emitted)."""

    iterations: list[tuple[int, str | None, int]] = field(default_factory=list)

    def record(self, proposed: int, accepted: int, emitted: int, drafter: str | None = None, *rest) -> None:
        self.iterations.append((proposed, drafter, emitted))
        super().record(proposed, accepted, emitted, drafter, *rest)

    def trace(self, depth: int) -> tuple[tuple[int, int, str | None], ...]:
        """(context depth, γ used, drafter) per iteration, from a prompt of `depth` tokens."""
        out = []
        for drafts, drafter, emitted in self.iterations:
            out.append((depth, drafts, drafter if drafts else None))
            depth += emitted
        return tuple(out)


def depth_policy(base: int, copies: bool = False, first_probe: int = 2) -> AutoGamma:
    """Auto γ (at most 2) over frozen costs that rise with the context depth: T(k) flat at the prompt's
    depth `base` (γ 2 pays), steep two tokens deeper (T(2) = 1.25, T(3) = 3: γ 1 pays only once drafts
    have been accepted, γ 2 never), interpolated between and extrapolated beyond. A zero γ probes with
    γ 1 every `first_probe`, 2·`first_probe`, ... plain steps."""
    cost = CostModel([1.0, 1.0, 1.0], depth=DepthCosts(base, [base + 2], [[1.0, 1.25, 3.0]]), frozen=True,
                     copies=copies)
    return AutoGamma(cost, first_probe=first_probe)


def traced_run(target: TableLM, make: Callable[[], tuple], prompt: list[int], params: SamplingParams,
               n: int) -> Callable[[], tuple]:
    """A run for `enumerate_law`: the first n tokens of one generation, with (drafter, γ) = make() built
    fresh inside the run -> (tokens, its trace: `Traced.trace`)."""
    def run() -> tuple:
        drafter, gamma = make()
        stats, out = Traced(), []
        for token in decode(target, drafter, prompt, params, gamma, 16, stats=stats):
            out.append(token)
            if len(out) >= n:
                break
        return tuple(out[:n]), stats.trace(len(prompt))
    return run
