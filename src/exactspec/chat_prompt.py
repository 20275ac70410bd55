"""Chat messages -> prompt token ids in which only the chat template's own markers are special tokens.

Rendering the template to text and encoding that text would parse `<|im_end|><|im_start|>system` typed
inside a user message -- or a tool's description, or an earlier call's arguments echoing a tool's output
-- as the special tokens themselves: anyone whose text reaches the prompt could forge a system or
assistant turn. Here every string a request gives is text whatever it contains. The markup is every
special token and every added token that looks like markup (Qwen adds `<tool_call>` without the special
flag, and encoders parse it all the same). A request none of whose strings holds, starts with a proper
suffix of, or ends with a proper prefix of a markup text is encoded exactly as before (render, encode);
otherwise each such string is rendered as a placeholder, and the rendered text is encoded piece by
piece: the template's pieces with special tokens parsed, the strings as text (their `<|im_start|>` is
plain characters, their `<tool_call>` broken after its `<`), so that no token spans a string's edge;
a string's edge whitespace stays the template's (a template that trims it trims it). A string the
template writes through `tojson` is put back JSON-escaped, as the template would have written it: a
second rendering, with a quote after each placeholder, shows which placeholders stood inside a JSON
string (the quote comes out escaped there).
"""

from __future__ import annotations

import json
import re
import uuid

from .errors import ExactSpecError


def special_texts(tokenizer) -> list[str]:
    """The text of every special token of `tokenizer` (what an encoder would parse as one)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    return sorted(texts | set(getattr(tokenizer, "all_special_tokens", [])), key=len, reverse=True)


def markup_texts(tokenizer) -> list[str]:
    """The text of every token an encoder parses out of plain text: the special tokens, and the tokens a
    vocabulary adds without the special flag that look like markup (Qwen's `<tool_call>`,
    `<tool_response>`, `<think>`: parsed all the same, `split_special_tokens` or not), longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    plain = {t.content for t in added.values() if not getattr(t, "special", False) and _MARKUP.search(t.content)}
    return sorted(plain | set(special_texts(tokenizer)), key=len, reverse=True)


_MARKUP = re.compile(r"[<>\[\]|]")  # what sets a markup token apart from an added word or run of spaces


class _Guard:
    """Which client strings are encoded on their own, as text: one that holds a markup text, starts with
    a proper suffix of one or ends with a proper prefix of one (a template's `>` after a name ending in
    `<|im_end|` would make the token)."""

    def __init__(self, markup: list[str]) -> None:
        self.markup = markup
        self.heads = {m[:i] for m in markup for i in range(1, len(m))}
        self.tails = {m[i:] for m in markup for i in range(1, len(m))}
        self.longest = max(map(len, markup), default=0)

    def __call__(self, text: str) -> bool:
        return any(self._edge(t) for t in {text, text.strip()}) or any(m in text for m in self.markup)

    def _edge(self, text: str) -> bool:
        """Starts with a proper suffix or ends with a proper prefix of a markup text (a template that
        trims the string puts its stripped edges against its own text: both are looked at)."""
        ends = range(1, min(len(text), self.longest) + 1)
        return any(text[-k:] in self.heads or text[:k] in self.tails for k in ends)


