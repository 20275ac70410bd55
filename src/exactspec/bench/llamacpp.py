"""llama.cpp rows for the side-by-side benchmark (installed by `make setup`; `pip install exactspec[llamacpp]` elsewhere).

- exactspec's own rows on llama.cpp come from `exactspec_method` over an engine loaded with
  `exactspec.load(backend="llama.cpp")` (engine.py: `llamacpp_engine`).
- `llamacpp-plain`: llama-cpp-python's own `Llama.generate` on the same context (its own sampler chain).
- `llamacpp-defaults`: the same, on a context with llama.cpp's own defaults as `llama-server` sets them
  (f16 KV cache, flash attention, n_batch 2048, n_ubatch 512, the same threads for every step): the plain
  speed a user gets without exactspec. Its greedy text can differ from ours when the load-time self-test
  chose another cache type (models/llamacpp/numerics.py).
- `llamacpp-prompt-lookup`: `Llama.generate` with `LlamaPromptLookupDecoding(num_pred_tokens=10)` as
  draft model, on a second `Llama` over the same file (it needs `logits_all`).

Both anchors start from an empty cache every run (no prefix reuse across runs), stop at EOS at T = 0
and run fixed-length at T > 0, and time prefill + decode, as exactspec's rows do (see bench/runner.py).
Their sampler is llama.cpp's: for T > 0 it applies top-k/top-p/min-p BEFORE temperature (exactspec
warps temperature first, as HF does), so only with top_p = 1 and min_p = 0 (the bench default) do both
sample the same law.

The first two anchors use the target's context settings (threads, n_ctx, the self-tested cache type and
n_ubatch, flash attention): with them, they and every exactspec row decode the same greedy tokens (tested),
except where our TILED PREFILL (models/llamacpp/adapter.py) computes a prompt's last len % 64 tokens with the
per-row kernel and `Llama.generate` with the tiled one (prompts of 64+ tokens on an f16 cache: its text
may then differ from ours, which equals our own plain decoding). With llama-cpp-python's
defaults (no flash attention) even its own prompt lookup drifts from its own plain decoding on 8 of the
10 bench prompts (see models/llamacpp/adapter.py, BATCH INVARIANCE).
"""

from __future__ import annotations

import json
import time

from ..engine import Engine
from ..errors import ExactSpecError
from ..models.llamacpp.adapter import LlamaCppLM
from ..models.llamacpp.runtime import import_llama_cpp, make_llama
from ..speculative.sampling import SamplingParams
from .methods import Method, exactspec_method, stops_at_eos

PROMPT_LOOKUP_TOKENS = 10


def sampler_kwargs(params: SamplingParams) -> dict:
    """SamplingParams -> `Llama.generate` keyword arguments (every llama.cpp extra switched off)."""
    return dict(temp=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                typical_p=1.0, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, mirostat_mode=0)


def llamacpp_generate(llama, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int, seed: int,
                      eos_token_ids: set[int], stop_on_eos: bool = True, grammar=None) -> list[int]:
    """Generated ids from llama-cpp-python's own generation loop, stopping after EOS (unless not
    `stop_on_eos`: the bench's fixed-length runs) or max_new_tokens; under llama.cpp's own `grammar`
    (a LlamaGrammar) if given."""
    llama.reset()  # n_tokens = 0: no reuse of a prefix cached by an earlier run (or by LlamaCppLM)
    llama.set_seed(seed)
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    gen = llama.generate(prompt_ids, reset=True, grammar=grammar, **sampler_kwargs(params))
    for token in gen:
        out.append(int(token))
        if (stop_on_eos and token in eos_token_ids) or len(out) >= max_new_tokens:
            break
    gen.close()
    return out


def _anchor(name: str, llama, eos: set[int], drafter: str | None, gamma: int | None, constrains: bool = False) -> Method:
    def run(prompt_ids, params, max_new_tokens, seed, response_format=None):
        t = time.perf_counter()
        grammar = llamacpp_grammar(response_format) if response_format else None  # built inside the timing
        ids = llamacpp_generate(llama, prompt_ids, params, max_new_tokens, seed, eos,
                                stop_on_eos=stops_at_eos(params, response_format), grammar=grammar)
        return ids, time.perf_counter() - t, None

    return Method(name, drafter, gamma, run, constrains=constrains)


def llamacpp_grammar(response_format: dict):
    """An OpenAI json_schema response_format -> llama.cpp's own grammar (GBNF) for it. Its JSON allows
    free whitespace (ours is compact), so at T = 0 its outputs may differ from ours."""
    from llama_cpp import LlamaGrammar

    schema = response_format.get("json_schema", {}).get("schema", {"type": "object"})
    return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)


def llamacpp_plain_method(engine: Engine) -> Method:
    """llama.cpp plain decoding on the target's own context (same threads, same n_ctx); under
    llama.cpp's own grammar on constrained workloads."""
    target = _target(engine)
    return _anchor("llamacpp-plain", target.llama, target.eos_token_ids, None, None, constrains=True)


def llamacpp_defaults_method(engine: Engine) -> Method:
    """llama.cpp plain decoding with llama.cpp's own context defaults (module docstring), same file and threads."""
    target = _target(engine)
    n = target.threads
    llama = make_llama(target.path, target.repack, n_ctx=target.max_length, n_batch=2048, n_ubatch=512,
                       n_threads=n, n_threads_batch=n, flash_attn=True)
    return _anchor("llamacpp-defaults", llama, target.eos_token_ids, None, None)


def prompt_lookup_llama(target: LlamaCppLM, num_pred_tokens: int = PROMPT_LOOKUP_TOKENS):
    """A second `Llama` over the target's GGUF (same n_ctx, batch and threads) with llama-cpp-python's
    prompt-lookup draft model (which forces `logits_all`)."""
    import_llama_cpp()
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
    methods = [llamacpp_plain_method(engine), llamacpp_defaults_method(engine)]
    if prompt_lookup:
        methods.append(llamacpp_prompt_lookup_method(engine))
    return methods


def _target(engine: Engine) -> LlamaCppLM:
    if not isinstance(engine.target, LlamaCppLM):
        raise ExactSpecError("llama.cpp anchors need an engine whose target runs on llama.cpp (--backend llama.cpp)")
    return engine.target


__all__ = ["llamacpp_defaults_method", "llamacpp_generate", "llamacpp_methods", "llamacpp_plain_method",
           "llamacpp_prompt_lookup_method", "prompt_lookup_llama", "sampler_kwargs", "exactspec_method"]
