"""A/B of the server path between two commits, interleaved in ONE run: `exactspec serve` of OLD against
`exactspec serve` of NEW, on the peer bench's workloads and client (bench/peer.py), each start cold.

Each commit is checked out into a worktree and served with PYTHONPATH = that worktree's src, plus its OWN
patched llama.cpp engine (the wheel its own scripts/build_llama_cpp.py builds, cached, installed into a
folder beside the worktree), so a regression in the engine's patches shows as well as one in Python.
`--engine new` (or `old`) gives both rows NEW's (OLD's) engine instead: what is left is Python alone; and
`OLD` = `NEW` with `--engine own` is not an A/B at all, so compare engines with two commits whose Python is
the same (a patch's commit and its parent).

A start is cold: a fresh process and an empty prefix-cache folder (EXACTSPEC_PREFIX_CACHE_DIR; commits
without a disk cache ignore it). Each start runs one round of each workload; the rows' order alternates
start by start (A B C, C B A, ...) so the machine's drift falls on both. A second row on OLD (old') gives the
noise band: old'/old is what a ratio looks like when nothing changed. At `--gamma 0` (greedy) every row's
texts must be identical, and the table says where they are not.

    .venv/bin/python scripts/bench_server_ab.py OLD NEW [--workloads agent,edit,chat] [--starts 3]
        [--gamma 0] [--engine own|new] [--threads 2] [--target GGUF] [--no-control] [--json FILE]

Per workload: tokens/s of each row (tokens and seconds summed over the starts), NEW/OLD and old'/OLD, the
per-start spread of NEW/OLD. The OpenMP environment both inherit is printed (compare under one only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from exactspec.bench.peer import Round, Server, environment, run_workload, start, stop
from exactspec.embedded import embedded_model_path

MAKE_CMAKE_ARGS = ("-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF "
                   "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF")


def checkout(repo: str, commit: str, where: str) -> str:
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "-q", where, commit], check=True)
    return where


def engine_folder(tree: str, into: str) -> str:
    """`tree`'s own patched llama.cpp wheel (built by its own script, cached by its patch label), installed
    into `into`: a folder to put on PYTHONPATH ahead of the venv's engine."""
    cmake = f"{MAKE_CMAKE_ARGS} -DCMAKE_PROJECT_llama.cpp_INCLUDE={tree}/scripts/llama_cpp_lib_only.cmake"
    env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src"), "CMAKE_ARGS": cmake,
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    wheel = subprocess.run([sys.executable, os.path.join(tree, "scripts", "build_llama_cpp.py")], env=env,
                           check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", into, wheel], check=True)
    return into


def server(name: str, tree: str, engine: str | None, args: argparse.Namespace) -> Server:
    path = os.path.join(tree, "src") + (os.pathsep + engine if engine else "")
    argv = ["env", f"PYTHONPATH={path}", sys.executable, "-m", "exactspec.cli", "serve", "--target", args.target,
            "--threads", str(args.threads), "--ctx-size", "8192", "--gamma", args.gamma]
    return Server(name, argv, "old")


def run(rows: list[Server], workloads: list[str], starts: int, scratch: str) -> dict[str, dict[str, list[Round]]]:
    """Per workload and row: one round per start, every start cold, the rows' order alternating."""
    results = {w: {s.name: [] for s in rows} for w in workloads}
    for k in range(starts):
        for s in (rows if k % 2 == 0 else rows[::-1]):
            for workload in workloads:
                os.environ["EXACTSPEC_PREFIX_CACHE_DIR"] = tempfile.mkdtemp(dir=scratch, prefix="prefix-")
                start(s, workload, scratch, empty_disk=False)  # the variable: commits before the flag ignore it
                try:
                    done = run_workload(s.url, workload, {})
                finally:
                    stop(s)
                results[workload][s.name].append(done)
                print(f"start {k + 1}: {workload}: {s.name}: {done.seconds:.2f} s, "
                      f"{done.tokens / done.seconds:.1f} tok/s", flush=True)
    return results


def speed(rounds: list[Round]) -> float:
    return sum(r.tokens for r in rounds) / sum(r.seconds for r in rounds)


def table(results: dict[str, dict[str, list[Round]]]) -> tuple[str, list[dict]]:
    lines = ["| workload | old tok/s | new tok/s | new/old [per start] | old'/old | texts identical |",
             "|---|---|---|---|---|---|"]
    rows = []
    for workload, by_row in results.items():
        old, new = by_row["old"], by_row["new"]
        per = [(n.tokens / n.seconds) / (o.tokens / o.seconds) for n, o in zip(new, old)]
        control = speed(by_row["old'"]) / speed(old) if "old'" in by_row else None
        texts = {name: [[c.text for c in r.calls] for r in rs] for name, rs in by_row.items()}
        same = all(t == texts["old"][0] for ts in texts.values() for t in ts)
        row = {"workload": workload, "old_tokens_per_s": speed(old), "new_tokens_per_s": speed(new),
               "new_over_old": speed(new) / speed(old), "per_start": per, "control": control, "same_texts": same}
        rows.append(row)
        lines.append(f"| {workload} | {row['old_tokens_per_s']:.1f} | {row['new_tokens_per_s']:.1f} | "
                     f"{row['new_over_old']:.3f} [{min(per):.3f}-{max(per):.3f}] | "
                     f"{'–' if control is None else f'{control:.3f}'} | {'yes' if same else '**no**'} |")
    return "\n".join(lines), rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--workloads", default="agent,edit,chat")
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--gamma", default="0")
    p.add_argument("--engine", choices=("own", "new", "old"), default="own",
                   help="own: each commit's own patched llama.cpp; new (old): NEW's (OLD's) for both, Python alone")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", default=None, help="GGUF (default: the embedded model)")
    p.add_argument("--no-control", action="store_true", help="no old' row (no noise band)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    args.target = args.target or embedded_model_path()
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    scratch = tempfile.mkdtemp(prefix="server-ab-")
    trees = {name: checkout(repo, commit, os.path.join(scratch, name)) for name, commit in
             (("old", args.old), ("new", args.new))}
    try:
        engines = {name: engine_folder(tree, os.path.join(scratch, f"engine-{name}")) for name, tree in trees.items()}
        if args.engine != "own":
            engines["old"] = engines["new"] = engines[args.engine]
        rows = [server("old", trees["old"], engines["old"], args), server("new", trees["new"], engines["new"], args)]
        if not args.no_control:
            rows.append(server("old'", trees["old"], engines["old"], args))
        print(f"OLD {args.old}, NEW {args.new}, engine {args.engine}, gamma {args.gamma}, threads {args.threads}; "
              f"environment: {environment()}", flush=True)
        text, out = table(run(rows, args.workloads.split(","), args.starts, scratch))
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"old": args.old, "new": args.new, "engine": args.engine, "rows": out}, f, indent=1)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
