"""The real coding-agent CLIs (Codex CLI, Claude Code, Qwen Code), pinned from npm
(tests/helpers/agent_clis.py), against a real `exactspec serve` on loopback, each configured only by base
URL and key as its docs say: a one-line prompt gets the model's answer printed (exit 0, no API error),
and every request the CLI sent was served (no 4xx, no 5xx in the server's access log). The CLIs send what they send -- namespace groups, hosted tools, developer
items, mid-conversation system messages, `?beta=true`, 32,000-token budgets -- so no body here is ours.

The target is a real GGUF run by the real llama.cpp engine, with the embedded model's tokenizer and chat
template, whose every answer is "ready" (gguf_models.answering_gguf): the CLIs' first prompts (Codex ~8.5k
tokens, Claude Code ~11.5k, past the 8,192-token training context: `--ctx-size 32768`, YaRN) render as
they do for the embedded model, and prefill in seconds where the embedded model takes one to two minutes
each on two cores (docs/server.md, "Coding-agent CLIs", has those runs).

A CLI that cannot be installed fails the test with npm's reason; it never skips."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys

from ..helpers.agent_clis import KEY, QUIET, Served, claude, cli, codex, qwen, said
from ..helpers.cli import assert_one_line_error
from ..helpers.servers import _free_port
from ..helpers.gguf_models import answering_gguf

PROMPT = "Reply with the single word: ready"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    target = answering_gguf(str(folder / "ready.gguf"), "ready")
    server = Served(folder, "--target", target, "--ctx-size", "32768", "--max-rows", "2")
    yield server
    log = server.stop()
    assert "Traceback" not in log, log[-3000:]


def answered(served: Served, proc, path: str) -> None:
    """The CLI exited 0 with an answer and no API error; each of its requests to `path` was a 200."""
    assert proc.returncode == 0, said(proc)
    assert "ready" in proc.stdout and "API Error" not in proc.stdout + proc.stderr, said(proc)
    calls = [(line, status) for line, status in served.statuses() if path in line]
    assert calls and all(status == 200 for _, status in calls), calls


def test_codex_cli_answers_a_one_line_prompt(served, tmp_path):
    proc = codex(served, tmp_path / "codex-home", tmp_path, PROMPT)
    answered(served, proc, "/v1/responses")


def test_claude_code_answers_a_one_line_prompt(served, tmp_path):
    proc = claude(served, tmp_path / "claude-home", tmp_path, PROMPT)
    answered(served, proc, "/v1/messages")


def test_qwen_code_answers_a_one_line_prompt(served, tmp_path):
    """A third agent CLI, on chat completions: its tools' schemas use `oneOf` with overlapping
    alternatives (held as `anyOf`, never refused), `max_tokens: 32000` (clamped), content parts."""
    proc = qwen(served, tmp_path / "qwen-home", tmp_path, PROMPT)
    answered(served, proc, "/v1/chat/completions")


def test_launch_runs_codex_against_a_server_it_starts(tmp_path_factory, tmp_path):
    """`exactspec launch codex --target F -- exec ...`: starts a server, writes Codex's settings from its
    real context into a private folder, runs the CLI (exit 0, the answer printed), stops the server."""
    target = answering_gguf(str(tmp_path_factory.mktemp("launch") / "ready.gguf"), "ready")
    env = {**os.environ, **QUIET, "PATH": os.path.dirname(cli("codex")) + os.pathsep + os.environ["PATH"]}
    env.pop("EXACTSPEC_API_KEY", None)
    port = _free_port()
    proc = subprocess.run([sys.executable, "-m", "exactspec.cli", "launch", "codex", "--target", target, "--port",
                           str(port), "--", "exec", "--skip-git-repo-check", "--cd", str(tmp_path), PROMPT],
                          env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and "ready" in proc.stdout, said(proc)
    assert "exactspec: starting exactspec.cli serve" in proc.stderr


def test_launch_refuses_a_cli_that_is_not_installed():
    proc = subprocess.run([sys.executable, "-m", "exactspec.cli", "launch", "claude"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": "/nonexistent"}, stdin=subprocess.DEVNULL)
    assert_one_line_error(proc, "claude is not installed")


def test_sigterm_stops_the_server_in_the_middle_of_a_long_prefill(tmp_path):
    """A coding agent's first prompt takes tens of seconds to prefill on a CPU: SIGTERM then stops the
    server promptly all the same (its grace for open requests, then the worker's current chunk; timed
    in docs/server.md), with its closing log line and no traceback. A hang check, not a timing: the
    bound is wide."""
    import random
    import threading
    import time

    import httpx

    served = Served(tmp_path, "--prefix-cache-dir", "none")  # the embedded model, its default context
    rng = random.Random(0)
    prompt = " ".join(rng.choice(["tool", "file", "line", "result", "the", "of", "run"]) for _ in range(5000))
    body = {"model": "x", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": prompt}]}

    def ask():
        try:
            with httpx.stream("POST", f"{served.base}/v1/chat/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as response:
                for _ in response.iter_lines():
                    pass
        except httpx.HTTPError:
            pass  # cut off by the stop: expected

    threading.Thread(target=ask, daemon=True).start()
    deadline = time.monotonic() + 60
    while "POST /v1/chat/completions" not in served.log_path.read_text():  # its stream has opened: prefilling
        assert time.monotonic() < deadline, served.log_path.read_text()[-2000:]
        time.sleep(0.1)
    time.sleep(1.0)
    started = time.monotonic()
    log = served.stop()
    assert time.monotonic() - started < 15 and served.process.returncode is not None, log[-2000:]
    assert "exactspec: server stopped" in log and "Traceback" not in log, log[-2000:]