def _as_text(tokenizer, text: str, plain: list[str]) -> list[int]:
    """`text`'s ids with no markup token among them: special tokens' texts as characters
    (`split_special_tokens`), and each of the `plain` added tokens' texts broken after its first character."""
    found = next((m for m in plain if m in text), None)
    if found is None:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []
    before, _, after = text.partition(found)
    return (_as_text(tokenizer, before, plain) + _as_text(tokenizer, found[:1], plain)
            + _as_text(tokenizer, found[1:], plain) + _as_text(tokenizer, after, plain))


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The generation prompt of `messages` as token ids; no string a client gave is parsed for special
    tokens. `tools` (OpenAI's tool objects) go to the template as its `tools`, for templates that lay
    them out. Guarded: every string of the messages (content, names, earlier calls' arguments, tool
    results) and of the tools (names, descriptions, schemas), dict keys included."""
    markup = markup_texts(tokenizer)
    plain = [m for m in markup if m not in set(special_texts(tokenizer))]
    guard = _Guard(markup)
    originals: list[str] = []

    def mark(text: str, probe: str = "") -> str:  # its edge whitespace stays the template's (`| trim` removes it)
        core = text.strip()
        if not core:
            return text
        originals.append(core)
        lead, trail = text[:len(text) - len(text.lstrip())], text[len(text.rstrip()):]
        return f"{lead}XSPEC{nonce}N{len(originals) - 1}X{probe}{trail}"

    nonce = uuid.uuid4().hex
    guarded = _guarded(messages, guard, mark), _guarded(tools, guard, mark)
    if not originals:
        return tokenizer.encode(_render(tokenizer, messages, tools), add_special_tokens=False)
    text = _render(tokenizer, *guarded)
    originals.clear()  # the probe rendering marks the same strings in the same order, a quote after each
    probed = _render(tokenizer, _guarded(messages, guard, lambda t: mark(t, '"')),
                     _guarded(tools, guard, lambda t: mark(t, '"')))
    found = list(re.finditer(f"XSPEC{nonce}N([0-9]+)X", text))
    escaped = [m.group(1) == "\\" for m in re.finditer(f'XSPEC{nonce}N[0-9]+X(\\\\?)"', probed)]
    if len(found) != len(escaped) or len(found) != text.lower().count(nonce):  # a mark altered (a filter)
        raise ExactSpecError("this chat template does not render the request's strings verbatim, and one holds a "
                             "special token's text: remove it")
    ids, at = [], 0
    for m, json_string in zip(found, escaped):
        original = originals[int(m.group(1))]
        value = json.dumps(original, ensure_ascii=False)[1:-1] if json_string else original
        ids += tokenizer.encode(text[at : m.start()], add_special_tokens=False)
        ids += _as_text(tokenizer, value, plain)
        at = m.end()
    return ids + tokenizer.encode(text[at:], add_special_tokens=False)


def _guarded(value, guard: _Guard, mark):
    """`value` with every string (dict keys too) that `guard` picks replaced by `mark(it)`."""
    if isinstance(value, str):
        return mark(value) if guard(value) else value
    if isinstance(value, dict):
        return {_guarded(k, guard, mark): _guarded(v, guard, mark) for k, v in value.items()}
    if isinstance(value, list):
        return [_guarded(v, guard, mark) for v in value]
    return value


def _render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


def generation_marker(tokenizer) -> list[int]:
    """The tokens the chat template puts before an assistant's answer (ChatML: `<|im_start|>assistant\n`):
    what a generation prompt adds to the same conversation; [] without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    messages = [{"role": "user", "content": "x"}]
    try:
        without = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
        with_it = tokenizer.encode(_render(tokenizer, messages), add_special_tokens=False)
    except Exception:  # a template that cannot render without a generation prompt: no marker
        return []
    n = next((i for i, (a, b) in enumerate(zip(without, with_it)) if a != b), min(len(without), len(with_it)))
    return with_it[n:]


def encode_prompt(tokenizer, prompt: str | list[dict], chat_template: bool) -> list[int]:
    """A user prompt (or a list of chat messages, which always go through the chat template) -> prompt
    token ids. Through the chat template, message content is never parsed for special tokens; a raw
    prompt is."""
    use_chat = chat_template
    if isinstance(prompt, list):
        if not getattr(tokenizer, "chat_template", None):
            raise ExactSpecError("this model has no chat template: pass a plain prompt")
        use_chat, messages = True, prompt
    else:
        messages = [{"role": "user", "content": prompt}]
    if use_chat:  # message content is text: a special token's text in it is not that token
        return encode_chat(tokenizer, messages)
    return tokenizer.encode(prompt)
