"""`--chat-template NAME|FILE`: a chat template for a model that has none (or instead of its own), a
built-in or a Jinja file, said on the start-up line; without one, chat on a template-less model is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager

import pytest

from exactspec.chat_templates import BUILT_IN, read_template
from exactspec.errors import ExactSpecError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


@contextmanager
def without_template(engine):
    """The session engine as a GGUF without a chat template would load, restored afterwards."""
    saved = engine.tokenizer.chat_template, engine.chat_template, engine.template_source
    engine.tokenizer.chat_template, engine.chat_template, engine.template_source = None, False, "none"
    try:
        yield engine
    finally:
        engine.tokenizer.chat_template, engine.chat_template, engine.template_source = saved


def test_builtin_chatml_renders_the_embedded_models_conversations_as_its_own_template(embedded_llamacpp):
    """SmolLM2's own template is ChatML: the built-in gives the same tokens for a conversation with a
    system message, so a template-less ChatML model served with `--chat-template chatml` is prompted as
    its makers did."""
    own = embedded_llamacpp.encode(MESSAGES)
    with without_template(embedded_llamacpp) as engine:
        with pytest.raises(ExactSpecError, match="no chat template"):
            engine.encode(MESSAGES)
        engine.set_chat_template(*read_template("chatml"))
        assert engine.encode(MESSAGES) == own and engine.runtime()["chat_template"] == "built-in chatml"


def test_every_builtin_renders_and_lays_calls_out_in_a_family(embedded_llamacpp):
    from exactspec.server.families import tool_format

    for name in BUILT_IN:
        text, source = read_template(name)
        assert source == f"built-in {name}" and "<|" in text
    assert tool_format(read_template("chatml")[0]) == "hermes"  # calls as JSON in <tool_call> tags


def exactspec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exactspec.cli", *args], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_generate_with_a_template_file(tmp_path, embedded_llamacpp):
    template = tmp_path / "qa.jinja"
    template.write_text("{% for m in messages %}{{ m.role[0] | upper }}: {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}A:{% endif %}")
    proc = exactspec("generate", "What is two plus two?", "--chat-template", str(template), "--max-new-tokens", "4",
                     "--gamma", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    ids = json.loads(proc.stdout)["prompt_token_ids"]
    assert embedded_llamacpp.tokenizer.decode(ids) == "U: What is two plus two?\nA:"


@pytest.mark.parametrize("spec,words", [("no-such-template", "not a built-in (chatml, llama3)"),
                                        ("BROKEN", "does not render a user message: TemplateSyntaxError")])
def test_a_wrong_template_is_one_line_before_the_load(tmp_path, spec, words):
    if spec == "BROKEN":
        spec = str(tmp_path / "broken.jinja")
        (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    proc = exactspec("generate", "hi", "--chat-template", spec)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("exactspec: error: --chat-template") and words in lines[0], proc.stderr
