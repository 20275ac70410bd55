"""The public entry point: load a target (and drafter) once, then generate or stream many times.

    engine = exactspec.load()                      # embedded SmolLM2-135M, prompt-lookup drafts
    result = engine.generate("Rewrite ...", max_new_tokens=128, temperature=0)
    for piece in engine.stream("Hello", temperature=0.7, top_p=0.9):
        print(piece, end="")
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .decode import decode
from .drafters.base import Drafter
from .drafters.model import ModelDrafter
from .drafters.ngram import NGramDrafter, PromptLookupDrafter
from .embedded import embedded_model_path
from .errors import ExactSpecError
from .models.torch_hf import HFCausalLM, load_hf_model, load_tokenizer
from .sampling import SamplingParams
from .stats import Stats

DRAFT_NAMES = ("prompt-lookup", "bigram", "unigram", "none")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: Stats = field(default_factory=Stats)


class Engine:
    """A loaded target model + tokenizer + drafter recipe. One request at a time (not thread-safe)."""

    def __init__(self, target: HFCausalLM, tokenizer, draft: str = "prompt-lookup", gamma: int = 4,
                 draft_model: HFCausalLM | None = None, chat_template: bool = True):
        if gamma < 0:
            raise ExactSpecError(f"gamma must be >= 0, got {gamma}")
        self.target, self.tokenizer, self.draft, self.gamma = target, tokenizer, draft, gamma
        self.draft_model = draft_model
        self.chat_template = chat_template and getattr(tokenizer, "chat_template", None) is not None

    # --- prompt handling -------------------------------------------------------------------
    def encode(self, prompt: str | list[dict], chat_template: bool | None = None) -> list[int]:
        """A user prompt (or a list of chat messages) -> prompt token ids."""
        use_chat = self.chat_template if chat_template is None else chat_template
        if isinstance(prompt, list):
            if not getattr(self.tokenizer, "chat_template", None):
                raise ExactSpecError("this model has no chat template: pass a plain prompt")
            use_chat, messages = True, prompt
        else:
            messages = [{"role": "user", "content": prompt}]
        if use_chat:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def make_drafter(self, draft: str | None = None) -> Drafter | None:
        """A fresh drafter (drafters hold per-request state)."""
        draft = self.draft if draft is None else draft
        if draft == "none":
            return None
        if draft == "prompt-lookup":
            return PromptLookupDrafter()
        if draft in ("bigram", "unigram"):
            return NGramDrafter(self.target.vocab_size, order=2 if draft == "bigram" else 1)
        if draft == "model" and self.draft_model is not None:
            return ModelDrafter(self.draft_model)
        raise ExactSpecError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFT_NAMES)} or a model path")

    # --- generation ------------------------------------------------------------------------
    def stream_ids(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int = 256,
                   gamma: int | None = None, seed: int | None = None, stats: Stats | None = None,
                   draft: str | None = None) -> Iterator[int]:
        if max_new_tokens <= 0:
            raise ExactSpecError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        gamma = self.gamma if gamma is None else gamma
        if gamma < 0:
            raise ExactSpecError(f"gamma must be >= 0, got {gamma}")
        generator = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(2**62, ()).item()))
        drafter = self.make_drafter(draft) if gamma > 0 else None
        return decode(self.target, drafter, prompt_ids, params, gamma, max_new_tokens, generator, stats)

    def stream(self, prompt: str | list[dict], max_new_tokens: int = 256, stop: list[str] | None = None,
               seed: int | None = None, gamma: int | None = None, chat_template: bool | None = None,
               draft: str | None = None, result: GenerationResult | None = None, **sampling) -> Iterator[str]:
        """Yield text pieces as tokens are accepted. `sampling`: temperature, top_k, top_p, min_p.
        Pass an empty `result` (see `new_result`) to read token ids, finish reason and stats afterwards."""
        result = result or self.new_result(prompt, chat_template)
        yield from self._run(result, max_new_tokens, stop, seed, gamma, draft, SamplingParams(**sampling))

    def new_result(self, prompt: str | list[dict], chat_template: bool | None = None) -> GenerationResult:
        return GenerationResult("", [], self.encode(prompt, chat_template), "length", Stats())

    def generate(self, prompt: str | list[dict], max_new_tokens: int = 256, stop: list[str] | None = None,
                 seed: int | None = None, gamma: int | None = None, chat_template: bool | None = None,
                 draft: str | None = None, **sampling) -> GenerationResult:
        """Generate one completion; the result carries text, token ids, finish reason and stats."""
        result = self.new_result(prompt, chat_template)
        for _ in self._run(result, max_new_tokens, stop, seed, gamma, draft, SamplingParams(**sampling)):
            pass
        return result

    def _run(self, result: GenerationResult, max_new_tokens, stop, seed, gamma, draft, params) -> Iterator[str]:
        """Drive the decode loop, detokenise incrementally, apply stop strings; fills `result`."""
        stops = [s for s in (stop or []) if s]
        tokens = self.stream_ids(result.prompt_token_ids, params, max_new_tokens, gamma, seed, result.stats, draft)
        sent = 0
        for token in tokens:
            result.token_ids.append(token)
            if token in self.target.eos_token_ids:
                result.finish_reason = "stop"
                break
            text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if hit >= 0:
                text, result.finish_reason = text[:hit], "stop"
            result.text = text
            # hold back a trailing partial UTF-8 sequence, and any text that might start a stop string
            safe = len(text) if hit >= 0 else _safe_prefix(text, stops)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
            if hit >= 0:
                break
        tokens.close()
        if len(result.text) > sent:
            yield result.text[sent:]


def _safe_prefix(text: str, stops: list[str]) -> int:
    """Length of `text` safe to emit: no trailing partial character, no possible start of a stop string."""
    end = len(text) - text.endswith("\ufffd")
    hold = max((n for s in stops for n in range(1, len(s)) if text[:end].endswith(s[:n])), default=0)
    return end - hold


def load(target: str | None = None, draft: str = "prompt-lookup", gamma: int = 4, chat_template: bool = True,
         dtype: torch.dtype = torch.float32, threads: int | None = None) -> Engine:
    """Load a local target checkpoint (directory or .gguf; default: the embedded SmolLM2-135M-Instruct)
    and a drafter: "prompt-lookup", "bigram", "unigram", "none", or a path to a draft model."""
    if threads:
        torch.set_num_threads(threads)
    path = target or embedded_model_path()
    if draft not in DRAFT_NAMES and not os.path.exists(draft):
        raise ExactSpecError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFT_NAMES)} or a model path")
    tokenizer = load_tokenizer(path)
    target_lm = HFCausalLM(load_hf_model(path, dtype), _eos_ids(tokenizer))
    draft_lm = None
    if draft not in DRAFT_NAMES:
        draft_lm = HFCausalLM(load_hf_model(draft, dtype), target_lm.eos_token_ids)
        check_same_vocab(target_lm, draft_lm, tokenizer, draft)
        draft = "model"
    return Engine(target_lm, tokenizer, draft, gamma, draft_lm, chat_template)


def _eos_ids(tokenizer) -> set[int] | None:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else None


def check_same_vocab(target: HFCausalLM, draft: HFCausalLM, tokenizer, draft_path: str) -> None:
    """Refuse a draft model whose vocabulary differs from the target's: its tokens would mean other things."""
    if draft.vocab_size != target.vocab_size:
        raise ExactSpecError(
            f"draft vocabulary ({draft.vocab_size} tokens) differs from the target's ({target.vocab_size}): {draft_path}"
        )
    try:
        draft_tokenizer = load_tokenizer(draft_path)
    except ExactSpecError:
        return  # a draft without its own tokenizer is taken to share the target's
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ExactSpecError(f"draft tokenizer differs from the target's: {draft_path}")
