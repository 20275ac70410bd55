"""Command line: thin subcommands over the Python API. Every user error is one line and exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import TYPE_CHECKING

from . import progress
from ._version import __version__
from .bench.cli import add_bench_subcommand, add_theory_subcommand, add_tune_subcommand
from .cli_common import add_model_args, load_engine
from .errors import ExactSpecError
from .scale.cli import add_batch_subcommand, add_ray_serve_args, serve_on_ray, wants_ray_serve
from .server import cli as server_cli
from .server.launch import add_launch_subcommand, split_passed

if TYPE_CHECKING:
    from .engine import Engine


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (applied identically to target and draft distributions)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else sample at this temperature")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0 = off)")
    g.add_argument("--lenience", type=float, default=1.0, metavar="L",
                   help="LOSSY, off by default: accept drafts more leniently (paper appendix A.5): L in (0, 1], "
                        "1 = exact (default); smaller accepts more drafts but the output is no longer the target's")
    g.add_argument("--verification", choices=["token", "block"], default="token",
                   help="how sampled drafts with a real law (draft model, bigram, unigram) are verified: token by "
                        "token (default) or the block jointly (Sun et al. 2025: exact too, never fewer accepted "
                        "drafts in expectation); point-mass drafters keep the token rule")
    g.add_argument("--seed", type=int, default=None, help="random seed (same seed, same output)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="generation budget per sample (default 128)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")


def _add_constraint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (the grammar masks target and draft laws alike; forced tokens are "
                             "free drafts)").add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="output valid JSON for this JSON schema file")
    g.add_argument("--json-object", action="store_true", help="output one JSON object (any keys)")
    g.add_argument("--regex", metavar="RE", help="output text matching this regular expression")
    g.add_argument("--grammar", metavar="FILE.lark", help="output text in this Lark grammar (llguidance dialect)")


def constraint_from_args(args: argparse.Namespace) -> dict | None:
    """The --json-schema / --json-object / --regex / --grammar choice as a constraint spec, checked."""
    def read(path: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ExactSpecError(f"cannot read {path}: {e.strerror}") from None

    spec = None
    if args.json_schema:
        try:
            schema = json.loads(read(args.json_schema))
        except json.JSONDecodeError as e:
            raise ExactSpecError(f"{args.json_schema} is not JSON: {e}") from None
        spec = {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    elif args.json_object:
        spec = {"type": "json_object"}
    elif args.regex is not None:
        spec = {"type": "regex", "regex": args.regex}
    elif args.grammar:
        spec = {"type": "grammar", "grammar": read(args.grammar)}
    if spec is not None:
        from .speculative.grammar import grammar_from_spec

        grammar_from_spec(spec)  # refuse a bad one before the slow model load
    return spec


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand, each registered by the room it belongs to (server/, scale/, bench/) with its
    options and handler (`args.func`); `generate` and `serve`'s choice of uvicorn or Ray Serve live here."""
    parser = argparse.ArgumentParser(
        prog="exactspec",
        description="Exact speculative decoding: the target model's outputs, fewer target forward passes.",
    )
    parser.add_argument("--version", action="version", version=f"exactspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_subcommand(sub)
    serve = server_cli.add_serve_subcommand(sub)
    add_ray_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    add_batch_subcommand(sub)
    add_bench_subcommand(sub)
    add_tune_subcommand(sub)
    add_theory_subcommand(sub)
    add_launch_subcommand(sub)
    return parser


def add_generate_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    gen = subparsers.add_parser("generate", help="generate text from a prompt",
                                description="Generate from PROMPT with speculative decoding. Greedy output is "
                                            "identical to plain decoding; sampled output has exactly the target's "
                                            "distribution.")
    gen.add_argument("prompt", nargs="?", help="the prompt text ('-' reads standard input)")
    gen.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this file instead")
    add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--num-samples", type=int, default=1, help="independent samples of the prompt (default 1)")
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    gen.add_argument("--compare", action="store_true",
                     help="also run plain decoding of the same target and report speed-up and identity")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_constraint_args(gen)
    gen.set_defaults(func=cmd_generate)
    return gen


def cmd_serve(args: argparse.Namespace) -> int:
    """`serve`: on Ray Serve when its options ask for replicas (scale/), else in this process (server/)."""
    if not wants_ray_serve(args):
        return server_cli.cmd_serve(args)
    server_cli.check_serve_args(args)
    return serve_on_ray(args, server_cli.model_name(args))


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the argument, standard input ('-') or --prompt-file; refuses an empty one, and
    says so when a prompt that looks like a file name is about to be used as text."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise ExactSpecError("give a prompt, '-' for standard input, or --prompt-file PATH (one of them)")
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt, source = f.read(), args.prompt_file
        except OSError as e:
            raise ExactSpecError(f"cannot read {args.prompt_file}: {e.strerror}") from None
    elif args.prompt == "-":
        prompt, source = sys.stdin.read(), "standard input"
    else:
        prompt, source = args.prompt, "the prompt argument"
        if os.path.isfile(prompt):
            print(f"exactspec: note: using the text {prompt!r} as the prompt; to use that file's contents, "
                  f"pass --prompt-file {prompt}", file=sys.stderr)
    if not prompt.strip():
        raise ExactSpecError(f"the prompt is empty ({source})")
    return prompt


def cmd_generate(args: argparse.Namespace) -> int:
    from .speculative.params import SamplingParams, check_gamma

    prompt = read_prompt(args)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    lenience=args.lenience, verification=args.verification)
    SamplingParams(**sampling)  # validate before the slow model load
    constraint = constraint_from_args(args)
    if constraint is not None:
        sampling["grammar"] = constraint
    if args.num_samples < 1:
        raise ExactSpecError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise ExactSpecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    args.gamma = check_gamma(args.gamma)
    if args.no_chat_template and args.chat_template:
        raise ExactSpecError("--no-chat-template and --chat-template contradict each other: pass one")
    engine = load_engine(args, chat_template=not args.no_chat_template)
    common = dict(max_new_tokens=args.max_new_tokens, stop=args.stop, **sampling)

    def run(gamma: int | str):  # all samples decoded together, one batch
        return engine.generate_batch(prompt, n=args.num_samples, seed=args.seed, gamma=gamma, **common)

    if args.compare:
        with progress.timed("warm-up"):
            warm_up_compare(engine, prompt, constraint)
    if not args.json and not args.compare and args.num_samples == 1:
        for piece in engine.stream(prompt, seed=args.seed, **common):
            print(piece, end="", flush=True)
        print()
        return 0
    results, stats = run(engine.gamma)
    out = {
        "prompt_token_ids": results[0].prompt_token_ids,
        "samples": [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason} for r in results],
        "stats": {**stats.to_dict(), **engine.runtime()},
    }
    if not args.json:  # the speculative result now, the plain run's comparison when it is done
        _print_samples(results, stats, constraint)
    if args.compare:
        progress.status("decoding the same prompt plainly (gamma 0) to compare ...")
        out["compare"] = compare(run, engine.gamma, results, stats, args.temperature == 0)
    if args.json:
        print(json.dumps(out))
        return 0
    if args.compare:
        c = out["compare"]
        spread = f" (rounds {min(c['round_speedups']):.2f}-{max(c['round_speedups']):.2f}x)"
        print(f"[plain decoding: {c['plain_tokens_per_s']:.1f} tok/s; speed-up {c['speedup']:.2f}x, median of "
              f"{c['rounds']} alternated rounds{spread}; outputs identical: {c['identical']}]", file=sys.stderr)
    return 0


