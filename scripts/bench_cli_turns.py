#!/usr/bin/env python3
"""Per-turn speed of a coding-agent CLI session: a Claude-Code-shaped Messages session replayed turn by
turn (the first request, then a shell call and its output, then a file read and its output), each turn
streamed; time to first token and prompt tokens per turn, for exactspec defaults, exactspec --gamma 0 and
llama-server, each a fresh process (exactspec on an empty prefix-cache folder), rows alternated by round.

The session has the shape of Claude Code 2.1.328's first request as captured against a local server
(a system prompt of three blocks, twelve tools of the same description and schema sizes and property
names, a user turn of two text blocks, a mid-conversation system message) with synthetic text of the same
lengths: no CLI's own prompt text is committed. llama-server shows a model whose chat template has no tool
syntax no tools at all (measured: its prompt is the same with and without them); exactspec lists them,
so its first prompt is longer: the table names both counts.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/bench_cli_turns.py LLAMA_SERVER [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.request

from exactspec.bench.peer import Server, environment, start, stop
from exactspec.embedded import embedded_model_path

CONTEXT = 32768  # the CLIs' first prompts do not fit the embedded model's 8,192 (docs/server.md)
WORDS = ("the a of to and in is it you that for on with as this be are run file line code test tool use when not "
         "or by can from each its what one all if do new any must your may only them path output command call "
         "result change read write more than before after keep user task step").split()
# (name, description characters, property names, schema characters, required)
TOOLS = [("Agent", 3225, ["description", "prompt", "subagent_type", "model", "effort", "run_in_background", "isolation"], 2010, ["description", "prompt"]),
         ("Bash", 2110, ["command", "timeout", "description", "run_in_background", "dangerouslyDisableSandbox"], 1783, ["command"]),
         ("Edit", 360, ["file_path", "old_string", "new_string", "replace_all"], 584, ["file_path", "old_string", "new_string"]),
         ("ListAgents", 1433, ["channel", "q", "cursor"], 499, []),
         ("Read", 790, ["file_path", "offset", "limit", "pages", "allow_large"], 1112, ["file_path"]),
         ("ReportFindings", 574, ["level", "findings"], 1896, ["findings"]),
         ("ScheduleWakeup", 3396, ["delaySeconds", "reason", "prompt", "stop", "noop"], 1423, []),
         ("Skill", 1417, ["skill", "args"], 345, ["skill"]),
         ("ToolSearch", 952, ["query", "max_results"], 427, ["query", "max_results"]),
         ("Workflow", 3496, ["script", "name", "description", "title", "args", "scriptPath", "resumeFromRunId"], 2150, []),
         ("Write", 240, ["file_path", "content"], 367, ["file_path", "content"])]
SYSTEM = (74, 62, 7010)  # the system blocks' characters
USER = (580, 33)  # the first user turn's text blocks
LATE_SYSTEM = 9189  # the mid-conversation system message
OUTPUTS = (1500, 3000)  # the tool results of turns 2 and 3


def words(chars: int, rng: random.Random) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def session(seed: int = 0) -> list[dict]:
    """The three turns' request bodies (each the whole transcript so far, as the CLI sends it)."""
    rng = random.Random(seed)
    tools = []
    for name, described, props, schema_chars, required in TOOLS:
        each = max(20, (schema_chars - 60) // max(1, len(props)) - 40)
        schema = {"type": "object", "properties": {p: {"type": "string", "description": words(each, rng)} for p in props}}
        if required:
            schema["required"] = required
        tools.append({"name": name, "description": words(described, rng), "input_schema": schema})
    system = [{"type": "text", "text": words(n, rng)} for n in SYSTEM]
    messages = [{"role": "user", "content": [{"type": "text", "text": words(n, rng)} for n in USER]},
                {"role": "system", "content": [{"type": "text", "text": words(LATE_SYSTEM, rng)}]}]
    bodies = [{"model": "exactspec", "max_tokens": 32, "stream": True, "system": system, "tools": tools,
               "messages": list(messages)}]
    for turn, (tool, args) in enumerate([("Bash", {"command": "ls -la src"}), ("Read", {"file_path": "/work/src/app.py"})]):
        messages += [{"role": "assistant", "content": [{"type": "text", "text": words(60, rng)},
                                                       {"type": "tool_use", "id": f"toolu_{turn}", "name": tool, "input": args}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn}",
                                                   "content": words(OUTPUTS[turn], rng)}]}]
        bodies.append({**bodies[0], "messages": list(messages)})
    return bodies


def turn(url: str, body: dict) -> dict:
    """One streamed Messages request -> seconds to the first text delta, to the end, and prompt tokens."""
    request = urllib.request.Request(url + "/v1/messages", json.dumps(body).encode(),
                                     {"content-type": "application/json", "x-api-key": "unused",
                                      "anthropic-version": "2023-06-01"})
    t0, first, prompt = time.perf_counter(), None, None
    with urllib.request.urlopen(request, timeout=1800) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if event.get("type") == "message_start":
                usage = event["message"].get("usage") or {}
                prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
            elif event.get("type") == "content_block_delta" and first is None:
                first = time.perf_counter() - t0
            elif event.get("type") == "message_delta":
                usage = event.get("usage") or {}
                if usage.get("input_tokens"):
                    prompt = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    return {"ttft": first, "seconds": time.perf_counter() - t0, "prompt": prompt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_server")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    gguf, t = embedded_model_path(), str(args.threads)
    ours = [sys.executable, "-m", "exactspec.cli", "serve", "--target", gguf, "--threads", t, "--ctx-size", str(CONTEXT)]
    rows = [Server("exactspec", ours, ""), Server("exactspec --gamma 0", ours + ["--gamma", "0"], ""),
            Server("llama-server", [args.llama_server, "-m", gguf, "-t", t, "-tb", t, "--host", "127.0.0.1",
                                    "-c", str(CONTEXT)], "")]
    bodies, results = session(), {row.name: [] for row in rows}
    print(environment(), file=sys.stderr)
    with tempfile.TemporaryDirectory() as logs:
        for r in range(args.rounds):
            for row in rows if r % 2 == 0 else rows[::-1]:
                start(row, "cli-turns", logs)
                try:
                    results[row.name].append([turn(row.url, body) for body in bodies])
                finally:
                    stop(row)
                print(row.name, json.dumps(results[row.name][-1]), file=sys.stderr)
    print("| row | " + " | ".join(f"turn {i + 1} TTFT (prompt tokens)" for i in range(len(bodies))) + " |")
    print("|---|" + "---|" * len(bodies))
    for name, runs in results.items():
        cells = []
        for i in range(len(bodies)):
            ttfts = [run[i]["ttft"] for run in runs if run[i]["ttft"] is not None]
            cells.append(f"{sum(ttfts) / max(1, len(ttfts)):.2f} s ({runs[0][i]['prompt']})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
