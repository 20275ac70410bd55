"""What a generation is before and after the loop: the request (`Request`: sampling, law, budget, γ,
drafter, stop strings; checked, its constraint compiled once for all its samples), the result it
fills, and the detokenisation that turns accepted tokens into text. `Engine.request` builds a
Request and `Engine.rows` turns it into the loop's rows (speculative/rows.py): `generate`, `stream`,
`generate_batch`, the server's worker and the Ray replicas all go through those two."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .detokenize import IncrementalText
from .errors import ExactSpecError, FieldError
from .speculative.grammar import Matcher, grammar_from_spec
from .speculative.law import LAW_KEYWORDS, Penalties, TargetLaw
from .speculative.params import check_gamma
from .speculative.sampling import SamplingParams
from .stats import Stats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: Stats = field(default_factory=Stats)
    detokenizer: IncrementalText | None = field(default=None, repr=False, compare=False)  # set by the engine
    logprobs: list[dict] | None = None  # with logprobs=k: per token {"token", "logprob", "top": [(id, lp)]}


@dataclass(frozen=True)
class LawSpec:
    """A request's law keywords, checked, its grammar compiled ONCE into `matcher`: a template at the
    start state that each sample copies (its own state, the compiled grammar shared)."""

    matcher: Matcher | None = None
    penalties: Penalties | None = None
    logprobs: int | None = None  # report each token's logprob and its k best alternatives

    def law(self, params: SamplingParams, result: GenerationResult, vocab_size: int) -> TargetLaw | None:
        """One sample's law (speculative/law.py), or None when it is the plain warp; with logprobs,
        `result.logprobs` is the law's list, filled in place as tokens commit."""
        matcher = self.matcher.copy() if self.matcher is not None else None
        law = TargetLaw(params, result.prompt_token_ids, vocab_size, matcher, self.penalties, self.logprobs)
        if law.trivial:
            return None
        result.logprobs = law.logprobs if self.logprobs is not None else None
        return law


_TOKEN_ID = re.compile(r"-?[0-9]+", re.ASCII)
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def bias_token(key: int | str, vocab_size: int) -> int:
    """A `logit_bias` key (an int, or a string of ASCII decimal digits as JSON keys are) -> the token id
    it names, which must be one of the model's; FieldError naming `logit_bias` otherwise."""
    text = str(key) if isinstance(key, int) and not isinstance(key, bool) else key
    if not isinstance(text, str) or not _TOKEN_ID.fullmatch(text) or not 0 <= int(text) < vocab_size:
        raise FieldError(f"logit_bias key {key!r} is not a token id of this model (0..{vocab_size - 1})", "logit_bias")
    return int(text)


def law_spec(grammar_tokenizer: Callable[[], object], vocab_size: int, response_format=None, grammar=None,
             logit_bias: dict | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, logprobs: int | None = None) -> LawSpec:
    """The law keywords (`Engine.make_law`'s, and the server's and `exactspec batch`'s request fields)
    checked and compiled, in ONE place: a bad bias or penalty is a FieldError naming its field.
    `grammar_tokenizer()` is only called (it is built once, slowly) when there is a grammar."""
    if response_format is not None and grammar is not None:
        raise ExactSpecError("give either response_format or grammar, not both")
    spec = {"type": "grammar", "grammar": grammar} if isinstance(grammar, str) else grammar or response_format
    compiled = grammar_from_spec(spec)
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise FieldError(f"logit_bias must map token ids to numbers, got {type(logit_bias).__name__}", "logit_bias")
    bias = {bias_token(k, vocab_size): v for k, v in (logit_bias or {}).items()}
    try:
        penalties = Penalties({k: float(v) for k, v in bias.items()}, presence_penalty, frequency_penalty,
                              repetition_penalty)
    except (TypeError, ValueError) as e:
        field_ = next((name for name in PENALTY_FIELDS if str(e).startswith(name)), "logit_bias")
        raise FieldError(str(e), field_) from None
    if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= 20):
        raise FieldError(f"logprobs must be an integer in [0, 20], got {logprobs!r}", "logprobs")
    matcher = Matcher(grammar_tokenizer(), compiled, vocab_size) if compiled is not None else None
    return LawSpec(matcher, penalties, logprobs)


