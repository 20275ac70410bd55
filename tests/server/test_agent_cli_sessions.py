"""Multi-turn sessions of the real coding-agent CLIs (pinned from npm) against a real exactspec server:
the CLI sends its prompt, the model calls a tool, the CLI runs it and sends the result back in its next
request, and so on until the model's final answer -- every request the CLI sent accepted.

The target is scripted (helpers/scripted_target.py: the embedded model's tokenizer and chat template,
answers chosen by what the conversation holds), so that each CLI really calls its tools: Codex runs a
shell command and then an `apply_patch` edit (its own patch format, applied by Codex to a file in a
temporary work folder), Claude Code runs a shell command; each then finishes. The server is the real
app (doors, tool grammar, drafters, key) on loopback; the CLIs are configured by base URL and key."""

from __future__ import annotations

import json

import pytest

from exactspec.embedded import embedded_model_path
from exactspec.engine import Engine
from exactspec.models.torch_hf import load_tokenizer
from exactspec.server import create_app

from ..helpers.agent_clis import KEY, PATCH_GRAMMAR, claude, codex, said
from ..helpers.scripted_target import ScriptedTarget
from ..helpers.servers import _running

NOTES = "notes-q7.txt"
PATCH = (f"apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: {NOTES}\n@@\n-status: draft\n+status: final\n"
         "*** End Patch\nEOF\n")


def call(name: str, **arguments) -> str:
    """A call in the server's generic tool format, as the grammar writes it (compact JSON)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))


def codex_script(history: str) -> str:
    """Read the notes, patch them, say so."""
    if "+status: final" in history:
        return "Patched."
    if f"cat {NOTES}" in history:
        return call("exec_command", cmd=PATCH)
    return call("exec_command", cmd=f"cat {NOTES}")


def codex_free_form_script(history: str) -> str:
    """Patch the notes with the free-form `apply_patch` tool (raw, under its Lark grammar), say so."""
    if "+status: final" in history:
        return "Patched."
    return f"<tool_call>apply_patch\n{PATCH.split(chr(10), 1)[1].rsplit('EOF', 1)[0]}</tool_call>"


def claude_script(history: str) -> str:
    """Read the notes, say so."""
    return "The notes are read." if f"cat {NOTES}" in history else call("Bash", command=f"cat {NOTES}")


class Statuses:
    """The app, recording the path and status of every response it sends."""

    def __init__(self, app) -> None:
        self.app, self.state, self.seen = app, app.state, []

    async def __call__(self, scope, receive, send):
        async def sent(message):
            if message["type"] == "http.response.start":
                self.seen.append((scope["path"], message["status"]))
            await send(message)

        return await self.app(scope, receive, sent)


def session(script):
    """`script`'s target served with the key -> (served, target, the app's statuses)."""
    tokenizer = load_tokenizer(embedded_model_path())
    target = ScriptedTarget(tokenizer, script, "<|im_start|>assistant\n")
    app = Statuses(create_app(Engine(target, tokenizer), model_name="exactspec", max_rows=1, api_key=KEY))
    for served in _running(app, None):
        yield served, target, app


@pytest.fixture
def codex_session():
    yield from session(codex_script)


@pytest.fixture
def codex_free_form_session():
    yield from session(codex_free_form_script)


@pytest.fixture
def claude_session():
    yield from session(claude_script)


@pytest.fixture
def workdir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / NOTES).write_text("status: draft\n")
    return work


def accepted(app: Statuses, path: str, at_least: int) -> None:
    """At least `at_least` model requests, each a 200; no request of any kind got a 4xx or 5xx."""
    assert sum(p == path for p, _ in app.seen) >= at_least, app.seen
    assert all(status < 400 for _, status in app.seen), app.seen


def test_codex_runs_a_command_then_applies_a_patch(codex_session, tmp_path, workdir):
    served, target, app = codex_session
    proc = codex(served, tmp_path / "codex-home", workdir, "Follow the script.", "--sandbox", "workspace-write")
    assert proc.returncode == 0 and "Patched." in proc.stdout, said(proc)
    assert (workdir / NOTES).read_text() == "status: final\n", said(proc)
    accepted(app, "/v1/responses", 3)
    assert any("status: draft" in h and f"cat {NOTES}" in h for h in target.histories), "no tool output came back"


def test_codex_edits_with_its_free_form_apply_patch_under_its_lark_grammar(codex_free_form_session, tmp_path, workdir):
    """Named as a model Codex has metadata for, Codex sends `apply_patch` as a `custom` tool with a Lark
    grammar: the call is written raw under that grammar, goes out as a `custom_tool_call`, and Codex
    applies it."""
    served, target, app = codex_free_form_session
    proc = codex(served, tmp_path / "codex-home", workdir, "Follow the script.", "--sandbox", "workspace-write",
                 model="gpt-5.5")
    assert proc.returncode == 0 and "Patched." in proc.stdout, said(proc)
    assert (workdir / NOTES).read_text() == "status: final\n", said(proc)
    accepted(app, "/v1/responses", 2)


def test_claude_code_runs_a_command_then_answers(claude_session, tmp_path, workdir):
    served, target, app = claude_session
    proc = claude(served, tmp_path / "claude-home", workdir, "Follow the script.", "--allowedTools", "Bash(cat:*)")
    assert proc.returncode == 0 and "The notes are read." in proc.stdout, said(proc)
    accepted(app, "/v1/messages", 2)
    assert any("status: draft" in h for h in target.histories), "no tool output came back"


SOURCE = "".join(f"    step_{i} = run(task_{i}, retries={i % 3})\n" for i in range(24))
EDITED = SOURCE.replace("retries=1)", "retries=5)", 1)


def patch_script(history: str) -> str:
    """A Codex-style patch of the file the prompt shows: every line kept as context, one changed."""
    lines = [f" {line}" for line in SOURCE.splitlines()]
    at = next(i for i, line in enumerate(lines) if "retries=1)" in line)
    lines[at:at + 1] = ["-" + SOURCE.splitlines()[at], "+" + EDITED.splitlines()[at]]
    return "*** Begin Patch\n*** Update File: steps.py\n@@\n" + "\n".join(lines) + "\n*** End Patch\n"


def test_a_free_form_patch_under_its_lark_grammar_is_exact_and_drafted():
    """Codex's `apply_patch` named (its own Lark grammar): the patch of a file shown in the prompt is the
    same text at γ 0 and with drafting, and drafting writes it in fewer target calls than tokens (the
    kept context lines are copies of the prompt: tokens per target call > 1.5)."""
    import openai

    tokenizer = load_tokenizer(embedded_model_path())
    target = ScriptedTarget(tokenizer, patch_script, "<|im_start|>assistant\n")
    tool = {"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": {
        "type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
    for served in _running(create_app(Engine(target, tokenizer), model_name="exactspec", max_rows=1), None):
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0, timeout=120)
        runs = {gamma: client.responses.create(
            model="exactspec", input=f"steps.py:\n{SOURCE}\nRaise the retries of step_1 to 5.", tools=[tool],
            tool_choice={"type": "custom", "name": "apply_patch"}, extra_body={"gamma": gamma}, max_output_tokens=900)
            for gamma in (0, 8)}
    calls = {gamma: [item for item in r.output if item.type == "custom_tool_call"] for gamma, r in runs.items()}
    assert [c.input for c in calls[0]] == [c.input for c in calls[8]] == [patch_script("")]
    drafted = runs[8].model_extra["speculative"]
    assert drafted["tokens_per_target_call"] > 1.5, drafted
