"""Command-line glue for scale-out: `serve --replicas N ...` (Ray Serve) and `batch IN.jsonl` (Ray Data or in-process)."""

from __future__ import annotations

import argparse
import sys

from ..cli_common import check_model_paths, prefix_cache_kwargs
from ..errors import ExactSpecError


def add_ray_serve_args(p: argparse.ArgumentParser) -> None:
    """`serve`'s Ray Serve options; without --replicas (or autoscaling bounds) `serve` is plain uvicorn."""
    g = p.add_argument_group("scale out on Ray Serve (needs: pip install 'exactspec[ray]')")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve through Ray Serve with N replicas, each its own engine (target + drafter)")
    _add_ray_args(g, "replica")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N", help="autoscale: fewest replicas")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N", help="autoscale: most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=None, metavar="R",
                   help="autoscale: requests per replica (queued or running) that Serve aims for")
    g.add_argument("--routing", choices=("affinity", "ray-prefix", "load"), default="affinity",
                   help="which replica serves a request: 'affinity' (default) the one that served the earlier "
                        "prompt this one extends (an agent session's previous step) unless its queue is full, "
                        "else the one with the fewest requests in flight; 'ray-prefix' Ray's "
                        "PrefixCacheAffinityRouter; 'load' Ray's default, queue length only")


def _add_ray_args(g, unit: str) -> None:
    g.add_argument(f"--cpus-per-{unit}", type=float, default=1.0, metavar="C",
                   help=f"CPUs Ray reserves for each {unit}; it runs C torch threads (default 1)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join a running cluster: 'auto' (this machine's `ray start --head`) or ray://HOST:10001; "
                        "default: start a private one-machine cluster")


def wants_ray_serve(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.replicas, args.min_replicas, args.max_replicas,
                                       args.target_ongoing_requests))


def load_kwargs(args: argparse.Namespace) -> dict:
    """`exactspec.load` keywords from the model options (what a replica or worker loads)."""
    import os

    target = os.path.abspath(args.target) if args.target else None  # workers start in other directories
    draft = os.path.abspath(args.draft) if os.path.exists(args.draft) else args.draft
    kwargs = dict(target=target, draft=draft, gamma=args.gamma, threads=args.threads, backend=args.backend)
    if getattr(args, "ctx_size", None):
        kwargs["ctx_size"] = args.ctx_size
    if getattr(args, "chat_template", None):  # absolute: workers start in other directories
        kwargs["template"] = os.path.abspath(args.chat_template) if os.path.isfile(args.chat_template) else args.chat_template
    if hasattr(args, "prefill_chunk"):  # serve's
        kwargs["prefill_chunk"] = args.prefill_chunk
    if hasattr(args, "store_mb"):  # every replica (and batch worker) keeps its own store
        kwargs["store_mb"] = args.store_mb
    if hasattr(args, "prefix_cache_mb"):  # every replica keeps its own prefix cache (sharing the disk folder)
        kwargs.update(prefix_cache_kwargs(args))
    rows = getattr(args, "max_rows", None) or getattr(args, "batch_size", None)
    if rows:  # a llama.cpp target's context holds the rows a replica (or batch worker) decodes together
        kwargs["rows"] = rows
    return kwargs


