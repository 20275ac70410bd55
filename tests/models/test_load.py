"""Start-up: a GGUF read once equals transformers' reading of it, and its conversion is cached."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from exactspec.embedded import embedded_model_path
from exactspec.models import checkpoint
from exactspec.models.gguf import GGUFFile, _hf_name
from exactspec.models.light_tokenizer import PROBE_TEXTS, LightTokenizer


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return embedded_model_path()


def test_tensors_and_config_equal_transformers_reading(gguf_path, monkeypatch):
    """Every tensor bit-equal (dequantized, Llama q/k rows un-permuted) and the same config fields as
    transformers' GGUF loader: its config reader, and its per-tensor steps (gguf's dequantize, then
    its LlamaTensorProcessor) over one gguf.GGUFReader parse (the slow part: seconds)."""
    import gguf as gguf_package
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, load_gguf_checkpoint

    reader = gguf_package.GGUFReader(gguf_path)
    monkeypatch.setattr(gguf_package, "GGUFReader", lambda path: reader)  # transformers imports it per call
    reference_config = load_gguf_checkpoint(gguf_path, return_tensors=False)["config"]
    ours = GGUFFile(gguf_path)
    config = ours.config()
    assert config == {k: v for k, v in reference_config.items() if k in config}
    processor = LlamaTensorProcessor(config=reference_config)
    assert set(ours.tensors) == {t.name for t in reader.tensors}
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model(**reference_config))
    shapes = {name: tuple(p.shape) for name, p in meta.state_dict().items()}  # where transformers loads them
    assert {_hf_name(t.name): tuple(reversed(t.shape.tolist())) for t in reader.tensors}.items() <= shapes.items()
    for t in reader.tensors:
        want = processor.process(gguf_package.dequantize(t.data, t.tensor_type), t.name).weights
        assert np.array_equal(ours.tensor(t.name), want), t.name


def test_tokenizer_equals_transformers(embedded, gguf_path):
    """The cached tokenizer (the engine's) encodes, decodes and renders the chat template as the
    tokenizer transformers builds from the GGUF does."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    reference = TokenizersBackend.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    ours = embedded.tokenizer
    assert isinstance(ours, LightTokenizer)
    assert ours.get_vocab() == reference.get_vocab() and ours.eos_token_id == reference.eos_token_id
    for text in PROBE_TEXTS + ["<|im_start|>user\nhi<|im_end|>", "x" * 300]:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    for messages in (chat, chat[1:]):
        want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
    assert embedded.encode("Hi") == reference.encode(
        reference.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)


def test_conversion_is_cached_per_file_identity(gguf_path, tmp_path, monkeypatch):
    """First load converts, the second uses the entry, a changed file gets a new entry; a conversion
    that cannot be written leaves no entry behind (and the load goes on without the cache)."""
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(checkpoint, "_resolved", {})
    converted = []

    def fake_convert(gguf, out):  # the cache logic, not the conversion (tested above): a marker only
        converted.append(gguf.path)
        (out / "exactspec-converted.json").write_text(json.dumps({"format": checkpoint.FORMAT}))

    monkeypatch.setattr(checkpoint, "convert", fake_convert)
    copy = tmp_path / "model.gguf"
    shutil.copyfile(gguf_path, copy)
    first = checkpoint.converted_dir(str(copy))
    checkpoint._resolved.clear()  # as a new process would: from the cache folder, not this one's memory
    assert checkpoint.converted_dir(str(copy)) == first and len(converted) == 1
    os.utime(copy, ns=(1, 1))  # same bytes, another mtime: the same identity
    checkpoint._resolved.clear()
    assert checkpoint.converted_dir(str(copy)) == first and len(converted) == 1
    elsewhere = tmp_path / "venv2" / "model.gguf"  # the same file under another path (a second venv)
    elsewhere.parent.mkdir()
    shutil.copyfile(copy, elsewhere)
    assert checkpoint.converted_dir(str(elsewhere)) == first and len(converted) == 1
    with open(copy, "r+b") as f:  # other bytes, same size: another identity
        f.seek(os.path.getsize(copy) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(copy, ns=(2, 2))
    second = checkpoint.converted_dir(str(copy))
    assert second != first and len(converted) == 2 and first.exists()

    def crash(gguf, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "convert", crash)
    with open(copy, "ab") as f:  # other bytes again
        f.write(b"\0")
    assert checkpoint.converted_dir(str(copy)) is None  # the caller falls back to transformers' reader
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == sorted([first.name, second.name])


def test_status_line_says_cached(capsys, gguf_path, embedded, monkeypatch):
    """The one line a person sees: the embedded model is converted by the session fixture, so cached."""
    from exactspec import progress

    monkeypatch.setattr(checkpoint, "_resolved", {})
    progress.enable()
    try:
        checkpoint.converted_dir(gguf_path)
    finally:
        progress.enable(os.environ.get("EXACTSPEC_VERBOSE", "") not in ("", "0"))
    assert capsys.readouterr().err == f"exactspec: loading {os.path.basename(gguf_path)} (cached)\n"
