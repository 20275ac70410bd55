"""The public entry point: load a target (and drafter) once, then generate or stream many times.

    engine = exactspec.load()                      # embedded SmolLM2-135M, prompt-lookup drafts
    result = engine.generate("Rewrite ...", max_new_tokens=128, temperature=0)
    for piece in engine.stream("Hello", temperature=0.7, top_p=0.9):
        print(piece, end="")
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .chat_prompt import encode_chat
from .detokenize import IncrementalText
from .device import cpu_name, describe, resolve_device, resolve_dtype
from .drafters.auto import AutoDrafter, DraftBandit
from .drafters.model import ModelDrafter
from .drafters.ngram import NGramDrafter
from .drafters.suffix import PromptLookupDrafter
from .drafters.source import read_source
from .embedded import embedded_model_path
from .errors import ExactSpecError
from .models import fast_llama
from .models.layouts import choose_layout, layout_named
from .models.prefix_cache import PrefixCache
from .models.seq2seq import Seq2SeqLM, is_encoder_decoder, load_seq2seq_model
from .models.torch_hf import HFCausalLM, load_hf_model, load_tokenizer
from .spec.costmodel import MAX_AUTO_GAMMA, Acceptance, AutoGamma, BatchCosts, CostModel, measure_drafter, measure_target
from .spec.interfaces import CausalLM, Drafter
from .spec.law import LAW_KEYWORDS, Matcher, Penalties, TargetLaw, grammar_from_spec, llg_tokenizer
from .spec.loop import decode, decode_batch
from .spec.sampling import SamplingParams
from .stats import Stats, total

DRAFT_NAMES = ("prompt-lookup", "bigram", "unigram", "auto", "none")
AUTO_ARMS = ("prompt-lookup", "bigram")  # plus the draft model, when the engine has one


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: Stats = field(default_factory=Stats)
    detokenizer: IncrementalText | None = field(default=None, repr=False, compare=False)  # set by the engine
    logprobs: list[dict] | None = None  # with logprobs=k: per token {"token", "logprob", "top": [(id, lp)]}


class Engine:
    """A loaded target model + tokenizer + drafter recipe. One request at a time (not thread-safe)."""

    def __init__(self, target: CausalLM, tokenizer, draft: str = "prompt-lookup", gamma: int | str = 4,
                 draft_model: CausalLM | None = None, chat_template: bool = True, prior_alpha: float = 0.3):
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.gamma = check_gamma(gamma)
        self.draft_model = draft_model
        self.chat_template = chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.prior_alpha = prior_alpha  # AutoGamma's prior acceptance rate (`exactspec tune` reports α per workload)
        self._target_costs: list[float] | None = None  # T(k), k = 1..K, and how often each was refined
        self._target_observations: list[int] = []
        self._batch_costs = BatchCosts()  # T(B, k), refined by batched auto-gamma iterations
        self._costs: dict[str, CostModel] = {}  # per drafter; AutoGamma refines them as it decodes
        self.hardware = "device cpu"  # `load` names device, dtype and the CPU flags behind the choice
        self.device, self.dtype = "cpu", "float32"  # where and in which dtype the target computes
        self.layout = None  # the dtype self-test's Choice (models/layouts.py) when `dtype="auto"` ran it on a CPU
        self._acceptance: dict[str, Acceptance] = {}  # per drafter: α by match length, across requests
        self._bandit: DraftBandit | None = None  # what `draft="auto"` learned, kept across requests
        self._llg_tok = None  # llguidance's view of the tokenizer, built on the first constrained request

    def runtime(self) -> dict:
        """Where and in which dtype the target computes, and on what greedy identity rests (the dtype
        self-test's verdict): for `generate --json` stats, `serve`'s start-up log and `/v1/models`."""
        if self.layout is not None:
            identity = "bit-exact (self-test)" if self.layout.exact else "by tolerance (no layout passed the self-test)"
        elif self.dtype == "gguf":
            identity = "not self-tested at load (llama.cpp; the test suite checks greedy identity on the embedded GGUF)"
        else:
            identity = "not self-tested (dtype given, or a GPU / an adapter without the lean forward)"
        return {"device": self.device, "dtype": self.dtype, "greedy_identity": identity, "hardware": self.hardware}

    # --- prefix cache ----------------------------------------------------------------------
    def set_prefix_cache(self, budget_mb: float | None) -> None:
        """Keep the KV of recent sequences across requests, reusing the longest cached prompt prefix
        (see models/prefix_cache.py), in at most `budget_mb` MiB; None or 0 turns it off. Targets
        that cannot snapshot their KV (the transformers adapter) ignore it."""
        if budget_mb is not None and budget_mb < 0:
            raise ExactSpecError(f"the prefix cache budget must be >= 0 MiB, got {budget_mb}")
        if hasattr(self.target, "snapshot_prefix"):
            self.target.prefix_cache = PrefixCache(budget_mb) if budget_mb else None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return getattr(self.target, "prefix_cache", None)

    # --- prompt handling -------------------------------------------------------------------
    def encode(self, prompt: str | list[dict], chat_template: bool | None = None) -> list[int]:
        """A user prompt (or a list of chat messages) -> prompt token ids. Through the chat template,
        message content is never parsed for special tokens (chat_prompt.py); a raw prompt is."""
        use_chat = self.chat_template if chat_template is None else chat_template
        if isinstance(prompt, list):
            if not getattr(self.tokenizer, "chat_template", None):
                raise ExactSpecError("this model has no chat template: pass a plain prompt")
            use_chat, messages = True, prompt
        else:
            messages = [{"role": "user", "content": prompt}]
        if use_chat:  # message content is text: a special token's text in it is not that token
            return encode_chat(self.tokenizer, messages)
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
        if draft == "auto":
            arms = AUTO_ARMS + (("model",) if self.draft_model is not None else ())
            return AutoDrafter(self.draft_bandit(), {name: self.make_drafter(name) for name in arms})
        raise ExactSpecError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFT_NAMES)} or a model path")

    def draft_bandit(self) -> DraftBandit:
        """The `auto` drafter's knowledge (acceptance and cost per drafter), over the target's T(k)."""
        if self._bandit is None:
            self.cost_model("none")  # measures T(k) once (shared by every cost model)
            self._bandit = DraftBandit(self._target_costs)
        return self._bandit

    def uses_draft_model(self, draft: str | None = None) -> bool:
        """Whether generations with `draft` run the draft model (one sequence at a time: it has one cache)."""
        draft = self.draft if draft is None else draft
        return draft == "model" or (draft == "auto" and self.draft_model is not None)

    def cost_model(self, draft: str | None = None, max_gamma: int = MAX_AUTO_GAMMA) -> CostModel:
        """The target's T(k) and T(B, k) (measured once, refined by every auto-gamma iteration: they are
        shared by every drafter's cost model) and the drafter's time per token (measured once per
        drafter, then refined by its auto-gamma proposals)."""
        draft = self.draft if draft is None else draft
        if self.is_encoder_decoder and (self._target_costs is None or draft not in self._costs):
            self._set_source(torch.randint(0, self.target.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist())
        if self._target_costs is None:
            self._target_costs = measure_target(self.target, max_k=max_gamma + 1)
            self._target_observations = [0] * len(self._target_costs)
        if draft not in self._costs:
            drafter = self.make_drafter(draft)
            draft_s = 0.0 if drafter is None else measure_drafter(drafter, self.target.vocab_size,
                                                                  SamplingParams(temperature=1.0))
            self._costs[draft] = CostModel(self._target_costs, draft_s, target_observations=self._target_observations,
                                           batch=self._batch_costs)
        return self._costs[draft]

    def acceptance(self, draft: str | None = None) -> Acceptance:
        """What auto γ has learned about a drafter's acceptance (by match length), kept across requests."""
        draft = self.draft if draft is None else draft
        if draft not in self._acceptance:
            self._acceptance[draft] = Acceptance(self.prior_alpha)
        return self._acceptance[draft]

    def drafting(self, gamma: int | str | None = None, draft: str | None = None) -> tuple[Drafter | None, int | AutoGamma]:
        """A fresh drafter and the γ policy for one generation: a fixed γ, or an AutoGamma over this
        engine's cost model and learned acceptance for "auto" (γ = 0, or no drafter and no grammar, means
        plain decoding)."""
        gamma = self.gamma if gamma is None else check_gamma(gamma)
        drafter = self.make_drafter(draft) if gamma != 0 else None
        if gamma == "auto":  # no drafter: the only drafts are grammar-forced ones, which γ does not budget
            gamma = AutoGamma(self.cost_model(draft), acceptance=self.acceptance(draft)) if drafter is not None else 1
        return drafter, gamma

    @property
    def is_encoder_decoder(self) -> bool:
        return isinstance(self.target, Seq2SeqLM)

    def _set_source(self, source_ids: list[int]) -> None:
        """Encoder-decoder pair: run the target's (and the draft model's) encoder over the source."""
        self.target.set_source(source_ids)
        if self.draft_model is not None:
            self.draft_model.set_source(source_ids)

    # --- generation ------------------------------------------------------------------------
    def stream_ids(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int = 256,
                   gamma: int | str | None = None, seed: int | None = None, stats: Stats | None = None,
                   draft: str | None = None, stop_on_eos: bool = True, law: TargetLaw | None = None) -> Iterator[int]:
        """Token ids as they are accepted (EOS included); `stop_on_eos=False` runs to max_new_tokens (the
        bench's fixed-length runs). `law`: see `make_law`."""
        if max_new_tokens <= 0:
            raise ExactSpecError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        drafter, policy = self.drafting(gamma, draft)
        if self.is_encoder_decoder:  # the prompt is the encoder's source; the decoder starts from its start token
            t = time.perf_counter()
            self._set_source(prompt_ids)
            if stats is not None:
                stats.prefill_s += time.perf_counter() - t
            if drafter is not None:
                drafter = read_source(drafter, prompt_ids, len(self.target.decoder_prompt), self.target.eos_token_ids)
            prompt_ids = self.target.decoder_prompt
        return decode(self.target, drafter, prompt_ids, params, policy, max_new_tokens, seeded(seed), stats,
                      stop_on_eos, law=law)

    def stream(self, prompt: str | list[dict], max_new_tokens: int = 256, stop: list[str] | None = None,
               seed: int | None = None, gamma: int | None = None, chat_template: bool | None = None,
               draft: str | None = None, result: GenerationResult | None = None, **sampling) -> Iterator[str]:
        """Yield text pieces as tokens are accepted. `sampling`: temperature, top_k, top_p, min_p, and the
        law keywords (see `make_law`): response_format, grammar, logit_bias, presence_penalty,
        frequency_penalty, repetition_penalty, logprobs.
        Pass an empty `result` (see `new_result`) to read token ids, finish reason and stats afterwards."""
        result = result or self.new_result(prompt, chat_template)
        params, law_options = split_sampling(sampling)
        law = self.make_law(result, params, **law_options)
        yield from self._run(result, max_new_tokens, stop, seed, gamma, draft, params, law)

    def grammar_tokenizer(self):
        """llguidance's view of the tokenizer: built once (about half a second), on first use."""
        if self._llg_tok is None:
            self._llg_tok = llg_tokenizer(self.tokenizer, self.target.vocab_size, self.target.eos_token_ids)
        return self._llg_tok

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes: a token holding part of a UTF-8 character keeps its raw bytes, where
        decoding it alone gives U+FFFD (OpenAI's logprobs `bytes`)."""
        return self.grammar_tokenizer().decode_bytes([token])

    def make_law(self, result: GenerationResult, params: SamplingParams, response_format=None, grammar=None,
                 logit_bias: dict | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, logprobs: int | None = None) -> TargetLaw | None:
        """The per-position law of one generation (spec/law.py), or None when it is the plain warp.
        `response_format`: OpenAI's ({"type": "json_object"}, {"type": "json_schema", "json_schema": {...}})
        or a pydantic model class; `grammar`: a Lark grammar string, or {"type": "regex", "regex": RE} /
        {"type": "grammar", "grammar": LARK}; `logprobs`: report each token's log-probability and its k
        best alternatives (k >= 0) in `result.logprobs`."""
        if response_format is not None and grammar is not None:
            raise ExactSpecError("give either response_format or grammar, not both")
        spec = {"type": "grammar", "grammar": grammar} if isinstance(grammar, str) else grammar or response_format
        compiled = grammar_from_spec(spec)
        try:
            penalties = Penalties({int(k): float(v) for k, v in (logit_bias or {}).items()}, presence_penalty,
                                  frequency_penalty, repetition_penalty)
        except (TypeError, ValueError) as e:
            raise ExactSpecError(str(e)) from None
        if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= 20):
            raise ExactSpecError(f"logprobs must be an integer in [0, 20], got {logprobs!r}")
        matcher = None
        if compiled is not None:
            matcher = Matcher(self.grammar_tokenizer(), compiled, self.target.vocab_size)
        law = TargetLaw(params, result.prompt_token_ids, self.target.vocab_size, matcher, penalties, logprobs)
        if law.trivial:
            return None
        result.logprobs = law.logprobs if logprobs is not None else None  # filled in place as tokens commit
        return law

    def new_result(self, prompt: str | list[dict], chat_template: bool | None = None) -> GenerationResult:
        return GenerationResult("", [], self.encode(prompt, chat_template), "length", Stats())

    def generate(self, prompt: str | list[dict], max_new_tokens: int = 256, stop: list[str] | None = None,
                 seed: int | None = None, gamma: int | None = None, chat_template: bool | None = None,
                 draft: str | None = None, **sampling) -> GenerationResult:
        """Generate one completion; the result carries text, token ids, finish reason and stats.
        `sampling`: as for `stream` (e.g. response_format={"type": "json_object"}, grammar=LARK)."""
        result = self.new_result(prompt, chat_template)
        for _ in self.stream(prompt, max_new_tokens, stop, seed, gamma, chat_template, draft, result, **sampling):
            pass
        return result

    def generate_batch(self, prompts: str | list[str], n: int = 1, max_new_tokens: int = 256,
                       stop: list[str] | None = None, seed: int | list[int | None] | None = None,
                       gamma: int | str | None = None,
                       chat_template: bool | None = None, draft: str | None = None,
                       **sampling) -> tuple[list[GenerationResult], Stats]:
        """Decode every prompt n times in ONE batch (one target forward per iteration for all rows).
        Results are prompt-major (prompt 0's n samples first); row i uses seed + i, or, with one seed per
        prompt, prompt p's sample j uses seed[p] + j (as a lone request with that seed would; None: random).
        Returns the results and the batch's stats (target_calls = batched forwards). Targets without a batched cache,
        and draft models, run the rows one after another instead."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if n < 1:
            raise ExactSpecError(f"n must be >= 1, got {n}")
        if max_new_tokens <= 0:
            raise ExactSpecError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        params, law_options = split_sampling(sampling)
        results = [self.new_result(p, chat_template) for p in prompts for _ in range(n)]
        laws = [self.make_law(r, params, **law_options) for r in results]
        seeds = _row_seeds(seed, len(prompts), n)
        draft = self.draft if draft is None else draft
        if not self.target.batched or self.uses_draft_model(draft):
            return self._sequential(results, max_new_tokens, stop, seeds, gamma, draft, params, laws)
        first, policy = self.drafting(gamma, draft)  # one policy for the batch, one drafter per row
        drafters = [first] + [self.make_drafter(draft) if first else None for _ in results[1:]]
        batch_stats, cancelled = Stats(), set()
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        for row, tokens in decode_batch(self.target, drafters, [r.prompt_token_ids for r in results], params,
                                        policy, max_new_tokens, gens, [r.stats for r in results], batch_stats,
                                        cancelled, laws=laws):
            if any(self._add(results[row], token, stop) for token in tokens):
                cancelled.add(row)
        return results, batch_stats

    def _sequential(self, results, max_new_tokens, stop, seeds, gamma, draft, params, laws):
        for result, seed, law in zip(results, seeds, laws):
            for _ in self._run(result, max_new_tokens, stop, seed, gamma, draft, params, law):
                pass
        return results, total(r.stats for r in results)

    def _add(self, result: GenerationResult, token: int, stop: list[str] | None) -> bool:
        """Append one generated token: text (incremental, see detokenize.py) and finish reason follow;
        True when EOS or a stop string ended the generation (later tokens must not be added)."""
        if result.detokenizer is None:
            result.detokenizer = IncrementalText(self.tokenizer, stop)
        detok = result.detokenizer
        result.token_ids.append(token)
        detok.add(token)
        if token in self.target.eos_token_ids or detok.stop_at >= 0:
            result.finish_reason = "stop"
        result.text = detok.text if detok.stop_at < 0 else detok.text[:detok.stop_at]
        return result.finish_reason == "stop"

    def _run(self, result: GenerationResult, max_new_tokens, stop, seed, gamma, draft, params,
             law: TargetLaw | None = None) -> Iterator[str]:
        """Drive the decode loop, detokenise incrementally, apply stop strings; fills `result`."""
        tokens = self.stream_ids(result.prompt_token_ids, params, max_new_tokens, gamma, seed, result.stats, draft,
                                 law=law)
        sent = 0
        for token in tokens:
            done = self._add(result, token, stop)
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

    def append_tokens(self, result: GenerationResult, tokens: list[int], stop: list[str] | None, sent: int,
                      final: bool = False) -> tuple[str, bool]:
        """`_run`'s detokenisation for callers that drive a decode loop themselves (the server's batch):
        add newly accepted `tokens` to `result` one at a time, up to EOS or a stop string, and return
        (the text after its first `sent` characters that is safe to send, whether EOS or a stop string
        ended the generation). `final`: the loop ended it (length, context), so nothing is held back."""
        done = any(self._add(result, token, stop) for token in tokens)
        if result.detokenizer is None:
            return "", done
        safe = result.detokenizer.safe_length(final=done or final)
        return result.text[sent:safe] if safe > sent else "", done


def _row_seeds(seed: int | list[int | None] | None, prompts: int, n: int) -> list[int]:
    """One seed per row of a prompt-major batch: seed + i, or seed[p] + j per prompt (None: random)."""
    def fresh() -> int:
        return int(torch.randint(2**62, ()).item())

    if isinstance(seed, list):
        if len(seed) != prompts:
            raise ExactSpecError(f"{len(seed)} seeds for {prompts} prompts")
        return [(fresh() if s is None else s) + j for s in seed for j in range(n)]
    base = fresh() if seed is None else seed
    return [base + i for i in range(prompts * n)]


def split_sampling(sampling: dict) -> tuple[SamplingParams, dict]:
    """Keyword arguments -> (the warp's SamplingParams, `Engine.make_law`'s keywords)."""
    law = {k: sampling.pop(k) for k in LAW_KEYWORDS if k in sampling}
    try:
        return SamplingParams(**sampling), law
    except TypeError as e:
        raise ExactSpecError(str(e)) from None


def seeded(seed: int | None) -> torch.Generator:
    """A generator seeded with `seed`, or with a fresh random seed."""
    return torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(2**62, ()).item()))


def check_gamma(gamma: int | str) -> int | str:
    """γ is an integer >= 0 (an int or its digits) or "auto"."""
    if gamma == "auto":
        return gamma
    valid = isinstance(gamma, int) and not isinstance(gamma, bool) or isinstance(gamma, str) and gamma.isdigit()
    if not valid or int(gamma) < 0:
        raise ExactSpecError(f"gamma must be an integer >= 0 or 'auto', got {gamma!r}")
    return int(gamma)


def adapter(module: torch.nn.Module, eos_token_ids: set[int] | None = None, fast: bool = True) -> CausalLM:
    """The encoder-decoder adapter for T5/BART-like modules; else the lean Llama-family forward when the
    architecture allows it, else the transformers one."""
    if getattr(module.config, "is_encoder_decoder", False):
        return Seq2SeqLM(module, eos_token_ids)
    if fast and fast_llama.supports(module):
        return fast_llama.FastLlamaLM(module, eos_token_ids)
    return HFCausalLM(module, eos_token_ids)


def load(target: str | None = None, draft: str = "prompt-lookup", gamma: int | str = 4, chat_template: bool = True,
         dtype: str | torch.dtype = "auto", threads: int | None = None, fast: bool = True,
         backend: str = "torch", prefix_cache_mb: float = 0, device: str = "auto") -> Engine:
    """Load a local target checkpoint (directory or .gguf; default: the embedded SmolLM2-135M-Instruct)
    and a drafter: "prompt-lookup", "bigram", "unigram", "none", or a path to a draft model. An
    encoder-decoder directory (T5, BART: `is_encoder_decoder` in config.json) loads through
    AutoModelForSeq2SeqLM; its draft model must be one too, with the same vocabulary.
    `gamma` is drafts per target call, or "auto" (chosen each iteration from measured costs).
    `backend`: "torch" (default) or "llama.cpp" (GGUF files only; needs the llamacpp extra).
    `prefix_cache_mb`: keep the KV of recent sequences across requests in this many MiB (0 = off).
    `device`: "auto" (a CUDA GPU when visible, else the CPU), "cpu", "cuda" or "cuda:N"; `dtype`: "auto"
    (bf16 on a GPU; on a CPU the fastest layout that passes a bit-equality self-test on this model,
    cached per machine and model: models/layouts.py) or a dtype / its name.
    The choice is on `engine.device`, `engine.dtype`, `engine.layout` and, in words, `engine.hardware`."""
    engine = _load(target, draft, gamma, chat_template, dtype, threads, fast, backend, device)
    engine.set_prefix_cache(prefix_cache_mb)
    return engine


def _load(target, draft, gamma, chat_template, dtype, threads, fast, backend, device) -> Engine:
    gamma = check_gamma(gamma)
    if threads:
        torch.set_num_threads(threads)
    if backend not in ("torch", "llama.cpp"):
        raise ExactSpecError(f"unknown backend {backend!r}: choose torch or llama.cpp")
    if backend == "llama.cpp":
        if str(device) not in ("auto", "cpu"):
            raise ExactSpecError(f"--device {device}: the llama.cpp backend runs on the CPU (use --backend torch)")
        return llamacpp_engine(target, draft, gamma, chat_template, threads=threads)
    path = target or embedded_model_path()
    if draft not in DRAFT_NAMES and not os.path.exists(draft):
        raise ExactSpecError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFT_NAMES)} or a model path")
    seq2seq = is_encoder_decoder(path)
    if draft not in DRAFT_NAMES and is_encoder_decoder(draft) != seq2seq:
        kind = lambda enc: "an encoder-decoder (T5/BART-like)" if enc else "a decoder-only"  # noqa: E731
        raise ExactSpecError(f"draft {draft} is {kind(not seq2seq)} model but the target is {kind(seq2seq)} one: "
                             "use a draft of the same kind")
    where = resolve_device("cpu" if seq2seq and device == "auto" else device)  # before the slow load
    if seq2seq and where.type != "cpu":
        raise ExactSpecError(f"--device {device}: encoder-decoder targets run on the CPU only")
    choose = dtype in (None, "auto") and where.type == "cpu"  # the lean forward's layout by self-test
    wanted = resolve_dtype(dtype, where)  # CPU auto: float32 until (and unless) the self-test picks

    def load_module(model_path: str) -> torch.nn.Module:
        if seq2seq:
            return load_seq2seq_model(model_path, wanted)
        return load_hf_model(model_path, wanted, where, light=fast)  # light: the lean forward only reads weights

    tokenizer = load_tokenizer(path)
    module = load_module(path)
    layout = None
    if not seq2seq and fast and fast_llama.supports(module):
        if choose:
            layout = choose_layout(module, path)
            chosen = layout_named(layout.layout)
            wanted, invariant = chosen.dtype, chosen.batch_invariant
        else:
            invariant = None  # the dtype's default mode (fast_llama.FastLlamaLM)
        target_lm = fast_llama.FastLlamaLM(module.to(wanted), _eos_ids(tokenizer), batch_invariant=invariant)
    else:
        target_lm = adapter(module, _eos_ids(tokenizer), fast)
    draft_lm = None
    if draft not in DRAFT_NAMES:  # the draft model sits on the target's device, in the target's dtype
        draft_module = load_module(draft)
        draft_lm = adapter(draft_module.to(wanted) if fast and fast_llama.supports(draft_module) else draft_module,
                           target_lm.eos_token_ids, fast)
        check_same_vocab(target_lm, draft_lm, tokenizer, draft)
        draft = "model"
    engine = Engine(target_lm, tokenizer, draft, gamma, draft_lm, chat_template)
    engine.device, engine.dtype = str(where), str(getattr(target_lm, "dtype", wanted)).removeprefix("torch.")
    engine.layout = layout
    engine.hardware = describe(where, getattr(target_lm, "dtype", wanted), layout)
    return engine


def _eos_ids(tokenizer) -> set[int] | None:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else None


def check_same_vocab(target: CausalLM, draft: CausalLM, tokenizer, draft_path: str) -> None:
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


def llamacpp_engine(path: str | None = None, draft: str = "prompt-lookup", gamma: int | str = 4,
                    chat_template: bool = True, n_ctx: int | None = None, threads: int | None = None,
                    repack: bool | None = None, **llama_kwargs) -> Engine:
    """`Engine` over a GGUF target run by llama.cpp; the tokenizer is transformers' reading of the same
    GGUF (its ids are checked against llama.cpp's own tokenizer in the tests). `draft` is a drafter
    name or a path to a draft GGUF (also run by llama.cpp). `llama_kwargs` go to `LlamaCppLM` (n_ubatch,
    flash_attn, type_k, ...)."""
    from .models.llama_cpp import load_llama_cpp  # lazy: llama.cpp is an optional extra

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
    engine = Engine(target, tokenizer, draft, gamma, draft_lm, chat_template)
    engine.dtype, engine.hardware = "gguf", f"llama.cpp on the CPU ({cpu_name()}), the GGUF's own weight types"
    return engine
