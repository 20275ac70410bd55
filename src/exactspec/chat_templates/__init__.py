"""Chat templates a user may give a model that has none (`--chat-template NAME|FILE`): a Jinja file, or a
built-in by name. The model's own template is used otherwise; a model with none answers chat requests
with a clear error (the server's 400) rather than a guessed format."""

from __future__ import annotations

import os
from importlib import resources

from ..errors import ExactSpecError

BUILT_IN = ("chatml", "llama3")


def read_template(spec: str) -> tuple[str, str]:
    """`spec` (a built-in's name, or a Jinja file's path) -> (the template's text, where it came from, in
    words for the start-up line). ExactSpecError (one line) for an unknown name, an unreadable file or a
    template that does not render a user message."""
    if spec in BUILT_IN:
        text, source = resources.files(__package__).joinpath(f"{spec}.jinja").read_text(), f"built-in {spec}"
    elif os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ExactSpecError(f"--chat-template {spec}: cannot read it ({e})") from None
        source = f"file {spec}"
    else:
        raise ExactSpecError(f"--chat-template {spec}: no such file, and not a built-in ({', '.join(BUILT_IN)})")
    check(text, spec)
    return text, source


def check(text: str, spec: str) -> None:
    """Refuse a template that does not compile, or does not render one user message, in one line."""
    from ..models.light_tokenizer import render_template  # transformers' environment, without importing it

    try:
        render_template(text, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    except Exception as e:  # jinja2's TemplateSyntaxError, UndefinedError, ...: the user's file
        raise ExactSpecError(f"--chat-template {spec}: the template does not render a user message: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
