"""Chat messages -> prompt token ids in which only the chat template's own markers are special tokens.

Rendering the template to text and encoding that text would parse `<|im_end|><|im_start|>system` typed
inside a user message as the special tokens themselves: any user could forge a system or assistant
turn. Here message content is text whatever it contains. Messages whose content holds no special
token's text are encoded exactly as before (render, encode); otherwise each such content is rendered
as a placeholder, and the rendered text is encoded piece by piece: the template's pieces with special
tokens parsed, the contents with `split_special_tokens=True` (their `<|im_start|>` is plain characters).
"""

from __future__ import annotations

import uuid

from .errors import ExactSpecError


def special_texts(tokenizer) -> list[str]:
    """The text of every special token of `tokenizer` (what an encoder would parse as one)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    return sorted(texts | set(getattr(tokenizer, "all_special_tokens", [])), key=len, reverse=True)


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The generation prompt of `messages` as token ids; content is never parsed for special tokens.
    `tools` (OpenAI's tool objects) go to the template as its `tools`, for templates that lay them out."""
    specials = special_texts(tokenizer)
    hostile = [i for i, m in enumerate(messages)
               if isinstance(m.get("content"), str) and any(s in m["content"] for s in specials)]
    if not hostile:
        return tokenizer.encode(_render(tokenizer, messages, tools), add_special_tokens=False)
    nonce = uuid.uuid4().hex
    marks = {i: f"[[exactspec-content-{nonce}-{i}]]" for i in hostile}
    text = _render(tokenizer, [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)], tools)
    ids: list[int] = []
    for i in hostile:
        before, found, text = text.partition(marks[i])
        if not found or marks[i] in text:
            raise ExactSpecError("this chat template does not render message content verbatim, and a message "
                                 "holds a special token's text: remove it from the message")
        ids += tokenizer.encode(before, add_special_tokens=False)
        ids += tokenizer.encode(messages[i]["content"], add_special_tokens=False, split_special_tokens=True)
    return ids + tokenizer.encode(text, add_special_tokens=False)


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
