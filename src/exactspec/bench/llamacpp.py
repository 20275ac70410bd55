"""llama.cpp rows for the side-by-side benchmark (optional extra: `make llamacpp`).

- `llamacpp_engine(path)`: an `Engine` whose target is a `LlamaCppLM`; `exactspec_method(engine, ...)`
  then gives exactspec-plain / exactspec-spec / auto rows on llama.cpp (same verifier, drafters, cost model).
- `llamacpp-plain`: llama-cpp-python's own `Llama.generate` on the same context (its own sampler chain).
- `llamacpp-prompt-lookup`: `Llama.generate` with `LlamaPromptLookupDecoding(num_pred_tokens=10)` as
  draft model, on a second `Llama` over the same file (it needs `logits_all`).

Both anchors start from an empty cache every run (no prefix reuse across runs), stop at EOS at T = 0
and run fixed-length at T > 0, and time prefill + decode, as exactspec's rows do (see bench/runner.py).
Their sampler is llama.cpp's: for T > 0 it applies top-k/top-p/min-p BEFORE temperature (exactspec
warps temperature first, as HF does), so only with top_p = 1 and min_p = 0 (the bench default) do both
sample the same law.

The anchors use the target's context settings (threads, n_ctx, n_ubatch=32, flash attention): with them,
both anchors and every exactspec row decode the same greedy tokens (tested). With llama-cpp-python's
defaults (no flash attention) even its own prompt lookup drifts from its own plain decoding on 8 of the
10 bench prompts (see models/llama_cpp.py, BATCH INVARIANCE).
"""

from __future__ import annotations

import time

from ..engine import DRAFT_NAMES, Engine, check_gamma, check_same_vocab
from ..errors import ExactSpecError
from ..models.llama_cpp import LlamaCppLM, _import, load_llama_cpp, make_llama
from ..models.torch_hf import load_tokenizer
from ..sampling import SamplingParams
from .runner import Method, exactspec_method

PROMPT_LOOKUP_TOKENS = 10


def llamacpp_engine(path: str | None = None, draft: str = "prompt-lookup", gamma: int | str = 4,
                    chat_template: bool = True, n_ctx: int | None = None, threads: int | None = None,
                    repack: bool | None = None, **llama_kwargs) -> Engine:
    """`Engine` over a GGUF target run by llama.cpp; the tokenizer is transformers' reading of the same
    GGUF (its ids are checked against llama.cpp's own tokenizer in the tests). `draft` is a drafter
    name or a path to a draft GGUF (also run by llama.cpp). `llama_kwargs` go to `LlamaCppLM` (n_ubatch,
    flash_attn, type_k, ...)."""
    from ..embedded import embedded_model_path

    gamma = check_gamma(gamma)
    path = path or embedded_model_path()
    if draft not in DRAFT_NAMES and not draft.endswith(".gguf"):
        raise ExactSpecError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFT_NAMES)} or a .gguf path")
    target = load_llama_cpp(path, n_ctx=n_ctx, threads=threads, repack=repack, **llama_kwargs)
    tokenizer = load_tokenizer(path)
    draft_lm = None
    if draft not in DRAFT_NAMES:
        draft_lm = load_llama_cpp(draft, n_ctx=target.max_length, threads=threads,
                                  eos_token_ids=target.eos_token_ids, repack=target.repack, **llama_kwargs)
        check_same_vocab(target, draft_lm, tokenizer, draft)
        draft = "model"
    return Engine(target, tokenizer, draft, gamma, draft_lm, chat_template)


def sampler_kwargs(params: SamplingParams) -> dict:
    """SamplingParams -> `Llama.generate` keyword arguments (every llama.cpp extra switched off)."""
    return dict(temp=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                typical_p=1.0, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, mirostat_mode=0)


def llamacpp_generate(llama, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int, seed: int,
                      eos_token_ids: set[int], stop_on_eos: bool = True) -> list[int]:
    """Generated ids from llama-cpp-python's own generation loop, stopping after EOS (unless not
    `stop_on_eos`: the bench's fixed-length runs) or max_new_tokens."""
    llama.reset()  # n_tokens = 0: no reuse of a prefix cached by an earlier run (or by LlamaCppLM)
    llama.set_seed(seed)
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    gen = llama.generate(prompt_ids, reset=True, **sampler_kwargs(params))
    for token in gen:
        out.append(int(token))
        if (stop_on_eos and token in eos_token_ids) or len(out) >= max_new_tokens:
            break
    gen.close()
    return out


def _anchor(name: str, llama, eos: set[int], drafter: str | None, gamma: int | None) -> Method:
    def run(prompt_ids, params, max_new_tokens, seed):
        t = time.perf_counter()
        n = len(llamacpp_generate(llama, prompt_ids, params, max_new_tokens, seed, eos, stop_on_eos=params.greedy))
        return n, time.perf_counter() - t, None

    return Method(name, drafter, gamma, run)


def llamacpp_plain_method(engine: Engine) -> Method:
    """llama.cpp plain decoding on the target's own context (same threads, same n_ctx)."""
    target = _target(engine)
    return _anchor("llamacpp-plain", target.llama, target.eos_token_ids, None, None)


def prompt_lookup_llama(target: LlamaCppLM, num_pred_tokens: int = PROMPT_LOOKUP_TOKENS):
    """A second `Llama` over the target's GGUF (same n_ctx, batch and threads) with llama-cpp-python's
    prompt-lookup draft model (which forces `logits_all`)."""
    _import()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return make_llama(target.path, target.repack, **target.context_kwargs(),
                      draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens))


def llamacpp_prompt_lookup_method(engine: Engine, num_pred_tokens: int = PROMPT_LOOKUP_TOKENS) -> Method:
    """llama-cpp-python's prompt-lookup speculative decoding, on a second Llama over the same GGUF."""
    target = _target(engine)
    llama = prompt_lookup_llama(target, num_pred_tokens)
    return _anchor("llamacpp-prompt-lookup", llama, target.eos_token_ids, "prompt-lookup", num_pred_tokens)


def llamacpp_methods(engine: Engine, prompt_lookup: bool = True) -> list[Method]:
    """The llama.cpp anchors for `build_methods` (instead of the HF ones) when the target is llama.cpp."""
    methods = [llamacpp_plain_method(engine)]
    if prompt_lookup:
        methods.append(llamacpp_prompt_lookup_method(engine))
    return methods


def _target(engine: Engine) -> LlamaCppLM:
    if not isinstance(engine.target, LlamaCppLM):
        raise ExactSpecError("llama.cpp anchors need an engine whose target runs on llama.cpp (--backend llama.cpp)")
    return engine.target


__all__ = ["llamacpp_engine", "llamacpp_generate", "llamacpp_methods", "llamacpp_plain_method",
           "llamacpp_prompt_lookup_method", "prompt_lookup_llama", "sampler_kwargs", "exactspec_method"]