def warm_up_compare(engine: Engine, prompt: str, grammar: object | None) -> list[int | str]:
    """`--compare`'s warm-up: auto γ's T(k), then four tokens with each side's γ, so that neither side's
    timed runs pay first-call costs (allocator, kernels, a policy's first pricing) -> the γs run."""
    # auto γ's T(k) (read or measured at load for a cached target): once, outside the timings, and before
    # this thread decodes (a measurement in a thread of its own beside this thread's OpenMP team ran
    # throttled: docs/benchmarks.md, "The same trap, from loading")
    if engine.prices_drafts and not engine.drafts.target_measured:
        progress.status("gamma auto: measuring the target's T(k) (a few seconds) ...")
        engine.cost_model()
    gammas = list(dict.fromkeys((0, engine.gamma)))
    for gamma in gammas:
        engine.generate(prompt, max_new_tokens=4, gamma=gamma, temperature=0, grammar=grammar)
    return gammas


COMPARE_ROUNDS = (3, 45)  # runs of each side in --compare, alternated (A B B A A B ...): each side warmed alike
COMPARE_S = 2.0  # ... as many as fit in about this many seconds of decoding (a short answer's run is noise)


def compare(run, gamma, results, stats, greedy: bool) -> dict:
    """`--compare`: the speculative run already made (`results`, `stats`), then plain and speculative
    runs alternated, A B B A A B ..., 3 to 45 of each (as many as fit in COMPARE_S seconds); the
    speed-up is the median of the rounds' ratios (a short answer's one run is at the mercy of a
    millisecond). `identical`: every plain and speculative output equal (greedy: must be)."""
    spec, plain, outputs = [stats], [], [[r.token_ids for r in results]]
    low, high = COMPARE_ROUNDS
    rounds = max(low, min(high, int(COMPARE_S / max(2 * stats.decode_s, 1e-3))))
    for i in range(2 * rounds - 1):
        is_plain = i % 4 in (0, 1)  # after the first A: B B A A B
        got, got_stats = run(0 if is_plain else gamma)
        (plain if is_plain else spec).append(got_stats)
        outputs.append([r.token_ids for r in got])
    ratios = [(s.tokens_per_s or 0) / (p.tokens_per_s or float("inf")) for s, p in zip(spec, plain)]

    median = statistics.median
    return {"identical": all(o == outputs[0] for o in outputs), "speedup": median(ratios), "rounds": len(ratios),
            "round_speedups": ratios,
            "spec_tokens_per_s": median([s.tokens_per_s or 0 for s in spec]),
            "plain_tokens_per_s": median([p.tokens_per_s or 0 for p in plain]),
            "spec_decode_s": median([s.decode_s for s in spec]), "plain_decode_s": median([p.decode_s for p in plain]),
            "greedy": greedy}


