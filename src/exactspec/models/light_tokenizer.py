"""The tokenizer of a converted checkpoint without transformers: `tokenizers` + a jinja chat template.

Why: importing transformers' tokenizer classes costs 1-2 s of a start that should take about three
(its chat-template module alone pulls half of the library). This class is the part of the Hugging
Face tokenizer API exactspec uses (encode, decode, apply_chat_template, special tokens, vocabulary)
over the same `tokenizer.json`. It is only used for a checkpoint whose conversion checked that it
encodes, decodes and renders the chat template exactly as transformers' tokenizer does
(`matches_transformers`, run once per converted file by checkpoint.py); others load transformers'.
"""

from __future__ import annotations

import copy

import json
from datetime import datetime
from pathlib import Path

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]  # transformers' clean_up_tokenization
_RELEASE_GIL_CHARS = 16 * 1024  # longer texts are encoded with the GIL released (see LightTokenizer._encode)
PROBE_TEXTS = ["Say hi.", "  Hello,\n\n world! 123 ünïcödé 你好 🙂", "def f(x):\n\treturn x**2  # ok", ""]


class LightTokenizer:
    """A Hugging Face fast tokenizer's behaviour over `tokenizer.json` (see the module docstring)."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        directory = Path(directory)
        self.backend_tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = directory / "chat_template.jinja"
        self.chat_template = template.read_text(encoding="utf-8") if template.exists() else config.get("chat_template")
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        for name in _SPECIAL:
            value = config.get(name)
            setattr(self, name, value.get("content") if isinstance(value, dict) else value)
        self._template = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int]):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    @property
    def added_tokens_decoder(self) -> dict:
        """id -> AddedToken (with .content and .special), as transformers' fast tokenizers expose it."""
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def all_special_tokens(self) -> list[str]:
        return [t.content for t in self.added_tokens_decoder.values() if t.special]

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """`split_special_tokens`: a special token's text in `text` is encoded as plain characters (as
        transformers does it: the backend's `encode_special_tokens` switch, for this call only)."""
        backend = self.backend_tokenizer
        if not split_special_tokens:
            return self._encode(text, add_special_tokens)
        backend.encode_special_tokens = True
        try:
            return self._encode(text, add_special_tokens)
        finally:
            backend.encode_special_tokens = False

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`Tokenizer.encode` holds the GIL throughout (1.7 s for a 3.5 MB prompt: the server's event
        loop, and /health, stood still); `encode_batch` releases it and gives the same ids."""
        if len(text) < _RELEASE_GIL_CHARS:
            return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and type(self.backend_tokenizer.model).__name__ != "BPE":  # transformers skips it for BPE
            for spaced, joined in _CLEAN_UP:
                text = text.replace(spaced, joined)
        return text

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            **kwargs):
        """The chat rendered as transformers renders it (same jinja settings and helpers)."""
        template = kwargs.pop("chat_template", None) or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None or self._template[0] != template:  # compiled once per template text
            self._template = (template, _compile(template))
        context = {"tools": None, "documents": None, **{name: getattr(self, name) for name in _SPECIAL}, **kwargs}
        text = self._template[1].render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def render_template(template: str, messages: list[dict], add_generation_prompt: bool = False, **context) -> str:
    """`template` rendered as transformers renders a chat template (no special tokens given: "")."""
    names = {name: "" for name in _SPECIAL}
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{"tools": None, "documents": None, **names, **context})


def _compile(template: str):
    """transformers' chat-template environment: sandboxed, trim/lstrip blocks, loop controls, its
    `tojson` (no HTML escaping), `raise_exception` and `strftime_now`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def matches_transformers(directory: str | Path) -> bool:
    """Whether `LightTokenizer` and transformers' tokenizer of `directory` agree on the probes: ids with
    and without special tokens, decoding, vocabulary, special token ids, and the chat template (if any)."""
    from transformers import AutoTokenizer

    light, reference = LightTokenizer(directory), AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if reference.clean_up_tokenization_spaces or light.get_vocab() != reference.get_vocab():
        return False
    if (light.eos_token_id, light.bos_token_id, light.pad_token_id) != (
            reference.eos_token_id, reference.bos_token_id, reference.pad_token_id):
        return False
    for text in PROBE_TEXTS:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            if light.encode(text, add_special_tokens=special) != ids:
                return False
            if any(light.decode(ids, skip_special_tokens=skip) != reference.decode(ids, skip_special_tokens=skip)
                   for skip in (True, False)):
                return False
    from ..chat_prompt import special_texts  # what decides whether message content is hostile

    specials = special_texts(reference)
    if special_texts(light) != specials:
        return False
    probe = "a" + " ".join(specials[:3]) + "b"  # typed special tokens: parsed, or text when split
    if any(light.encode(probe, add_special_tokens=False, split_special_tokens=split)
           != reference.encode(probe, add_special_tokens=False, split_special_tokens=split) for split in (True, False)):
        return False
    if bool(light.chat_template) != bool(getattr(reference, "chat_template", None)):
        return False
    if light.chat_template:
        chats = [[{"role": "user", "content": t}] for t in PROBE_TEXTS[:2]]
        chats.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
        for chat in chats:
            for prompt in (True, False):
                try:
                    want = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
                except Exception:
                    continue  # a template that refuses this conversation refuses it in both
                if light.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) != want:
                    return False
    return True


def llg_tokenizer(tokenizer, vocab_size: int, eos_token_ids: set[int]):
    """An llguidance tokenizer over a Hugging Face fast tokenizer, or over the `tokenizer.json` a
    LightTokenizer holds (what llguidance's own helper serializes) (~0.5 s: build once per engine)."""
    import llguidance

    eos = sorted(eos_token_ids) or None
    if not isinstance(tokenizer, LightTokenizer):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
