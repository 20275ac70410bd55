"""`exactspec bench`, `tune` and `theory`: the commands that measure (speed-ups side by side, costs and
acceptance, gamma) and the one that recomputes the paper's formulas. Heavy imports stay inside the
commands, so `theory` (and every other command's start) loads no torch."""

from __future__ import annotations

import argparse
import json
import sys

from .. import progress
from ..cli_common import add_backend_arg, add_model_args, add_verbose_arg, load_engine
from ..drafters import STORE_MB
from ..errors import ExactSpecError


def add_bench_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench` on the CLI's subparsers; its handler is `args.func`."""
    bench = subparsers.add_parser("bench", help="benchmark speculative vs plain decoding side by side",
                                  description="Run our plain decoding, our speculative decoding per drafter and gamma, "
                                              "and Hugging Face generate anchors in one process, interleaved; report "
                                              "tokens/s and speed-ups (medians of per-repetition ratios).")
    bench.add_argument("--target", metavar="PATH", help="target model (default: the embedded SmolLM2-135M-Instruct)")
    bench.add_argument("--draft-model", metavar="PATH", help="also bench a draft model (ours and HF assisted generation)")
    bench.add_argument("--workloads", default="grounded,chat",
                       help="comma list of grounded, chat, edit, json (extraction and tool-call prompts, each under its "
                            "JSON schema: constrained plain decoding is the baseline, plus unconstrained plain and "
                            "speculation on grammar-forced tokens alone, drafter none), agent (multi-turn tool-use "
                            "transcripts replayed step by step: per-step latency with and without the prefix cache; "
                            "--prompts = transcripts), agent-repeat (many sessions of the same task kinds, "
                            "interleaved, each method keeping its caches and store across sessions as a server "
                            "does; adds auto and suffix), selfconsistency (n = 8 samples of a reasoning prompt "
                            "at T = 0.7 as one batch: plain, auto, prompt lookup, suffix)")
    bench.add_argument("--prefix-cache-mb", type=float, default=1024, metavar="MIB",
                       help="prefix cache budget of the agent workloads' cached rows (default 1024)")
    bench.add_argument("--store-mb", type=float, default=STORE_MB, metavar="MIB",
                       help=f"store of earlier outputs for the suffix drafter (default {STORE_MB:g})")
    bench.add_argument("--temperatures", default="0,1", help="comma list (default 0,1)")
    bench.add_argument("--drafters", default="prompt-lookup,bigram", help="comma list of drafters")
    bench.add_argument("--gammas", default="2,4,6", help="comma list of fixed gammas (auto is added unless --no-auto; "
                       "with --batch: the first, or auto)")
    bench.add_argument("--no-auto", action="store_true", help="skip --gamma auto rows")
    bench.add_argument("--verification", default="token", metavar="RULE,...",
                       help="comma list of token, block: each speculative row once per verifier's rule, side by side "
                            "(rows get a verification field; tokens/call and tokens/s compare them). Block applies "
                            "to drafters with a real law (bigram, unigram, --draft-model, auto); prompt lookup and "
                            "suffix keep their token rows. The side-by-side rows only (default token)")
    bench.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate anchors")
    bench.add_argument("--prompts", type=int, default=3, help="prompts per workload (default 3)")
    bench.add_argument("--reps", type=int, default=2, help="repetitions (default 2)")
    bench.add_argument("--max-new-tokens", type=int, default=None,
                       help="tokens per run (default 96, --quick 48; json cases: their own budget, 384, unless given)")
    bench.add_argument("--quick", action="store_true", help="a small run that finishes in a few minutes")
    bench.add_argument("--json", action="store_true", help="print {rows, cost_model} as JSON instead of a table")
    bench.add_argument("--plot", metavar="FILE.png", help="plot measured and predicted speed-up vs gamma")
    bench.add_argument("--batch", metavar="B,...", help="instead: batched throughput for these batch sizes "
                       "(batched speculative vs batched plain vs B sequential runs), e.g. 1,4,8")
    bench.add_argument("--peer", metavar="LLAMA_SERVER", help="instead: the peer bench (bench/peer.py): this "
                       "llama-server binary and `exactspec serve` on the same GGUF and threads, one process per row "
                       "(llama-server plain, its own speculation, exactspec --gamma 0, exactspec's defaults), started "
                       "anew for each workload; the same requests through one client, --reps rounds alternating the "
                       "rows' order; the first (cold) round reported apart from the rest (warm: a replay), ratios "
                       "from the figures beside them, and whether each row's texts equal its own plain row's")
    bench.add_argument("--peer-workloads", default="agent,long-agent,edit,chat,join",
                       help="comma list of agent, long-agent (3 sessions interleaved behind a ~3.3k-token system "
                            "prompt of tool specs: step latency, TTFT), edit, chat, short (answers of a few tokens), concurrent (the chat prompts 8 "
                            "at a time), join (a long prompt arrives while a chat answer streams: the stream's worst "
                            "gap, the joiner's TTFT) (default %(default)s)")
    bench.add_argument("--peer-args", default="", metavar="ARGS", help="extra llama-server arguments for every row")
    bench.add_argument("--peer-cold-rounds", type=int, default=1, metavar="N",
                       help="cold rounds per row, each after a fresh start of every server (default 1; the warm "
                            "rounds follow the last start: --reps counts the last cold round and them)")
    bench.add_argument("--peer-spec", default=";".join(peer_spec_default()), metavar="FLAGS;...",
                       help="llama-server speculation rows, one per ';'-separated flag set (default: %(default)s; "
                            "'' = none; write --peer-spec='--spec-default' with '=')")
    bench.add_argument("--threads", type=int, default=None)
    add_backend_arg(bench)
    add_verbose_arg(bench)
    bench.set_defaults(func=cmd_bench)
    return bench


def add_tune_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `tune` on the CLI's subparsers; its handler is `args.func`."""
    tune = subparsers.add_parser("tune", help="measure costs and acceptance; recommend gamma",
                                 description="Measure T(k)/T(1) of the target, the drafter's cost c, and the "
                                             "acceptance rate on a workload; print the predicted speed-up per gamma "
                                             "and the best gamma (0 means: do not speculate).")
    add_model_args(tune)
    tune.add_argument("--workload", default="grounded", help="grounded, chat or edit (default grounded)")
    tune.add_argument("--temperature", type=float, default=0.0)
    tune.add_argument("--max-new-tokens", type=int, default=64)
    tune.add_argument("--json", action="store_true")
    tune.add_argument("--table", action="store_true",
                      help="the paper's Table 3 on your pair: alpha per drafter x temperature x workload, c, the "
                           "speed-up predicted (Theorem 3.8 and the measured T(k) model) and measured against plain "
                           "decoding at --gamma, and the best gamma under each model")
    tune.add_argument("--drafters", default=None, help="--table: comma list (default prompt-lookup,bigram, plus "
                                                       "the draft model when --draft is a path)")
    tune.add_argument("--temperatures", default="0,1", help="--table: comma list (default 0,1)")
    tune.add_argument("--workloads", default="grounded,chat", help="--table: comma list (default grounded,chat)")
    tune.add_argument("--prompts", type=int, default=2, help="--table: prompts per workload (default 2)")
    tune.add_argument("--lenience", default="1", metavar="L,...",
                      help="--table: also measure these LOSSY lenience values in (0, 1] (default 1 = exact only)")
    tune.add_argument("--dtype-test", action="store_true",
                      help="re-run the dtype self-test of `--dtype auto` on this CPU and model (bit-equality of "
                           "k-token blocks vs single tokens, T(1) and T(8) per layout), refresh its cache, and "
                           "print what it found")
    tune.add_argument("--remeasure", action="store_true",
                      help="measure again, now, what exactspec times once per machine and model and caches (the "
                           "llama.cpp self-test's ranking of settings, the dtype choice, auto gamma's T(k)), replace "
                           "the cached figures, and print them; a measurement taken while other processes were busy "
                           "stays provisional (measured again at a later quiet start)")
    tune.set_defaults(func=cmd_tune)
    return tune


def add_theory_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `theory` on the CLI's subparsers; its handler is `args.func`."""
    theory = subparsers.add_parser("theory", help="the paper's formulas: speed-up, arithmetic cost, optimal gamma",
                                   description="Leviathan et al. (2023): expected tokens per iteration, Theorem 3.8 "
                                               "walltime factor, Theorem 3.11 arithmetic factor, optimal gamma.")
    theory.add_argument("--alpha", type=float, help="acceptance rate in [0, 1]")
    theory.add_argument("--gamma", type=int, help="draft tokens per iteration (default: the optimal one)")
    theory.add_argument("--c", type=float, default=0.0, help="draft/target time per token (default 0)")
    theory.add_argument("--c-hat", type=float, default=0.0, help="draft/target arithmetic per token (default 0)")
    theory.add_argument("--table", action="store_true", help="print the paper's Table 1 recomputed")
    theory.set_defaults(func=cmd_theory)
    return theory


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..models.light_llama import hf_module
    from .runner import build_methods, methods_for, plot, run_bench, to_markdown
    from .workloads import CONSTRAINED, WORKLOADS, load_cases

    verifications = _verifications(args)
    if args.peer:
        return _bench_peer(args)
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS + SPECIAL:
            raise ExactSpecError(f"unknown workload {w!r}: choose from {', '.join(WORKLOADS + SPECIAL)}")
    special = [w for w in workloads if w in SPECIAL]
    workloads = [w for w in workloads if w not in SPECIAL]
    drafters = [d for d in args.drafters.split(",") if d]
    gammas = ["auto"] if args.batch and args.gammas == "auto" else [int(g) for g in _floats(args.gammas)]
    temperatures, prompts, reps, max_new = _floats(args.temperatures), args.prompts, args.reps, args.max_new_tokens
    default_max_new = 96
    if args.quick:
        gammas, prompts, reps, default_max_new, drafters = [4, 16], 1, 1, 48, drafters[:2]
    if args.draft_model:
        drafters.append("model")
    args.draft = args.draft_model or "prompt-lookup"
    args.gamma = 4
    engine = load_engine(args, rows=_rows(args, special))
    if args.batch:
        return _bench_batch(engine, args, [int(b) for b in _floats(args.batch)], workloads[0], temperatures[0],
                            drafters[0], gammas[0], max_new or default_max_new, reps)
    hf_draft = hf_module(engine.draft_model.module) if engine.draft_model is not None and engine.backend == "torch" else None
    if args.draft_model:
        engine.draft = "model"
    methods = build_methods(engine, drafters, gammas, not args.no_auto, not args.no_hf, hf_draft, engine.backend,
                            constrained=any(w in CONSTRAINED for w in workloads), verifications=verifications)
    total = sum(len(methods_for(methods, w in CONSTRAINED)) * min(prompts, len(load_cases(w))) for w in workloads) \
        * len(temperatures) * reps
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=args.json and not sys.stderr.isatty()) as bar:
        rows = run_bench(engine, methods, workloads, temperatures, prompts, reps, max_new, bar,
                         default_max_new) if workloads else []
    special_rows = _bench_special(engine, args, special, drafters, gammas, temperatures, prompts, reps)
    rows += special_rows
    cost = engine.cost_model("none")
    report = {"hardware": engine.hardware, "rows": rows, "cost_model": {
        "target_s": cost.target_s, "target_ratios": cost.ratios(), "ceiling": _ceiling(cost), "depths": cost.depths(),
        "draft_s_per_token": {d: engine.cost_model(d).draft_s_per_token for d in drafters}}}
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        if workloads:
            print(to_markdown([r for r in rows if r["workload"] not in SPECIAL]))
        _print_special(special_rows)
        print(f"\n{engine.hardware}")
        print("T(k)/T(1): " + ", ".join(f"{k + 1}: {r:.2f}" for k, r in enumerate(cost.ratios())))
        print("ceiling (every draft accepted, (γ+1) / (T(γ+1)/T(1))): "
              + ", ".join(f"γ={g}: {c:.2f}×" for g, c in _ceiling(cost).items()))
    return 0


def _verifications(args: argparse.Namespace) -> tuple[str, ...]:
    """--verification's rules, checked before the model loads: token and/or block, for the side-by-side rows."""
    from ..speculative.params import VERIFICATIONS

    rules = tuple(dict.fromkeys(v.strip() for v in args.verification.split(",") if v.strip()))
    if not rules or any(v not in VERIFICATIONS for v in rules):
        raise ExactSpecError(f"--verification {args.verification!r}: a comma list of {', '.join(VERIFICATIONS)}")
    if rules != ("token",) and (args.batch or args.peer):
        raise ExactSpecError("--verification compares the side-by-side rows: not with --batch or --peer")
    return rules


def peer_spec_default() -> tuple[str, ...]:
    from .peer import SPEC

    return SPEC


def _bench_peer(args: argparse.Namespace) -> int:
    """`bench --peer PATH`: the peer bench's table (or JSON rows), the CPU and the environment named."""
    import os
    import shlex
    import tempfile

    from ..device import cpu_label
    from ..embedded import embedded_model_path
    from ..models.llamacpp.runtime import default_threads, resolve_repack
    from .peer import WORKLOADS, environment, peer_table, repack_crashes, run_peer_bench, servers

    if not (os.path.isfile(args.peer) and os.access(args.peer, os.X_OK)):
        raise ExactSpecError(f"--peer {args.peer}: not an executable llama-server binary")
    if args.peer_cold_rounds < 1 or args.reps < 1:
        raise ExactSpecError(f"--peer-cold-rounds and --reps must be >= 1, got {args.peer_cold_rounds} and {args.reps}")
    workloads = [w for w in args.peer_workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            raise ExactSpecError(f"unknown peer workload {w!r}: choose from {', '.join(WORKLOADS)}")
    gguf = os.path.abspath(args.target) if args.target else embedded_model_path()
    threads = args.threads or default_threads()
    spec = tuple(f.strip() for f in args.peer_spec.split(";") if f.strip())
    say = lambda text: print(f"exactspec: peer bench: {text}", file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="exactspec-peer-") as logs:
        no_repack = not resolve_repack(gguf) or repack_crashes(args.peer, gguf, threads, logs)
        say(f"{cpu_label()}, {threads} threads, {environment()}{'; llama-server --no-repack' if no_repack else ''}")
        rows = run_peer_bench(servers(args.peer, gguf, threads, spec, shlex.split(args.peer_args), no_repack=no_repack),
                              workloads, args.reps, log_dir=logs, say=say, cold=args.peer_cold_rounds)
    report = {"hardware": f"{cpu_label()}, {threads} threads", "environment": environment(),
              "llama_server_no_repack": no_repack, "rows": rows}
    repack = ("; llama-server --no-repack (its repacked AMX kernels die here, or our probe turned repacking off)"
              if no_repack else "")
    print(json.dumps(report) if args.json else
          f"{peer_table(rows)}\n\n{report['hardware']}; {report['environment']}{repack}")
    return 0


def _rows(args: argparse.Namespace, special: list[str]) -> int:
    """Rows a llama.cpp target's context holds for this bench: the largest --batch, or the n samples of
    selfconsistency; else one (the single-row workloads)."""
    if args.batch:
        return max(int(b) for b in _floats(args.batch))
    if "selfconsistency" in special:
        from .selfconsistency import load_selfconsistency

        return int(load_selfconsistency()["n"])
    return 1


def _ceiling(cost) -> dict[int, float]:
    """The most speculation can give on this hardware at some γ: every draft accepted."""
    return {g: cost.ceiling(g) for g in (1, 2, 4, 8, 16, 32) if g <= cost.max_gamma}


SPECIAL = ("agent", "agent-repeat", "selfconsistency")  # workloads with their own runners and tables


def _bench_special(engine, args, special, drafters, gammas, temperatures, prompts, reps) -> list[dict]:
    """The rows of the agent workloads (bench/agent.py; per temperature) and selfconsistency (its own T)."""
    rows = []
    for name in special:
        if name == "selfconsistency":
            from tqdm import tqdm

            from .budget import QUICK_SECONDS
            from .selfconsistency import METHODS, run_selfconsistency_bench

            with tqdm(total=len(METHODS) * prompts * reps, desc=name, unit="batch", file=sys.stderr,
                      disable=args.json and not sys.stderr.isatty()) as bar:
                rows += run_selfconsistency_bench(engine, prompts, reps, args.max_new_tokens, args.store_mb, bar,
                                                  QUICK_SECONDS if args.quick else None)
        else:
            rows += _bench_agent(engine, args, name, drafters, gammas, temperatures, prompts, reps)
    return rows


def _print_special(rows: list[dict]) -> None:
    from .agent import agent_table
    from .selfconsistency import selfconsistency_table

    for name in SPECIAL:
        chosen = [r for r in rows if r["workload"] == name]
        if chosen and name == "selfconsistency":
            print(f"\nselfconsistency: n = {chosen[0]['n']} samples per prompt at T = {chosen[0]['temperature']:g}, one batch:")
            print(selfconsistency_table(chosen))
        elif chosen:
            print(f"\n{name} workload, per step (prefill of the history + the answer):")
            print(agent_table(chosen))


def _bench_agent(engine, args, name, drafters, gammas, temperatures, transcripts, reps) -> list[dict]:
    """An agent workload's rows (see bench/agent.py), one set per temperature. agent-repeat adds auto
    and suffix (the store's drafter) to the first of --drafters."""
    from tqdm import tqdm

    from ..embedded import embedded_model_path
    from .agent import build_agent_methods, load_agent_repeat, load_agent_workload, run_agent_bench
    from .budget import QUICK_SECONDS

    if args.prefix_cache_mb <= 0:
        raise ExactSpecError(f"--prefix-cache-mb must be > 0 for the agent workload, got {args.prefix_cache_mb}")
    steps = 3 if args.quick else None
    gguf = args.target or embedded_model_path()
    chosen = drafters[:1] + (["auto", "suffix"] if name == "agent-repeat" else [])
    methods = build_agent_methods(engine, list(dict.fromkeys(chosen)), gammas + ([] if args.no_auto else ["auto"]),
                                  args.prefix_cache_mb, not args.no_hf, gguf if gguf.endswith(".gguf") else None,
                                  args.threads, args.store_mb)
    sessions = (load_agent_repeat() if name == "agent-repeat" else load_agent_workload())["transcripts"]
    n_transcripts = len(sessions) if name == "agent-repeat" else min(transcripts, len(sessions))
    rows = []
    with tqdm(total=len(methods) * n_transcripts * reps * len(temperatures), desc=name, unit="replay",
              file=sys.stderr, disable=args.json and not sys.stderr.isatty()) as bar:
        for temperature in temperatures:
            rows += run_agent_bench(engine, methods, temperature, n_transcripts, steps, reps, progress=bar, name=name,
                                    budget_s=QUICK_SECONDS if args.quick else None)
    return rows


def _bench_batch(engine, args, batches, workload, temperature, drafter, gamma, max_new, reps) -> int:
    from tqdm import tqdm

    from .runner import batch_table, run_batch_bench

    with tqdm(desc="batch", unit="run", file=sys.stderr, disable=args.json and not sys.stderr.isatty()) as bar:
        rows = run_batch_bench(engine, batches, workload, temperature, drafter, gamma, max_new, reps, bar)
    print(json.dumps({"batch_rows": rows}) if args.json else batch_table(rows))
    return 0


def _check_free_text(workloads: list[str]) -> None:
    """tune measures drafters on free text; a constrained workload's schemas are bench's to run."""
    from .workloads import CONSTRAINED

    for w in workloads:
        if w in CONSTRAINED:
            raise ExactSpecError(f"tune measures free-text workloads; {w!r} runs under its schemas in "
                                 f"`exactspec bench --workloads {w}`")


def _dtype_test(args: argparse.Namespace) -> int:
    """`tune --dtype-test`: the layout self-test of `dtype auto`, re-run, cached and printed."""
    from dataclasses import asdict

    from ..embedded import embedded_model_path
    from ..models.fast_llama import FastLlamaLM
    from ..models.layouts import choose_layout

    if args.backend == "llama.cpp" or args.device not in ("auto", "cpu"):
        raise ExactSpecError("--dtype-test tests the torch backend on the CPU")
    args.dtype = "float32"  # the trials cast from the checkpoint's full-precision weights
    engine = load_engine(args)
    if not isinstance(engine.target, FastLlamaLM):
        raise ExactSpecError("--dtype-test: this target does not run on the lean Llama forward; auto keeps float32")
    choice = choose_layout(engine.target.module, args.target or embedded_model_path(), refresh=True)
    if args.json:
        print(json.dumps(asdict(choice)))
        return 0
    print(engine.hardware.split(", dtype")[0])
    print("layout              bit-equal  max |diff|  T(1) ms  T(8) ms")
    for t in choice.trials:
        ms = lambda v: f"{v:7.1f}" if v is not None else "      –"  # noqa: E731
        verdict = {True: "yes", False: "no", None: "untested"}[t.bit_equal]  # untested: slower than a qualifier
        diff = f"{t.max_diff:10.3g}" if t.bit_equal is not None else "         –"
        print(f"{t.layout:18s}  {verdict:9s}  {diff}  {ms(t.t1_ms)}  {ms(t.t8_ms)}")
    print(f"dtype auto picks {choice.describe()}")
    return 0


def _remeasure(args: argparse.Namespace) -> int:
    """`tune --remeasure`: every timed cache entry of this model measured again and printed."""
    import torch

    from ..cachedir import remeasure
    from ..quiet import busy_now

    remeasure("llamacpp-numerics", "layouts", "target-costs")
    engine = load_engine(args)
    with progress.timed("measure T(k)"):
        cost = engine.cost_model()
    before = busy_now(torch.get_num_threads())
    report = {**engine.runtime(), "target_ms": {depth: [round(1e3 * t, 3) for t in curve[:8]]
                                                for depth, curve in cost.depths().items()},
              "machine_now": before.describe()}
    if args.json:
        print(json.dumps(report))
        return 0
    print(engine.hardware)
    print(f"greedy identity: {report['greedy_identity']}")
    for depth, ms in report["target_ms"].items():
        print(f"T(1..8) at depth {depth}: " + " ".join(f"{t:.2f}" for t in ms) + " ms")
    print(f"now: {before.describe()}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..speculative.params import SamplingParams
    from ..stats import Stats
    from .workloads import load_workload

    _check_free_text(args.workloads.split(",") if args.table else [args.workload])
    if args.remeasure:
        return _remeasure(args)
    if args.dtype_test:
        return _dtype_test(args)
    if args.table:
        return _tune_table(args)
    params = SamplingParams(temperature=args.temperature)
    engine = load_engine(args)
    if engine.draft == "none":
        raise ExactSpecError("tune needs a drafter: pass --draft")
    with progress.timed("measure T(k)"):
        cost = engine.cost_model()
    stats = Stats()
    prompts = load_workload(args.workload)
    for i, prompt in enumerate(tqdm(prompts, desc="tune", unit="prompt", file=sys.stderr, disable=not sys.stderr.isatty())):
        for _ in engine.stream_ids(engine.encode(prompt), params, args.max_new_tokens, max(cost.max_gamma // 2, 1), i, stats):
            pass
    alpha = stats.alpha or 0.0
    best = cost.best_gamma(alpha)
    table = [{"gamma": g, "target_ratio": cost.ratios()[g], "predicted_speedup": cost.predicted_speedup(alpha, g),
              "ceiling": cost.ceiling(g)} for g in range(cost.max_gamma + 1)]
    report = {"alpha": alpha, "c": cost.draft_s_per_token / cost.target_s[0], "t1_s": cost.target_s[0],
              "per_gamma": table, "recommended_gamma": best, "draft": engine.draft, "workload": args.workload,
              "hardware": engine.hardware}
    if args.json:
        print(json.dumps(report))
        return 0
    print(engine.hardware)
    print(f"drafter {engine.draft} on '{args.workload}' at T={args.temperature:g}: alpha = {alpha:.3f}, "
          f"c = {report['c']:.4f}, T(1) = {1000 * cost.target_s[0]:.1f} ms")
    print("gamma  T(gamma+1)/T(1)  predicted speed-up  ceiling (all accepted)")
    for row in table:
        print(f"{row['gamma']:5d}  {row['target_ratio']:15.2f}  {row['predicted_speedup']:18.2f}  {row['ceiling']:21.2f}")
    print(f"recommended gamma: {best}" + ("  (do not speculate: verification costs more than it saves)" if best == 0 else ""))
    return 0


def _tune_table(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..speculative.params import SamplingParams
    from .table import measure_table, to_markdown
    from .workloads import WORKLOADS

    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            raise ExactSpecError(f"unknown workload {w!r}: choose from {', '.join(WORKLOADS)}")
    if not str(args.gamma).isdigit() or int(args.gamma) < 1:
        raise ExactSpecError(f"tune --table measures at a fixed --gamma >= 1, got {args.gamma!r}")
    gamma, temperatures = int(args.gamma), _floats(args.temperatures)
    leniences = _floats(args.lenience)
    for lenience in leniences:
        SamplingParams(lenience=lenience)  # validate before the slow model load
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise ExactSpecError("--prompts and --max-new-tokens must be >= 1")
    engine = load_engine(args)
    drafters = [d for d in (args.drafters or "prompt-lookup,bigram").split(",") if d]
    if engine.draft == "model" and args.drafters is None:
        drafters.append("model")
    for d in drafters:
        engine.make_drafter(d)  # refuse unknown names before measuring
    engine.cost_model(drafters[0], max_gamma=max(8, gamma))
    total = len(drafters) * len(temperatures) * len(workloads) * args.prompts * len(leniences)
    with tqdm(total=total, desc="tune", unit="run", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        rows = measure_table(engine, drafters, temperatures, workloads, gamma, args.prompts, args.max_new_tokens, bar,
                             leniences)
    ratios = engine.cost_model(drafters[0]).ratios()
    if args.json:
        print(json.dumps({"rows": [r.to_dict() for r in rows], "target_ratios": ratios,
                          "t1_s": engine.cost_model(drafters[0]).target_s[0]}))
    else:
        print(to_markdown(rows, ratios))
    return 0


def cmd_theory(args: argparse.Namespace) -> int:
    from ..speculative import theory

    if args.table:
        print("alpha  gamma  arithmetic ops  walltime")
        for alpha, gamma, _, _ in theory.PAPER_TABLE_1:
            print(f"{alpha:5.1f}  {gamma:5d}  {theory.arithmetic_factor(alpha, gamma):13.2f}x  "
                  f"{theory.walltime_factor(alpha, gamma):7.2f}x")
        return 0
    if args.alpha is None:
        raise ExactSpecError("theory needs --alpha (or --table)")
    gamma = theory.optimal_gamma(args.alpha, args.c) if args.gamma is None else args.gamma
    print(f"alpha={args.alpha:g} gamma={gamma} c={args.c:g} c_hat={args.c_hat:g}")
    print(f"expected tokens per iteration: {theory.expected_tokens(args.alpha, gamma):.3f}")
    print(f"walltime speed-up (Thm 3.8):   {theory.walltime_factor(args.alpha, gamma, args.c):.2f}x")
    print(f"arithmetic factor (Thm 3.11):  {theory.arithmetic_factor(args.alpha, gamma, args.c_hat):.2f}x")
    print(f"optimal gamma for this c:      {theory.optimal_gamma(args.alpha, args.c)}")
    return 0