@dataclass(frozen=True)
class Request:
    """What a request asks of each of its samples; the n samples of a request share one Request."""

    params: SamplingParams
    law: LawSpec = field(default_factory=LawSpec)
    max_new_tokens: int = 256
    stop: list[str] | None = None
    gamma: int | str | None = None  # None: the engine's
    draft: str | None = None  # None: the engine's
    # what its rows learn of their drafts' acceptance, per drafter (`Drafting.policy`): shared by its
    # samples and, in one `generate_batch` call, by every prompt's rows
    views: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ExactSpecError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.gamma is not None:
            object.__setattr__(self, "gamma", check_gamma(self.gamma))


def split_sampling(sampling: dict) -> tuple[SamplingParams, dict]:
    """Keyword arguments -> (the warp's SamplingParams, `law_spec`'s keywords)."""
    law = {k: sampling.pop(k) for k in LAW_KEYWORDS if k in sampling}
    try:
        return SamplingParams(**sampling), law
    except TypeError as e:
        raise ExactSpecError(str(e)) from None


def seeded(seed: int | None) -> torch.Generator:
    """A generator seeded with `seed`, or with a fresh random seed."""
    return torch.Generator().manual_seed(seed if seed is not None else _fresh())


def row_seeds(seed: int | list[int | None] | None, prompts: int, n: int) -> list[int]:
    """One seed per row of a prompt-major batch: seed + i, or seed[p] + j per prompt (None: random)."""
    if isinstance(seed, list):
        if len(seed) != prompts:
            raise ExactSpecError(f"{len(seed)} seeds for {prompts} prompts")
        return [(_fresh() if s is None else s) + j for s in seed for j in range(n)]
    base = _fresh() if seed is None else seed
    return [base + i for i in range(prompts * n)]


def _fresh() -> int:
    return int(torch.randint(2**62, ()).item())


def add_token(result: GenerationResult, token: int, stop: list[str] | None, tokenizer,
              eos_token_ids: set[int]) -> bool:
    """Append one generated token: text (incremental, see detokenize.py) and finish reason follow;
    True when EOS or a stop string ended the generation (later tokens must not be added)."""
    if result.detokenizer is None:
        result.detokenizer = IncrementalText(tokenizer, stop)
    detok = result.detokenizer
    result.token_ids.append(token)
    detok.add(token)
    if token in eos_token_ids or detok.stop_at >= 0:
        result.finish_reason = "stop"
    result.text = detok.text if detok.stop_at < 0 else detok.text[:detok.stop_at]
    return result.finish_reason == "stop"


def text_pieces(result: GenerationResult, tokens: Iterator[int], stop: list[str] | None, tokenizer,
                eos_token_ids: set[int]) -> Iterator[str]:
    """Detokenise a lone generation's tokens into `result` as they come, apply stop strings, and yield
    the text as it is safe to show; closes `tokens` at EOS or a stop string."""
    sent = 0
    for token in tokens:
        done = add_token(result, token, stop, tokenizer, eos_token_ids)
        # hold back a trailing partial UTF-8 sequence, and any text that might start a stop string
        safe = result.detokenizer.safe_length(final=done)
        if safe > sent:
            yield result.text[sent:safe]
            sent = safe
        if done:
            break
    tokens.close()
    if len(result.text) > sent:
        yield result.text[sent:]


def release(result: GenerationResult, tokens: list[int], stop: list[str] | None, sent: int, final: bool,
            tokenizer, eos_token_ids: set[int]) -> tuple[str, bool]:
    """`text_pieces` for callers that drive the loop themselves (the server's batch): add newly accepted
    `tokens` to `result` one at a time, up to EOS or a stop string; return (the text after its first
    `sent` characters that is safe to send, whether EOS or a stop string ended it). `final`: the loop
    ended it (length, context), so nothing is held back."""
    done = any(add_token(result, token, stop, tokenizer, eos_token_ids) for token in tokens)
    if result.detokenizer is None:
        return "", done
    safe = result.detokenizer.safe_length(final=done or final)
    return result.text[sent:safe] if safe > sent else "", done
