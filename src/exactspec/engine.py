"""The public entry point: load a target (and drafter) once, then generate or stream many times.

    engine = exactspec.load()                      # embedded SmolLM2-135M, prompt-lookup drafts
    result = engine.generate("Rewrite ...", max_new_tokens=128, temperature=0)
    for piece in engine.stream("Hello", temperature=0.7, top_p=0.9):
        print(piece, end="")

The Engine is where a request becomes rows of the one loop (`request`, `rows`); loading lives in
loading.py, drafters and γ policies in drafting.py, requests and results in generation.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace

import torch

from .batching import Job, run_jobs
from .cachedir import in_own_thread
from .chat_prompt import encode_prompt
from .chat_templates import read_template
from .drafters.auto import DraftBandit
from .drafting import STORE_MB, Drafting
from .errors import ExactSpecError
from .generation import (GenerationResult, LawSpec, Request, law_spec, release, row_seeds, seeded, split_sampling,
                         text_pieces)
from .loading import Loaded, adapter, load_llamacpp, load_models, runtime
from .models.light_tokenizer import llg_tokenizer
from .models.seq2seq import Seq2SeqLM
from .prefix_store import PREFIX_DISK_MB, DiskPrefixStore
from .autogamma.costs import MAX_AUTO_GAMMA, CostModel
from .speculative.interfaces import CausalLM, Drafter, GammaPolicy, PersistentPrefix, PrefixSnapshots, RowContexts
from .speculative.law import TargetLaw
from .speculative.loop import decode_row
from .speculative.params import DRAFT_NAMES, PREFILL_CHUNK, check_gamma
from .speculative.prefix_cache import PrefixCache
from .speculative.rows import Row
from .speculative.sampling import SamplingParams
from .stats import Stats

__all__ = ["DRAFT_NAMES", "Engine", "GenerationResult", "Request", "adapter", "check_gamma", "llamacpp_engine", "load"]


class Engine:
    """A loaded target model + tokenizer + drafter recipe. One request at a time (not thread-safe)."""

    def __init__(self, target: CausalLM, tokenizer, draft: str = "prompt-lookup", gamma: int | str = 4,
                 draft_model: CausalLM | None = None, chat_template: bool = True, prior_alpha: float = 0.3):
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.gamma = check_gamma(gamma)
        self.draft_model = draft_model
        self.chat_template = chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.template_source = "the model's" if getattr(tokenizer, "chat_template", None) else "none"
        self.drafts = Drafting(target, draft_model, prior_alpha)  # drafters, and what auto γ / auto draft learn
        self.hardware = "device cpu"  # `load` names device, dtype and the CPU flags behind the choice
        self.device, self.dtype = "cpu", "float32"  # where and in which dtype the target computes
        self.layout = None  # the dtype self-test's Choice (models/layouts.py) when `dtype="auto"` ran it on a CPU
        self.backend = "torch"  # what runs the target: "torch" or "llama.cpp" (`load` resolves "auto")
        self._llg_tok = None  # llguidance's view of the tokenizer, built on the first constrained request
        self.prefill_chunk: int | None = PREFILL_CHUNK  # joining prompts' tokens per iteration (batching.py)

    def runtime(self) -> dict:
        """Device, dtype, what greedy identity rests on, hardware (see `loading.runtime`), and where the
        chat template came from."""
        return {**runtime(self.device, self.dtype, self.layout, self.hardware, self.target.identity),
                "chat_template": self.template_source}

    def set_chat_template(self, template: str, source: str) -> None:
        """Render chat messages with this Jinja `template` (instead of the model's, or where it has none);
        `source` says where it came from (`chat_templates.read_template`)."""
        self.tokenizer.chat_template = template
        self.chat_template, self.template_source = True, source

    def context_line(self) -> str:
        """`context 8192 tokens per row x 16 rows (KV cache 2.8 GiB)`: what --ctx-size gave, and its cost."""
        rows = self.target.max_rows if isinstance(self.target, RowContexts) else 1
        kv = self.target.kv_bytes if isinstance(self.target, RowContexts) else None
        cost = f"KV cache {kv / 2**30:.2f} GiB, allocated" if kv else "KV cache grows as used"
        yarn = f"; {self.target.rope_note}" if isinstance(self.target, RowContexts) and self.target.rope_note else ""
        return f"context {self.target.max_length} tokens per row x {rows} row{'s' * (rows > 1)} ({cost}{yarn})"

    def set_prefix_cache(self, budget_mb: float | None, disk: str | os.PathLike | None = None,
                         disk_mb: float = PREFIX_DISK_MB) -> None:
        """Keep the KV of recent sequences across requests, reusing the longest cached prompt prefix
        (see speculative/prefix_cache.py), in at most `budget_mb` MiB; None or 0 turns it off. Targets
        that cannot snapshot their KV (the transformers adapter) ignore it. `disk`: a folder where the
        snapshots also go, in at most `disk_mb` MiB, and are found again after a restart
        (prefix_store.py; targets whose snapshots cannot leave the process ignore it)."""
        if budget_mb is not None and budget_mb < 0:
            raise ExactSpecError(f"the prefix cache budget must be >= 0 MiB, got {budget_mb}")
        if disk is not None and disk_mb <= 0:
            raise ExactSpecError(f"the disk prefix cache budget must be > 0 MiB, got {disk_mb}")
        if isinstance(self.target, PrefixSnapshots):
            old = self.target.prefix_cache
            if old is not None and old.spill is not None:
                old.spill.close()  # its writer thread ends with it
            spill = None
            if budget_mb and disk is not None and isinstance(self.target, PersistentPrefix) and self.target.persist_key:
                spill = DiskPrefixStore(disk, self.target.persist_key, disk_mb)
            self.target.prefix_cache = PrefixCache(budget_mb, spill=spill) if budget_mb else None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.target.prefix_cache if isinstance(self.target, PrefixSnapshots) else None

    @property
    def is_encoder_decoder(self) -> bool:
        return isinstance(self.target, Seq2SeqLM)

    @property
    def prices_drafts(self) -> bool:
        """Whether its defaults price drafts by the target's T(k) (auto γ with a drafter): T(k) is then
        read or measured before anything is timed or served (`load`, `cli.warm_up_compare`, `cli_common.warm_up`)."""
        return self.gamma == "auto" and self.draft != "none"

    def encode(self, prompt: str | list[dict], chat_template: bool | None = None) -> list[int]:
        """A user prompt (or a list of chat messages) -> prompt token ids (see `chat_prompt.encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, self.chat_template if chat_template is None else chat_template)

    def new_result(self, prompt: str | list[dict], chat_template: bool | None = None) -> GenerationResult:
        return GenerationResult("", [], self.encode(prompt, chat_template), "length", Stats())

    # --- drafters, γ and the store (drafting.py); `draft=None` is the engine's drafter -----
    def _draft(self, draft: str | None) -> str:
        return self.draft if draft is None else draft

    def make_drafter(self, draft: str | None = None) -> Drafter | None:
        return self.drafts.make(self._draft(draft))

    def draft_bandit(self) -> DraftBandit:
        return self.drafts.bandit()

    def uses_draft_model(self, draft: str | None = None) -> bool:
        return self.drafts.uses_draft_model(self._draft(draft))

    def cost_model(self, draft: str | None = None, max_gamma: int = MAX_AUTO_GAMMA) -> CostModel:
        return self.drafts.cost_model(self._draft(draft), max_gamma)

    def drafting(self, gamma: int | str | None = None, draft: str | None = None,
                 views: dict | None = None) -> tuple[Drafter | None, GammaPolicy]:
        """A fresh drafter and the γ policy (a FixedGamma, or an AutoGamma) for one generation; `views`: the
        request's (`Request.views`)."""
        return self.drafts.policy(self.gamma if gamma is None else check_gamma(gamma), self._draft(draft), views)

    # --- building a generation: the one place a request becomes rows ----------------------
    def grammar_tokenizer(self):
        """llguidance's view of the tokenizer: built once (about half a second), on first use."""
        if self._llg_tok is None:
            self._llg_tok = llg_tokenizer(self.tokenizer, self.target.vocab_size, self.target.eos_token_ids)
        return self._llg_tok

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes (OpenAI's logprobs `bytes`): a token holding part of a UTF-8 character
        keeps its raw bytes, where decoding it alone gives U+FFFD."""
        return self.grammar_tokenizer().decode_bytes([token])

    def law_spec(self, **law_options) -> LawSpec:
        """The law keywords (see `make_law`) checked, the constraint compiled once for all samples."""
        return law_spec(self.grammar_tokenizer, self.target.vocab_size, **law_options)

    def make_law(self, result: GenerationResult, params: SamplingParams, **law_options) -> TargetLaw | None:
        """One generation's per-position law (speculative/law.py), or None for the plain warp. Keywords:
        `response_format` (OpenAI's json_object / json_schema, or a pydantic model class); `grammar` (a
        Lark string, or {"type": "regex" | "grammar", ...}); `logit_bias`, `presence_penalty`,
        `frequency_penalty`, `repetition_penalty`; `logprobs` = k in [0, 20] (`result.logprobs`)."""
        return self.law_spec(**law_options).law(params, result, self.target.vocab_size)

    def request(self, max_new_tokens: int = 256, stop: list[str] | None = None, gamma: int | str | None = None,
                draft: str | None = None, **sampling) -> Request:
        """One request's settings, checked (budget and γ before the constraint is compiled)."""
        params, law_options = split_sampling(sampling)
        plain = Request(params, max_new_tokens=max_new_tokens, stop=stop, gamma=gamma, draft=draft)
        return replace(plain, law=self.law_spec(**law_options))

    def rows(self, request: Request, results: list[GenerationResult], seeds: list[int | None],
             keys: list | None = None, laws: list[TargetLaw | None] | None = None) -> list[Row]:
        """The loop's rows for `results` (one sample each): each its own law, drafter and generator;
        ONE γ policy for them all (an AutoGamma is asked once per iteration for its rows). An
        encoder-decoder row reads its source here: build and decode such rows one at a time."""
        if laws is None:
            laws = [request.law.law(request.params, r, self.target.vocab_size) for r in results]
        draft = self._draft(request.draft)
        first, policy = self.drafting(request.gamma, draft, request.views)
        drafters = [first] + [self.drafts.make(draft, policy) if first is not None else None for _ in results[1:]]
        rows = []
        for i, (result, drafter, seed, law) in enumerate(zip(results, drafters, seeds, laws)):
            prompt = result.prompt_token_ids
            if self.is_encoder_decoder:  # the prompt is the encoder's source; the decoder starts from its start token
                drafter, prompt = self.drafts.read_source(prompt, drafter, result.stats)
            rows.append(Row(i if keys is None else keys[i], prompt, drafter, request.params, policy,
                            request.max_new_tokens, seeded(seed), result.stats, law))
        return rows

    # --- generating ------------------------------------------------------------------------
    def stream_ids(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int = 256,
                   gamma: int | str | None = None, seed: int | None = None, stats: Stats | None = None,
                   draft: str | None = None, stop_on_eos: bool = True, law: TargetLaw | None = None) -> Iterator[int]:
        """Token ids as they are accepted (EOS included); `stop_on_eos=False` runs to max_new_tokens (the
        bench's fixed-length runs). `law`: see `make_law`."""
        result = GenerationResult("", [], prompt_ids, "length", stats if stats is not None else Stats())
        request = Request(params, max_new_tokens=max_new_tokens, gamma=gamma, draft=draft)
        return decode_row(self.target, self.rows(request, [result], [seed], laws=[law])[0], stop_on_eos)

    def stream(self, prompt: str | list[dict], max_new_tokens: int = 256, stop: list[str] | None = None,
               seed: int | None = None, gamma: int | None = None, chat_template: bool | None = None,
               draft: str | None = None, result: GenerationResult | None = None, **sampling) -> Iterator[str]:
        """Yield text pieces as tokens are accepted. `sampling`: temperature, top_k, top_p, min_p, and the
        law keywords (see `make_law`). Pass an empty `result` (see `new_result`) to read token ids, finish
        reason and stats afterwards."""
        result = result or self.new_result(prompt, chat_template)
        request = self.request(max_new_tokens, stop, gamma, draft, **sampling)
        yield from self._run(result, request, seed)

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
                       gamma: int | str | None = None, chat_template: bool | None = None, draft: str | None = None,
                       **sampling) -> tuple[list[GenerationResult], Stats]:
        """Decode every prompt n times as rows of ONE batch (one target forward per iteration for all
        rows; the scheduler's admission, batching.py). Results are prompt-major (prompt 0's n samples
        first); row i uses seed + i, or, with one seed per prompt, prompt p's sample j uses seed[p] + j
        (as a lone request with that seed would; None: random). Returns the results and the batch's
        stats (target_calls = batched forwards); the first failing row's error is raised."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if n < 1:
            raise ExactSpecError(f"n must be >= 1, got {n}")
        request = self.request(max_new_tokens, stop, gamma, draft, **sampling)
        if len(prompts) * n > 1:  # every row learns from one view, cautious at short matches (RequestAcceptance)
            self.drafts.learned.view(self._draft(draft), request.views, cautious=True)
        seeds = iter(row_seeds(seed, len(prompts), n))
        jobs = [[Job(self.new_result(p, chat_template), request, next(seeds)) for _ in range(n)] for p in prompts]
        stats = Stats()
        if error := next((e for e in run_jobs(self, jobs, stats) if e is not None), None):
            raise error
        return [job.result for samples in jobs for job in samples], stats

    def _run(self, result: GenerationResult, request: Request, seed: int | None) -> Iterator[str]:
        """Drive one row through the loop; text pieces as they are safe to show (generation.text_pieces)."""
        tokens = decode_row(self.target, self.rows(request, [result], [seed])[0])
        return text_pieces(result, tokens, request.stop, self.tokenizer, self.target.eos_token_ids)

    def append_tokens(self, result: GenerationResult, tokens: list[int], stop: list[str] | None, sent: int,
                      final: bool = False) -> tuple[str, bool]:
        """The scheduler's delivery (batching.py): see `generation.release`."""
        return release(result, tokens, stop, sent, final, self.tokenizer, self.target.eos_token_ids)


def load(target: str | None = None, draft: str = "prompt-lookup", gamma: int | str = "auto", chat_template: bool = True,
         dtype: str | torch.dtype = "auto", threads: int | None = None, fast: bool = True, backend: str = "auto",
         prefix_cache_mb: float = 0, device: str = "auto", store_mb: float = STORE_MB, rows: int = 1,
         ctx_size: int | None = None, prefill_chunk: int | None = PREFILL_CHUNK,
         prefix_cache_dir: str | os.PathLike | None = None, prefix_cache_disk_mb: float = PREFIX_DISK_MB,
         template: str | None = None) -> Engine:
    """Load a local target checkpoint (directory or .gguf; default: the embedded SmolLM2-135M-Instruct)
    and a drafter: "prompt-lookup", "suffix" (the context and a store of earlier outputs, `store_mb`
    MiB, 0 = none: drafters/suffix.py), "bigram", "unigram", "auto", "none", or a draft model's path
    (an encoder-decoder target, T5 / BART, needs one, same vocabulary). `gamma`: drafts per target
    call, or "auto" (chosen from measured costs). `backend`: "auto" (llama.cpp for a GGUF target on the
    CPU, else torch: `loading.choose_backend`), "torch" or "llama.cpp". `prefix_cache_mb`: KV of recent
    sequences kept across requests (0 = off); `prefix_cache_dir`: a folder where they also go (in at most
    `prefix_cache_disk_mb` MiB) and survive a restart (None: memory only). `template`: a chat template to
    use instead of the model's (a Jinja file's path, or a built-in: "chatml", "llama3"). `device`: "auto" (a CUDA GPU when visible, else the CPU),
    "cpu", "cuda[:N]"; `dtype`: "auto" (bf16 on a GPU; on a CPU
    the fastest layout that passes a bit-equality self-test on this model, cached per machine and
    model: models/layouts.py) or a dtype: see `engine.device`, `.dtype`, `.layout`, `.hardware`. `rows`:
    sequences a llama.cpp target decodes together (its context holds that many, KV memory allowing: a
    server's or a batch's rows; 1 = one at a time); the torch backend batches rows without it.
    `ctx_size`: tokens per row, prompt and output (None: the model's training context, on llama.cpp as
    much of it as a quarter of the free memory holds, at least 4096; `engine.context_line()` says).
    `prefill_chunk`: prompt tokens prefilled per iteration while other rows decode (None or 0: whole
    prompts; outputs are the same either way, batching.py)."""
    engine = in_own_thread(lambda: _loaded_engine(target, draft, check_gamma(gamma), chat_template, dtype, threads,
                                                  fast, backend, device, rows, ctx_size))
    if template is not None:
        engine.set_chat_template(*read_template(template))
    engine.set_prefix_cache(prefix_cache_mb, prefix_cache_dir, prefix_cache_disk_mb)
    engine.drafts.set_store(store_mb)
    engine.prefill_chunk = prefill_chunk or None
    return engine


def _loaded_engine(target: str | None, draft: str, gamma: int | str, chat_template: bool, *model_args) -> Engine:
    """The models loaded and, under auto γ on a target whose T(k) is cached per machine, T(k) read or
    measured. `load` runs this in a thread that exits (cachedir.in_own_thread): loading and measuring run
    OpenMP regions, and a team libgomp kept on the caller's thread made every later decode or measurement
    from another thread run in its throttled mode: a server's worker decoded several times slower, and a
    first start's T(k) priced wide passes as nearly free (docs/benchmarks.md, "The same trap, from loading")."""
    engine = _engine(load_models(target, draft, *model_args), gamma, chat_template)
    if engine.prices_drafts and engine.target.cost_key is not None:
        engine.cost_model()
    return engine


def llamacpp_engine(path: str | None = None, draft: str = "prompt-lookup", gamma: int | str = 4,
                    chat_template: bool = True, **llama_kwargs) -> Engine:
    """`Engine` over a GGUF target run by llama.cpp (see `loading.load_llamacpp`: `draft`, n_ctx,
    threads, repack and llama.cpp's own keywords)."""
    gamma = check_gamma(gamma)  # loaded in a thread that exits, as `load` (`_loaded_engine`)
    return _engine(in_own_thread(lambda: load_llamacpp(path, draft, **llama_kwargs)), gamma, chat_template)


def _engine(loaded: Loaded, gamma: int | str, chat_template: bool) -> Engine:
    engine = Engine(loaded.target, loaded.tokenizer, loaded.draft, gamma, loaded.draft_model, chat_template)
    engine.device, engine.dtype, engine.layout, engine.hardware = loaded.device, loaded.dtype, loaded.layout, loaded.hardware
    engine.backend = loaded.backend
    return engine