def serve_on_ray(args: argparse.Namespace, model_name: str) -> int:
    """`exactspec serve --replicas N`: deploy and serve until interrupted."""
    from ..server.auth import read_key
    from . import init_ray
    from .serve import Replicas, run

    if read_key(args.api_key, args.api_key_file) is not None:  # fail closed: never a key silently unenforced
        raise ExactSpecError("an API key is not enforced with --replicas yet: serve without --replicas, or put "
                             "the Ray Serve ingress behind a proxy that checks the key")

    count = args.replicas if args.replicas is not None else max(1, args.min_replicas or 1)
    replicas = Replicas(count, args.cpus_per_replica, args.min_replicas,
                        args.max_replicas, args.target_ongoing_requests, args.routing)
    for name in ("count", "cpus"):
        if getattr(replicas, name) <= 0:
            raise ExactSpecError(f"--{'replicas' if name == 'count' else 'cpus-per-replica'} must be > 0")
    if replicas.min_replicas is not None and not 0 <= replicas.min_replicas <= replicas.count:
        raise ExactSpecError("--min-replicas must be >= 0 and <= --replicas (the replicas it starts with)")
    if replicas.max_replicas is not None and replicas.max_replicas < max(replicas.count, replicas.min_replicas or 0):
        raise ExactSpecError("--max-replicas must be >= --replicas and --min-replicas")
    check_model_paths(args)
    init_ray(args.ray_address, max(replicas.count, replicas.max_replicas or 0) * replicas.cpus)
    print(f"exactspec: deploying {replicas.count} replica(s) on Ray Serve, {replicas.routing} routing", file=sys.stderr)
    run(load_kwargs(args), model_name, args.max_rows, replicas, args.host, args.port, blocking=True)
    return 0


def add_batch_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ..cli_common import add_model_args, add_prefix_cache_args

    p = subparsers.add_parser(
        "batch", help="generate for every line of a JSON-lines file (in-process or on Ray Data)",
        description="Each input line is a request with the server's fields: {\"id\", \"prompt\" (raw text) or "
                    "\"messages\" (chat), \"max_tokens\", \"temperature\", \"top_p\", \"top_k\", \"min_p\", "
                    "\"seed\", \"stop\", \"gamma\"} (defaults: the server's; temperature 1). Each output line, "
                    "in input order: {\"id\", \"text\", \"token_ids\", \"finish_reason\", \"stats\"}, or {\"id\", "
                    "\"error\"} for a bad line (reported with its line number; the others still run). Lines "
                    "with the same options decode together as one batch; each keeps its own seed.")
    p.add_argument("input", metavar="IN.jsonl", help="input file ('-': standard input)")
    p.add_argument("--output", "-o", required=True, metavar="OUT.jsonl", help="output file")
    p.add_argument("--batch-size", type=int, default=16, metavar="B", help="lines per batch (default 16)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="token budget for lines that set no max_tokens (default 256)")
    add_model_args(p)
    add_prefix_cache_args(p, "finished lines (prompt + answer): lines sharing a prefix (a system prompt, few-shot examples)")
    g = p.add_argument_group("scale out on Ray Data (needs: pip install 'exactspec[ray]')")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run on Ray Data with N engine workers (default: in this process, no Ray)")
    _add_ray_args(g, "worker")
    p.set_defaults(func=cmd_batch)
    return p


def cmd_batch(args: argparse.Namespace) -> int:
    from ..speculative.params import check_gamma
    from . import batch

    args.gamma = check_gamma(args.gamma)
    for flag, value in (("--batch-size", args.batch_size), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise ExactSpecError(f"{flag} must be >= 1, got {value}")
    if args.replicas is not None and args.replicas < 1:
        raise ExactSpecError(f"--replicas must be >= 1, got {args.replicas}")
    prefix_cache_kwargs(args)
    if args.cpus_per_worker <= 0:
        raise ExactSpecError(f"--cpus-per-worker must be > 0, got {args.cpus_per_worker}")
    lines = list(batch.read_lines(args.input))
    if args.replicas is None:
        from ..cli_common import load_engine

        engine = load_engine(args, **prefix_cache_kwargs(args), rows=args.batch_size)
        outputs = batch.run_local(engine, lines, args.batch_size, args.max_tokens)
    else:
        from . import init_ray

        check_model_paths(args)
        init_ray(args.ray_address, args.replicas * args.cpus_per_worker)
        outputs = batch.run_ray(load_kwargs(args), lines, args.batch_size, args.max_tokens, args.replicas,
                                args.cpus_per_worker)
    count, errors, seconds = batch.write(outputs, args.output, total=len(lines))
    print(f"exactspec: {count} lines ({errors} with errors) in {seconds:.1f} s, {count / max(seconds, 1e-9):.2f} "
          f"lines/s -> {args.output}", file=sys.stderr)
    return 0
