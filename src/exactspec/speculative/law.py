"""Per-position transforms of the target law: grammar masks, logit bias and penalties, and logprobs.

Everything that reshapes the law sampled at a position lives here; the decode loop (loop.py)
calls it for every row alike. A `TargetLaw` turns the logits at the position that follows
`prefix` into the law sampled there:

    logits -> + logit_bias -> presence / frequency / repetition penalties(prefix) -> grammar mask(prefix)
           -> warp (temperature, top-k, top-p, min-p)

Exactness under speculation (Leviathan et al. 2023, with a law that depends on the prefix)
-------------------------------------------------------------------------------------------
Write c for the accepted context and d_0..d_{k-1} for the drafts. The law we must reproduce at
position i is P_i = warp(T(logits_i, c + d_<i)), where T applies bias, penalties and the grammar mask
computed with the prefix c + d_<i -- the drafts before position i INCLUDED, because that is exactly the
prefix the position has whenever it is reached (position i is only reached if d_<i were accepted).
The verifier's argument only needs, at each position, the target law P_i and the law Q_i the draft was
actually sampled from, both conditioned on the same prefix; it then emits d_i with probability
min(1, P_i(d_i)/Q_i(d_i)) and on rejection draws from norm(max(0, P_i - Q_i)). Hence:

* the mask is applied to the logits BEFORE the warp (renormalising inside the warp), for the target
  and for a draft model alike (the draft law Q_i is then the one it sampled from: masking it only
  raises acceptance, it is not needed for exactness -- using the right Q_i is);
* the residual is built from the masked P_i, so a token outside the grammar is never emitted;
* a draft outside the grammar has P_i(d_i) = 0 and is rejected with probability 1. For point-mass
  drafts (prompt lookup, forced tokens) the residual at that position is P_i minus nothing, i.e. the
  position is a plain bonus position, so cutting the proposal at its first invalid token changes no
  law. For a stochastic draft the residual norm(max(0, P_i - Q_i)) differs from P_i, so such drafts are
  kept whole (positions after an invalid draft are never reached; their laws are placeholders);
* grammar-forced tokens (the grammar allows exactly one continuation TEXT; we propose its canonical
  tokens) are drafts with Q = point mass; where the masked law allows only that token, P_i = 1 and the
  draft is accepted surely, elsewhere (another tokenization of the same text is allowed) it is accepted
  with P_i(d_i), like any point-mass draft. Another drafter then continues from c + forced with its own
  Q: any proposal mechanism is exact as long as each draft's Q is the law it was drawn from given
  everything before it.
* the matcher advances only along accepted tokens: to score a window it consumes the valid drafts,
  reads a mask after each, and rolls back; after verification it consumes the emitted tokens (always
  valid: they were sampled from masked laws). Tokens are validated before they are consumed, since
  consuming an invalid token leaves an llguidance matcher in a permanent error state.

Penalties follow the usual conventions: `repetition_penalty` (Hugging Face) divides positive / multiplies
negative logits of every token in prompt + generated text; `presence_penalty` and `frequency_penalty`
(OpenAI) subtract over the generated tokens only; `logit_bias` adds per token id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .interfaces import Proposal
from ..errors import ExactSpecError
from .grammar import Matcher
from .sampling import SamplingParams, warp

# keywords of Engine.make_law (the rest of a request's sampling keywords go to SamplingParams)
LAW_KEYWORDS = ("response_format", "grammar", "logit_bias", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "logprobs")

# --- the law ------------------------------------------------------------------------------------


MIN_REPETITION_PENALTY = 0.01  # and at most its inverse: logits scaled by more overflow towards inf / NaN


@dataclass(frozen=True)
class Penalties:
    """OpenAI / Hugging Face penalty keywords (defaults: off)."""

    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 1 / MIN_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {1 / MIN_REPETITION_PENALTY:g}] "
                             f"(further from 1 the logits overflow), got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1


class TargetLaw:
    """The law sampled at each position of one generation: params + grammar + penalties (+ logprobs).

    The decode loop asks `propose` for drafts, `probs` for the target laws of the window, then
    `commit`s the emitted tokens. `trivial` laws (plain warp) let the loop keep its fast paths."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int, matcher: Matcher | None = None,
                 penalties: Penalties | None = None, top_logprobs: int | None = None):
        self.params, self.matcher = params, matcher
        self.penalties = penalties if penalties is not None and penalties.active else None
        self.vocab_size, self.prompt_len = vocab_size, len(prompt)
        self.top_logprobs = top_logprobs  # None: no logprobs; k >= 0: the token's and the k best
        self.logprobs: list[dict] = []  # one per emitted token: {"token", "logprob", "top": [(id, lp)]}
        self.forced_proposed = self.forced_accepted = 0
        self._last_forced = 0
        self._committed = len(prompt)  # tokens before the current window (prompt + emitted)
        self._raw: torch.Tensor | None = None  # this window's raw logits [k+1, V] (for logprobs)
        if self.penalties is not None:
            self._counts = torch.zeros(vocab_size)  # [V] occurrences among generated tokens
            self._seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] in prompt or generated
            self._seen[torch.tensor(prompt, dtype=torch.long)] = True
            bias = torch.zeros(vocab_size)
            for token, b in self.penalties.logit_bias.items():
                if not 0 <= int(token) < vocab_size:
                    raise ExactSpecError(f"logit_bias names token {token}, outside the vocabulary of {vocab_size}")
                bias[int(token)] = b
            self._bias = bias

    @property
    def trivial(self) -> bool:
        return self.matcher is None and self.penalties is None and self.top_logprobs is None

    # --- proposing --------------------------------------------------------------------------
    def forced(self, room: int) -> list[int]:
        """The tokens the grammar forces next (at most `room`; see Matcher.forced): point-mass drafts the
        target's masked law accepts surely or nearly, proposed whatever γ is (γ budgets the drafter
        that continues from them)."""
        forced = self.matcher.forced()[:room] if self.matcher is not None and room > 0 else []
        self.forced_proposed += len(forced)
        self._last_forced = len(forced)
        return forced

    def prepend_forced(self, forced: list[int], rest: Proposal | None) -> Proposal | None:
        """Forced tokens, then the drafter's proposal `rest` (drafted from context + forced with
        `law=self`); a point-mass proposal is cut at its first token outside the grammar."""
        rest = rest if rest is not None and len(rest) else None
        if not forced:
            proposal = rest
        elif rest is None:
            proposal = Proposal(torch.tensor(forced, dtype=torch.long), None)
        else:
            probs = None
            if rest.probs is not None:
                one_hot = torch.nn.functional.one_hot(torch.tensor(forced), rest.probs.shape[-1]).to(rest.probs)
                probs = torch.cat([one_hot, rest.probs])
            proposal = Proposal(torch.tensor(forced + rest.tokens(), dtype=torch.long), probs, rest.match)
        if proposal is not None and proposal.probs is None and self.matcher is not None:
            valid = self.matcher.valid_prefix(proposal.tokens())
            proposal = Proposal(proposal.ids[:valid], None, proposal.match) if valid else None
        return proposal

    def draft_probs(self, logits: torch.Tensor, prefix: list[int]) -> torch.Tensor:
        """A draft model's law [V] at the position after `prefix` (context + drafts so far): its logits
        through the same transform as the target's."""
        drafts = prefix[self._committed:]
        return self.probs(logits[None], drafts, offset=len(drafts), record=False)[0]

    # --- scoring ----------------------------------------------------------------------------
    def probs(self, logits: torch.Tensor, drafts: list[int], offset: int = 0, record: bool = True) -> torch.Tensor:
        """logits [n, V]; row j is the position after context + drafts[:offset + j] -> laws [n, V]."""
        n = logits.shape[0]
        if record:
            self._raw = logits
        x = logits.float()
        if self.penalties is not None:
            x = self._penalise(x + self._bias, drafts, offset)
        if self.matcher is not None:
            _, masks = self.matcher.masks_along(drafts[: offset + n - 1])
            rows = [masks[min(offset + j, len(masks) - 1)] for j in range(n)]  # past an invalid draft: never reached
            mask = torch.stack(rows)[:, : x.shape[-1]]
            if mask.shape[-1] < x.shape[-1]:  # the model's padded vocabulary: never allowed
                mask = torch.nn.functional.pad(mask, (0, x.shape[-1] - mask.shape[-1]))
            x = x.masked_fill(~mask, float("-inf"))
        return warp(x, self.params)

    @property
    def greedy_fast(self) -> bool:
        """Greedy without penalties: `greedy` may skip the masks wherever the target's own argmax is allowed."""
        return self.params.greedy and self.penalties is None

    def greedy(self, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        """Greedy verification under a grammar (no penalties): logits [k+1, V] of the window -> the
        emitted tokens (accepted drafts, then the next masked argmax). The masked argmax IS the raw
        argmax whenever the grammar allows that token (it is the maximum over all tokens, hence over
        the allowed ones; ties resolve to the same first index), so the [V] mask is computed only at
        positions whose raw argmax the grammar refuses: one token check instead of a mask per position."""
        self._raw = logits
        raw = logits.argmax(-1).tolist()
        emitted, consumed = [], 0
        for j, token in enumerate(raw):
            if self.matcher is not None and self.matcher.valid_prefix([token]) != 1:
                allowed = self.matcher.mask()[: logits.shape[-1]].to(logits.device)
                token = int(logits[j, : len(allowed)].masked_fill(~allowed, float("-inf")).argmax())
            emitted.append(token)
            if j == len(drafts) or token != drafts[j]:
                break
            if self.matcher is not None:
                consumed += self.matcher.consume([token])
        if self.matcher is not None:
            self.matcher.rollback(consumed)
        return emitted

    def _penalise(self, x: torch.Tensor, drafts: list[int], offset: int) -> torch.Tensor:
        pen = self.penalties
        counts, seen = self._counts.clone(), self._seen.clone()
        for t in drafts[:offset]:
            counts[t] += 1
            seen[t] = True
        rows = []
        for j in range(x.shape[0]):
            row = x[j]
            if pen.repetition_penalty != 1:
                row = torch.where(seen, torch.where(row > 0, row / pen.repetition_penalty, row * pen.repetition_penalty),
                                  row)
            rows.append(row - pen.frequency_penalty * counts - pen.presence_penalty * (counts > 0).float())
            if offset + j < len(drafts):
                counts[drafts[offset + j]] += 1
                seen[drafts[offset + j]] = True
        return torch.stack(rows)

    # --- committing -------------------------------------------------------------------------
    def commit(self, emitted: list[int], accepted: int) -> None:
        """Advance past the emitted tokens (emitted[:accepted] are accepted drafts)."""
        self.forced_accepted += min(accepted, self._last_forced)
        self._last_forced = 0
        if self.matcher is not None:
            self.matcher.commit(emitted)
        if self.penalties is not None:
            for t in emitted:
                self._counts[t] += 1
                self._seen[t] = True
        if self.top_logprobs is not None and self._raw is not None:
            lp = torch.log_softmax(self._raw[: len(emitted)].float(), -1)  # [len(emitted), V]
            for i, t in enumerate(emitted):
                top = []
                if self.top_logprobs:
                    values, ids = lp[i].topk(self.top_logprobs)
                    top = list(zip(ids.tolist(), values.tolist()))
                self.logprobs.append({"token": t, "logprob": float(lp[i, t]), "top": top})
        self._raw = None
        self._committed += len(emitted)
