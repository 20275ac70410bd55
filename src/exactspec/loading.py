"""Loading: a checkpoint (directory or GGUF) -> the target adapter, its tokenizer, the draft model, and
where and in which dtype they compute. `engine.load` and `engine.llamacpp_engine` wrap these in an
`Engine`; this module does not know the Engine (no import cycle)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import torch

from . import progress
from .cachedir import file_identity
from .chat_prompt import generation_marker
from .device import cpu_label, describe, resolve_device, resolve_dtype
from .embedded import embedded_model_path
from .errors import ExactSpecError
from .models import fast_llama
from .models.layouts import Choice, choose_layout, layout_named
from .models.seq2seq import Seq2SeqLM, is_encoder_decoder, load_seq2seq_model
from .models.torch_hf import HFCausalLM, load_hf_model, load_tokenizer
from .speculative.interfaces import CausalLM
from .speculative.params import DRAFT_NAMES, check_draft


@dataclass
class Loaded:
    """What a load produced: models, tokenizer, the drafter name ("model" when a draft model was
    loaded), and the placement `Engine.runtime` reports."""

    target: CausalLM
    tokenizer: object
    draft: str
    draft_model: CausalLM | None = None
    device: str = "cpu"
    dtype: str = "float32"
    layout: Choice | None = None  # the dtype self-test's choice (models/layouts.py), when it ran
    hardware: str = "device cpu"
    backend: str = "torch"  # what runs the target: "torch" or "llama.cpp"


BIT_EXACT, TOLERANCE = "bit-exact (self-tested)", "by tolerance"  # `identity` labels (also models/layouts.py)
UNTESTED_CUDA, NOT_SELF_TESTED = "untested device (CUDA)", "not self-tested"


def identity(device: str, dtype: str, layout: Choice | None, gguf_identity: str = "") -> dict:
    """What each promise rests on, in one of four labels (BIT_EXACT, TOLERANCE, UNTESTED_CUDA,
    NOT_SELF_TESTED), for `/v1/models` and every response's `speculative.identity`:
    `greedy`: speculative == plain decoding (a token's logits alone == inside a verification block);
    `reproducible`: the same request gives the same text alone, batched beside other prompts and after
    a prefix-cache hit (the same row's logits in each, bit for bit: layouts.identity_diffs)."""
    if str(device).startswith("cuda"):
        return {"greedy": UNTESTED_CUDA, "reproducible": UNTESTED_CUDA}
    if layout is not None:
        return {"greedy": BIT_EXACT if layout.exact else TOLERANCE,
                "reproducible": BIT_EXACT if layout.exact and layout.reproducible else TOLERANCE}
    if dtype == "gguf":  # llama.cpp: blocks vs steps (and rows vs alone, when batched) are self-tested;
        # a prompt's KV restored from the prefix cache and the rest prefilled is not
        return {"greedy": BIT_EXACT if gguf_identity.startswith("bit-exact") else TOLERANCE,
                "reproducible": NOT_SELF_TESTED}
    return {"greedy": NOT_SELF_TESTED, "reproducible": NOT_SELF_TESTED}


def runtime(device: str, dtype: str, layout: Choice | None, hardware: str, gguf_identity: str = "") -> dict:
    """Where and in which dtype the target computes, and on what greedy identity rests (the dtype
    self-test's verdict, in words: `greedy_identity`; in labels: `identity`, see `identity`): for
    `generate --json` stats, `serve`'s start-up log and `/v1/models`."""
    if str(device).startswith("cuda"):
        words = ("untested device (CUDA): the forward runs unchunked and cuBLAS is not row-invariant; greedy "
                 "identity is tested there (gpu-check), not guaranteed bit for bit")
    elif layout is not None:
        words = ("bit-exact (self-test)" if layout.exact else "by tolerance (no layout passed the self-test)")
        words += f"; {layout.identity_words()}"
    elif dtype == "gguf":
        words = f"llama.cpp: {gguf_identity}"
    else:
        words = "not self-tested (dtype given, or an adapter without the lean forward)"
    return {"device": device, "dtype": dtype, "greedy_identity": words, "hardware": hardware,
            "identity": identity(device, dtype, layout, gguf_identity)}


def adapter(module: torch.nn.Module, eos_token_ids: set[int] | None = None, fast: bool = True) -> CausalLM:
    """The encoder-decoder adapter for T5/BART-like modules; else the lean Llama-family forward when the
    architecture allows it, else the transformers one."""
    if getattr(module.config, "is_encoder_decoder", False):
        return Seq2SeqLM(module, eos_token_ids)
    if fast and fast_llama.supports(module):
        return fast_llama.FastLlamaLM(module, eos_token_ids)
    return HFCausalLM(module, eos_token_ids)


def load_models(target: str | None, draft: str, dtype, threads: int | None, fast: bool, backend: str,
                device: str, rows: int = 1, ctx_size: int | None = None) -> Loaded:
    """`engine.load`'s models (see its docstring): checked before the slow part, then loaded."""
    if ctx_size is not None and ctx_size < 2:
        raise ExactSpecError(f"--ctx-size must be >= 2 tokens, got {ctx_size}")
    if threads:
        torch.set_num_threads(threads)
    if backend not in BACKENDS:
        raise ExactSpecError(f"unknown backend {backend!r}: choose {', '.join(BACKENDS)}")
    path = target or embedded_model_path()
    if backend == "auto":
        backend, why = choose_backend(path, draft, dtype, device)
        if backend == "llama.cpp":
            try:
                loaded = load_llamacpp(path, draft, n_ctx=ctx_size, threads=threads, rows=rows)
            except ExactSpecError as e:  # not installed, its library does not load, a file it cannot run
                print(f"exactspec: backend torch: llama.cpp cannot run {os.path.basename(path)} here: {e}",
                      file=sys.stderr, flush=True)
            else:
                progress.status(f"backend llama.cpp ({why}; --backend torch for PyTorch)")
                return loaded
        elif why:
            progress.status(f"backend torch ({why})")
    elif backend == "llama.cpp":
        if str(device) not in ("auto", "cpu"):
            raise ExactSpecError(f"--device {device}: the llama.cpp backend runs on the CPU (use --backend torch)")
        return load_llamacpp(path, draft, n_ctx=ctx_size, threads=threads, rows=rows)
    check_draft(draft)
    seq2seq = is_encoder_decoder(path)
    if draft not in DRAFT_NAMES and is_encoder_decoder(draft) != seq2seq:
        kind = lambda enc: "an encoder-decoder (T5/BART-like)" if enc else "a decoder-only"  # noqa: E731
        raise ExactSpecError(f"draft {draft} is {kind(not seq2seq)} model but the target is {kind(seq2seq)} one: "
                             "use a draft of the same kind")
    where = resolve_device("cpu" if seq2seq and device == "auto" else device)  # before the slow load
    if seq2seq and where.type != "cpu":
        raise ExactSpecError(f"--device {device}: encoder-decoder targets run on the CPU only")
    return with_context(_load_torch(path, draft, dtype, fast, seq2seq, where), ctx_size)


def with_context(loaded: Loaded, ctx_size: int | None) -> Loaded:
    """A torch target's context cut to `ctx_size` tokens (its KV grows as used, so this only caps it); more
    than the model's own positions is refused, naming both."""
    if ctx_size is not None:
        own = loaded.target.max_length
        if ctx_size > own:
            raise ExactSpecError(f"--ctx-size {ctx_size} exceeds this model's {own} positions")
        for lm in (loaded.target, loaded.draft_model):
            if lm is not None:
                lm.max_length = min(lm.max_length, ctx_size)
    return loaded


BACKENDS = ("auto", "torch", "llama.cpp")


def choose_backend(path: str, draft: str, dtype, device: str) -> tuple[str, str]:
    """`--backend auto`: llama.cpp for a GGUF target on the CPU (its own kernels on the file's own weight
    types: several times faster than the torch path there), else torch — a Hugging Face directory, a GPU,
    a dtype asked for (a torch notion), a draft model that is no GGUF. Returns (backend, why). `load_models`
    falls back to torch, saying why in one line, when llama.cpp is missing or cannot load the file."""
    if not os.path.exists(path):
        return "torch", ""  # the torch path names what is missing
    if not str(path).endswith(".gguf"):
        return "torch", "the target is not a GGUF file"
    if dtype not in (None, "auto"):
        return "torch", f"dtype {dtype} asked for"
    if draft not in DRAFT_NAMES and not draft.endswith(".gguf"):
        return "torch", "the draft model is not a GGUF file"
    if resolve_device(device).type != "cpu":
        return "torch", "a GPU is visible"
    return "llama.cpp", "a GGUF target on the CPU"


def _load_torch(path: str, draft: str, dtype, fast: bool, seq2seq: bool, where: torch.device) -> Loaded:
    """The torch backend's load, its arguments checked: target, tokenizer, draft model, dtype choice."""
    choose = dtype in (None, "auto") and where.type == "cpu"  # the lean forward's layout by self-test
    wanted = resolve_dtype(dtype, where)  # CPU auto: float32 until (and unless) the self-test picks

    def load_module(model_path: str) -> torch.nn.Module:
        if seq2seq:
            return load_seq2seq_model(model_path, wanted)
        return load_hf_model(model_path, wanted, where, light=fast)  # light: the lean forward only reads weights

    if draft not in DRAFT_NAMES:  # before the slow loads: a draft of another vocabulary is refused at once
        declared = declared_vocab(path), declared_vocab(draft)
        if None not in declared:
            refuse_other_vocab(*declared, draft)
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
        if layout is not None and not layout.generated_kv:  # decode steps' KV is not a prefill's, bit for bit:
            target_lm.cache_generated_kv = False  # the prefix cache keeps prompts' KV (prefix_cache.remember)
    else:
        target_lm = adapter(module, _eos_ids(tokenizer), fast)
    draft_lm = None
    if draft not in DRAFT_NAMES:  # the draft model sits on the target's device, in the target's dtype
        draft_module = load_module(draft)
        draft_lm = adapter(draft_module.to(wanted) if fast and fast_llama.supports(draft_module) else draft_module,
                           target_lm.eos_token_ids, fast)
        check_same_vocab(target_lm, draft_lm, tokenizer, draft)
        draft = "model"
    computes = getattr(target_lm, "dtype", wanted)
    if os.path.isfile(path):  # a GGUF: auto γ's measured T(k) is cached per file and layout (autogamma/measure.py)
        target_lm.cost_key = f"torch|{file_identity(path)}|{where}|{computes}|{layout and layout.layout}"
    return Loaded(target_lm, tokenizer, draft, draft_lm, str(where), str(computes).removeprefix("torch."), layout,
                  describe(where, computes, layout))


def _eos_ids(tokenizer) -> set[int] | None:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else None


def declared_vocab(path: str) -> int | None:
    """The vocabulary size a checkpoint declares (config.json's `vocab_size`, a GGUF header's), read
    without loading it; None when it declares none."""
    try:
        if str(path).endswith(".gguf"):
            from .models.gguf import header_ints

            return header_ints(path, ("vocab_size",)).get("vocab_size")
        with open(os.path.join(path, "config.json")) as f:
            size = json.load(f).get("vocab_size")
        return size if isinstance(size, int) else None
    except (OSError, ValueError, AttributeError):
        return None


def refuse_other_vocab(target_size: int, draft_size: int, draft_path: str) -> None:
    if draft_size != target_size:
        raise ExactSpecError(f"draft vocabulary ({draft_size} tokens) differs from the target's ({target_size}): {draft_path}")


def check_same_vocab(target: CausalLM, draft: CausalLM, tokenizer, draft_path: str) -> None:
    """Refuse a draft model whose vocabulary differs from the target's: its tokens would mean other things."""
    refuse_other_vocab(target.vocab_size, draft.vocab_size, draft_path)
    try:
        draft_tokenizer = load_tokenizer(draft_path)
    except ExactSpecError:
        return  # a draft without its own tokenizer is taken to share the target's
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ExactSpecError(f"draft tokenizer differs from the target's: {draft_path}")


def load_llamacpp(path: str | None = None, draft: str = "prompt-lookup", n_ctx: int | None = None,
                  threads: int | None = None, repack: bool | None = None, **llama_kwargs) -> Loaded:
    """A GGUF target run by llama.cpp; the tokenizer is transformers' reading of the same GGUF (its ids
    are checked against llama.cpp's own tokenizer in the tests). `draft` is a drafter name or a path to
    a draft GGUF (also run by llama.cpp). `llama_kwargs` go to `LlamaCppLM` (rows, n_ubatch, flash_attn, ...). The
    target's cache type, one-token threads and n_ubatch come from the load-time self-test
    (models/llamacpp/numerics.py); a draft model runs with the same context settings."""
    from .models.llamacpp.adapter import load_llama_cpp  # lazy: a torch target never imports llama.cpp
    from .models.llamacpp.numerics import load_self_tested

    path = path or embedded_model_path()
    if draft not in DRAFT_NAMES and not draft.endswith(".gguf"):
        raise ExactSpecError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFT_NAMES)} or a .gguf path")
    target = load_self_tested(path, n_ctx=n_ctx, threads=threads, repack=repack, **llama_kwargs)
    tokenizer = load_tokenizer(path)
    target.turn_marker = generation_marker(tokenizer)  # assistant turns are prefilled as decoding wrote them
    draft_lm = None
    if draft not in DRAFT_NAMES:
        settings = {k: v for k, v in target.context_kwargs().items() if k not in ("n_ctx", "n_threads", "n_threads_batch")}
        # the draft model's cache holds one row: rows that draft with it decode alone (batching.py)
        draft_lm = load_llama_cpp(draft, n_ctx=target.max_length, threads=threads,
                                  eos_token_ids=target.eos_token_ids, repack=target.repack, **settings)
        check_same_vocab(target, draft_lm, tokenizer, draft)
        draft = "model"
    return Loaded(target, tokenizer, draft, draft_lm, "cpu", "gguf",
                  hardware=f"llama.cpp on the CPU ({cpu_label()}), the GGUF's own weight types", backend="llama.cpp")