def _print_samples(results, stats, constraint) -> None:
    """The samples on stdout, their stats on stderr."""
    for i, r in enumerate(results):
        if len(results) > 1:
            print(f"--- sample {i + 1}")
        print(r.text, flush=True)
    rate = stats.acceptance_rate
    print(f"\n[{stats.emitted} tokens, {stats.tokens_per_s or 0:.1f} tok/s, {stats.target_calls} target calls, "
          f"{stats.tokens_per_target_call or 0:.2f} tokens/call, acceptance "
          f"{'n/a' if rate is None else f'{rate:.2f}'}"
          f"{'' if stats.exact else f', LOSSY: lenience {stats.lenience:g}'}"
          f"{f', {stats.forced} grammar-forced drafts' if constraint is not None else ''}]", file=sys.stderr,
          flush=True)



def _quiet_transformers() -> None:
    """Keep stderr for our own messages: no library warnings, and progress bars only on a terminal.
    Through the environment while transformers is not imported (most commands never import it)."""
    if "transformers" not in sys.modules:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        if not sys.stderr.isatty():
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv, passed = split_passed(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if passed is not None:
        args.cli_args = passed
    _quiet_transformers()
    progress.enable()
    try:
        return args.func(args)
    except (ExactSpecError, ValueError) as e:
        print(f"exactspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
